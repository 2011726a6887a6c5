"""Estimated device time of an instruction trace on one NeuronCore.

Per-instruction costs follow the cycle rules of nki-reference.md §3, with every
constant in the Target table of targets.py (which cites its sources):

- TensorE: nc_matmul issues every max(N_moving, 64) cycles at the TensorE clock, x4 with
  fp32 operands; a TensorE transpose is a matmul against the identity (N = partitions).
- VectorE: N x (2 for two-tensor-input ops, 8 for nisa.reciprocal, 1 otherwise) + 64
  fixed cycles, N = elements per partition; on v3+ the bf16 perf mode halves
  tensor_copy / tensor_scalar / tensor_tensor when every operand is a <= 2-byte float.
- ScalarE: max(64, N) cycles. GpSimd: N + 64 cycles at its clock (an assumption: the
  sources give no GpSimd cycle rule).
- DMA: each transfer costs bytes / (23 B/ns queue bandwidth) plus ~1.3 us fixed.
  Transfers spread over the 16 queues of a core, so both the bytes and the fixed costs
  divide by 16: DMA time = sum(bytes / efficiency) / 368 GB/s + n_transfers * 1.3 us / 16.
  DMA transposes run at 90% (from HBM) or 50% (SBUF -> SBUF) efficiency.

Engines overlap: the five engines run concurrently (the compiler's scheduling and the
NKI tutorials' double buffering), so the kernel takes as long as its busiest engine
plus a serial term of two DMA fixed costs: the first load must land before any compute
starts, and the last store starts after the last compute ends.

Not modelled: dependencies and stalls between instructions (the model is a throughput
bound, exact for a well-pipelined kernel, optimistic otherwise); semaphores and
instruction-issue overhead (e.g. ~600 ns hwDGE descriptor generation); the HBM
bandwidth shared by the 8 cores of a chip; DMA efficiency loss for small
(< 2-4 KiB per partition) or strided transfers; PE row/column tiling concurrency;
LoadStationary (overlapped on hardware); SBUF bank conflicts; clock throttling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .targets import Target, get_target
from .tracing import ENGINES

_TWO_INPUT_VECTOR_OPS = frozenset({"tensor_tensor", "scalar_tensor_tensor", "select"})
_PERF_MODE_OPS = frozenset({"tensor_copy", "tensor_scalar", "tensor_tensor"})
_PERF_MODE_DTYPES = frozenset({"bfloat16", "float16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2"})


@dataclass
class Estimate:
    target: str
    total_seconds: float
    engine_seconds: dict = field(default_factory=dict)  # busy time per engine, DMA included
    serial_seconds: float = 0.0
    matmul_flops: int = 0
    dma_bytes: int = 0
    instructions: int = 0
    peak_flops: float = 0.0  # dense BF16 TensorE peak of the target

    @property
    def bound(self) -> str:
        """The busiest engine."""
        return max(self.engine_seconds, key=self.engine_seconds.get)

    @property
    def peak_fraction(self) -> float:
        """Matmul FLOP/s over the TensorE BF16 peak (79 TF/core on trn2)."""
        return self.matmul_flops / self.total_seconds / self.peak_flops if self.total_seconds else 0.0

    def __repr__(self):
        engines = ", ".join(f"{e}={s * 1e6:.1f}us" for e, s in self.engine_seconds.items())
        return (f"Estimate({self.target}: total={self.total_seconds * 1e6:.1f}us, {self.bound}-bound, "
                f"{self.peak_fraction:.1%} of TensorE peak; {engines})")


def compute_cycles(ins, target: Target) -> float:
    """Cycles of one compute instruction on its engine's clock."""
    n = ins.free_size
    engine = ins.engine
    if engine == "tensor":
        fp32 = any(o.dtype == "float32" for o in ins.operands[1:])
        return max(n, target.matmul_min_cycles) * (target.matmul_fp32_factor if fp32 else 1)
    if engine == "scalar":
        return max(n, target.scalar_min_cycles)
    if engine == "gpsimd":
        return n + target.vector_fixed_cycles
    factor = 2 if ins.op in _TWO_INPUT_VECTOR_OPS else target.reciprocal_factor if ins.op == "reciprocal" else 1
    cycles = n * factor
    if (target.vector_perf_mode and ins.op in _PERF_MODE_OPS
            and all(o.dtype in _PERF_MODE_DTYPES for o in ins.operands)):
        cycles /= target.vector_perf_mode_speedup
    return cycles + target.vector_fixed_cycles


def _dma_efficiency(ins, target: Target) -> float:
    if ins.op != "dma_transpose":
        return 1.0
    from_sbuf = ins.operands[1].buffer == "sbuf"
    return target.dma_transpose_efficiency_sbuf if from_sbuf else target.dma_transpose_efficiency_hbm


def estimate(instructions, target=None) -> Estimate:
    target = get_target(target)
    clocks = {"tensor": target.tensor_hz, "vector": target.vector_hz, "scalar": target.scalar_hz,
              "gpsimd": target.gpsimd_hz}
    busy = dict.fromkeys(ENGINES, 0.0)
    dma_bytes = 0
    dma_weighted_bytes = 0.0
    transfers = 0
    matmul_flops = 0
    for ins in instructions:
        if ins.engine == "dma":
            transfers += 1
            dma_bytes += ins.bytes
            dma_weighted_bytes += ins.bytes / _dma_efficiency(ins, target)
            continue
        busy[ins.engine] += compute_cycles(ins, target) / clocks[ins.engine]
        if ins.op == "nc_matmul":
            matmul_flops += ins.flops
    queues = target.dma_queues
    busy["dma"] = dma_weighted_bytes / (queues * target.dma_queue_bytes_per_s) + transfers * target.dma_fixed_s / queues
    serial = 2 * target.dma_fixed_s if transfers else 0.0
    return Estimate(target.name, max(busy.values()) + serial, busy, serial, matmul_flops, dma_bytes,
                    len(instructions), target.bf16_flops)
