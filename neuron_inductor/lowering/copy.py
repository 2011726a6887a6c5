"""Data movement (family `copy`): copy / copy_, cat, constant_pad_nd, slice_scatter, flip, repeat.

Each op is a list of *pieces*: a box of the destination filled either from one input (read by its
logical shape, so strided / expanded host views work) or with a constant. Pieces never overlap,
so the DMAs may complete in any order. Input pieces are direct HBM -> HBM DMAs, one per box of
`plan_copy` with no partition limit (`_walk`: up to HBM_BOX_ROWS leading elements; a large one-DMA
piece is cut for the LNC programs to share, `_share_out`); constant pieces DMA a memset SBUF tile of
`plan_copy`'s tiles. No engine touches the data.

A piece's `dst` / `src` list one slice per dim of the destination / source: `shift` (the box's
offset), `step` (a strided box, slice_scatter's step) and `mode`: "same" follows the walked dim,
"one" reads index 0 of a size-1 source dim (broadcast, repeat), "flip" reads the walked index
mirrored. DMAs have no negative or zero strides, so the dims a source does not follow ("one",
"flip", and destination dims the source lacks) are walked one index at a time.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from .common import arg, val
from .context import LoweringContext
from .ir import KernelSpec, Unsupported
from .lnc import split_nest
from .reduction import Dim, plan_copy
from .registry import register_lowering

aten = torch.ops.aten

# The most DMAs one kernel may issue: flip / broadcast / repeat walk some dims one index at a
# time, and every DMA is a line of the unrolled kernel.
MAX_DMAS = 16384
# Rows (leading-dim elements) of one HBM -> HBM box: no partition limit applies off chip, and an access
# pattern's sizes are uint16 (nki-reference.md §2)
HBM_BOX_ROWS = 65535


def _walk(ctx: LoweringContext, shape, single=(), hbm: bool = True) -> list[dict]:
    """plan_copy's walk of `shape`, with the dims in `single` walked one index at a time. `hbm`: the
    boxes are HBM -> HBM DMAs, whose leading dims lie on no partitions: boxes of up to HBM_BOX_ROWS
    rows, not the tile's partitions (fewer, larger DMAs; `_share_out` gives each LNC program one)."""
    shape = [int(s) for s in shape]
    tile = dataclasses.replace(ctx.tile, partitions=HBM_BOX_ROWS) if hbm else ctx.tile
    planned = plan_copy(tile, [1 if d in single else s for d, s in enumerate(shape)])
    return [(Dim(d, shape[d], False, "loop", 1) if d in single else p).as_param() for d, p in enumerate(planned)]


def _slice(dim: int, shift: int = 0, step: int = 1, mode: str = "same") -> dict:
    return {"dim": dim, "shift": int(shift), "step": int(step), "mode": mode}


def _piece(ctx: LoweringContext, shape, offsets, source: int | None, source_offsets=None, steps=None,
           source_steps=None) -> dict:
    """A destination box of `shape` at `offsets` (every `steps`-th element), read from input
    `source` at `source_offsets` (default: its origin), or filled with the constant when `source` is None."""
    rank = len(shape)
    source_offsets = source_offsets or [0] * rank
    steps, source_steps = steps or [1] * rank, source_steps or [1] * rank
    return {"source": source, "dims": _walk(ctx, shape, hbm=source is not None),
            "dst": [_slice(d, offsets[d], steps[d]) for d in range(rank)],
            "src": [_slice(d, source_offsets[d], source_steps[d]) for d in range(rank)]}


def _broadcast_piece(ctx: LoweringContext, shape, source_shape, source: int) -> dict:
    """The whole destination `shape` read from input `source` broadcast to it (torch rules)."""
    lead = len(shape) - len(source_shape)
    if lead < 0 or any(s not in (1, shape[lead + k]) for k, s in enumerate(source_shape)):
        raise Unsupported(f"source of shape {list(source_shape)} does not broadcast to {list(shape)}")
    src = [_slice(lead + k, mode="one" if s == 1 else "same") for k, s in enumerate(source_shape)]
    single = set(range(lead)) | {s["dim"] for s in src if s["mode"] == "one"}
    return {"source": source, "dims": _walk(ctx, shape, single), "dst": [_slice(d) for d in range(len(shape))],
            "src": src}


def _tile_size(piece: dict, axis: str) -> int:
    size = 1
    for d in piece["dims"]:
        if d["axis"] == axis:
            size *= d["chunk"]
    return size


