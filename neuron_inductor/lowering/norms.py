"""Lowerings of the row-normalising ops: softmax / log_softmax, layer norm, RMS norm and
cross-entropy (nll_loss), forward and backward; group norm's forward (rows: a sample's group);
and batch norm's forward (training and eval), which normalises per channel instead
(`channel_layout`: channels on partitions).

All of them reduce every row of a tensor over its trailing dims, so they share one layout: rows
(the flattened leading dims) go to the partitions and the reduced elements (the flattened
trailing dims) to the free axis, in column chunks that fit SBUF. The layout is computed here, at
lowering time: for every row tile and column chunk, the exact HBM slices its DMAs read or write.
A row tile may straddle leading dims (rows 0..127 of a [2, 65, D] tensor), so it is covered by a
few "boxes" (per-dim slices of one contiguous run of rows); templates emit one dma_copy per box,
which works for any shape and for strided / permuted / expanded input views alike.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..passes import rms_norm_fusion
from .common import result_values, val
from .context import KIB, LoweringContext
from .ir import KernelSpec, Unsupported
from .lnc import split_row_tiles
from .registry import register_lowering

aten = torch.ops.aten

# The live tiles of one row tile may take the usable SBUF per partition minus this reserve, which
# leaves room for a tile being allocated while its predecessor is live (160 KiB of trn2's 208 KiB).
SBUF_RESERVE = 48 * KIB
# Column chunks start at multiples of this: whole bn_stats groups (512), PSUM blocks (512) and
# 128-column matmul blocks.
CHUNK_ALIGN = 512


# --- layout ------------------------------------------------------------------------------------

Box = list[list[int]]  # per-dim [start, stop) of one contiguous run of a flattened range


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Split the row-major flat range [start, stop) of `shape` into boxes, in order.

    Each box is a list of per-dim [start, stop) whose elements, read row-major, are one
    contiguous run of the flat range; at most 2 * len(shape) - 1 boxes.
    """
    if not shape:
        return [[]] if stop > start else []
    inner = math.prod(shape[1:])
    first, first_rem = divmod(start, inner)
    last, last_rem = divmod(stop, inner)
    if first == last:
        return [[[first, first + 1], *box] for box in flat_boxes(shape[1:], first_rem, last_rem)]
    boxes = []
    if first_rem:
        boxes += [[[first, first + 1], *box] for box in flat_boxes(shape[1:], first_rem, inner)]
        first += 1
    if last > first:
        boxes.append([[first, last], *[[0, size] for size in shape[1:]]])
    if last_rem:
        boxes += [[[last, last + 1], *box] for box in flat_boxes(shape[1:], 0, last_rem)]
    return boxes


