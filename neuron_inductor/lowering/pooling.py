"""Lowerings of 2-d pooling: max_pool2d_with_indices, avg_pool2d, _adaptive_avg_pool2d and their
backwards.

Every [H, W] plane (one sample and channel) sits on one partition, whole, 128 planes per tile;
the kernel walks the kh * kw window offsets, each a strided [OH, OW] view of the (padded) plane.
ceil_mode windows may run past the padding: the padded plane grows to hold them; max pooling's
dilation spaces the offsets. Planes too large for SBUF raise Unsupported.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .common import bind_arguments, result_values, val
from .context import LoweringContext
from .ir import KernelSpec, Unsupported
from .norms import SBUF_RESERVE
from .registry import register_lowering

aten = torch.ops.aten

# Window offsets per kernel: each costs a handful of VectorE instructions per plane tile.
MAX_WINDOW = 64


def _pair(values, what: str) -> tuple[int, int]:
    values = [int(v) for v in values]
    if len(values) == 1:
        return values[0], values[0]
    if len(values) != 2:
        raise Unsupported(f"{what} {values}")
    return values[0], values[1]


def _plane_geometry(ctx: LoweringContext, x: fx.Node, output: tuple[int, int], kernel, stride, padding,
                    dilation=(1, 1)) -> dict:
    """Template params of a pooling over the last two dims of `x` into [OH, OW] = `output`."""
    value = val(x)
    if value.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"input has dtype {value.dtype}; the kernel handles fp32 / bf16 / fp16")
    shape = tuple(int(s) for s in value.shape)
    if len(shape) not in (3, 4):
        raise Unsupported(f"{len(shape)}-d input (2-d pooling takes [C, H, W] or [N, C, H, W])")
    planes, (height, width) = math.prod(shape[:-2]), shape[-2:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    out_h, out_w = output
    if planes * height * width == 0 or out_h * out_w == 0:
        raise Unsupported("empty tensor")
    if kh * kw > MAX_WINDOW:
        raise Unsupported(f"{kh}x{kw} window (over {MAX_WINDOW} offsets)")
    # ceil_mode's last windows may run past the padding.
    padded_h = max(height + 2 * ph, (out_h - 1) * sh + (kh - 1) * dh + 1)
    padded_w = max(width + 2 * pw, (out_w - 1) * sw + (kw - 1) * dw + 1)
    # Live per partition (fp32): the plane, its padded copy, and about 8 [OH, OW] tiles.
    if 4 * (height * width + padded_h * padded_w + 8 * out_h * out_w) > ctx.sbuf_budget(SBUF_RESERVE):
        raise Unsupported(f"{height}x{width} planes do not fit one partition of SBUF")
    return {"planes": planes, "height": height, "width": width, "out_h": out_h, "out_w": out_w,
            "kh": kh, "kw": kw, "sh": sh, "sw": sw, "ph": ph, "pw": pw, "dh": dh, "dw": dw,
            "padded_h": padded_h, "padded_w": padded_w,
            "plane_tiles": [[start, min(ctx.tile.partitions, planes - start)]
                            for start in range(0, planes, ctx.tile.partitions)]}


def _output_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """ATen's pooling_output_shape: a ceil_mode window must start inside the input or its left
    padding."""
    out = (size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _window_args(args: dict) -> tuple[tuple[int, int], ...]:
    """kernel, stride (the kernel when empty), padding, dilation (1 for average pools) and the
    output size."""
    kernel = _pair(args["kernel_size"], "kernel_size")
    stride = _pair(args["stride"], "stride") if args["stride"] else kernel
    padding = _pair(args["padding"], "padding")
    dilation = _pair(args["dilation"], "dilation") if "dilation" in args else (1, 1)
    size = [int(s) for s in val(args["self"]).shape[-2:]]
    output = tuple(_output_size(size[d], kernel[d], stride[d], padding[d], dilation[d], bool(args["ceil_mode"]))
                   for d in range(2))
    return kernel, stride, padding, dilation, output


@register_lowering(aten.max_pool2d_with_indices.default)
def lower_max_pool(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args = bind_arguments(node)
    kernel, stride, padding, dilation, output = _window_args(args)
    geometry = _plane_geometry(ctx, args["self"], output, kernel, stride, padding, dilation)
    return KernelSpec(family="pool", params={"mode": "max", **geometry}, inputs=[args["self"]],
                      outputs=result_values(node), flops=kernel[0] * kernel[1] * val(node)[0].numel())


@register_lowering(aten.max_pool2d_with_indices_backward.default)
def lower_max_pool_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args = bind_arguments(node)
    kernel, stride, padding, dilation, output = _window_args(args)
    geometry = _plane_geometry(ctx, args["self"], output, kernel, stride, padding, dilation)
    return KernelSpec(family="pool", params={"mode": "max_backward", **geometry},
                      inputs=[args["grad_output"], args["indices"]], outputs=[node],
                      flops=3 * kernel[0] * kernel[1] * val(args["grad_output"]).numel())


def _avg_params(ctx: LoweringContext, args: dict) -> tuple[dict, int]:
    kernel, stride, padding, _dilation, output = _window_args(args)
    geometry = _plane_geometry(ctx, args["self"], output, kernel, stride, padding)
    override = args["divisor_override"]
    if override is not None and int(override) == 0:
        raise Unsupported("divisor_override=0")
    include_pad = bool(args["count_include_pad"])
    if override is not None:
        divisor = int(override)
    elif include_pad and not args["ceil_mode"]:
        divisor = kernel[0] * kernel[1]
    else:
        divisor = None  # each window divides by its count of input (and, included, padding) elements
    return {"divisor": divisor, "count_include_pad": include_pad, **geometry}, kernel[0] * kernel[1]


@register_lowering(aten.avg_pool2d.default)
def lower_avg_pool(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args = bind_arguments(node)
    params, window = _avg_params(ctx, args)
    return KernelSpec(family="pool", params={"mode": "avg", **params}, inputs=[args["self"]],
                      outputs=[node], flops=window * val(node).numel())


@register_lowering(aten.avg_pool2d_backward.default)
def lower_avg_pool_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args = bind_arguments(node)
    params, window = _avg_params(ctx, args)
    return KernelSpec(family="pool", params={"mode": "avg_backward", **params}, inputs=[args["grad_output"]],
                      outputs=[node], flops=window * val(args["grad_output"]).numel())


# Reduce instructions of a general adaptive average pool (one per output row and column
# forward, one per input row and column backward).
MAX_ADAPTIVE_STEPS = 1024


def _adaptive_windows(size: int, out: int) -> list[list[int]]:
    """ATen's adaptive windows along one dim: [floor(o * size / out), ceil((o + 1) * size / out))."""
    return [[o * size // out, -(-(o + 1) * size // out)] for o in range(out)]


def _covering(windows: list[list[int]], size: int) -> list[list[int]]:
    """Per input index, the [first, last + 1) outputs whose windows hold it (they are consecutive)."""
    covers = []
    for i in range(size):
        hits = [o for o, (start, stop) in enumerate(windows) if start <= i < stop]
        covers.append([hits[0], hits[-1] + 1])
    return covers


def _adaptive_params(ctx: LoweringContext, x: fx.Node, output: tuple[int, int], backward: bool) -> dict:
    """An average pool when each output size divides the input's; else separable sums over
    ATen's adaptive windows (rows and columns of varying lengths)."""
    height, width = (int(s) for s in val(x).shape[-2:])
    out_h, out_w = output
    if out_h and out_w and not height % out_h and not width % out_w:
        kernel = (height // out_h, width // out_w)
        return {"mode": "avg_backward" if backward else "avg", "divisor": kernel[0] * kernel[1],
                "count_include_pad": True, **_plane_geometry(ctx, x, output, kernel, kernel, (0, 0))}
    geometry = _plane_geometry(ctx, x, output, (1, 1), (1, 1), (0, 0))
    steps = height + width if backward else out_h + out_w
    if steps > MAX_ADAPTIVE_STEPS:
        raise Unsupported(f"adaptive pooling in {steps} reduce steps (over {MAX_ADAPTIVE_STEPS})")
    # Live per partition (fp32): the plane, the partial sums and a few [OH, OW] tiles.
    if 4 * (2 * height * width + out_w * height + width * out_h + 4 * out_h * out_w) > ctx.sbuf_budget(SBUF_RESERVE):
        raise Unsupported(f"adaptive {height}x{width} -> {out_h}x{out_w} planes do not fit one partition of SBUF")
    h_windows, w_windows = _adaptive_windows(height, out_h), _adaptive_windows(width, out_w)
    return {"mode": "adaptive_avg_backward" if backward else "adaptive_avg", **geometry,
            "h_windows": h_windows, "w_windows": w_windows,
            "h_covers": _covering(h_windows, height), "w_covers": _covering(w_windows, width)}


@register_lowering(aten._adaptive_avg_pool2d.default)
def lower_adaptive_avg_pool(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x, output_size = node.args
    params = _adaptive_params(ctx, x, _pair(output_size, "output_size"), backward=False)
    return KernelSpec(family="pool", params=params, inputs=[x], outputs=[node], flops=val(x).numel())


@register_lowering(aten._adaptive_avg_pool2d_backward.default)
def lower_adaptive_avg_pool_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    grad_output, x = node.args
    params = _adaptive_params(ctx, x, tuple(int(s) for s in val(grad_output).shape[-2:]), backward=True)
    return KernelSpec(family="pool", params=params, inputs=[grad_output], outputs=[node], flops=val(x).numel())
