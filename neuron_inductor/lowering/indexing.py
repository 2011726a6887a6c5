"""Indexing (family `gather_scatter`): row gathers and scatter-adds through one-hot matmuls,
and gathers / scatters along the last dim through lane masks.

Row ops (`mode` "row_gather" / "row_scatter"): embedding, index_select(dim=0), index.Tensor with
one index, embedding_dense_backward, index_put on dim 0. On hardware a row gather is an indirect
DMA (`dma_copy` with `.ap(vector_offset=...)`); our interpreter has no indirect DMA, so the kernels
use the TensorE formulation instead, which is exact and runs unchanged on the device but costs
O(vocab) per token tile -- right for small tables, not for 100k-row vocabularies:
  gather:       out[T, D]  = onehot(ids)[T, V] @ W[V, D]    (one-hot built transposed, [V, T])
  scatter-add:  dW[V, D]  += onehot(ids)^T[V, T] @ dY[T, D]  (duplicates accumulate in PSUM)
Token ids are compared in fp32 (exact below 2**24). Out-of-range ids match no row: a gather
returns zeros and a scatter drops the row (PyTorch raises); negative ids are not wrapped.

Lane ops (`mode` "lane_gather" / "lane_scatter"): gather / scatter.value / scatter.src /
scatter_add along the last dim with an index of the same leading shape (cross-entropy's
`gather(log_probs, -1, target[:, None])` and its backward's `scatter.value`). Rows sit on
partitions; each index column becomes an int32 lane mask (all ones where `iota == index`) over
the free axis, and values move as their fp32 bits under it: a gather sums x's masked bits (the
indexed lane's value plus +0.0s), a scatter bit-selects the new value into its lanes. Infinities
and NaN therefore land exactly where eager puts them and never spread along the row (0 * inf
never happens). A gathered -0.0 may come back as +0.0.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .common import arg, float32_bits, val
from .ir import KernelSpec, Unsupported
from .reduction import EXACT_INT_LIMIT, FREE_MAX, PSUM_FMAX, walk_dims
from .registry import register_lowering

aten = torch.ops.aten

# lanes per tile of a lane op: up to eight [rows, lanes] fp32 tiles are live at once
LANE_FMAX = FREE_MAX // 4


def _token_dims(ids_shape, width: int, width_limit: int) -> list[dict]:
    """Walk of a [*ids_shape, width] tensor: ids dims on partitions, `width` on the free axis."""
    shape = [int(s) for s in ids_shape] + [int(width)]
    p_group = [d for d, s in enumerate(ids_shape) if s > 1]
    return [d.as_param() for d in walk_dims(shape, set(), p_group, [len(ids_shape)] if width > 1 else [], width_limit)]


def _check_table(table: torch.Tensor, ids: torch.Tensor) -> None:
    if table.dim() != 2:
        raise Unsupported("row gathers / scatters of a table that is not 2-D")
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() == 0:
        raise Unsupported(f"indices of dtype {ids.dtype} and rank {ids.dim()}")
    if table.shape[0] >= EXACT_INT_LIMIT:
        raise Unsupported("more rows than fp32 compares exactly")
    if table.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"table dtype {table.dtype}")


def _row_gather(node: fx.Node, table: fx.Node, ids: fx.Node) -> KernelSpec:
    w, i = val(table), val(ids)
    _check_table(w, i)
    rows, width = int(w.shape[0]), int(w.shape[1])
    params = {"mode": "row_gather", "rows": rows, "dims": _token_dims(i.shape, width, PSUM_FMAX)}
    return KernelSpec("gather_scatter", params, [table, ids], [node], flops=2 * i.numel() * rows * width)


@register_lowering(aten.embedding.default)
def lower_embedding(node: fx.Node) -> KernelSpec:
    return _row_gather(node, node.args[0], node.args[1])


@register_lowering(aten.index_select.default)
def lower_index_select(node: fx.Node) -> KernelSpec:
    if int(arg(node, 1, "dim")) % max(val(node.args[0]).dim(), 1) != 0:
        raise Unsupported("index_select along a dim other than 0")
    return _row_gather(node, node.args[0], node.args[2])


@register_lowering(aten.index.Tensor)
def lower_index(node: fx.Node) -> KernelSpec:
    indices = list(node.args[1])
    if len(indices) != 1 or indices[0] is None or val(indices[0]).dtype == torch.bool:
        raise Unsupported("advanced indexing other than one integer index on dim 0")
    return _row_gather(node, node.args[0], indices[0])


def _row_scatter(node, base, ids, values, rows: int, width: int, accumulate: bool, padding_idx: int) -> KernelSpec:
    i, v = val(ids), val(values)
    if tuple(v.shape) != tuple(i.shape) + (width,):
        raise Unsupported("scattered values that do not have the index's shape plus one row")
    _check_table(val(node), i)
    params = {"mode": "row_scatter", "rows": rows, "dims": _token_dims(i.shape, width, PSUM_FMAX),
              "accumulate": accumulate, "padding_idx": padding_idx, "has_base": base is not None}
    inputs = [values, ids] + ([base] if base is not None else [])
    return KernelSpec("gather_scatter", params, inputs, [node], flops=2 * i.numel() * rows * width)


@register_lowering(aten.embedding_dense_backward.default)
def lower_embedding_dense_backward(node: fx.Node) -> KernelSpec:
    grad, ids, num_weights, padding_idx, scale_grad_by_freq = node.args[:5]
    if scale_grad_by_freq:
        raise Unsupported("scale_grad_by_freq")
    width = int(val(node).shape[1])
    return _row_scatter(node, None, ids, grad, int(num_weights), width, True, int(padding_idx))


@register_lowering(aten.index_put.default)
def lower_index_put(node: fx.Node) -> KernelSpec:
    """index_put(self[V, D], [ids], values[*ids, D], accumulate). Without accumulate the rows named
    by ids are replaced; with duplicate ids PyTorch leaves the result unspecified (here: their sum)."""
    base, indices, values = node.args[0], list(node.args[1]), node.args[2]
    accumulate = bool(arg(node, 3, "accumulate", False))
    if len(indices) != 1 or indices[0] is None or val(indices[0]).dtype == torch.bool:
        raise Unsupported("index_put with other than one integer index on dim 0")
    b = val(base)
    if b.dim() != 2:
        raise Unsupported("index_put into a tensor that is not 2-D")
    return _row_scatter(node, base, indices[0], values, int(b.shape[0]), int(b.shape[1]), accumulate, -1)


# ---- lane ops: gather / scatter along the last dim ------------------------------------------------

def _lane_spec(node: fx.Node, mode: str, x: fx.Node, dim, index: fx.Node, src=None, value=None,
               reduce: str | None = None) -> KernelSpec:
    xv, iv = val(x), val(index)
    rank = xv.dim()
    if rank < 2 or int(dim) % rank != rank - 1:
        raise Unsupported(f"{mode} along a dim other than the last of a tensor of rank >= 2")
    if tuple(iv.shape[:-1]) != tuple(xv.shape[:-1]):
        raise Unsupported("an index whose leading dims differ from the input's")
    if isinstance(src, fx.Node) and tuple(val(src).shape) != tuple(iv.shape):
        raise Unsupported("a scatter source of another shape than the index")
    if xv.shape[-1] >= EXACT_INT_LIMIT or not xv.dtype.is_floating_point:
        raise Unsupported(f"lane {mode} of {xv.dtype} with {xv.shape[-1]} lanes")
    width = int(xv.shape[-1])
    params = {
        "mode": mode,
        "dims": _token_dims(xv.shape[:-1], width, LANE_FMAX),
        "index_width": int(iv.shape[-1]),
        "reduce": reduce,
    }
    if value is not None:
        # eager casts the value to x's dtype; the kernel places that value's fp32 bits
        params["value"] = float(value)
        params["value_bits"] = float32_bits(torch.tensor(float(value), dtype=xv.dtype).item())
    inputs = [x, index] + ([src] if isinstance(src, fx.Node) else [])
    return KernelSpec("gather_scatter", params, inputs, [node], flops=xv.numel() * int(iv.shape[-1]))


@register_lowering(aten.gather.default)
def lower_gather(node: fx.Node) -> KernelSpec:
    if arg(node, 3, "sparse_grad", False):
        raise Unsupported("sparse_grad")
    return _lane_spec(node, "lane_gather", node.args[0], node.args[1], node.args[2])


@register_lowering(aten.scatter.value)
def lower_scatter_value(node: fx.Node) -> KernelSpec:
    return _lane_spec(node, "lane_scatter", node.args[0], node.args[1], node.args[2], value=node.args[3])


@register_lowering(aten.scatter.src)
def lower_scatter_src(node: fx.Node) -> KernelSpec:
    return _lane_spec(node, "lane_scatter", node.args[0], node.args[1], node.args[2], src=node.args[3])


@register_lowering(aten.scatter_add.default)
def lower_scatter_add(node: fx.Node) -> KernelSpec:
    return _lane_spec(node, "lane_scatter", node.args[0], node.args[1], node.args[2], src=node.args[3], reduce="add")

