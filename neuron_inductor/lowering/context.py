"""The lowering context: the hardware target every lowering and every template render sees.

Like JAX Pallas's `LoweringRuleContext`, one object carries what a lowering rule needs besides the
node: the `Target` of the `target` option (sim/targets.py) and the tile sizes that follow from it.
Lowerings take it as their first argument (`lowering(ctx, node)`), derive tile sizes and SBUF /
PSUM budgets from it instead of module constants, and templates see it as `tile` (the sizes) and
`target` (the chip), so no template spells a partition count.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import sim
from ..config import ConfigError
from ..sim.targets import KIB

FP32_BYTES = 4


@dataclass(frozen=True)
class TileSizes:
    """The on-chip tile limits of one target, as lowerings and templates use them."""

    partitions: int        # partition dim of every SBUF / PSUM tile (nl.tile_size.pmax)
    stationary_fmax: int   # TensorE stationary free size: rows M of one matmul tile
    moving_fmax: int       # TensorE moving free size in elements: columns N of one matmul tile
    psum_fmax: int         # fp32 elements of one PSUM bank per partition
    psum_banks: int        # PSUM banks per partition
    sbuf_bytes: int        # usable SBUF bytes per partition (what kernels may allocate)
    scalar_imm_bias: bool  # ScalarE activation takes a number as bias (NeuronCore-v3+)


@dataclass(frozen=True)
class LoweringContext:
    target: sim.Target
    tile: TileSizes
    lnc: int = 1  # physical cores per logical core: kernels that split their work use this many programs

    @classmethod
    def for_target(cls, target: str | sim.Target, lnc: int | None = None) -> LoweringContext:
        """The context of a target name (trn1 / trn2 / trn3, or gen2..gen4) or Target, for a logical
        core of `lnc` physical cores (None: the target's default, 2 on trn2 / trn3, 1 on trn1)."""
        resolved = sim.get_target(target)
        lnc = resolved.default_lnc if lnc is None else lnc
        if lnc not in range(1, resolved.default_lnc + 1):
            raise ConfigError(f"option lnc={lnc!r}: a {resolved.name} logical NeuronCore has 1 to "
                             f"{resolved.default_lnc} physical cores (set the lnc option or "
                             "NEURON_LOGICAL_NC_CONFIG accordingly)")
        return cls(resolved, _tile_sizes(resolved), lnc)

    def sbuf_budget(self, reserve: int) -> int:
        """Bytes per partition a family's budgeted tiles may take: the usable SBUF minus `reserve`,
        the bytes its other tiles (results, constants, per-tile working set) need whatever the
        chip's size; the caller says what the reserve holds."""
        return self.tile.sbuf_bytes - reserve


def _tile_sizes(target: sim.Target) -> TileSizes:
    language = sim.language.tile_size
    return TileSizes(
        partitions=language.pmax,
        stationary_fmax=language.gemm_stationary_fmax,
        moving_fmax=target.moving_fmax,
        psum_fmax=target.psum_bank_bytes // FP32_BYTES,
        psum_banks=target.psum_bytes // target.psum_bank_bytes,
        sbuf_bytes=target.sbuf_usable_bytes,
        scalar_imm_bias=target.nc_version >= 3,
    )


__all__ = ["KIB", "LoweringContext", "TileSizes"]
