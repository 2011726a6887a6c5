"""Splitting a kernel's work over the physical cores of a logical NeuronCore (LNC=2 on trn2 / trn3).

A kernel whose output falls into independent blocks along some loop (matmul: batches, row blocks
or column blocks; attention: batches, heads, query tiles) gives each program of its SPMD launch
(`kernel[2](...)`) every nl.num_programs(0)-th iteration of that loop from its nl.program_id(0) on
(`_lnc.py.j2`; interleaved, so a causal kernel's short and long query tiles are dealt out alike).
Row-normalising kernels (rms_norm, layer_norm forward, softmax), whose row tiles are unrolled at render time, deal the
tiles out the same way: tile i runs on program i % nl.num_programs(0).
Indexing (gather_indirect, lowering/indexing.py) splits a row gather's token tiles the same way, and
gives each program of a row scatter a contiguous range of output rows (or, after a core_barrier,
of columns). The shares are disjoint and cover the loop, and every store an iteration makes lies inside its own
block, so no two programs write the same output element (no races; a core_barrier only where a
scatter's writes follow the other program's fill). The kernel
reads nl.num_programs(0), so it is whole at any launch size (the `neuron` toolchain launches with
the host's LNC).
"""

from __future__ import annotations

import math

from .context import LoweringContext


def plan_split(ctx: LoweringContext, counts: dict[str, int]) -> dict | None:
    """The loop to split over ctx.lnc programs, from `counts` (loop name -> iterations, outermost
    first): the one whose largest share is the smallest fraction of its loop (ties: the outer one),
    as {"loop": name, "count": iterations}; None when ctx.lnc is 1 or no loop has 2 iterations
    (a second program would get no work)."""
    if ctx.lnc == 1:
        return None
    candidates = [(math.ceil(count / ctx.lnc) / count, order, name, count)
                  for order, (name, count) in enumerate(counts.items()) if count >= 2]
    if not candidates:
        return None
    _, _, name, count = min(candidates)
    return {"loop": name, "count": count}


def split_row_tiles(ctx: LoweringContext, layout: dict) -> bool:
    """Whether a row-normalising kernel (lowering/norms.py) deals its row tiles out over ctx.lnc
    programs: each row tile reads and writes only its own rows, so any deal is race-free."""
    return ctx.lnc > 1 and len(layout["row_tiles"]) >= 2


def split_nest(ctx: LoweringContext, levels: list[list[int | None]]) -> int | None:
    """The level of a loop nest (outermost first) to deal out over ctx.lnc programs, by `plan_split`'s
    rule over each level's iterations; a level is its variants' loop counts (None: one iteration
    written out at render time, e.g. a ragged last chunk). None: nothing to split."""
    counts = {str(depth): sum(count or 1 for count in variants) for depth, variants in enumerate(levels)}
    split = plan_split(ctx, counts)
    return None if split is None else int(split["loop"])