def spans(shape: tuple[int, ...], limit: int, align: int = 1) -> list[dict]:
    """Cover the flattened `shape` with spans of at most `limit` elements, of balanced lengths
    that are multiples of `align` (but the last, or when `limit` < `align`).

    A span is {"start", "size", "boxes": [{"at": [a, b], "index": box}]}: `at` is where the box's
    elements sit inside the span (the partition or free-axis range of the on-chip tile).
    """
    total = math.prod(shape)
    balanced = -(-total // -(-total // limit))
    size = min(limit, -(-balanced // align) * align) if limit >= align else limit
    result = []
    for start in range(0, total, size):
        stop = min(total, start + size)
        boxes, at = [], 0
        for box in flat_boxes(shape, start, stop):
            length = math.prod(b - a for a, b in box)
            boxes.append({"at": [at, at + length], "index": box})
            at += length
        result.append({"start": start, "size": stop - start, "boxes": boxes})
    return result


def row_layout(ctx: LoweringContext, shape: tuple[int, ...], reduced_ndim: int, bytes_per_col: int) -> dict:
    """Template params placing the rows of `shape` on partitions and its last `reduced_ndim`
    dims on the free axis, in column chunks whose live tiles take `bytes_per_col` bytes per
    column (per partition) within the target's SBUF budget."""
    lead, trail = shape[: len(shape) - reduced_ndim], shape[len(shape) - reduced_ndim:]
    rows, cols = math.prod(lead), math.prod(trail)
    if rows == 0 or cols == 0:
        raise Unsupported("empty tensor")
    return {
        "rows": rows,
        "cols": cols,
        "row_tiles": spans(lead, ctx.tile.partitions),
        "col_chunks": spans(trail, max(1, ctx.sbuf_budget(SBUF_RESERVE) // bytes_per_col), CHUNK_ALIGN),
        # Index of the per-row statistics (mean / rstd), which keep the reduced dims with size 1.
        "stat_index": [[0, 1]] * reduced_ndim,
    }


# --- node helpers ------------------------------------------------------------------------------

def _shape(node) -> tuple[int, ...]:
    return tuple(int(s) for s in val(node).shape)


def _float_input(node: fx.Node, what: str) -> None:
    if val(node).dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"{what} has dtype {val(node).dtype}; the kernel handles fp32 / bf16 / fp16")


def _reduced_ndim_for_dim(shape: tuple[int, ...], dim: int) -> int:
    """Number of trailing dims a reduction over `dim` covers: `dim` plus any size-1 dims after it."""
    dim = dim % max(len(shape), 1)
    if any(size != 1 for size in shape[dim + 1:]):
        raise Unsupported(f"reduction over dim {dim} of {list(shape)} is not innermost "
                          "(the kernel reduces along the free axis)")
    return len(shape) - dim


# --- softmax / log_softmax ---------------------------------------------------------------------

def _softmax_layout(ctx: LoweringContext, x: fx.Node, what: str, dim: int,
                    bytes_per_col: int) -> tuple[tuple[int, ...], dict]:
    """The shape of the softmax operand `x` and its row layout for a softmax over `dim`."""
    _float_input(x, what)
    shape = _shape(x)
    if not shape:
        raise Unsupported("0-d input")
    return shape, row_layout(ctx, shape, _reduced_ndim_for_dim(shape, dim), bytes_per_col)


@register_lowering(aten._softmax.default, aten._log_softmax.default)
def lower_softmax(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, dim, _half_to_float = node.args
    # Live per column (fp32 worst case): x, its exponentials, y.
    shape, layout = _softmax_layout(ctx, x, "input", dim, 12)
    split = split_row_tiles(ctx, layout)
    return KernelSpec(
        family="softmax",
        params={"mode": "forward", "log": node.target is aten._log_softmax.default, "lnc_split": split, **layout},
        inputs=[x], outputs=[node], flops=5 * math.prod(shape), grid=ctx.lnc if split else 1)


@register_lowering(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def lower_softmax_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    grad_output, output, dim, _input_dtype = node.args
    # Live per column: dy, y, their product (or exp(y)), dx.
    shape, layout = _softmax_layout(ctx, output, "output", dim, 16)
    split = split_row_tiles(ctx, layout)
    return KernelSpec(
        family="softmax",
        params={"mode": "backward", "log": node.target is aten._log_softmax_backward_data.default,
                "lnc_split": split, **layout},
        inputs=[grad_output, output], outputs=[node], flops=4 * math.prod(shape), grid=ctx.lnc if split else 1)


# --- layer norm --------------------------------------------------------------------------------

def _optional_float(node, what: str) -> list[fx.Node]:
    if node is None:
        return []
    _float_input(node, what)
    return [node]


@register_lowering(aten.native_layer_norm.default)
def lower_layer_norm(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, normalized_shape, weight, bias, eps = node.args
    _float_input(x, "input")
    shape = _shape(x)
    # Live per column: x, a temporary, y, and the weight and bias (each a row and its broadcast).
    layout = row_layout(ctx, shape, len(normalized_shape), 28)
    split = split_row_tiles(ctx, layout)  # the backward's weight / bias gradients sum over every row tile: not split
    return KernelSpec(
        family="layer_norm",
        params={"mode": "forward", "eps": float(eps), "has_weight": weight is not None,
                "has_bias": bias is not None, "lnc_split": split, **layout},
        inputs=[x, *_optional_float(weight, "weight"), *_optional_float(bias, "bias")],
        outputs=result_values(node), flops=8 * math.prod(shape), grid=ctx.lnc if split else 1)


@register_lowering(aten.native_layer_norm_backward.default)
def lower_layer_norm_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    grad_out, x, normalized_shape, mean, rstd, weight, _bias, _output_mask = node.args
    _float_input(x, "input")
    has_dx, has_dw, has_db = (value is not None for value in val(node))
    if has_dw and weight is None:
        raise Unsupported("grad_weight requested without a weight")
    shape = _shape(x)
    # Live per column: dy, x, x_hat, g = dy * w, g * x_hat, dy * x_hat, a temporary, dx, and the
    # weight (a row and its broadcast).
    layout = row_layout(ctx, shape, len(normalized_shape), 40)
    trail = shape[len(shape) - len(normalized_shape):]
    # grad_weight / grad_bias: column sums over all rows, accumulated in PSUM with a partition's
    # worth of columns per matmul output block on partitions, one PSUM column per block.
    col_blocks = spans(trail, ctx.tile.partitions, ctx.tile.partitions)
    if (has_dw or has_db) and len(col_blocks) > ctx.tile.psum_fmax:
        raise Unsupported(f"grad_weight over {layout['cols']} columns exceeds one PSUM bank of block sums")
    return KernelSpec(
        family="layer_norm",
        params={"mode": "backward", "has_weight": weight is not None, "has_dx": has_dx,
                "has_dw": has_dw, "has_db": has_db, "col_blocks": col_blocks, **layout},
        inputs=[grad_out, x, mean, rstd, *_optional_float(weight, "weight")],
        outputs=result_values(node), flops=12 * math.prod(shape))


# --- RMS norm ----------------------------------------------------------------------------------

def _rms_norm_spec(ctx: LoweringContext, node: fx.Node, x: fx.Node, residual: fx.Node | None, weight,
                   eps: float, reduced_ndim: int) -> KernelSpec:
    _float_input(x, "input")
    shape = _shape(x)
    # Live per column: x, its squares, y, and the weight (a row and its broadcast); with a
    # residual, its tile too (x then holds x + residual).
    layout = row_layout(ctx, shape, reduced_ndim, 20 if residual is None else 24)
    split = split_row_tiles(ctx, layout)
    return KernelSpec(
        family="rms_norm",
        params={"eps": float(eps), "has_weight": weight is not None, "has_residual": residual is not None,
                "lnc_split": split, **layout},
        inputs=[x, *_optional_float(residual, "residual"), *_optional_float(weight, "weight")],
        outputs=result_values(node), flops=(4 if residual is None else 5) * math.prod(shape),
        grid=ctx.lnc if split else 1)


@register_lowering(aten._fused_rms_norm.default)
def lower_rms_norm(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, normalized_shape, weight, eps = node.args
    if eps is None:
        # ATen computes in fp32 for fp32 / bf16 / fp16 inputs and defaults eps to fp32's epsilon.
        eps = torch.finfo(torch.float32).eps
    return _rms_norm_spec(ctx, node, x, None, weight, eps, len(normalized_shape))


@register_lowering(rms_norm_fusion.RMS_NORM)
def lower_fused_rms_norm(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """The norm passes/rms_norm_fusion.py recognised in a decomposed graph: over the last dim,
    outputs (y, rstd[, x + residual])."""
    x, residual, weight, eps, _rstd_dtype = node.args
    return _rms_norm_spec(ctx, node, x, residual, weight, eps, 1)


# --- cross-entropy (nll_loss over log-probabilities) -------------------------------------------

REDUCTIONS = ("none", "mean", "sum")  # ATen's reduction enum


def _nll_params(ctx: LoweringContext, x: fx.Node, weight, reduction: int, ignore_index: int,
                bytes_per_col: int) -> dict:
    _float_input(x, "input")
    shape = _shape(x)
    if len(shape) not in (1, 2):
        raise Unsupported(f"{len(shape)}-d input (nll_loss takes [C] or [N, C])")
    return {"reduction": REDUCTIONS[reduction], "ignore_index": int(ignore_index),
            "has_weight": weight is not None, "batched": len(shape) == 2,
            **row_layout(ctx, shape, 1, bytes_per_col)}


@register_lowering(aten.nll_loss_forward.default)
def lower_nll_loss(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, target, weight, reduction, ignore_index = node.args
    # Live per column: x, the class-index iota, the target penalty, x + penalty, and the weight
    # (a row, its broadcast and its product with the target mask).
    params = _nll_params(ctx, x, weight, reduction, ignore_index, 32)
    # a target outside [0, C) but ignore_index fails the kernel's bounds check (eager: IndexError)
    bounds = {"op": "nll_loss", "dims": [len(_shape(x)) - 1], "sizes": [_shape(x)[-1]], "from_end": False,
              "error": "IndexError", "ignore_index": int(ignore_index)}
    return KernelSpec(
        family="cross_entropy", params={"mode": "forward", **params},
        inputs=[x, target, *_optional_float(weight, "weight")],
        outputs=result_values(node), flops=3 * math.prod(_shape(x)), index_bounds=bounds)


@register_lowering(aten.nll_loss_backward.default)
def lower_nll_loss_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    grad_output, x, target, weight, reduction, ignore_index, total_weight = node.args
    # Live per column: the class-index iota, the gradient tile, and the weight (a row, its
    # broadcast and its product with the target mask).
    params = _nll_params(ctx, x, weight, reduction, ignore_index, 20)
    # The mean divides by total_weight; the other reductions do not read it.
    divisor = [total_weight] if params["reduction"] == "mean" else []
    return KernelSpec(
        family="cross_entropy", params={"mode": "backward", **params},
        inputs=[grad_output, target, *divisor, *_optional_float(weight, "weight")],
        outputs=[node], flops=2 * math.prod(_shape(x)))


# --- batch norm ----------------------------------------------------------------------------------

# HBM reads per kernel above which the channel layout is too fragmented (a [N, C] input gives one
# DMA per sample and channel tile): the node falls back instead of emitting that many DMAs.
MAX_BATCH_NORM_DMAS = 16384


def channel_layout(ctx: LoweringContext, shape: tuple[int, ...], bytes_per_col: int) -> dict:
    """Template params placing the channels (dim 1) of `shape` on partitions and every sample's
    spatial positions on the free axis: columns n * S + s of an [N, C, S] view, in column chunks
    whose live tiles take `bytes_per_col` bytes per column. A chunk is a list of pieces, each one
    DMA of one sample's contiguous spatial run: {"n", "s": [start, stop], "at": [start, stop]}.

    With at most 64 channels the samples split into `split` equal blocks, block j on partitions
    [j * C, (j + 1) * C) with samples [j * batch, (j + 1) * batch) (`batch` is then per block),
    so more partitions work; the kernel combines the blocks' statistics."""
    batch, channels, spatial = shape[0], shape[1], math.prod(shape[2:])
    if batch * channels * spatial == 0:
        raise Unsupported("empty tensor")
    partitions = ctx.tile.partitions
    split = next((k for k in range(partitions // channels, 1, -1) if batch % k == 0), 1)
    batch //= split
    col_chunks = []
    for span in spans((batch, spatial), max(1, ctx.sbuf_budget(SBUF_RESERVE) // bytes_per_col), CHUNK_ALIGN):
        pieces = []
        for box in span["boxes"]:
            (n0, n1), (s0, s1) = box["index"]
            at = box["at"][0]
            for n in range(n0, n1):
                pieces.append({"n": n, "s": [s0, s1], "at": [at, at + s1 - s0]})
                at += s1 - s0
        col_chunks.append({"size": span["size"], "pieces": pieces})
    channel_tiles = [{"start": start, "size": size} for start, size in
                     ((start, min(partitions, channels - start)) for start in range(0, channels, partitions))]
    dmas = split * len(channel_tiles) * sum(len(chunk["pieces"]) for chunk in col_chunks)
    if dmas > MAX_BATCH_NORM_DMAS:
        raise Unsupported(f"{dmas} DMAs for {batch} samples of {spatial} positions (over {MAX_BATCH_NORM_DMAS})")
    return {"batch": batch, "split": split, "channels": channels, "spatial": spatial,
            "channel_tiles": channel_tiles, "col_chunks": col_chunks}


def _batch_norm_input(x: fx.Node) -> tuple[int, ...]:
    _float_input(x, "input")
    shape = _shape(x)
    if len(shape) < 2:
        raise Unsupported(f"{len(shape)}-d input (batch norm takes [N, C, ...])")
    return shape


@register_lowering(aten._native_batch_norm_legit_functional.default)
def lower_batch_norm_training(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, weight, bias, running_mean, running_var, training, momentum, eps = node.args
    if not training:
        raise Unsupported("training=False (eval batch norm arrives as _native_batch_norm_legit_no_training)")
    shape = _batch_norm_input(x)
    count = shape[0] * math.prod(shape[2:])
    if count < 2:
        raise Unsupported("one value per channel: the unbiased running variance divides by zero")
    # Live per column: x and y (fp32 worst case).
    layout = channel_layout(ctx, shape, 8)
    return KernelSpec(
        family="batch_norm",
        params={"mode": "train", "eps": float(eps), "momentum": float(momentum),
                "unbias": count / (count - 1), "has_weight": weight is not None,
                "has_bias": bias is not None, **layout},
        inputs=[x, *_optional_float(running_mean, "running_mean"), *_optional_float(running_var, "running_var"),
                *_optional_float(weight, "weight"), *_optional_float(bias, "bias")],
        outputs=result_values(node), flops=10 * math.prod(shape))


@register_lowering(aten._native_batch_norm_legit_no_training.default)
def lower_batch_norm_eval(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, weight, bias, running_mean, running_var, _momentum, eps = node.args
    shape = _batch_norm_input(x)
    if any(user.args[1] != 0 for user in node.users):
        raise Unsupported("its empty saved-statistics results are read")
    layout = channel_layout(ctx, shape, 8)
    return KernelSpec(
        family="batch_norm",
        params={"mode": "eval", "eps": float(eps), "has_weight": weight is not None,
                "has_bias": bias is not None, **layout},
        inputs=[x, *_optional_float(running_mean, "running_mean"), *_optional_float(running_var, "running_var"),
                *_optional_float(weight, "weight"), *_optional_float(bias, "bias")],
        outputs=result_values(node)[:1], flops=2 * math.prod(shape))


# --- group norm ----------------------------------------------------------------------------------

# Per-channel affine instructions (one per channel of a group and column chunk) per row tile.
MAX_GROUP_NORM_AFFINE_OPS = 2048


@register_lowering(aten.native_group_norm.default)
def lower_group_norm(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, weight, bias, batch, channels, spatial, groups, eps = node.args
    _float_input(x, "input")
    batch, channels, spatial, groups = (int(v) for v in (batch, channels, spatial, groups))
    if batch * channels * spatial == 0:
        raise Unsupported("empty tensor")
    group_channels = channels // groups
    # Rows (sample, group) are contiguous runs of the input: [N * G, C / G * S]. Fewer rows than
    # half the partitions split into sub-rows of whole channels (the kernel combines their
    # statistics), so more partitions work: the layout's groups are then sub-groups.
    split = next((k for k in range(ctx.tile.partitions // (batch * groups), 1, -1) if group_channels % k == 0), 1)
    groups, group_channels = groups * split, group_channels // split
    shape = (batch * groups, group_channels * spatial)
    # Live per column: x and y (fp32 worst case).
    layout = row_layout(ctx, shape, 1, 8)
    if group_channels * len(layout["col_chunks"]) > MAX_GROUP_NORM_AFFINE_OPS:
        raise Unsupported(f"{group_channels} channels per group over {len(layout['col_chunks'])} column chunks "
                          f"(over {MAX_GROUP_NORM_AFFINE_OPS} affine instructions per row tile)")
    # The rows of each row tile as runs of consecutive groups of one sample, for the per-channel
    # weight and bias viewed as [G, C / G]: {"at": [start, stop] on partitions, "groups": [g0, g1]}.
    group_runs = []
    for tile in layout["row_tiles"]:
        runs, row = [], tile["start"]
        while row < tile["start"] + tile["size"]:
            group = row % groups
            stop = min(tile["start"] + tile["size"], row - group + groups)
            runs.append({"at": [row - tile["start"], stop - tile["start"]], "groups": [group, group + stop - row]})
            row = stop
        group_runs.append(runs)
    return KernelSpec(
        family="group_norm",
        params={"eps": float(eps), "has_weight": weight is not None, "has_bias": bias is not None,
                "split": split, "groups": groups, "group_channels": group_channels, "spatial": spatial,
                "group_runs": group_runs, **layout},
        inputs=[x, *_optional_float(weight, "weight"), *_optional_float(bias, "bias")],
        outputs=result_values(node), flops=8 * math.prod(shape))
