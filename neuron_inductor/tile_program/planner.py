"""Tiling a pointwise program: the iteration space, the loop nest and where each load sits, as data.

The group's shape is coalesced TensorIterator-style (adjacent dims every operand steps through
uniformly merge). Two or more coalesced dims make a grid region: leading dims one index at a
time, then column chunks on the free dim, then row tiles of up to P partitions (the target's
partition count, `TileSizes.partitions`). One dim makes flat regions: [P, numel // P] plus a
one-partition tail. The plan is plain data (views as source + reshape / window, loop starts as
stride or base) that `codegen_templates/pointwise.py.j2` writes out.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..sim.targets import KIB
from .ir import NL_DTYPE, PointwiseProgram, ProgramInput, on_chip_name
from .partitions import choose_rows, fold_leads, widen_rows
from .select import resolve_program

if TYPE_CHECKING:
    from ..lowering.context import TileSizes

FREE_TILE_MAX = 8192       # elements per partition of one tile
FREE_TILE_MIN = 512
# SBUF per partition kept out of the loop's tiles: hoisted row / scalar operands and the
# allocator's slack. The rest is split between an iteration's tiles and the next one's.
SBUF_RESERVE = 80 * KIB


def _broadcast_strides(inp: ProgramInput, shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Per group dim: the input's element stride (0 where it broadcasts) and its logical extent."""
    offset = len(shape) - len(inp.shape)
    strides, extents = [], []
    for d, size in enumerate(shape):
        i = d - offset
        if i < 0 or inp.shape[i] != size:
            strides.append(0)
            extents.append(1)
        else:
            strides.append(inp.stride[i] if size != 1 else 0)
            extents.append(size)
    return strides, extents


