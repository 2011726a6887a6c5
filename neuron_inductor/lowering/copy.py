"""Data movement (family `copy`): copy_ into a graph input, cat, constant_pad_nd, slice_scatter.

Each op is a list of *pieces*: a box of the destination filled either from one input (read by its
logical shape, so strided / expanded host views work) or with a constant. Pieces never overlap,
so the DMAs may complete in any order. Input pieces are direct HBM -> HBM DMAs, one per tile of
`plan_copy`; constant pieces DMA a memset SBUF tile. No engine touches the data.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .common import arg, val
from .ir import KernelSpec, Unsupported
from .reduction import plan_copy
from .registry import register_lowering

aten = torch.ops.aten


def _piece(shape, offsets, source: int | None, source_offsets=None) -> dict:
    """A destination box of `shape` at `offsets`, read from input `source` at `source_offsets`
    (default: its origin), or filled with the constant when `source` is None."""
    return {"source": source, "dims": [d.as_param() for d in plan_copy(shape)], "offsets": list(offsets),
            "source_offsets": list(source_offsets or [0] * len(shape))}


def _tile_size(piece: dict, axis: str) -> int:
    size = 1
    for d in piece["dims"]:
        if d["axis"] == axis:
            size *= d["chunk"]
    return size


def _fill_pieces(out_shape, inner_lo, inner_hi) -> list[dict]:
    """Boxes covering out_shape minus the box [inner_lo, inner_hi): per dim d, the slabs before
    and after the inner box, restricted to the inner box on dims < d (so slabs are disjoint)."""
    pieces = []
    for d, extent in enumerate(out_shape):
        for lo, hi in ((0, inner_lo[d]), (inner_hi[d], extent)):
            if hi <= lo:
                continue
            shape, offsets = [], []
            for e, size in enumerate(out_shape):
                if e < d:
                    shape.append(inner_hi[e] - inner_lo[e])
                    offsets.append(inner_lo[e])
                elif e == d:
                    shape.append(hi - lo)
                    offsets.append(lo)
                else:
                    shape.append(size)
                    offsets.append(0)
            if all(s > 0 for s in shape):
                pieces.append(_piece(shape, offsets, None))
    return pieces


def _spec(node: fx.Node, inputs: list, pieces: list[dict], fill=None, inplace: bool = False) -> KernelSpec:
    out = val(node)
    if out.dtype in (torch.float64, torch.complex64, torch.complex128):
        raise Unsupported(f"dtype {out.dtype} has no on-chip equivalent")
    if out.dim() == 0:
        raise Unsupported("0-d data movement")
    pieces = [p for p in pieces if all(d["extent"] > 0 for d in p["dims"])]
    fills = [p for p in pieces if p["source"] is None]
    fill_tile = tuple(max(_tile_size(p, axis) for p in fills) for axis in "pf") if fills else None
    if fills:
        fill = int(fill) if out.dtype == torch.bool or not out.dtype.is_floating_point else float(fill)
    params = {"pieces": pieces, "fill": fill, "fill_tile": fill_tile, "inplace": inplace}
    return KernelSpec("copy", params, inputs, [node], inplace={0: 0} if inplace else {})


@register_lowering(aten.copy_.default)
def lower_copy_(node: fx.Node) -> KernelSpec:
    """copy_(dst, src): the kernel writes src into its input 0 and returns nothing."""
    dst, src = node.args[0], node.args[1]
    if not isinstance(src, fx.Node) or val(src).shape != val(dst).shape:
        raise Unsupported("copy_ from a broadcast source (expand it on the host first)")
    shape = val(dst).shape
    return _spec(node, [dst, src], [_piece(shape, [0] * len(shape), 1)], inplace=True)


@register_lowering(aten.cat.default)
def lower_cat(node: fx.Node) -> KernelSpec:
    tensors = list(node.args[0])
    out = val(node)
    dim = int(arg(node, 1, "dim", 0)) % max(out.dim(), 1)
    inputs, pieces, offset = [], [], 0
    for t in tensors:
        shape = val(t).shape
        if val(t).dim() == 1 and shape[0] == 0:  # legacy cat skips empty 1-D tensors
            continue
        if val(t).dtype != out.dtype:
            raise Unsupported("cat of mixed dtypes")
        offsets = [0] * out.dim()
        offsets[dim] = offset
        pieces.append(_piece(shape, offsets, len(inputs)))
        inputs.append(t)
        offset += shape[dim]
    if not inputs:
        raise Unsupported("cat of empty tensors only")
    return _spec(node, inputs, pieces)


@register_lowering(aten.constant_pad_nd.default)
def lower_constant_pad_nd(node: fx.Node) -> KernelSpec:
    x = val(node.args[0])
    pad = list(arg(node, 1, "pad"))
    value = arg(node, 2, "value", 0)
    rank = x.dim()
    lo, hi, src_lo, src_hi = [0] * rank, list(val(node).shape), [0] * rank, list(x.shape)
    for i in range(len(pad) // 2):
        d = rank - 1 - i
        before, after = int(pad[2 * i]), int(pad[2 * i + 1])
        # a negative pad crops the input instead
        lo[d], src_lo[d] = max(before, 0), max(-before, 0)
        src_hi[d] = x.shape[d] - max(-after, 0)
        hi[d] = lo[d] + max(src_hi[d] - src_lo[d], 0)
    if any(s != 0 for s in src_lo) or any(h != s for h, s in zip(src_hi, x.shape)):
        raise Unsupported("constant_pad_nd with negative (cropping) pads")
    pieces = _fill_pieces(list(val(node).shape), lo, hi)
    pieces.append(_piece(list(x.shape), lo, 0))
    return _spec(node, [node.args[0]], pieces, fill=value)


@register_lowering(aten.slice_scatter.default)
def lower_slice_scatter(node: fx.Node) -> KernelSpec:
    base, src = node.args[0], node.args[1]
    shape = list(val(base).shape)
    rank = len(shape)
    dim = int(arg(node, 2, "dim", 0)) % rank
    start = arg(node, 3, "start")  # the end is implied by the source's extent
    step = int(arg(node, 5, "step", 1))
    if step != 1:
        raise Unsupported("slice_scatter with a step")
    start = 0 if start is None else int(start)
    start = min(max(start + shape[dim] if start < 0 else start, 0), shape[dim])
    lo = [0] * rank
    lo[dim] = start
    hi = shape.copy()
    hi[dim] = start + int(val(src).shape[dim])
    # the base everywhere outside the slice (read in place), the source inside it
    pieces = [{**box, "source": 0, "source_offsets": box["offsets"]} for box in _fill_pieces(shape, lo, hi)]
    pieces.append(_piece(list(val(src).shape), lo, 1))
    return _spec(node, [base, src], pieces)