def _dma_count(piece: dict) -> int:
    return math.prod(-(-d["extent"] // d["chunk"]) for d in piece["dims"])


def _fill_pieces(ctx: LoweringContext, out_shape, inner_lo, inner_hi) -> list[dict]:
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
                pieces.append(_piece(ctx, shape, offsets, None))
    return pieces


def _share_out(ctx: LoweringContext, pieces: list[dict]) -> None:
    """A piece of one DMA holding more than a ctx.lnc-th of the kernel's elements, in a box of more rows
    than the partitions (one that tiles would have cut, _walk), is cut along its outermost dim of 2+
    elements into ctx.lnc chunks, so that the LNC programs share it. Smaller boxes stay one DMA: a
    one-program copy kernel replays as copies (sim/replay.py), an SPMD one as operations."""
    if ctx.lnc == 1 or not pieces:
        return
    size = lambda p: math.prod(d["extent"] for d in p["dims"])  # noqa: E731
    largest = max(pieces, key=size)
    rows = math.prod(d["chunk"] for d in largest["dims"] if d["axis"] == "p")
    if _dma_count(largest) > 1 or rows <= ctx.tile.partitions or size(largest) * ctx.lnc <= sum(map(size, pieces)):
        return
    for d in largest["dims"]:
        if d["chunk"] >= 2:
            d["chunk"] = -(-d["chunk"] // ctx.lnc)
            d["walked"] = d["chunk"] < d["extent"]
            return


def _deal_pieces(ctx: LoweringContext, pieces: list[dict]) -> bool:
    """Deal the pieces' DMAs out over ctx.lnc programs (pieces are disjoint boxes of the destination, so
    any deal is race-free): piece["split"] is the walked dim (lowering/lnc.py `split_nest`) whose boxes are
    dealt, or, for a piece with nothing to split (one DMA) when the kernel splits, piece["deal"] is the
    program index (modulo the launch) that issues it, round-robin from the last program on (the
    split loops give program 0 their odd box). True when the kernel splits."""
    for piece in pieces:
        walked = [d for d in piece["dims"] if d["walked"]]
        depth = split_nest(ctx, [[-(-d["extent"] // d["chunk"])] for d in walked])
        piece["split"] = None if depth is None else walked[depth]["index"]
    whole = [p for p in pieces if p["split"] is None]
    split = len(whole) < len(pieces) or (ctx.lnc > 1 and len(whole) >= 2)
    for number, piece in enumerate(whole):
        piece["deal"] = ctx.lnc - 1 - number % ctx.lnc if split else None
    for piece in pieces:
        piece.setdefault("deal", None)
    return split


def _spec(ctx: LoweringContext, node: fx.Node, inputs: list, pieces: list[dict], fill=None, inplace: bool = False,
          dst_view=None) -> KernelSpec:
    """`dst_view`: the shape the pieces see the (fresh, contiguous) output as, if not its own."""
    out = val(node)
    if out.dtype in (torch.float64, torch.complex64, torch.complex128):
        raise Unsupported(f"dtype {out.dtype} has no on-chip equivalent")
    pieces = [p for p in pieces if all(d["extent"] > 0 for d in p["dims"])]
    _share_out(ctx, pieces)
    dmas = sum(_dma_count(p) for p in pieces)
    if dmas > MAX_DMAS:
        raise Unsupported(f"{dmas} DMAs (more than {MAX_DMAS}: too many indices walked one at a time)")
    fills = [p for p in pieces if p["source"] is None]
    fill_tile = tuple(max(_tile_size(p, axis) for p in fills) for axis in "pf") if fills else None
    if fills:
        fill = int(fill) if out.dtype == torch.bool or not out.dtype.is_floating_point else float(fill)
    split = _deal_pieces(ctx, pieces)
    params = {"pieces": pieces, "fill": fill, "fill_tile": fill_tile, "inplace": inplace,
              "dst_view": tuple(dst_view) if dst_view is not None else None}
    return KernelSpec("copy", params, inputs, [node], inplace={0: 0} if inplace else {},
                      grid=ctx.lnc if split else 1)


def _check_cast(src: torch.dtype, dst: torch.dtype) -> None:
    """A DMA converts through fp32 and rounds to nearest: exact for these casts only."""
    if src == dst or dst.is_floating_point or dst == torch.bool:
        return
    if src == torch.bool or (src in (torch.int32, torch.int64) and dst in (torch.int32, torch.int64)):
        return  # (int64 graph values are int32 in the kernels)
    raise Unsupported(f"copy casting {src} to {dst} (a DMA rounds instead of truncating / wrapping)")


def _lower_copy(ctx: LoweringContext, node: fx.Node, inplace: bool) -> KernelSpec:
    dst, src = node.args[0], node.args[1]
    if not isinstance(src, fx.Node):
        raise Unsupported("copy from a Python scalar")
    if val(src).dtype in (torch.float64, torch.complex64, torch.complex128):
        raise Unsupported(f"source dtype {val(src).dtype} has no on-chip equivalent")
    _check_cast(val(src).dtype, val(dst).dtype)
    inputs = [dst, src] if inplace else [src]
    piece = _broadcast_piece(ctx, val(dst).shape, val(src).shape, len(inputs) - 1)
    return _spec(ctx, node, inputs, [piece], inplace=inplace)


@register_lowering(aten.copy_.default)
def lower_copy_(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """copy_(dst, src): the kernel writes src (broadcast, cast) into its input 0 and returns nothing."""
    return _lower_copy(ctx, node, inplace=True)


@register_lowering(aten.copy.default)
def lower_copy(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """copy(dst, src): a new tensor like dst holding src broadcast to dst's shape, cast to its dtype
    (dst's values are not read, so the kernel takes src only)."""
    return _lower_copy(ctx, node, inplace=False)


# Elementwise copies that are data movement only when the group holds nothing else.
_COPY_OPS = (aten.clone.default, aten._to_copy.default)


def lone_copy(nodes: list[fx.Node], outputs: list[fx.Node]) -> fx.Node | None:
    """The node of a pointwise group that is one same-dtype clone / _to_copy of a tensor (None
    otherwise). Such a group needs no engine: `lower_lone_copy` moves it HBM -> HBM, one DMA per
    box instead of a load and a store through SBUF; a permuted source (attention's
    out.transpose(1, 2).contiguous()) keeps its whole rows in each box."""
    if len(nodes) != 1 or outputs != nodes or nodes[0].target not in _COPY_OPS:
        return None
    node = nodes[0]
    src = node.args[0]
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
        return None
    if val(src).dtype != val(node).dtype or val(src).shape != val(node).shape or val(node).numel() == 0:
        return None
    return node


def lower_lone_copy(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """A `lone_copy` node as a copy kernel: HBM -> HBM DMAs of `plan_copy`'s boxes."""
    src = node.args[0]
    piece = _broadcast_piece(ctx, val(node).shape, val(src).shape, 0)
    return _spec(ctx, node, [src], [piece])


@register_lowering(aten.cat.default)
def lower_cat(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
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
        pieces.append(_piece(ctx, shape, offsets, len(inputs)))
        inputs.append(t)
        offset += shape[dim]
    if not inputs:
        raise Unsupported("cat of empty tensors only")
    return _spec(ctx, node, inputs, pieces)


@register_lowering(aten.constant_pad_nd.default)
def lower_constant_pad_nd(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
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
    pieces = _fill_pieces(ctx, list(val(node).shape), lo, hi)
    pieces.append(_piece(ctx, [h - l for l, h in zip(lo, hi)], lo, 0, src_lo))
    return _spec(ctx, node, [node.args[0]], pieces, fill=value)


@register_lowering(aten.slice_scatter.default)
def lower_slice_scatter(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    base, src = node.args[0], node.args[1]
    shape = list(val(base).shape)
    rank = len(shape)
    dim = int(arg(node, 2, "dim", 0)) % rank
    start = arg(node, 3, "start")  # the end is implied by the source's extent
    step = int(arg(node, 5, "step", 1))
    start = 0 if start is None else int(start)
    start = min(max(start + shape[dim] if start < 0 else start, 0), shape[dim])
    count = int(val(src).shape[dim])
    lo = [0] * rank
    lo[dim] = start
    hi = shape.copy()
    hi[dim] = start + max(count - 1, 0) * step + min(count, 1)
    # the base everywhere outside the slice (read in place), the source inside it: outside means
    # before / after the slice's span, and the gaps between its elements (step > 1)
    pieces = [{**box, "source": 0, "src": box["dst"]} for box in _fill_pieces(ctx, shape, lo, hi)]
    steps = [1] * rank
    steps[dim] = step
    for gap in range(1, step):
        gap_shape, gap_lo = shape.copy(), lo.copy()
        gap_shape[dim], gap_lo[dim] = count - 1, start + gap
        if count > 1:
            pieces.append(_piece(ctx, gap_shape, gap_lo, 0, gap_lo, steps, steps))
    pieces.append(_piece(ctx, list(val(src).shape), lo, 1, steps=steps))
    return _spec(ctx, node, [base, src], pieces)


@register_lowering(aten.flip.default)
def lower_flip(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x = val(node.args[0])
    rank = x.dim()
    flipped = {int(d) % max(rank, 1) for d in arg(node, 1, "dims")}
    flipped = {d for d in flipped if x.shape[d] > 1}  # mirroring one index moves nothing
    shape = list(x.shape)
    piece = {"source": 0, "dims": _walk(ctx, shape, flipped), "dst": [_slice(d) for d in range(rank)],
             "src": [_slice(d, mode="flip" if d in flipped else "same") for d in range(rank)]}
    return _spec(ctx, node, [node.args[0]], [piece])


@register_lowering(aten.repeat.default)
def lower_repeat(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """The output seen as [r0, s0, r1, s1, ...] (repeats interleaved with the input's padded
    shape) is the input broadcast along the repeat dims."""
    x = val(node.args[0])
    repeats = [int(r) for r in arg(node, 1, "repeats")]
    lead = len(repeats) - x.dim()
    if lead < 0:
        raise Unsupported("repeat with fewer repeats than dims")
    padded = [1] * lead + list(x.shape)
    view = [n for pair in zip(repeats, padded) for n in pair]
    src = [_slice(2 * (lead + k) + 1) for k in range(x.dim())]
    repeat_dims = set(range(0, len(view), 2))
    piece = {"source": 0, "dims": _walk(ctx, view, repeat_dims), "dst": [_slice(d) for d in range(len(view))],
             "src": src}
    return _spec(ctx, node, [node.args[0]], [piece], dst_view=view)
