"""Where the padding sits in every tensor of a symbolic ATen graph.

A dim is *padded* when its size depends on a bucketed symbol. Its *layout* says which of its
positions hold real data once every symbol is padded to its bucket: a tuple of factors
`(f1, ..., fk)` whose product is the dim's size, read row-major, where a position is real iff each
digit is below its factor's real value. `(s,)` is a real prefix followed by padding; `(2, s)` is
the result of flattening `[2, s]`: two real prefixes, each followed by its padding.

Layouts start at the graph inputs (`bucketing.dim_factors`), flow through reshapes exactly (factor
matching), through permutes / broadcasts / reductions by dim bookkeeping, and become UNKNOWN where
a reshape mixes a padded factor with others in a way that cannot be tracked. An UNKNOWN layout is
only a problem when an op needs a mask over that dim: the pad-safety pass then refuses to pad.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from ..bucketing import dim_factors, size_expr

aten = torch.ops.aten

UNKNOWN = "unknown"
# A tensor's layout: one entry per dim, None (not padded), a tuple of factors, or UNKNOWN.
Layout = tuple


class MultiLayout(tuple):
    """Layouts of a multi-output op's results, indexed like its value tuple."""


RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}

# Ops whose (first) output has the first input's shape and layout: elementwise or row-local.
SAME_AS_FIRST = {
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten._softmax.default, aten._log_softmax.default, aten.cumsum.default, aten.cumprod.default,
    aten.contiguous.default, aten.lift_fresh_copy.default, aten.native_layer_norm.default,
    aten._fused_rms_norm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default, aten.slice_scatter.default,
    aten.select_scatter.default, aten.index_put.default, aten.scatter.value, aten.scatter.src,
    aten.scatter_add.default, aten.index_add.default, aten.copy_.default,
}

REDUCTIONS = {
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.amax.default,
    aten.amin.default, aten.argmax.default, aten.argmin.default, aten.logsumexp.default,
    aten.prod.default, aten.prod.dim_int, aten.any.default, aten.any.dim, aten.any.dims,
    aten.all.default, aten.all.dim, aten.var.correction, aten.std.correction, aten.linalg_vector_norm.default,
}


def is_padded_expr(expr: sympy.Expr, symbols: frozenset) -> bool:
    return bool(expr.free_symbols & symbols)


def same_size(a, b) -> bool:
    return sympy.expand(size_expr(a) - size_expr(b)) == 0


def tensor_val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def input_layout(shape, symbols: frozenset) -> Layout:
    """Layout of a graph input (or any tensor whose provenance is unknown): see bucketing.dim_factors."""
    return tuple(dim_factors(size_expr(s)) if is_padded_expr(size_expr(s), symbols) else None for s in shape)


def reduced_dims(node: fx.Node) -> tuple[list[int] | None, bool]:
    """(dims, keepdim) of a reduction node; dims None means every dim."""
    target, args = node.target, list(node.args) + [None] * 3
    if target is aten.linalg_vector_norm.default:  # (self, ord, dim, keepdim)
        dims = node.kwargs.get("dim", args[2])
        dims = [dims] if isinstance(dims, int) else dims
        return (list(dims) if dims else None), bool(node.kwargs.get("keepdim", args[3] or False))
    if target in (aten.sum.default, aten.mean.default, aten.amax.default, aten.amin.default,
                  aten.prod.default, aten.any.default, aten.all.default):
        if target in (aten.amax.default, aten.amin.default):
            dims = node.kwargs.get("dim", args[1])
            return (list(dims) if dims else None), bool(node.kwargs.get("keepdim", args[2] or False))
        return None, False
    dims = node.kwargs.get("dim", args[1])
    keepdim = bool(node.kwargs.get("keepdim", args[2] or False))
    if isinstance(dims, int):
        dims = [dims]
    return (list(dims) if dims else None), keepdim


def _normalize(factors, symbols: frozenset):
    """Drop unit factors and merge runs of unpadded ones; None when nothing is padded."""
    merged: list[sympy.Expr] = []
    for factor in factors:
        if factor == 1:
            continue
        if merged and not is_padded_expr(factor, symbols) and not is_padded_expr(merged[-1], symbols):
            merged[-1] = merged[-1] * factor
        else:
            merged.append(factor)
    return tuple(merged) if any(is_padded_expr(f, symbols) for f in merged) else None


