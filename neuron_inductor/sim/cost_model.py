"""Estimated device time of an instruction trace on one NeuronCore.

Every constant is in the Target table of targets.py, which cites its sources (nki-reference.md
§2/§3 tags: T2 trainium2.html, A2 trainium2_arch.html, DB nki-dma-bandwidth-guide.html, DO
nki-dma-overview.html, PG nki_perf_guide.html, all under awsdocs-neuron's nki/ pages).

Step time: a trace is cut into kernel launches (`Trace.launches`, marked by every `kernel(...)`
call). Launches run one after another with nothing overlapping across a kernel boundary; each costs

    max(busiest engine + serial term, longest dependency chain) + a fixed launch cost

and the step is the sum over launches.

- Engines (within a launch): the five engines run concurrently (the NKI tutorials' pipelining and
  double buffering), so a well-pipelined launch takes as long as its busiest engine plus a serial term
  of two DMA fixed costs: its first load lands before any compute starts, its last store starts after
  the last compute ends.
- Dependency chain: instructions that read an allocation wait for the latest instruction that wrote
  it. The longest such chain (each DMA counted at its full latency, 1.3 us plus its transfer) is a
  second lower bound: a kernel whose instructions form one chain cannot overlap its engines (PG
  "Opt #3": an engine idles on the semaphore of the engine it waits for). Dependencies are tracked
  per allocation (a tile, a PSUM buffer, an HBM tensor), not per byte: reads of one block of a buffer
  wait for the latest write to any block of it. Write-after-read and write-after-write are not
  dependencies (the compiler rotates buffers).
- Launch cost: `launch_fixed_s` (2 us: a cross-engine semaphore, ~1.3 us DB, plus one hwDGE
  descriptor, ~600 ns A2; no source publishes a per-launch figure).

Per-instruction costs follow the cycle rules of nki-reference.md §3:

- TensorE: nc_matmul issues every max(N_moving, 64) cycles at the TensorE clock, x4 with fp32
  operands; a TensorE transpose is a matmul against the identity (N = partitions).
- VectorE: N x (2 for two-tensor-input ops, 8 for nisa.reciprocal, 1 otherwise) + 64 fixed cycles,
  N = elements per partition; on v3+ the bf16 perf mode halves tensor_copy / tensor_scalar /
  tensor_tensor when every operand is a <= 2-byte float.
- ScalarE: max(64, N) cycles. GpSimd: N + 64 cycles at its clock (an assumption: the sources give
  no GpSimd cycle rule).
- DMA: each transfer moves bytes / efficiency over the DMA engines it reaches, plus ~1.3 us fixed;
  transfers spread over the 16 queues of a core, so in the engine-busy bound the fixed costs divide
  by 16: DMA busy = sum(bytes / (efficiency x engines x 23 B/ns)) + n_transfers x 1.3 us / 16.
  - Efficiency by size and stride (copies): b / (b + 256 B), b = contiguous bytes per descriptor (the
    shorter of the two sides' innermost contiguous runs, within one partition on chip). DB: < 256 B
    per partition is severely overhead-bound, 2 KiB approaches peak, >= 4 KiB saturates; a strided
    access (an element at a time) is a 2- or 4-byte run.
  - Engines: an SBUF side of P partitions reaches ceil(P / 8) of the 16 engines (DO: 4 rows use one
    engine); HBM -> HBM and transposes reach all 16.
  - dma_transpose: <= 90% from HBM, <= 50% SBUF -> SBUF (A2), times the fraction of the dst's
    [128 partitions, 16 contiguous elements] blocks it fills (A2: a multiple of 128 partitions and of
    16 in the innermost free dim is the prerequisite for that efficiency; other sizes cost DMA
    performance, charged here as padded blocks). The hardware-DGE transpose's shape conditions
    (nki.isa.dma_transpose: src.shape[0] == 16, src.shape[-1] % 128 == 0, 2-byte dtype) are whole
    blocks, so they run at the ceiling; software-DGE descriptor work on GpSimd is not charged.

Not modelled: engine contention inside a chain (the chain and the busy bound are each exact only
at their extreme); semaphores and instruction-issue overhead beyond the launch cost; the HBM
bandwidth shared by the 8 cores of a chip; the programs of an SPMD launch on separate cores (they
are summed as if on one); PE row/column tiling concurrency; LoadStationary (overlapped on
hardware); SBUF bank conflicts; software-DGE descriptor cost on GpSimd; clock throttling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .targets import Target, get_target
from .tracing import ENGINES

_TWO_INPUT_VECTOR_OPS = frozenset({"tensor_tensor", "scalar_tensor_tensor", "select"})
_PERF_MODE_OPS = frozenset({"tensor_copy", "tensor_scalar", "tensor_tensor"})
_PERF_MODE_DTYPES = frozenset({"bfloat16", "float16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2"})
_WRITTEN_ROLES = frozenset({"dst", "reduce_res"})
_READ_WRITE_OPS = frozenset({"nc_matmul"})  # accumulates into its PSUM dst


@dataclass
class LaunchEstimate:
    """One kernel launch of a trace: instructions [start, stop)."""
    kernel: str
    start: int
    stop: int
    seconds: float                 # what the launch costs, launch cost included
    engine_seconds: dict           # busy time per engine
    serial_seconds: float
    chain_seconds: float           # longest dependency chain
    launch_seconds: float

    @property
    def stall_seconds(self) -> float:
        """Time the dependency chain adds over the pipelined bound."""
        return max(0.0, self.chain_seconds - max(self.engine_seconds.values()) - self.serial_seconds)


@dataclass
class Estimate:
    target: str
    total_seconds: float
    engine_seconds: dict = field(default_factory=dict)  # busy time per engine, DMA included, summed over launches
    serial_seconds: float = 0.0
    matmul_flops: int = 0
    dma_bytes: int = 0
    instructions: int = 0
    peak_flops: float = 0.0  # dense BF16 TensorE peak of the target
    launch_seconds: float = 0.0  # fixed launch costs, summed
    stall_seconds: float = 0.0   # what dependency chains add over the pipelined bound, summed
    launches: list = field(default_factory=list)  # LaunchEstimate per kernel launch

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
        return (f"Estimate({self.target}: total={self.total_seconds * 1e6:.1f}us over {len(self.launches)} "
                f"launch(es), {self.bound}-bound, {self.peak_fraction:.1%} of TensorE peak; {engines}; "
                f"stalls={self.stall_seconds * 1e6:.1f}us, launches={self.launch_seconds * 1e6:.1f}us)")


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


def dma_size_efficiency(run_bytes: float, target: Target) -> float:
    """Fraction of DMA bandwidth reached with `run_bytes` contiguous bytes per descriptor."""
    return run_bytes / (run_bytes + target.dma_descriptor_overhead_bytes)


def dma_transpose_efficiency(ins, target: Target) -> float:
    """A2's ceiling (HBM or SBUF source) times the fill of the dst's [128, 16] blocks."""
    from_sbuf = len(ins.operands) > 1 and ins.operands[1].buffer == "sbuf"
    ceiling = target.dma_transpose_efficiency_sbuf if from_sbuf else target.dma_transpose_efficiency_hbm
    dst = ins.operands[0].shape if ins.operands else ()
    if len(dst) < 2:
        return ceiling
    block_p, block_f = target.dma_transpose_block
    partitions, inner = dst[0], dst[-1]
    fill = (partitions / (block_p * math.ceil(partitions / block_p))) * (inner / (block_f * math.ceil(inner / block_f)))
    return ceiling * fill


def _dma_engines(ins, target: Target) -> int:
    # All 16 engines work together on a transpose (A2); HBM -> HBM splits by shape.
    if ins.op == "dma_transpose" or not any(o.buffer in ("sbuf", "psum") for o in ins.operands):
        return target.dma_queues
    return min(target.dma_queues, max(1, math.ceil(ins.partitions / target.dma_partitions_per_engine)))


def dma_transfer_seconds(ins, target: Target) -> float:
    """Time the bytes of one DMA occupy the engines it reaches (fixed cost excluded)."""
    if not ins.bytes:
        return 0.0
    if ins.op == "dma_transpose":  # the engines write [128, 16] blocks together: no per-row descriptors
        efficiency = dma_transpose_efficiency(ins, target)
    else:
        efficiency = dma_size_efficiency(ins.dma_run_bytes or ins.bytes / max(1, ins.partitions), target)
    return ins.bytes / (efficiency * _dma_engines(ins, target) * target.dma_queue_bytes_per_s)


def _clocks(target: Target) -> dict:
    return {"tensor": target.tensor_hz, "vector": target.vector_hz, "scalar": target.scalar_hz,
            "gpsimd": target.gpsimd_hz}


def _busy_and_latency(ins, target: Target, clocks: dict) -> tuple[float, float]:
    """(time on its engine, time until its result is there). A DMA's fixed cost overlaps across the
    16 queues in the busy bound, but a transfer that is waited for takes all of it."""
    if ins.engine == "dma":
        transfer = dma_transfer_seconds(ins, target)
        return transfer + target.dma_fixed_s / target.dma_queues, transfer + target.dma_fixed_s
    seconds = compute_cycles(ins, target) / clocks[ins.engine]
    return seconds, seconds


def instruction_seconds(ins, target=None) -> float:
    """Busy time of one instruction on its engine, the unit of the engine-busy bound."""
    target = get_target(target)
    return _busy_and_latency(ins, target, _clocks(target))[0]


def _launch(instructions, start: int, stop: int, target: Target, clocks: dict) -> tuple[LaunchEstimate, int, int]:
    busy = dict.fromkeys(ENGINES, 0.0)
    finished: dict[int, float] = {}  # allocation -> when its latest writer finishes (dependency chain)
    chain = 0.0
    transfers = matmul_flops = dma_bytes = 0
    for index in range(start, stop):
        ins = instructions[index]
        seconds, latency = _busy_and_latency(ins, target, clocks)
        busy[ins.engine] += seconds
        if ins.engine == "dma":
            transfers += 1
            dma_bytes += ins.bytes
        elif ins.op == "nc_matmul":
            matmul_flops += ins.flops
        ready = 0.0
        written = []
        for operand, alloc in zip(ins.operands, ins.allocs):
            if operand.role in _WRITTEN_ROLES:
                written.append(alloc)
                if ins.op not in _READ_WRITE_OPS:
                    continue
            ready = max(ready, finished.get(alloc, 0.0))
        done = ready + latency
        for alloc in written:
            finished[alloc] = done
        chain = max(chain, done)
    serial = 2 * target.dma_fixed_s if transfers else 0.0
    total = max(max(busy.values()) + serial, chain) + target.launch_fixed_s
    kernel = instructions[start].kernel
    return (LaunchEstimate(kernel, start, stop, total, busy, serial, chain, target.launch_fixed_s),
            matmul_flops, dma_bytes)


def launch_bounds(n: int, launches=None) -> list[tuple[int, int]]:
    """[start, stop) of each non-empty launch; instructions before the first mark form a launch."""
    starts = sorted({0, *(s for s in (launches or ()) if 0 <= s < n)}) if n else []
    return [(a, b) for a, b in zip(starts, starts[1:] + [n]) if b > a]


def estimate(instructions, target=None, launches=None) -> Estimate:
    """The estimate of `instructions`, cut into kernel launches at the indices `launches` (None or
    empty: one launch)."""
    target = get_target(target)
    clocks = _clocks(target)
    busy = dict.fromkeys(ENGINES, 0.0)
    per_launch = []
    matmul_flops = dma_bytes = 0
    for start, stop in launch_bounds(len(instructions), launches):
        launch, flops, nbytes = _launch(instructions, start, stop, target, clocks)
        per_launch.append(launch)
        matmul_flops += flops
        dma_bytes += nbytes
        for engine, seconds in launch.engine_seconds.items():
            busy[engine] += seconds
    return Estimate(target.name, sum(l.seconds for l in per_launch), busy,
                    sum(l.serial_seconds for l in per_launch), matmul_flops, dma_bytes, len(instructions),
                    target.bf16_flops, sum(l.launch_seconds for l in per_launch),
                    sum(l.stall_seconds for l in per_launch), per_launch)
