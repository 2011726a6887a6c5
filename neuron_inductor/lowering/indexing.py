"""Indexing (families `gather_indirect`, `gather_rows`, `gather_lanes`, `gather_columns`, one
template per kernel shape): row gathers and scatters by indirect DMA or one-hot matmuls, and
gathers / scatters along the last dim (lanes) or another dim (columns) through lane masks.

Row ops (`mode` "row_gather" / "row_scatter"): embedding, index_select, index.Tensor with integer
index tensors on consecutive dims (broadcast against each other), embedding_dense_backward,
index_put with integer indices on consecutive dims (the static KV cache's write at dim 2 of
[B, H, S, D]). The kernel views the table as [outer, rows, inner] (the dims before, at and after the
indexed ones; several indexed dims flatten into one row number, sum(index_k * stride_k)) and the
result as [outer, *ids, inner]. Negative ids of index / index_put count back from the end of their
dim; those of embedding and index_select are out of range, as in eager.
Each row op takes one of two formulations; `row_path.choose` picks the one the cost model says is
cheaper, and logs both estimates:

- `gather_indirect` (any table size): a gather is an indirect DMA, `dma_copy` from
  `table.ap(vector_offset=row numbers)`, which copies bits (exact for every dtype, inf / NaN
  included). A scatter first writes zeros (or base) to the whole output in blocks of whole rows
  with long contiguous runs (row_path.FillPlan), then merges duplicate rows on chip so that each
  indirect write names a row once, as dma_compute requires. Per token tile (merge "tile", a
  [tokens, tokens] same-row mask): a scatter-add adds the merged sums (mask @ values in fp32 PSUM)
  with `dma_compute`, a replacing scatter writes the last value of each row with `dma_copy` (the
  last write wins, as in eager's sequential index_put on the CPU). Over every token (merge "all",
  a scatter-add with one index tensor and outer == 1, where row_path.scatter_merge finds it
  cheaper): the first token of each row writes the sum of all of its tokens by `dma_copy` (onto a
  base: adds it by `dma_compute`), so each row is written once and nothing is read back.
  Under LNC > 1 (lowering/lnc.py) a gather deals its token tiles out over the programs; a scatter
  with outer == 1 gives each program a contiguous range of output rows to fill and (merge "tile")
  to write, tokens of other rows masked out, or (merge "all") the columns [col_lo, col_hi) of every
  row, written after a core_barrier that lets both fills land.
- `gather_rows` (tiny tables): the TensorE formulation, O(rows) per token tile:
    gather:       out[T, I]  = onehot(ids)[T, V] @ W[V, I]    (one-hot built transposed, [V, T])
    scatter-add:  dW[V, I]  += onehot(ids)^T[V, T] @ dY[T, I]  (duplicates accumulate in PSUM)
  Gathers and replacing scatters move W's / the values' bits through the matmul (TABLE_KINDS), so
  no 0 * inf happens; a scatter-add multiplies the values themselves, so an inf / NaN in dY still
  turns the other rows of its column into NaN. Token ids are compared in fp32 (exact below 2**24).

Out-of-range ids (outside [-size, size) for index / index_put, [0, size) for embedding,
index_select, gather and scatter) fail the kernel, as eager fails: on both paths they match no row
(with several index tensors each one is checked against its own dim: an id out of range in one
index makes the row number negative rather than naming another row), and the kernel's bounds
check (codegen_templates/_bounds.py.j2) ends with an indirect DMA under oob_mode.error that
addresses outside the index tensor on the partitions that saw one: the DMA fails on hardware and
in the interpreter, and index_errors.py turns the interpreter's NkiIndexError into eager's
exception (KernelSpec.index_bounds says which op, dims and sizes). embedding_dense_backward is not
checked (eager's is not; its forward was).

Lane ops (`mode` "lane_gather" / "lane_scatter"): gather / scatter.value / scatter.src /
scatter_add along the last dim of a tensor of rank >= 2 with an index of the same leading shape
(cross-entropy's `gather(log_probs, -1, target[:, None])` and its backward's `scatter.value`). Rows sit on
partitions; each index column becomes an int32 lane mask (all ones where `iota == index`) over
the free axis, and values move as their fp32 bits under it: a gather sums x's masked bits (the
indexed lane's value plus +0.0s), a scatter bit-selects the new value into its lanes; an index
outside [0, C) names no lane and fails the bounds check. Infinities
and NaN therefore land exactly where eager puts them and never spread along the row (0 * inf
never happens). A gathered -0.0 may come back as +0.0. A gather or scatter along the last dim
may instead take `gather_indirect` (row_path decides by the cost model; it wins for all but tiny
widths): x is viewed as one-element rows and each index column is one indirect DMA of the
elements r * C + index (exact bits, -0.0 kept); a scatter first copies x to the output, then
writes (dma_copy) or adds (dma_compute, scatter_add) each column in order. An index outside
[0, C) reads or writes nothing on both paths and fails the bounds check, as eager raises.

Column ops (`mode` "column_gather" / "column_scatter"): the same along any other dim, with an
index matching the input in every other dim. x is viewed as [outer, size, inner]: the indexed dim
sits on partitions and each free-axis column takes its own index; index row k reaches every
partition through a ones matmul (1.0 * id, exact), the masks and bit moves are the lane ops', and
a gather sums each column's masked bits over the partitions with a ones matmul.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import torch
import torch.fx as fx

from .common import arg, float32_bits, val
from .context import LoweringContext, TileSizes
from .ir import KernelSpec, Unsupported
from .lnc import plan_split
from . import row_path
from .reduction import EXACT_INT_LIMIT, walk_dims
from .registry import register_lowering

aten = torch.ops.aten

LANE_FMAX = row_path.LANE_FMAX  # lanes per tile of a lane op


# How a row gather moves each table dtype through its fp32 one-hot matmul, exactly (a product
# 0 * x never meets a non-finite x): small integers (|x| < 2**16) as fp32 values, 16-bit floats as
# their bits read as int16, 32-bit floats and integers (int64 moves through int32 tiles) as two fp32
# halves of their bits, joined by shift and or.
TABLE_KINDS = {
    torch.float32: "bits32", torch.int32: "bits32", torch.int64: "bits32",
    torch.bfloat16: "bits16", torch.float16: "bits16",
    torch.bool: "small_int", torch.uint8: "small_int", torch.int8: "small_int", torch.int16: "small_int",
}


def _token_dims(tile: TileSizes, ids_shape, width: int, width_limit: int) -> list[dict]:
    """Walk of a [*ids_shape, width] tensor: ids dims on partitions, `width` on the free axis."""
    shape = [int(s) for s in ids_shape] + [int(width)]
    p_group = [d for d, s in enumerate(ids_shape) if s > 1]
    f_group = [len(ids_shape)] if width > 1 else []
    return [d.as_param() for d in walk_dims(tile, shape, set(), p_group, f_group, width_limit)]


def _row_dims(tile: TileSizes, outer: int, ids_shape, inner: int, p_group, free_limit: int) -> list[dict]:
    """Walk of [outer, *ids_shape, inner] (a row op's result viewed around its ids): outer indices
    one at a time, ids dims on partitions (`p_group`, default all of them), inner on the free axis
    in chunks of up to `free_limit`."""
    shape = [outer] + [int(s) for s in ids_shape] + [inner]
    if p_group is None:
        p_group = [1 + d for d, s in enumerate(ids_shape) if s > 1]
    f_group = [len(shape) - 1] if inner > 1 else []
    return [d.as_param() for d in walk_dims(tile, shape, set(), p_group, f_group, free_limit)]


def _check_indices(indices: list[torch.Tensor]) -> None:
    for i in indices:
        if i.dtype not in (torch.int64, torch.int32):
            raise Unsupported(f"indices of dtype {i.dtype}")


def _row_params(tile: TileSizes, mode: str, table: torch.Tensor, first: int, indices: list[torch.Tensor],
                free_limit: int | None = None) -> dict:
    """Geometry of a row op on `table` indexed by `indices` on its dims first, first + 1, ...:
    the table is viewed as [outer, rows, inner] (rows = the indexed dims flattened) and the result
    as [outer, *ids, inner], its inner dim walked in chunks of up to `free_limit`."""
    _check_indices(indices)
    if mode == "row_scatter" and not table.dtype.is_floating_point:
        raise Unsupported(f"row scatters into a {table.dtype} tensor")
    if table.dtype not in TABLE_KINDS:
        raise Unsupported(f"table dtype {table.dtype}")
    shape = [int(s) for s in table.shape] or [1]  # a 0-d table is one row
    last = first + len(indices)
    outer, rows, inner = math.prod(shape[:first]), math.prod(shape[first:last]), math.prod(shape[last:])
    if rows >= EXACT_INT_LIMIT:
        raise Unsupported("more rows than fp32 compares exactly")
    ids_shape = torch.broadcast_shapes(*(i.shape for i in indices)) or torch.Size([1])  # a 0-d index: one id
    if outer * rows * inner == 0 or math.prod(ids_shape) == 0:
        raise Unsupported("a row op on an empty tensor")
    if len(indices) == 1:
        dims, strides = _row_dims(tile, outer, ids_shape, inner, None, free_limit or tile.psum_fmax), []
    else:
        # several broadcast index tensors: each tile covers part of the last ids dim, where an
        # index either varies (a slice of it) or is broadcast (one value for the whole tile)
        dims = _row_dims(tile, outer, ids_shape, inner, [len(ids_shape)] if ids_shape[-1] > 1 else [],
                         free_limit or tile.psum_fmax)
        strides = [math.prod(shape[d + 1:last]) for d in range(first, last)]
    index_shapes = [[1] * (len(ids_shape) - i.dim()) + [int(s) for s in i.shape] for i in indices]
    return {"mode": mode, "outer": outer, "rows": rows, "inner": inner, "dims": dims,
            "table_kind": TABLE_KINDS[table.dtype], "index_shapes": index_shapes,
            "index_sizes": shape[first:last], "row_strides": strides}


def _row_path(ctx: LoweringContext, mode: str, table: torch.Tensor, first: int, indices: list[torch.Tensor],
              accumulate: bool = True, base: bool = False):
    """(family, params) of a row op: row_path picks one-hot matmuls or indirect DMA by the cost model;
    an indirect one may split over the LNC programs (params "split") and, a scatter, says how it
    fills its output ("fill") and merges duplicate rows ("merge")."""
    params = _row_params(ctx.tile, mode, table, first, indices)
    tokens = math.prod(torch.broadcast_shapes(*(i.shape for i in indices))) or 1
    op = row_path.RowOp(mode, params["outer"], params["rows"], params["inner"], tokens, table.element_size(),
                        params["table_kind"], ctx.tile, accumulate, base)
    choice = row_path.choose(op, ctx.target)
    if choice.path == "indirect":
        params = _row_params(ctx.tile, mode, table, first, indices, op.indirect_chunk)
        params.update(_indirect_plan(ctx, op, params, len(indices)))
    return choice.family, params


def _indirect_plan(ctx: LoweringContext, op: row_path.RowOp, params: dict, index_tensors: int) -> dict:
    """gather_indirect's LNC split, fill and merge. A gather deals its token tiles out over the
    programs; a scatter with outer == 1 gives each program a contiguous range of output rows, which
    it fills and alone writes (the tokens of other rows are masked out), so no two programs write
    one element and no barrier is needed."""
    if op.mode == "row_gather":
        token_tiles = math.prod(math.ceil(d["extent"] / d["chunk"]) for d in params["dims"][1:-1])
        return {"split": plan_split(ctx, {"token_tiles": token_tiles})}
    split = plan_split(ctx, {"row_blocks": replace(op, programs=ctx.lnc).fill.blocks}) if op.outer == 1 else None
    op = replace(op, programs=ctx.lnc if split else 1)
    merge = row_path.scatter_merge(op, ctx.target) if index_tensors == 1 and op.outer == 1 else "tile"
    return {"split": split, "merge": merge, "fill": asdict(op.fill), "tokens": op.tokens, "merge_group": op.merge_group}


def _merge_flops(params: dict, partitions: int) -> int:
    """TensorE FLOPs of gather_indirect's duplicate merge: per token tile, a [t, t] @ [t, inner]
    matmul ("tile"), or one with every tile from it on ("all")."""
    if params.get("merge") == "all":
        p, n = partitions, params["tokens"]
        sizes = [min(p, n - a) for a in range(0, n, p)]
        return sum(2 * ta * sum(sizes[a:]) * params["inner"] for a, ta in enumerate(sizes))
    ids = [d for d in params["dims"][1:-1] if d["axis"] == "p"]
    tile = math.prod(d["chunk"] for d in ids)
    tokens = math.prod(d["extent"] for d in params["dims"][1:-1])
    return 2 * params["outer"] * tokens * min(tile, tokens) * params["inner"]


def _index_bounds(node: fx.Node, first: int, sizes, from_end: bool, error: str) -> dict:
    """KernelSpec.index_bounds: what index_errors.py says when the bounds check fails."""
    return {"op": node.target.overloadpacket.__name__, "dims": list(range(first, first + len(sizes))), "sizes": [int(s) for s in sizes],
            "from_end": from_end, "error": error}


def _row_gather(ctx: LoweringContext, node: fx.Node, table: fx.Node, first: int, indices: list[fx.Node],
                from_end: bool, error: str = "IndexError") -> KernelSpec:
    """`from_end`: negative ids count from the end of their dim (x[i]); else they are out of range."""
    w, ids = val(table), [val(i) for i in indices]
    family, params = _row_path(ctx, "row_gather", w, first, ids)
    params.update(ids_from_end=from_end, check_bounds=True)
    tokens = math.prod(val(node).shape) // max(params["outer"] * params["inner"], 1)
    flops = 2 * params["outer"] * tokens * params["rows"] * params["inner"] if family == "gather_rows" else 0
    if family == "gather_indirect":
        params["padding_idx"] = -1  # (the template's row filter is shared with embedding's backward)
    return KernelSpec(family, params, [table, *indices], [node], flops=flops, grid=_grid(ctx, params),
                      index_bounds=_index_bounds(node, first, params["index_sizes"], from_end, error))


@register_lowering(aten.embedding.default)
def lower_embedding(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    if val(node.args[0]).dim() != 2:
        raise Unsupported("an embedding table that is not 2-D")
    return _row_gather(ctx, node, node.args[0], 0, [node.args[1]], from_end=False)


@register_lowering(aten.index_select.default)
def lower_index_select(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    table, index = node.args[0], node.args[2]
    return _row_gather(ctx, node, table, int(arg(node, 1, "dim")) % max(val(table).dim(), 1), [index], from_end=False)


def _indexed_dims(indices: list, what: str) -> tuple[int, list[fx.Node]]:
    """(first indexed dim, index tensors) of an advanced-indexing list: integer index tensors on
    consecutive dims, None elsewhere."""
    present = [d for d, i in enumerate(indices) if i is not None]
    if not present or present != list(range(present[0], present[-1] + 1)):
        raise Unsupported(f"{what} with index tensors that are not on consecutive dims")
    tensors = [indices[d] for d in present]
    if any(val(i).dtype == torch.bool for i in tensors):
        raise Unsupported(f"{what} with a boolean mask")
    return present[0], tensors


@register_lowering(aten.index.Tensor)
def lower_index(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    first, tensors = _indexed_dims(list(node.args[1]), "index")
    return _row_gather(ctx, node, node.args[0], first, tensors, from_end=True)


def _row_scatter(ctx: LoweringContext, node, base, first: int, indices: list, values, accumulate: bool,
                 padding_idx: int, from_end: bool = True, error: str | None = "IndexError") -> KernelSpec:
    """Rows of values [outer, *ids, inner] summed (accumulate) or placed into [outer, rows, inner];
    `error`: the exception an id out of range raises (None: not checked)."""
    ids, v, out = [val(i) for i in indices], val(values), val(node)
    family, params = _row_path(ctx, "row_scatter", out, first, ids, accumulate, base is not None)
    ids_shape = tuple(torch.broadcast_shapes(*(i.shape for i in ids)))
    expected = tuple(out.shape[:first]) + ids_shape + tuple(out.shape[first + len(ids):])
    # values may differ from the indexed shape by size-1 dims only (same elements in the same order)
    if [s for s in v.shape if s != 1] != [s for s in expected if s != 1]:
        raise Unsupported("scattered values broadcast over the indexed shape")
    if v.dtype != out.dtype:
        raise Unsupported(f"scattered values of dtype {v.dtype} into {out.dtype}")
    params.update(accumulate=accumulate, padding_idx=padding_idx, has_base=base is not None, ids_from_end=from_end,
                  check_bounds=error is not None)
    inputs = [values, *indices] + ([base] if base is not None else [])
    if family == "gather_rows":
        flops = 2 * v.numel() * params["rows"]
    else:
        flops = _merge_flops(params, ctx.tile.partitions) if accumulate else 0
    bounds = _index_bounds(node, first, params["index_sizes"], from_end, error) if error else None
    return KernelSpec(family, params, inputs, [node], flops=flops, index_bounds=bounds, grid=_grid(ctx, params))


def _grid(ctx: LoweringContext, params: dict) -> int:
    return ctx.lnc if params.get("split") else 1


@register_lowering(aten.embedding_dense_backward.default)
def lower_embedding_dense_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    grad, ids, num_weights, padding_idx, scale_grad_by_freq = node.args[:5]
    if scale_grad_by_freq:
        raise Unsupported("scale_grad_by_freq")
    return _row_scatter(ctx, node, None, 0, [ids], grad, True, int(padding_idx), error=None)


@register_lowering(aten.index_put.default)
def lower_index_put(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """index_put(self, [None, ..., ids, ...], values, accumulate): integer indices on consecutive
    dims (the static KV cache's `cache.index_copy_(2, cache_position, states)`; several broadcast
    indices in the backward of `x[i, j]`). Without accumulate the rows
    named by ids are replaced; of duplicate ids the last one wins, as in eager on the CPU (PyTorch
    leaves it unspecified)."""
    base, values = node.args[0], node.args[2]
    accumulate = bool(arg(node, 3, "accumulate", False))
    first, tensors = _indexed_dims(list(node.args[1]), "index_put")
    return _row_scatter(ctx, node, base, first, tensors, values, accumulate, -1)


# ---- lane ops: gather / scatter along the last dim ------------------------------------------------

def _lane_spec(ctx: LoweringContext, node: fx.Node, mode: str, x: fx.Node, dim, index: fx.Node, src=None,
               value=None, reduce: str | None = None) -> KernelSpec:
    """A gather / scatter along `dim`: a lane op when `dim` is the last dim of a tensor of rank >= 2,
    a column op otherwise."""
    xv, iv = val(x), val(index)
    rank = xv.dim()
    if isinstance(src, fx.Node) and tuple(val(src).shape) != tuple(iv.shape):
        raise Unsupported("a scatter source of another shape than the index")
    shape = [int(s) for s in xv.shape] or [1]  # a 0-d tensor is one element along dim 0
    dim = int(dim) % max(rank, 1)
    if not xv.dtype.is_floating_point or shape[dim] >= EXACT_INT_LIMIT:
        raise Unsupported(f"{mode} of {xv.dtype} with {shape[dim]} positions along the dim")
    index_shape = [int(s) for s in iv.shape] or [1]
    if index_shape[:dim] + index_shape[dim + 1:] != shape[:dim] + shape[dim + 1:]:
        raise Unsupported("an index whose other dims differ from the input's")
    if xv.numel() == 0 or iv.numel() == 0:
        raise Unsupported(f"{mode} of an empty tensor")
    width = index_shape[dim]
    if rank == 1 and value is None:
        # A 1-D gather / scatter is a row op over the elements (index_select / index_put), so ids sit on
        # partitions, 128 per DMA; the lane and column forms below would walk one element per instruction.
        if mode == "lane_gather":
            return _row_gather(ctx, node, x, 0, [index], from_end=False, error="RuntimeError")
        return _row_scatter(ctx, node, x, 0, [index], src, reduce == "add", -1, from_end=False, error="RuntimeError")
    inputs = [x, index] + ([src] if isinstance(src, fx.Node) else [])
    bounds = _index_bounds(node, dim, [shape[dim]], False, "RuntimeError")
    if rank >= 2 and dim == rank - 1:
        rows = math.prod(shape[:-1])
        op = row_path.RowOp(mode, rows, shape[-1], 1, width, xv.element_size(), "", ctx.tile, reduce == "add")
        if row_path.choose(op, ctx.target).path == "indirect":
            params = {"mode": mode, "rows_total": rows, "lanes": shape[-1], "index_width": width,
                      "reduce": reduce, "has_src": isinstance(src, fx.Node)}
            if value is not None:
                params["value"] = float(value)
            return KernelSpec("gather_indirect", params, inputs, [node], index_bounds=bounds)
    if rank >= 2 and dim == rank - 1:
        params = {"mode": mode, "dims": _token_dims(ctx.tile, shape[:-1], shape[-1], LANE_FMAX)}
    else:
        inner = math.prod(shape[dim + 1:])
        params = {"mode": mode.replace("lane", "column"), "outer": math.prod(shape[:dim]), "size": shape[dim],
                  "inner": inner, "column_chunk": min(inner, ctx.tile.psum_fmax)}
    params.update(index_width=width, reduce=reduce)
    if value is not None:
        # eager casts the value to x's dtype; the kernel places that value's fp32 bits
        params["value"] = float(value)
        params["value_bits"] = float32_bits(torch.tensor(float(value), dtype=xv.dtype).item())
    family = "gather_lanes" if params["mode"].startswith("lane") else "gather_columns"
    return KernelSpec(family, params, inputs, [node], flops=xv.numel() * width, index_bounds=bounds)


@register_lowering(aten.gather.default)
def lower_gather(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    if arg(node, 3, "sparse_grad", False):
        raise Unsupported("sparse_grad")
    return _lane_spec(ctx, node, "lane_gather", node.args[0], node.args[1], node.args[2])


@register_lowering(aten.scatter.value)
def lower_scatter_value(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    return _lane_spec(ctx, node, "lane_scatter", node.args[0], node.args[1], node.args[2], value=node.args[3])


@register_lowering(aten.scatter.src)
def lower_scatter_src(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    return _lane_spec(ctx, node, "lane_scatter", node.args[0], node.args[1], node.args[2], src=node.args[3])


@register_lowering(aten.scatter_add.default)
def lower_scatter_add(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    return _lane_spec(ctx, node, "lane_scatter", node.args[0], node.args[1], node.args[2], src=node.args[3],
                      reduce="add")