def coalesce(shape: tuple[int, ...], strides: list[list[int]], extents: list[list[int]]):
    """Merge adjacent dims every operand steps through uniformly (TensorIterator-style).

    Returns (sizes, strides, extents): the coalesced iteration shape and, per operand, its stride
    (0 = broadcast) and logical extent (its view shape) in every coalesced dim.
    """
    sizes: list[int] = []
    out_strides = [[] for _ in strides]
    out_extents = [[] for _ in strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        if sizes and all(s[-1] == st[d] * size for s, st in zip(out_strides, strides)):
            sizes[-1] *= size
            for k, st in enumerate(strides):
                out_strides[k][-1] = st[d]
                out_extents[k][-1] *= extents[k][d]
            continue
        sizes.append(size)
        for k, st in enumerate(strides):
            out_strides[k].append(st[d])
            out_extents[k].append(extents[k][d])
    return sizes, out_strides, out_extents


def _chunks(extent: int, limit: int) -> list[dict]:
    """Loop variants covering range(extent) in near-equal chunks of at most `limit`."""
    count = -(-extent // limit)
    size = -(-extent // count)
    full, rest = divmod(extent, size)
    variants = [{"count": full if full > 1 else None, "start_full": full > 1, "size": size, "base": 0}]
    if rest:
        variants.append({"count": None, "start_full": False, "size": rest, "base": full * size})
    return variants


def _level(var: str, start: str, extent: int, limit: int) -> dict:
    """One loop level: `start` (the variable holding the chunk's first index) is `var * stride` in
    a counted loop of full chunks, else the fixed `base`."""
    variants = [{"count": v["count"], "stride": v["size"] if v["start_full"] else None, "base": v["base"],
                 "size": v["size"]} for v in _chunks(extent, limit)]
    return {"var": var, "start": start, "variants": variants}


def _view(var: str, source: str, shape=None, flat: int | None = None, window: tuple[int, int] | None = None) -> dict:
    """A view of kernel argument `source`: reshaped to `(flat,)`, then the elements `window`, then
    reshaped to `shape` (each step only when given)."""
    return {"var": var, "source": source, "flat": flat, "window": window,
            "shape": None if shape is None else tuple(shape)}


def _column_limit(cols: int, free_limit: int, programs: int, alone: bool) -> int:
    """The column chunk of a walk over `cols`: `free_limit`, or, when the columns are the only loop
    that could be shared (`alone`) by `programs` > 1 LNC programs, small enough for one chunk each
    (never under FREE_TILE_MIN: narrower tiles pay more per-instruction and per-DMA fixed cost than the
    split saves)."""
    if programs == 1 or not alone:
        return free_limit
    return min(free_limit, max(FREE_TILE_MIN, -(-cols // programs)))


def plan_kernel(program: PointwiseProgram, tile: TileSizes, programs: int = 1) -> dict:
    """Template parameters: tiling regions, loads, resolved instructions and stores, for the
    target whose tile sizes are `tile`, launched as `programs` LNC programs (lowering/pointwise.py
    deals the loops out)."""
    shape = program.shape
    broadcast = [_broadcast_strides(inp, shape) for inp in program.inputs]
    out_strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    sizes, strides, extents = coalesce(
        shape, [b[0] for b in broadcast] + [out_strides], [b[1] for b in broadcast] + [list(shape)])

    order = None
    if len(sizes) >= 2:
        sizes, strides, extents, order = choose_rows(sizes, strides, extents, tile.partitions, FREE_TILE_MAX)
        kinds = {}
        for inp, st in zip(program.inputs, strides):
            kinds[inp.name] = {(True, True): "tile", (True, False): "col", (False, True): "row",
                               (False, False): "scalar"}[(st[order[-2]] != 0, st[-1] != 0)]
    else:
        kinds = {inp.name: "tile" if st and st[0] != 0 else "scalar" for inp, st in zip(program.inputs, strides)}
    operand_kinds = {name: "col" if kind in ("col", "scalar") else "tile" for name, kind in kinds.items()}
    hoisted = {name for name, kind in kinds.items() if kind in ("row", "scalar")}
    store_dtypes = [on_chip_name(node.meta["val"].dtype) for node, _ in program.results]
    resolved = resolve_program(program, operand_kinds, hoisted, store_dtypes, tile.scalar_imm_bias)
    iteration_bytes = (tile.sbuf_bytes - SBUF_RESERVE) // 2  # this iteration's tiles, and the next one's
    free_limit = max(FREE_TILE_MIN, min(FREE_TILE_MAX, iteration_bytes // max(resolved.tile_bytes, 1)))

    inputs = [(f"in{k}", inp) for k, inp in enumerate(program.inputs)]
    outputs = [(f"out{k}", tuple(int(s) for s in node.meta["val"].shape))
               for k, (node, _) in enumerate(program.results)]
    if math.prod(shape) == 0:
        regions = []  # an empty result: nothing to compute
    elif len(sizes) >= 2:
        grid = widen_rows(sizes, strides, extents, order, list(kinds.values()), tile.partitions, free_limit)
        folded = fold_leads(grid[0], grid[1], grid[3], grid[4], list(kinds.values()), free_limit, programs)
        regions = [_grid_region(*grid, folded, inputs, outputs, kinds, free_limit, tile.partitions, programs)]
    else:
        regions = _flat_regions(sizes[0] if sizes else 1, inputs, outputs, kinds, free_limit, tile.partitions,
                                programs)
    for region in regions:
        region["instrs"] = resolved.instrs
        for store, src in zip(region["stores"], resolved.stores):
            store["src"] = src
    return {"regions": regions}


def _load(var: str, view: str, roles: list[str], inp: ProgramInput, kind: str) -> dict:
    dtype = NL_DTYPE[inp.column_dtype if kind in ("col", "scalar") else inp.tile_dtype]
    return {"var": var, "view": view, "roles": roles, "dtype": dtype, "kind": kind, "broadcasts": [], "permute": None}


def _grid_region(sizes, strides, extents, order, whole, folded, inputs, outputs, kinds, free_limit, partitions,
                 programs) -> dict:
    """[lead..., rows, cols] in the dim order `order` (partitions.py): rows on partitions in tiles of
    `partitions`, cols on the free dim in large chunks. With a `whole` dim (widen_rows) or `folded`
    lead dims (fold_leads) each tile's free axis is the folded leads, that dim and the last one, all
    whole ([rows, *free] views: permuted so rows come first, an operand's broadcast dims repeated)."""
    lead = [d for d in order[:-2] if d != whole and d not in folded]
    row = order[-2]
    free = folded + ([] if whole is None else [whole]) + [len(sizes) - 1]  # the tile's free axis, outermost first
    levels = [{"var": f"l{i}", "start": None,
               "variants": [{"count": sizes[d], "stride": None, "base": 0, "size": 1}]}
              for i, d in enumerate(lead)]
    if len(free) == 1:
        alone = not lead and sizes[row] <= partitions
        levels.append(_level("c", "c0", sizes[-1], _column_limit(sizes[-1], free_limit, programs, alone)))
    else:
        levels.append({"var": "c", "start": None, "variants": [{"count": None, "stride": None, "base": 0,
                                                                "size": math.prod(sizes[d] for d in free)}]})
    levels.append(_level("r", "r0", sizes[row], partitions))
    roles_of_dims = [""] * len(sizes)
    for i, d in enumerate(lead):
        roles_of_dims[d] = f"l{i}"
    roles_of_dims[row], roles_of_dims[-1] = "row", "col"
    if len(free) > 1:  # slices written out whole ("0:n")
        for d in free:
            roles_of_dims[d] = f"0:{sizes[d]}"
    tile_order = [row] + free
    permute = tile_order + [d for d in range(len(sizes)) if d not in tile_order]
    permute = None if permute == sorted(permute) else tuple(permute)
    n_lead = len(lead)
    views, loads = [], [[] for _ in range(len(levels) + 1)]
    for (name, inp), st, ext in zip(inputs, strides, extents):
        view = f"{name}_v" if inp.arg_shape != tuple(ext) else name
        if view != name:
            views.append(_view(view, name, ext))
        roles = [role if s != 0 else "one" for role, s in zip(roles_of_dims, st)]
        kind = kinds[inp.name]
        load = _load(inp.name, view, roles, inp, kind)
        if kind in ("tile", "col"):
            depth = len(levels)
            load["broadcasts"] = [(d, sizes[d]) for d in folded if st[d] == 0]
            load["permute"] = permute
        elif kind == "row":
            depth = n_lead + 1
        else:
            depth = max((i + 1 for i, d in enumerate(lead) if st[d] != 0), default=0)
        loads[depth].append(load)
    stores = []
    for name, out_shape in outputs:
        view = f"{name}_v" if tuple(out_shape) != tuple(sizes) else name
        if view != name:
            views.append(_view(view, name, sizes))
        stores.append({"view": view, "roles": roles_of_dims, "permute": permute})
    return {"views": views, "levels": levels, "loads": loads, "stores": stores,
            "partitions": levels[-1]["variants"][0]["size"], "iota": None}


def _flat_regions(numel, inputs, outputs, kinds, free_limit, partitions, programs) -> list[dict]:
    """A 1-D iteration: [P, numel // P] plus a one-partition tail of numel % P elements (P = `partitions`)."""
    per_partition, tail = divmod(numel, partitions)
    parts = []
    if per_partition:
        parts.append((0, partitions, per_partition))
    if tail:
        parts.append((partitions * per_partition, 1, tail))
    regions = []
    for index, (start, rows, cols) in enumerate(parts):
        suffix = "" if len(parts) == 1 else ("_main", "_tail")[index]
        levels = [_level("c", "c0", cols, _column_limit(cols, free_limit, programs, True)),
                  _level("r", "r0", rows, partitions)]
        views, loads = [], [[] for _ in range(len(levels) + 1)]

        def flat_view(name, logical, var):
            if rows * cols == numel:  # the whole tensor
                if tuple(logical) == (rows, cols):
                    return name
                views.append(_view(var, name, (rows, cols)))
            else:
                views.append(_view(var, name, (rows, cols), None if len(logical) == 1 else numel,
                                   (start, start + rows * cols)))
            return var

        for name, inp in inputs:
            kind = kinds[inp.name]
            if kind == "tile":
                view = flat_view(name, inp.arg_shape, f"{name}{suffix}_v")
                loads[len(levels)].append(_load(inp.name, view, ["row", "col"], inp, kind))
            else:
                view = f"{name}_s"
                if index == 0:
                    views.append(_view(view, name, (1, math.prod(inp.shape))))
                loads[0].append(_load(inp.name, view, ["one", "one"], inp, kind))
        stores = [{"view": flat_view(name, shape, f"{name}{suffix}_v"), "roles": ["row", "col"], "permute": None}
                  for name, shape in outputs]
        regions.append({"views": views, "levels": levels, "loads": loads, "stores": stores,
                        "partitions": rows, "iota": {"base": start, "channel_multiplier": cols if rows > 1 else 0}})
    return regions