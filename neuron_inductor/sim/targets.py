"""Per-target hardware constants: the one table the rules, the memory model and the cost model read.

Every number comes from nki-reference.md §2/§3; the `Src` tags there name the public
pages (T2 = trainium2.html, A2 = trainium2_arch.html, DB = nki-dma-bandwidth-guide.html, ...).
Where the sources disagree, the choice is stated next to the field.

Target selection: explicit argument, else env `NEURON_PLATFORM_TARGET_OVERRIDE`
(trn1|gen2, trn2|gen3, trn3|gen4), else trn2. (The real simulator defaults to trn3
when no chip is found; this project builds for Trn2, so trn2 is the default.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
KIB = 1024


@dataclass(frozen=True)
class Target:
    name: str
    nc_version: int
    # Memory (§2): bytes per partition.
    sbuf_bytes: int            # physical SBUF per partition (A2, A3)
    sbuf_usable_bytes: int     # physical minus 16 KiB reserve: nki-library's budget on v3 (§2)
    psum_bytes: int            # 8 banks x 2 KiB (§2)
    psum_bank_bytes: int
    matmul_dst_banks: int      # PSUM banks one matmul may write: 1 (v2/v3), 8 (v4) (§1 nc_matmul)
    moving_fmax: int           # moving free size limit in elements (v2/v3: 512) ...
    moving_fmax_bytes: int     # ... or in bytes per partition on v4 (4096 fp32 / 8192 bf16 = 16 KiB)
    # Engines (§3).
    tensor_hz: float           # TensorE clock (A1, A2, A3)
    vector_hz: float           # VectorE clock (A2, N3, A3)
    scalar_hz: float           # ScalarE clock (A2)
    gpsimd_hz: float           # GpSimdE clock (A2)
    bf16_flops: float          # dense BF16 FLOP/s per core (N3, A2, N4): 79 TF, not 128*128*2*2.4 GHz
    dma_queues: int            # DMA engines per core (§2: 16 engines/core)
    dma_queue_bytes_per_s: float  # per engine: DB's 23 B/ns (DO says 27.2 GB/s; DB chosen)
    dma_fixed_s: float         # fixed cost per DMA transfer, ~1.3 us (§3 cost rules)
    vector_perf_mode: bool     # v3+ bf16 perf mode on VectorE (§3 cost rules)
    # Cycle rules (§3 "Cost rules", arch guides A1-A3, mostly measured on v2); same on every target.
    matmul_min_cycles: int = 64        # nc_matmul issue ~ max(N_moving, 64) TensorE cycles
    matmul_fp32_factor: int = 4        # fp32 operands ~4x slower than bf16/fp16/tf32/fp8
    vector_fixed_cycles: int = 64      # VectorE ~N (+N per extra input) + ~60-100 fixed: low end
    vector_perf_mode_speedup: int = 2  # bf16 perf mode: 2-4x copy/tensor_scalar, 2x tensor_tensor: low end
    reciprocal_factor: int = 8         # nisa.reciprocal "~8x slower for big N" than activation(reciprocal)
    scalar_min_cycles: int = 64        # ScalarE ~ max(64, N)
    dma_transpose_efficiency_hbm: float = 0.9   # DMA transpose <= 90% of DMA throughput from HBM (A2)
    dma_transpose_efficiency_sbuf: float = 0.5  # ... and <= 50% SBUF -> SBUF (A2)
    # The 16 DMA engines write one [128 partitions, 16 contiguous elements] dst block at a time; other
    # sizes work "at the cost of DMA performance" (A2 "DMA Transpose"): charged as whole padded blocks.
    dma_transpose_block: tuple = (128, 16)
    # DMA efficiency by contiguous bytes per descriptor b: b / (b + this). A fit of DB's bands (one
    # constant): 4 KiB -> 94% ("nearly saturates", DO), 2 KiB -> 89% ("approaches peak"), 256 B -> 50%
    # ("improving but below peak" from 256 B), 64 B -> 20%, 4 B -> 1.5% ("severely overhead-bound").
    dma_descriptor_overhead_bytes: int = 256
    dma_partitions_per_engine: int = 8  # each DMA engine serves 8 SBUF partitions (DO "Example 1")
    # Fixed cost of one kernel launch: the engines drain at the kernel boundary and the next kernel's
    # first instruction waits on a cross-engine semaphore (~1.3 us, DB) after one hwDGE descriptor
    # (~600 ns, A2). No source publishes a per-launch figure; this is their sum, rounded.
    launch_fixed_s: float = 2.0e-6


TARGETS = {
    "trn1": Target(
        name="trn1", nc_version=2,
        sbuf_bytes=192 * KIB, sbuf_usable_bytes=176 * KIB, psum_bytes=16 * KIB, psum_bank_bytes=2 * KIB,
        matmul_dst_banks=1, moving_fmax=512, moving_fmax_bytes=0,
        tensor_hz=2.8e9, vector_hz=1.12e9, scalar_hz=1.4e9, gpsimd_hz=1.4e9,
        bf16_flops=95e12, dma_queues=16, dma_queue_bytes_per_s=272e9 / 16, dma_fixed_s=1.3e-6,
        vector_perf_mode=False,
    ),
    "trn2": Target(
        name="trn2", nc_version=3,
        sbuf_bytes=224 * KIB, sbuf_usable_bytes=208 * KIB, psum_bytes=16 * KIB, psum_bank_bytes=2 * KIB,
        matmul_dst_banks=1, moving_fmax=512, moving_fmax_bytes=0,
        tensor_hz=2.4e9, vector_hz=0.96e9, scalar_hz=1.2e9, gpsimd_hz=1.2e9,
        bf16_flops=79e12, dma_queues=16, dma_queue_bytes_per_s=23e9, dma_fixed_s=1.3e-6,
        vector_perf_mode=True,
    ),
    "trn3": Target(
        name="trn3", nc_version=4,
        sbuf_bytes=256 * KIB, sbuf_usable_bytes=240 * KIB, psum_bytes=16 * KIB, psum_bank_bytes=2 * KIB,
        matmul_dst_banks=8, moving_fmax=512, moving_fmax_bytes=16 * KIB,
        tensor_hz=2.4e9, vector_hz=1.2e9, scalar_hz=1.2e9, gpsimd_hz=1.2e9,
        bf16_flops=79e12, dma_queues=16, dma_queue_bytes_per_s=528e9 / 16, dma_fixed_s=1.3e-6,
        vector_perf_mode=True,
    ),
}
_ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}


def get_target(name: str | Target | None = None) -> Target:
    """The Target for `name`, else for $NEURON_PLATFORM_TARGET_OVERRIDE, else trn2."""
    if isinstance(name, Target):
        return name
    if name is None:
        name = os.environ.get(TARGET_ENV) or "trn2"
    target = _RESOLVED.get(name)
    if target is None:
        key = _ALIASES.get(name.lower(), name.lower())
        if key not in TARGETS:
            raise ValueError(f"unknown NKI target {name!r}; expected one of trn1, trn2, trn3 (or gen2..gen4)")
        target = _RESOLVED[name] = TARGETS[key]
    return target


_RESOLVED = {}  # spelling -> Target
