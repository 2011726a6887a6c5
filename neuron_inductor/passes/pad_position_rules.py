"""Pad-safety rules for positions: indices and offsets into a padded dim count real positions.
Negative indices, slices, selects and scatters from the end count from the real end; a cat along a
padded dim gathers each part's real rows to their real offset; constant padding puts its fill after
the real data; ranges started from a padded size start from the real size. Indexing into a padded
dim whose real positions are not a prefix (a merged or unknown layout) is refused.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from ..bucketing import dim_factors, size_expr
from ..lowering.registry import pad_rule
from .pad_rewriter import Rewriter, Unsafe
from .padded_layout import UNKNOWN, cat_dim, cat_parts, is_padded_expr, prefix_cat, tensor_val

aten = torch.ops.aten

# Indexing ops: which argument they index, and along which dims (index values count real positions).
INDEXED_DIMS = {
    aten.embedding.default: lambda node: (0, [0]),
    aten.index_select.default: lambda node: (0, [node.args[1]]),
    aten.gather.default: lambda node: (0, [node.args[1]]),
    aten.index.Tensor: lambda node: (0, [d for d, i in enumerate(node.args[1]) if i is not None]),
}


@pad_rule(aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default,
          what="accumulate: padded values -> 0; overwriting at padded indices refused")
def index_put(rw: Rewriter, node: fx.Node) -> None:
    accumulate = len(node.args) > 3 and bool(node.args[3])
    base = node.args[0]
    for dim, index in enumerate(node.args[1]):
        if index is not None:
            rw.real_positions(rw.dim_layout(base, dim))
    indices = [i for i in node.args[1] if isinstance(i, fx.Node)]
    padded_positions = any(rw.padded_dims(i) for i in indices) or rw.padded_dims(node.args[2])
    count_negative_indices_from_real_end(rw, node, base, node.args[1], 1)
    if not padded_positions:
        return
    if not accumulate:
        raise Unsafe("overwrites at padded index positions")
    rw.mask_args(node, [(2, None, "zero")], "padded values -> 0")


@pad_rule(aten.select.int, what="an index from the end counts from the real end")
def select(rw: Rewriter, node: fx.Node) -> None:
    source, dim, index = node.args
    layout = rw.dim_layout(source, dim)
    if layout is None:
        return
    index_expr = size_expr(index.meta["val"]) if isinstance(index, fx.Node) else sympy.Integer(index)
    if index_expr.is_Integer and int(index_expr) >= 0:
        return
    if layout == UNKNOWN or len(layout) > 1:
        raise Unsafe("indexes a merged padded dim from its end")
    if index_expr.is_Integer:
        index_expr = size_expr(tensor_val(source).shape[dim]) + index_expr
    position = rw.real_scalar(index_expr)
    position = rw.call(aten.view.default, position, [1])
    picked = rw.call(aten.index_select.default, source, dim, position)
    result = rw.call(aten.squeeze.dim, picked, dim)
    rw.replace(node, result, "index counted from the real end")


@pad_rule(aten.slice.Tensor, what="negative / symbolic bounds count from the real end")
def slice(rw: Rewriter, node: fx.Node) -> None:
    source, dim, start, _, step = _with_defaults(node, [None, 0, 0, None, 1])
    layout = rw.dim_layout(source, dim)
    if layout is None:
        return
    start_expr = size_expr(start.meta["val"]) if isinstance(start, fx.Node) else sympy.Integer(start or 0)
    if start_expr.is_Integer and int(start_expr) >= 0:
        if int(start_expr) and len(layout) > 1:
            raise Unsafe("slices a merged padded dim at an offset")
        return
    out_size = size_expr(tensor_val(node).shape[dim])
    if _whole_blocks(layout, start_expr, out_size):
        return
    if layout == UNKNOWN or len(layout) > 1:
        raise Unsafe("slices a merged padded dim from its end")
    if start_expr.is_Integer:
        start_expr = size_expr(tensor_val(source).shape[dim]) + start_expr
    keep = set()
    with rw.graph.inserting_before(node.next):  # after the slice: its size may be read
        if out_size.is_Integer:
            positions = rw.call(aten.arange.start_step, 0, int(out_size) * step, step, dtype=torch.int32)
            positions = rw.call(aten.add.Tensor, positions, rw.real_scalar(start_expr))
        else:  # a padded length from a real start: positions past the real end stay in bounds
            if step != 1 or len(dim_factors(out_size)) > 1:
                raise Unsafe("slices a padded length with a step, or into a merged dim")
            keep.add(length := rw.call(aten.sym_size.int, node, dim))  # the slice stays, for its size
            positions = rw.call(aten.arange.start_step, 0, length, 1, dtype=torch.int32)
            last = rw.prologue(("last", source, dim), aten.sub.Tensor,
                               rw.extra_input("bucket_extent", size_expr(tensor_val(source).shape[dim])), 1)
            positions = rw.call(aten.minimum.default, rw.call(aten.add.Tensor, positions,
                                                                    rw.real_scalar(start_expr)), last)
        result = rw.call(aten.index_select.default, source, dim, positions)
    rw.replace(node, result, "start counted from the real end", keep=keep)


@pad_rule(aten.constant_pad_nd.default, what="padded data moved so the fill follows the real data")
def constant_pad(rw: Rewriter, node: fx.Node) -> None:
    """Padding a padded dim puts the fill after the bucket's padding, not after the real data (as
    `F.pad(labels, (0, 1), value=ignore_index)` for shifted labels expects): every position from
    the real end on takes the fill value."""
    source, pads = node.args[0], node.args[1]
    fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    rank = tensor_val(source).dim()
    ends = []
    for pair in range(len(pads) // 2):
        dim = rank - 1 - pair
        layout = rw.dim_layout(source, dim)
        if layout is None:
            continue
        before, after = pads[2 * pair], pads[2 * pair + 1]
        if layout == UNKNOWN or len(layout) > 1 or not (isinstance(before, int) and isinstance(after, int)):
            raise Unsafe("pads a merged padded dim (or by a symbolic amount)")
        if after < 0:
            raise Unsafe("crops the end of a padded dim")
        ends.append((dim, sympy.Integer(before) + size_expr(tensor_val(source).shape[dim])))
    if not ends:
        return
    created: set[fx.Node] = set()
    result = node
    with rw.graph.inserting_before(node.next):
        for dim, real_end in ends:
            size = rw.call(aten.sym_size.int, node, dim)
            positions = rw.call(aten.arange.start_step, 0, size, 1, dtype=torch.int64)
            keep = rw.call(aten.lt.Tensor, positions, rw.real_scalar(real_end))
            keep = rw.call(aten.view.default, keep, [-1] + [1] * (rank - 1 - dim))
            fill_value = rw.call(aten.scalar_tensor.default, fill, dtype=tensor_val(node).dtype)
            result = rw.call(aten.where.self, keep, result, fill_value)
            created |= {size, positions, keep, fill_value, result}
    rw.replace(node, result, "positions past the real end -> fill value", keep=created)


@pad_rule(aten.slice_scatter.default, aten.select_scatter.default,
          what="positions from the end count from the real end")
def scatter_into_slice(rw: Rewriter, node: fx.Node) -> None:
    base, src, dim = node.args[0], node.args[1], node.args[2]
    layout = rw.dim_layout(base, dim)
    if node.target is aten.slice_scatter.default and rw.padded_dims(src, [dim]):
        # The padded rows of `src` are written too, and may land on real rows of the base: they
        # write the base's own values there instead.
        if layout is None:
            raise Unsafe("writes a padded source into an unpadded dim")
        bounds = list(node.args[3:6]) + [None, None, 1][len(node.args[3:6]):]
        own = rw.call(aten.slice.Tensor, base, dim, *bounds)
        node.update_arg(1, rw.call(aten.where.self, rw.mask_for(src, [dim]), src, own))
        rw.note(node, "padded source rows write the base's own values")
    if layout is None:
        return
    position = node.args[3] if len(node.args) > 3 else 0
    expr = size_expr(position.meta["val"]) if isinstance(position, fx.Node) else sympy.Integer(position or 0)
    if not expr.is_Integer or int(expr) < 0 or (int(expr) and len(layout) > 1):
        raise Unsafe("writes at a position counted from the end of a padded dim")


@pad_rule(aten.cat.default, what="parts along a padded dim re-packed after each part's real end")
def cat(rw: Rewriter, node: fx.Node) -> None:
    """A cat along a padded dim places each part after the previous part's *padded* end. Equal
    prefix parts give the (k, e) layout the runtime reads a k*e dim in; other prefix parts are
    gathered so that each part's real rows follow the previous part's real rows (positions past
    the real total keep whatever they hold)."""
    parts, dim = cat_parts(node), cat_dim(node)
    rw.aligned(node, parts, skip_dim=dim)
    if not rw.padded_dims(node, [dim]):
        return
    layouts = [rw.dim_layout(part, dim) for part in parts]
    if layouts[0] is not None and layouts[0] != UNKNOWN and len(layouts[0]) == 1 and len(set(layouts)) == 1:
        return
    if not prefix_cat(layouts, rw.symbols, tensor_val(node).shape[dim]):
        raise Unsafe("concatenates along a padded dim parts whose real rows are not prefixes")
    created: set[fx.Node] = set()

    def call(target, *args, **kwargs) -> fx.Node:
        created.add(result := rw.call(target, *args, **kwargs))
        return result

    with rw.graph.inserting_before(node.next):
        positions = call(aten.arange.start_step, 0, call(aten.sym_size.int, node, dim), 1, dtype=torch.int32)
        source, before = positions, sympy.Integer(0)
        for part in parts:
            shift_from = rw.real_scalar(before)  # each part's real rows start after the real rows before it
            shift = rw.prologue(("cat_shift", before), aten.sub.Tensor, rw.extra_input("bucket_extent", before),
                                shift_from) if is_padded_expr(before, rw.symbols) else None
            if shift is not None:
                moved = call(aten.add.Tensor, positions, shift)
                source = call(aten.where.self, call(aten.ge.Tensor, positions, shift_from), moved, source)
            before = before + size_expr(tensor_val(part).shape[dim])
        end = rw.real_scalar(before)  # past the real total: any in-bounds position
        source = call(aten.where.self, call(aten.ge.Tensor, positions, end), positions, source)
        result = call(aten.index_select.default, node, dim, source)
    rw.replace(node, result, "parts gathered to their real offsets", keep=created)


@pad_rule(aten.arange.start, aten.arange.start_step,
          what="a start computed from a padded size counts from the real size")
def arange(rw: Rewriter, node: fx.Node) -> None:
    """A range's values come from its start and step; its end only sets its (padded) length. A
    start computed from a padded size (arange(n - 1, -1, -1)) counts from the real size."""
    start, step = node.args[0], node.args[2] if len(node.args) > 2 else 1
    if isinstance(step, fx.Node):
        raise Unsafe("a range whose step is a size")
    if not isinstance(start, fx.Node) or not is_padded_expr(size_expr(start.meta["val"]), rw.symbols):
        return
    keep = set()
    real_start = rw.real_scalar(size_expr(start.meta["val"]))
    real_length = rw.real_scalar(size_expr(tensor_val(node).shape[0]))
    with rw.graph.inserting_before(node.next):
        keep.add(length := rw.call(aten.sym_size.int, node, 0))
        counts = rw.call(aten.arange.start_step, 0, length, 1, **node.kwargs)
        values = rw.call(aten.add.Tensor, rw.call(aten.mul.Tensor, counts, step), real_start)
        # Past the real length the values would leave the range (and an index built from them its
        # tensor): they repeat the start.
        below = aten.lt.Tensor if isinstance(real_length, fx.Node) else aten.lt.Scalar
        result = rw.call(aten.where.self, rw.call(below, counts, real_length), values, real_start)
    rw.replace(node, result, "starts from the real size", keep=keep)


@pad_rule(*INDEXED_DIMS, what="index values count real positions; negative indices from the real end")
def indexing(rw: Rewriter, node: fx.Node) -> None:
    index_arg, dims = INDEXED_DIMS[node.target](node)
    source = node.args[index_arg]
    for dim in dims:
        rw.real_positions(rw.dim_layout(source, dim))
    if node.target is aten.gather.default:
        rw.aligned(node, [source, node.args[2]], skip_dim=node.args[1] % tensor_val(node).dim())
    if node.target is aten.index.Tensor:
        count_negative_indices_from_real_end(rw, node, source, node.args[1], 1)
    elif node.target is aten.embedding.default:
        bound_index(rw, node, 1, source, 0)
    else:  # index_select, gather: (source, dim, index)
        bound_index(rw, node, 2, source, node.args[1])


# An id every indexing kernel's bounds check refuses (below -size for any dim size; int32, as kernels
# read ids): what an id outside the real extent of a padded dim becomes.
OUT_OF_RANGE = -(2 ** 31)


def _bounded(rw: Rewriter, index: fx.Node, source: fx.Node, dim: int, from_end: bool) -> fx.Node:
    """`index` (ids into dim `dim` of `source`) as the kernels get it in a padded graph. Its padded
    positions hold 0, a real row (values computed there may be anything, and an indexing kernel's
    bounds check would fail on them where eager never looks). Indexing into a padded dim, ids count
    real positions: with `from_end` negative ones count from the real end, and an id outside the
    real extent becomes OUT_OF_RANGE, so that the kernel (which sees the bucket's size) fails as
    eager does."""
    if tensor_val(index).dtype == torch.bool:
        if rw.padded_dims(source, [dim]):
            raise Unsafe("masks a padded dim with a boolean index")
        return index
    bounded = rw.masked(index, None, "zero") if rw.padded_dims(index) else index
    if not rw.padded_dims(source, [dim]):
        return bounded
    real = rw.real_scalar(size_expr(tensor_val(source).shape[dim]))
    if from_end:
        wrapped = rw.call(aten.add.Tensor, bounded, real)
        bounded = rw.call(aten.where.self, rw.call(aten.lt.Scalar, bounded, 0), wrapped, bounded)
    outside = rw.call(aten.ge.Tensor if isinstance(real, fx.Node) else aten.ge.Scalar, bounded, real)
    if from_end:
        outside = rw.call(aten.logical_or.default, outside, rw.call(aten.lt.Scalar, bounded, 0))
    refused = rw.call(aten.scalar_tensor.default, OUT_OF_RANGE, dtype=tensor_val(index).dtype)
    return rw.call(aten.where.self, outside, refused, bounded)


def bound_index(rw: Rewriter, node: fx.Node, position: int, source: fx.Node, dim: int) -> None:
    """The index tensor args[position] of `node`, ids into dim `dim` of `source` (negative ones out
    of range, as for embedding and gather), bounded by `_bounded`."""
    index = node.args[position]
    bounded = _bounded(rw, index, source, dim % max(tensor_val(source).dim(), 1), from_end=False)
    if bounded is not index:
        node.update_arg(position, bounded)
        rw.note(node, "ids at padded positions -> 0; ids past the real extent refused")


def count_negative_indices_from_real_end(rw: Rewriter, node: fx.Node, source: fx.Node, indices,
                                         position: int) -> None:
    """Advanced indexing takes negative indices from the end of a dim: the real end (and its
    padded positions and ids outside the real extent go through `_bounded`)."""
    new_indices = [_bounded(rw, index, source, dim, from_end=True) if isinstance(index, fx.Node) else index
                   for dim, index in enumerate(indices)]
    if any(new is not old for new, old in zip(new_indices, indices)):
        node.update_arg(position, new_indices)
        rw.note(node, "negative indices counted from the real end; ids at padded positions -> 0")


def _with_defaults(node: fx.Node, defaults: list) -> list:
    """`node`'s positional arguments, keyword ones in their schema place, the rest from `defaults`."""
    names = [a.name for a in node.target._schema.arguments][:len(defaults)]
    given = list(node.args) + [node.kwargs.get(name, default) for name, default in
                               zip(names[len(node.args):], defaults[len(node.args):])]
    return [default if value is None else value for value, default in zip(given, defaults)]


def _whole_blocks(layout, start: sympy.Expr, length: sympy.Expr) -> bool:
    """Whether a slice of a dim laid out (k, e) takes whole blocks of e (the parts of a cat of equal
    padded parts): its padded bounds then cut the same blocks."""
    if layout == UNKNOWN or len(layout) != 2 or not layout[0].is_Integer:
        return False
    first, count = sympy.simplify(start / layout[1]), sympy.simplify(length / layout[1])
    return (first.is_Integer and count.is_Integer and 0 <= int(first) and int(count) > 0
            and int(first) + int(count) <= int(layout[0]))
