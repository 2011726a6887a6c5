"""Views that only insert or remove size-1 dims ("unit views"), which fusion looks through.

A linear's result is [N, F] and the model reads it as [1, N, F]; gradients come back the other way.
Such a view keeps every element at the same row-major position whatever the strides, so a fusion
group can read a member through it without materialising anything: its tile-program value is the
member's, and a pointwise node of the view's shape runs in the group's iteration space. Anything else
(merging or splitting dims of size > 1, permutes, expands, slices) is not a unit view: default-deny.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
             aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.alias.default}


def without_units(shape) -> tuple[int, ...] | None:
    """The sizes other than 1; None if a size is symbolic (unbacked SymInts never fuse)."""
    if not all(isinstance(s, int) for s in shape):
        return None
    return tuple(s for s in shape if s != 1)


def same_up_to_units(a, b) -> bool:
    """Whether two static shapes list the same sizes once their size-1 dims are dropped."""
    sizes = without_units(a)
    return sizes is not None and sizes == without_units(b)


def unit_view_source(node: fx.Node) -> fx.Node | None:
    """The tensor `node` views if it is a unit view of it (same dtype, same sizes up to 1s), else None."""
    if node.op != "call_function" or node.target not in _RESHAPES or not node.args:
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node):
        return None
    out, inp = node.meta.get("val"), source.meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)) or out.dtype != inp.dtype:
        return None
    return source if same_up_to_units(out.shape, inp.shape) else None


def in_group_dims(shape, stride, node_shape, group_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An operand of a node of `node_shape` (broadcast to it, numpy-style), restated in the dims of
    `group_shape` (equal to `node_shape` up to 1s): the same elements, so the kernel's logical reshape
    of the argument to the group's iteration space reads what the node reads. A node of any other
    shape broadcasts against the group (numpy-style): its operands are returned as they are."""
    shape, stride, node_shape = tuple(shape), tuple(stride), tuple(node_shape)
    if node_shape == tuple(group_shape) or not same_up_to_units(node_shape, group_shape):
        return shape, stride
    pad = len(node_shape) - len(shape)
    if pad < 0:
        raise ValueError(f"an operand of shape {shape} does not broadcast to {node_shape}")
    padded, padded_stride = (1,) * pad + shape, (0,) * pad + stride
    # the node's and the group's non-unit dims pair up in order (same_up_to_units)
    node_dims = [d for d, size in enumerate(node_shape) if size != 1]
    group_dims = [d for d, size in enumerate(group_shape) if size != 1]
    out_shape, out_stride = [1] * len(group_shape), [0] * len(group_shape)
    for n, g in zip(node_dims, group_dims):
        out_shape[g], out_stride[g] = padded[n], padded_stride[n] if padded[n] != 1 else 0
    return tuple(out_shape), tuple(out_stride)
