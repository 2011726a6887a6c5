"""Which coalesced dim of a pointwise grid lies on the partitions.

The grid region (planner.py) walks [lead..., rows, cols]: rows on partitions, cols on the free
axis. By default rows is the second-to-last coalesced dim. When that dim is short (a [B, H, S, D]
operand times a broadcast [S, D] coalesces to [H, S*D]: H rows; a [B, H, S, D] -> [B, S, H, D]
copy coalesces to [S, H, D]: H rows), VectorE and the DMA queues work on H of the partitions
(the cost model charges VectorE per element per partition, and a transfer of P partitions reaches
ceil(P / 8) DMA engines). Two other layouts keep the same operands and strides:

- another non-last dim on the partitions (the S of the permuted copy), the rest walked as lead dims;
- the last dim split into [k, cols / k] (k <= partitions dividing it), k on the partitions: a
  split of a dim of stride s is the view [s * cols / k, s], valid for every operand.

When the last dim is narrow (attention's D = 128 under a permuted [B, S, H, D] view), `widen_rows`
then moves part of a long row dim onto the free axis: rows [S] -> [S / k, k], each tile
[S / k rows, k * D] (a [rows, k, D] box of every operand): fewer, wider DMAs (the cost model's
per-transfer fixed cost and per-descriptor efficiency) and instructions.

`choose_rows` prices each layout with VectorE's per-instruction rule (N elements per partition
+ 64 fixed cycles, nki-reference.md §3), a proxy for the DMA side too (its engines also follow
the partition count, and its fixed cost per descriptor also favours wide columns), and takes
another layout only where it at least halves that price: kernels whose default layout is
reasonable keep it.
"""

from __future__ import annotations

import math

VECTOR_FIXED_CYCLES = 64  # per instruction (nki-reference.md §3, cost_model.py)
GAIN = 2.0  # how much cheaper another layout must be than the default


def _cycles_per_element(rows: int, cols: int, partitions: int, free_max: int) -> float:
    """VectorE cycles per element of a [rows, cols] walk: tiles of min(rows, P) partitions (ragged
    ones cost a whole tile) and min(cols, free_max) columns, each instruction + 64 fixed cycles."""
    tiles = -(-rows // partitions)
    occupied = rows / tiles
    width = min(cols, free_max)
    return (1 + VECTOR_FIXED_CYCLES / width) / occupied


def _split_last(sizes, strides, extents, k: int):
    """The grid with its last dim split into [k, last / k]."""
    last = sizes[-1]
    inner = last // k
    new_strides = [st[:-1] + [st[-1] * inner, st[-1]] for st in strides]
    # an operand that has the last dim (even as an expanded, stride-0 view) splits it; one broadcast
    # along it (extent 1) gets two size-1 dims
    new_extents = [ext[:-1] + ([k, inner] if ext[-1] == last else [1, 1]) for ext in extents]
    return sizes[:-1] + [k, inner], new_strides, new_extents


def choose_rows(sizes: list[int], strides: list[list[int]], extents: list[list[int]], partitions: int,
                free_max: int):
    """(sizes, strides, extents, order) of the grid layout to walk; `order` lists the grid's dims as
    [lead..., rows, cols] (cols is always the last dim)."""
    rank = len(sizes)
    default = (sizes, strides, extents, list(range(rank)))
    if 0 in sizes:  # an empty grid has no walk to price
        return default
    candidates = []
    for row in range(rank - 2):
        order = [d for d in range(rank - 1) if d != row] + [row, rank - 1]
        candidates.append((_cycles_per_element(sizes[row], sizes[-1], partitions, free_max),
                           (sizes, strides, extents, order)))
    divisors = [k for k in range(2, min(partitions, sizes[-1]) + 1) if sizes[-1] % k == 0]
    if divisors:
        k = max(divisors)
        candidates.append((_cycles_per_element(k, sizes[-1] // k, partitions, free_max),
                           (*_split_last(sizes, strides, extents, k), list(range(rank + 1)))))
    if not candidates:
        return default
    cost, layout = min(candidates, key=lambda c: c[0])
    return layout if cost * GAIN <= _cycles_per_element(sizes[-2], sizes[-1], partitions, free_max) else default


WIDE_COLS = 512  # a last dim narrower than this is widened by part of the row dim


def widen_rows(sizes, strides, extents, order, kinds: list[str], partitions: int, free_limit: int):
    """(sizes, strides, extents, order, whole): the row dim split into [rows / k, k] with k on the free
    axis beside the last dim (`whole` = the index of the k dim, taken whole by every tile), or the
    grid unchanged and whole None. Only when every operand is a whole tile or a scalar (`kinds`:
    a row- or column-broadcast operand would need its tile replicated along k), the row dim keeps
    at least `partitions` rows, and k times the last dim fits `free_limit`."""
    row, last = order[-2], sizes[-1]
    unchanged = (sizes, strides, extents, order, None)
    if last >= WIDE_COLS or any(kind not in ("tile", "scalar") for kind in kinds):
        return unchanged
    ks = [k for k in range(2, free_limit // last + 1) if sizes[row] % k == 0 and sizes[row] // k >= partitions]
    if not ks:
        return unchanged
    k = max(ks)
    outer = sizes[row] // k
    new_sizes = sizes[:row] + [outer, k] + sizes[row + 1:]
    new_strides = [st[:row] + [st[row] * k, st[row]] + st[row + 1:] for st in strides]
    new_extents = [ext[:row] + ([outer, k] if st[row] != 0 else [1, 1]) + ext[row + 1:]
                   for ext, st in zip(extents, strides)]
    shifted = [d + 1 if d > row else d for d in order]
    return new_sizes, new_strides, new_extents, shifted, row + 1


FREE_AXIS_DIMS = 4  # free dims of one access pattern (nki-reference.md §2)


def fold_leads(sizes, strides, order, whole, kinds: list[str], free_limit: int, programs: int) -> list[int]:
    """The lead dims (those walked one index at a time) to take whole onto each tile's free axis, beside
    the `whole` dim and the last one: [rows, lead..., k, cols] tiles, so a [B, H, S, D] walk is a few
    wide tiles, not B * H narrow ones (fewer DMAs and instructions, each DMA's runs as long as before).
    Innermost lead first, while the tile stays within WIDE_COLS (and `free_limit`) elements, where fixed
    costs are paid off (wider tiles only cut the overlap of loads, compute and stores), and its free axis
    within FREE_AXIS_DIMS dims;
    only when every operand is a whole tile or a scalar (`kinds`, as widen_rows), never a lead a scalar
    operand steps along (it would vary along the free axis). With `programs` > 1 LNC programs, outer
    leads of at least `programs` iterations stay loops for the programs to share."""
    if any(kind not in ("tile", "scalar") for kind in kinds):
        return []
    scalars = [st for st, kind in zip(strides, kinds) if kind == "scalar"]
    leads = [d for d in order[:-2] if d != whole]
    width = sizes[-1] * (sizes[whole] if whole is not None else 1)
    room = FREE_AXIS_DIMS - 1 - (whole is not None)
    folded: list[int] = []
    for position in range(len(leads) - 1, -1, -1):
        d = leads[position]
        if len(folded) == room or width * sizes[d] > min(free_limit, WIDE_COLS) or any(st[d] != 0 for st in scalars):
            break
        if programs > 1 and math.prod(sizes[e] for e in leads[:position + 1]) >= programs > \
                math.prod(sizes[e] for e in leads[:position]):
            break  # the last loop the programs could share
        folded.append(d)
        width *= sizes[d]
    return sorted(folded)