def _unknown_like(shape, symbols: frozenset) -> Layout:
    return tuple(UNKNOWN if is_padded_expr(size_expr(s), symbols) else None for s in shape)


def _reshape(layout: Layout, in_shape, out_shape, symbols: frozenset) -> Layout:
    """Match the input's factors, in order, to the output dims, splitting constant factors."""
    if UNKNOWN in layout:
        return _unknown_like(out_shape, symbols)
    atoms = [f for dim_layout, size in zip(layout, in_shape)
             for f in (dim_layout if dim_layout is not None else (size_expr(size),))]
    result = []
    for size in out_shape:
        target, group, product = size_expr(size), [], sympy.Integer(1)
        while sympy.expand(product - target) != 0:
            if not atoms:
                return _unknown_like(out_shape, symbols)
            atom = atoms.pop(0)
            if atom.is_Integer and target.is_Integer and product.is_Integer:
                need = int(target) // int(product)
                if need and int(atom) > need:
                    if int(atom) % need:
                        return _unknown_like(out_shape, symbols)
                    atoms.insert(0, sympy.Integer(int(atom) // need))
                    atom = sympy.Integer(need)
            group.append(atom)
            product = product * atom
        result.append(_normalize(group, symbols))
    return tuple(result)


def _broadcast(node: fx.Node, val: torch.Tensor, layouts: dict, symbols: frozenset) -> Layout:
    """Each padded output dim takes the layout of a same-size input dim (aligned from the right)."""
    rank = val.dim()
    result = []
    for axis in range(rank):
        size = size_expr(val.shape[axis])
        if not is_padded_expr(size, symbols):
            result.append(None)
            continue
        found = None
        for arg in tensor_inputs(node):
            arg_val, layout = tensor_val(arg), layouts.get(arg)
            offset = axis - (rank - arg_val.dim())
            if isinstance(layout, MultiLayout) or layout is None or offset < 0:
                continue
            if layout[offset] is None or not same_size(arg_val.shape[offset], size):
                continue
            found = layout[offset] if found in (None, layout[offset]) else UNKNOWN
        result.append(found if found is not None else dim_factors(size))
    return tuple(result)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    found = []
    for arg in list(node.args) + list(node.kwargs.values()):
        for item in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(item, fx.Node) and tensor_val(item) is not None:
                found.append(item)
    return found


def cat_dim(node: fx.Node) -> int:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return dim % tensor_val(node).dim()


def cat_parts(node: fx.Node) -> list[fx.Node]:
    """The parts a cat concatenates: legacy empty 1-D parts (skipped by cat) left out."""
    rank = tensor_val(node).dim()
    return [t for t in node.args[0] if not (rank > 1 and tensor_val(t).dim() == 1 and tensor_val(t).shape[0] == 0)]


def prefix_cat(parts: list, symbols: frozenset, size) -> bool:
    """Whether a cat along a padded dim can be rewritten to hold its real rows as a prefix: every
    part is unpadded or a real prefix, and the output's own layout is a single prefix factor."""
    return all(p is None or (p != UNKNOWN and len(p) == 1) for p in parts) and len(dim_factors(size_expr(size))) == 1


def _cat(node: fx.Node, val: torch.Tensor, layouts: dict, symbols: frozenset) -> Layout:
    """Concatenating k tensors of layout (e,) along a padded dim gives (k, e). Other concatenations
    of prefixes are rewritten by the pad-safety pass to the prefix layout of their output; anything
    else is UNKNOWN (and the pass refuses to pad it)."""
    base = _broadcast(node, val, layouts, symbols)
    dim = cat_dim(node)
    if not is_padded_expr(size_expr(val.shape[dim]), symbols):
        return base
    parts = [(layouts.get(t) or (None,) * val.dim())[dim] for t in cat_parts(node)]
    first = parts[0]
    if first is not None and first != UNKNOWN and len(first) == 1 and all(p == first for p in parts):
        return base[:dim] + (_normalize((sympy.Integer(len(parts)),) + first, symbols),) + base[dim + 1:]
    if prefix_cat(parts, symbols, val.shape[dim]):
        return base[:dim] + (dim_factors(size_expr(val.shape[dim])),) + base[dim + 1:]
    return base[:dim] + (UNKNOWN,) + base[dim + 1:]


def _squeezed_dims(shape, dims) -> list[int]:
    rank = len(shape)
    dims = set(range(rank)) if dims is None else {d % rank for d in dims}
    return [i for i in range(rank) if not (i in dims and size_expr(shape[i]) == 1)]


def _layout_of(node: fx.Node, val: torch.Tensor, layouts: dict, symbols: frozenset) -> Layout:
    if not any(is_padded_expr(size_expr(s), symbols) for s in val.shape):
        return tuple(None for _ in val.shape)
    target, args = node.target, node.args
    first = args[0] if args and isinstance(args[0], fx.Node) else None
    first_val, first_layout = tensor_val(first), layouts.get(first)
    if first_val is None or first_layout is None or isinstance(first_layout, MultiLayout):
        return _broadcast(node, val, layouts, symbols)
    rank = first_val.dim()
    if target in RESHAPES:
        return _reshape(first_layout, first_val.shape, val.shape, symbols)
    if target is aten.permute.default:
        return tuple(first_layout[d % rank] for d in args[1])
    if target is aten.transpose.int:
        order = list(range(rank))
        a, b = args[1] % rank, args[2] % rank
        order[a], order[b] = order[b], order[a]
        return tuple(first_layout[d] for d in order)
    if target is aten.t.default:
        return tuple(reversed(first_layout))
    if target is aten.unsqueeze.default:
        dim = args[1] % val.dim()
        return first_layout[:dim] + (None,) + first_layout[dim:]
    if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        dims = None if target is aten.squeeze.default else ([args[1]] if isinstance(args[1], int) else args[1])
        return tuple(first_layout[i] for i in _squeezed_dims(first_val.shape, dims))
    if target in REDUCTIONS:
        dims, keepdim = reduced_dims(node)
        dims = set(range(rank)) if dims is None else {d % rank for d in dims}
        if keepdim:
            return tuple(None if i in dims else l for i, l in enumerate(first_layout))
        return tuple(l for i, l in enumerate(first_layout) if i not in dims)
    if target in (aten.mm.default, aten.bmm.default):
        other = layouts.get(args[1])
        return first_layout[:-1] + (other[-1] if other else None,)
    if target is aten.addmm.default:
        a, b = layouts.get(args[1]), layouts.get(args[2])
        return (a[0] if a else None, b[1] if b else None)
    if target is aten.embedding.default:
        return tuple(layouts.get(args[1]) or input_layout(val.shape[:-1], symbols)) + (None,)
    if target is aten.index_select.default:
        dim, index = args[1] % rank, layouts.get(args[2])
        return first_layout[:dim] + ((index[0] if index else None),) + first_layout[dim + 1:]
    if target is aten.gather.default:
        return layouts.get(args[2]) or input_layout(val.shape, symbols)
    if target is aten.cat.default:
        return _cat(node, val, layouts, symbols)
    if target in SAME_AS_FIRST and val.dim() == rank and all(map(same_size, first_val.shape, val.shape)):
        return first_layout
    return _broadcast(node, val, layouts, symbols)


def analyse(gm: fx.GraphModule, symbols: frozenset) -> dict[fx.Node, Layout | MultiLayout]:
    """Layout of every tensor-valued node of `gm` (MultiLayout for multi-output ops)."""
    layouts: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            layouts[node] = input_layout(val.shape, symbols)
        elif node.op == "call_function" and node.target is operator.getitem:
            parent = layouts.get(node.args[0])
            if isinstance(parent, MultiLayout):
                layouts[node] = parent[node.args[1]]
            elif isinstance(val, torch.Tensor):
                layouts[node] = input_layout(val.shape, symbols)
        elif node.op == "call_function" and isinstance(val, (tuple, list)):
            layouts[node] = MultiLayout(
                _layout_of(node, v, layouts, symbols) if isinstance(v, torch.Tensor) else None for v in val)
        elif node.op == "call_function" and isinstance(val, torch.Tensor):
            layouts[node] = _layout_of(node, val, layouts, symbols)
    return layouts
