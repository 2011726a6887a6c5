"""Convolution family: `convolution` (conv1d / conv2d, any stride / padding / dilation / groups, bias
or not) and `convolution_backward` (grad_input, grad_weight, grad_bias as the output mask asks)
-> `codegen_templates/convolution.py.j2`.

Trainium has no convolution engine, so every pass is an implicit GEMM on TensorE with the
contraction on partitions (see the template for the loops):
- forward: contraction over input channels, one matmul per (channel tile, kernel tap) accumulated
  in PSUM; the moving operand is a shifted, strided window of an SBUF patch of the input rows the
  output block needs (zero padding written into the patch, never materialised in HBM);
- grad_input: the same pass on grad_output, contracting over output channels (the weight is
  already [out channels, in channels], no transpose), once per output phase of a strided
  convolution (see _grad_input_phases: no zeros inserted, no matmuls on them);
- grad_weight: contraction over batch * output positions, both operands transposed on TensorE;
- grad_bias: a sum over batch and positions.
Depthwise convolutions (groups = in = out channels, e.g. Mamba's causal conv1d) would contract over
one partition: one channel per partition instead, with diag(w[:, tap]) as the stationary operand
of each tap's matmul (forward, grad_input); grad_weight multiplies dy by each window on GpSimd
and sums the products on ScalarE.
Transposed convolutions, 3-d convolutions and mixed dtypes raise Unsupported (visible fallback).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from .common import bind_arguments, val
from .context import KIB, LoweringContext, TileSizes
from .ir import KernelSpec, Unsupported
from .registry import register_lowering

aten = torch.ops.aten

# Tile sizes come from the context: channels per partition tile (`tile.partitions`) and fp32
# columns of one PSUM bank (`tile.psum_fmax`), the largest output block of one accumulation.
# Per-partition SBUF bytes for the resident weight panel and for the input patch, and for
# grad_weight's result rows (the weight's rows, output channels on partitions): fixed shares that
# fit together (176 KiB) in the smallest target's usable SBUF (trn1), so a larger SBUF leaves the
# plan unchanged.
PANEL_BYTES = 64 * KIB
PATCH_BYTES = 48 * KIB
ACCUMULATOR_BYTES = 64 * KIB
ACCUMULATOR_BANKS = 4  # PSUM banks grad_weight accumulates in (of 8; the transposes, double-buffered, use the rest)
# Outputs per block of the depthwise grad_weight pass (GpSimd and ScalarE): long rows amortise the
# per-instruction overhead.
DEPTHWISE_POSITIONS = 2048
MAX_TILE_ELEMENTS = 32767  # an SBUF tile's elements per partition: the access pattern's int16 stride

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pair(values, rank: int, height: int = 1) -> list[int]:
    """A per-spatial-dim argument as [h, w]; 1-d convolutions get h = `height`."""
    values = list(values) * rank if len(values) == 1 else list(values)
    return values if rank == 2 else [height, *values]


def _geometry(x_shape, w_shape, stride, padding, dilation, groups) -> dict:
    rank = len(x_shape) - 2
    if rank not in (1, 2):
        raise Unsupported(f"{rank}-d convolution (only 1-d and 2-d lower to kernels)")
    if 0 in x_shape or 0 in w_shape:
        raise Unsupported("empty convolution")
    pad = _pair(padding, rank, height=0)
    geometry = {
        "rank": rank, "batch": x_shape[0], "in_channels": x_shape[1], "out_channels": w_shape[0],
        "groups": groups, "in_size": _pair(x_shape[2:], rank), "kernel": _pair(w_shape[2:], rank),
        "stride": _pair(stride, rank), "padding": pad, "dilation": _pair(dilation, rank),
    }
    geometry["span"] = [(k - 1) * d + 1 for k, d in zip(geometry["kernel"], geometry["dilation"])]
    geometry["out_size"] = [(i + 2 * p - s) // st + 1 for i, p, s, st in
                            zip(geometry["in_size"], pad, geometry["span"], geometry["stride"])]
    if min(geometry["out_size"]) <= 0:
        raise Unsupported("convolution with an empty output")
    return geometry


def _check_dtypes(*values: torch.Tensor) -> torch.dtype:
    dtype = values[0].dtype
    if dtype not in SUPPORTED_DTYPES or any(v.dtype != dtype for v in values):
        raise Unsupported(f"convolution of {[str(v.dtype) for v in values]} (TensorE takes one fp32/bf16/fp16 dtype)")
    return dtype


def _output_blocks(out_size: list[int], max_positions: int, max_cols: int, patch_elements,
                   itemsize: int) -> tuple[int, int]:
    """(rows, columns) of an output block: at most `max_positions` outputs, `max_cols` columns and a
    patch (`patch_elements(rows, cols)` elements per partition) within the SBUF budget."""
    cols = min(out_size[1], max_cols)
    rows = min(out_size[0], max(1, max_positions // cols))
    while patch_elements(rows, cols) > MAX_TILE_ELEMENTS or patch_elements(rows, cols) * itemsize > PATCH_BYTES:
        if rows > 1:
            rows = (rows + 1) // 2
        elif cols > 1:
            cols = (cols + 1) // 2
        else:
            raise Unsupported("convolution input patch of one output exceeds the SBUF budget")
    return rows, cols


def _window(k_tiles: int, itemsize: int, in_size, pad_lo, stride, span, out_size, max_cols: int,
            max_positions: int) -> dict:
    """How a pass walks its outputs: blocks of rows x columns, each reading a patch of the source
    (rows [y * stride - pad_lo, ...) spanning `span` more per tap extent) that fits SBUF."""
    def patch_elements(rows, cols):
        return k_tiles * ((rows - 1) * stride[0] + span[0]) * ((cols - 1) * stride[1] + span[1])

    block_rows, block_cols = _output_blocks(out_size, max_positions, max_cols, patch_elements, itemsize)
    return {
        "stride": list(stride), "pad_lo": list(pad_lo), "in_size": list(in_size), "out_size": list(out_size),
        "span": list(span), "block_rows": block_rows, "block_cols": block_cols,
        "patch_rows": (block_rows - 1) * stride[0] + span[0], "patch_cols": (block_cols - 1) * stride[1] + span[1],
    }


def _window_pass(tile: TileSizes, g: dict, dtype: torch.dtype, group_k: int, max_cols: int,
                 max_positions: int | None = None) -> dict:
    """A pass reading windows of the convolution's input (forward, grad_weight); at most
    `max_positions` outputs per block (default: one PSUM bank of fp32)."""
    k_tiles = math.ceil(group_k / tile.partitions)
    c = {"batch": g["batch"], "groups": g["groups"], "group_k": group_k, "k_tiles": k_tiles,
         "taps": g["kernel"][0] * g["kernel"][1], "kernel": g["kernel"], "dilation": g["dilation"]}
    c.update(_window(k_tiles, torch.empty((), dtype=dtype).element_size(), g["in_size"], g["padding"], g["stride"],
                     g["span"], g["out_size"], max_cols, max_positions or tile.psum_fmax))
    return c


def _grad_input_phases(tile: TileSizes, g: dict, k_tiles: int, itemsize: int) -> list[dict]:
    """grad_input as stride-1 correlations of grad_output, one per output phase.

    dx[y] = sum over taps t with (y + p - t * d) % s == 0 of w[t] * dy[(y + p - t * d) / s]: for
    the outputs y = phase + s * j those taps are fixed and read dy[j + offset_t], so each phase is a
    plain convolution over dy (no zeros inserted, no work on them), stored every s-th output.
    """
    per_dim = []
    for dim in range(2):
        s, p, d, k = g["stride"][dim], g["padding"][dim], g["dilation"][dim], g["kernel"][dim]
        phases = []
        for phase in range(min(s, g["in_size"][dim])):
            taps = [(t, (phase + p - t * d) // s) for t in range(k) if (phase + p - t * d) % s == 0]
            low = min((offset for _, offset in taps), default=0)
            phases.append({"phase": phase, "count": math.ceil((g["in_size"][dim] - phase) / s),
                           "taps": [(t, offset - low) for t, offset in taps], "pad_lo": -low,
                           "span": max((offset for _, offset in taps), default=low) - low + 1})
        per_dim.append(phases)
    result = []
    for py in per_dim[0]:
        for px in per_dim[1]:
            window = _window(k_tiles, itemsize, g["out_size"], [py["pad_lo"], px["pad_lo"]], [1, 1],
                             [py["span"], px["span"]], [py["count"], px["count"]], tile.psum_fmax, tile.psum_fmax)
            window.update(out_offset=[py["phase"], px["phase"]], out_step=g["stride"], taps=[py["taps"], px["taps"]])
            result.append(window)
    return result


def _is_depthwise(g: dict) -> bool:
    return g["groups"] == g["in_channels"] == g["out_channels"]


def _conv_pass(tile: TileSizes, g: dict, dtype: torch.dtype, grad_input: bool) -> dict:
    """Forward convolution, or (grad_input) the transposed convolution of grad_output, as `phases`:
    output grids (offset, step) each computed from a window walk and its taps (weight index,
    patch offset) per spatial dim."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    partitions = tile.partitions
    if grad_input:
        group_k = g["out_channels"] // g["groups"]
        c = {"batch": g["batch"], "groups": g["groups"], "group_k": group_k,
             "k_tiles": math.ceil(group_k / partitions),
             "taps": g["kernel"][0] * g["kernel"][1], "kernel": g["kernel"], "weight": "km",
             "group_m": g["in_channels"] // g["groups"], "m": g["in_channels"]}
        c["phases"] = _grad_input_phases(tile, g, c["k_tiles"], itemsize)
    else:
        c = _window_pass(tile, g, dtype, g["in_channels"] // g["groups"], tile.psum_fmax)
        c.update(weight="mk", group_m=g["out_channels"] // g["groups"], m=g["out_channels"])
        phase = {key: c.pop(key) for key in ("stride", "pad_lo", "in_size", "out_size", "span", "block_rows",
                                             "block_cols", "patch_rows", "patch_cols")}
        phase.update(out_offset=[0, 0], out_step=[1, 1],
                     taps=[[(t, t * d) for t in range(k)] for k, d in zip(g["kernel"], c.pop("dilation"))])
        c["phases"] = [phase]
    if _is_depthwise(g):
        c.update(kind="depthwise")
        return c
    per_row = c["k_tiles"] * c["taps"]
    fit = min(PANEL_BYTES // (per_row * itemsize), MAX_TILE_ELEMENTS // per_row)
    # whole partition-row tiles when they fit, else fewer rows (more re-reads of the input patches)
    block_m = min(c["group_m"], fit // partitions * partitions) or min(c["group_m"], fit)
    if block_m == 0:
        raise Unsupported("convolution weight panel of one output channel exceeds the SBUF budget")
    c.update(kind="conv", block_m=block_m)
    return c


def _grad_weight_pass(tile: TileSizes, g: dict, dtype: torch.dtype) -> dict:
    """TensorE: per block of output-channel tiles and group of taps, one PSUM bank per (channel
    tile, tap, 512 input channels) accumulates over the whole batch; the taps are walked in groups
    that fit. Depthwise: GpSimd products, ScalarE sums."""
    if _is_depthwise(g):
        c = _window_pass(tile, g, dtype, 1, DEPTHWISE_POSITIONS, DEPTHWISE_POSITIONS)
        c.update(kind="depthwise_grad_weight", m=g["in_channels"])
        return c
    partitions, bank = tile.partitions, tile.psum_fmax  # bank: fp32 columns of one PSUM bank
    c = _window_pass(tile, g, dtype, g["in_channels"] // g["groups"], partitions)
    # the patch covers up to a PSUM bank of outputs, transposed in sub-blocks of whole rows (<= partitions)
    c["sub_rows"] = max(1, partitions // c["block_cols"])
    group_m = g["out_channels"] // g["groups"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    # PSUM banks: (output-channel tiles) x (512-channel chunks of a block of input channels) x taps
    block_m_tiles = max(1, min(math.ceil(group_m / partitions), ACCUMULATOR_BANKS // math.ceil(c["group_k"] / bank)))
    block_k = min(c["group_k"], bank * max(1, ACCUMULATOR_BANKS // block_m_tiles))
    while block_m_tiles * block_k * c["taps"] * itemsize > ACCUMULATOR_BYTES and block_k > partitions:
        block_k = max(partitions, block_k // 2 // partitions * partitions)
    if block_m_tiles * block_k * c["taps"] * itemsize > ACCUMULATOR_BYTES:
        raise Unsupported("grad_weight rows of one input-channel tile exceed the SBUF budget")
    k_chunks = math.ceil(block_k / bank)
    c.update(kind="grad_weight", group_m=group_m, k_chunks=k_chunks, block_m_tiles=block_m_tiles, block_k=block_k,
             k_tiles=math.ceil(block_k / partitions),
             group_taps=min(c["taps"], ACCUMULATOR_BANKS // (k_chunks * block_m_tiles)))
    return c


def _grad_bias_pass(tile: TileSizes, g: dict) -> dict:
    cols = min(g["out_size"][1], tile.psum_fmax * 4)
    rows = min(g["out_size"][0], max(1, tile.psum_fmax * 4 // cols))
    return {"kind": "grad_bias", "batch": g["batch"],
            "m": g["out_channels"], "out_size": g["out_size"], "block_rows": rows, "block_cols": cols}


def _conv_flops(g: dict) -> int:
    """2 * MACs of one convolution of this geometry (forward, grad_input and grad_weight alike)."""
    return (2 * g["batch"] * g["out_channels"] * math.prod(g["out_size"]) * (g["in_channels"] // g["groups"])
            * math.prod(g["kernel"]))


def _bound_geometry(args: dict) -> dict:
    """The geometry of a (forward or backward) convolution node's bound arguments."""
    if args["transposed"]:
        raise Unsupported("transposed convolution")
    return _geometry(tuple(val(args["input"]).shape), tuple(val(args["weight"]).shape), args["stride"],
                     args["padding"], args["dilation"], args["groups"])


@register_lowering(aten.convolution.default)
def lower_convolution(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args = bind_arguments(node)
    x, w, bias = args["input"], args["weight"], args["bias"]
    dtype = _check_dtypes(val(x), val(w), val(node), *([val(bias)] if bias is not None else []))
    g = _bound_geometry(args)
    c = _conv_pass(ctx.tile, g, dtype, grad_input=False)
    c.update(src=0, weight_arg=1, bias_arg=2 if bias is not None else None, out=0)
    inputs = [x, w] + ([bias] if bias is not None else [])
    return KernelSpec("convolution", {"spatial_rank": g["rank"], "passes": [c]}, inputs, [node],
                      flops=_conv_flops(g))


@register_lowering(aten.convolution_backward.default)
def lower_convolution_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args = bind_arguments(node)
    grad, x, w = args["grad_output"], args["input"], args["weight"]
    dtype = _check_dtypes(val(grad), val(x), val(w))
    g = _bound_geometry(args)
    if list(val(grad).shape[2:]) != g["out_size"][2 - g["rank"]:]:
        raise Unsupported("grad_output shape does not match the convolution")
    mask = list(args["output_mask"])
    # Results by the mask, not by the value metadata: eager CPU also returns grad_weight when only
    # grad_bias is asked for.
    results = dict(enumerate(val(node)))
    users = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    outputs = [users.get(i, results[i]) for i in range(3) if mask[i]]
    inputs = [grad, x, w]
    passes, flops = [], 0
    out_index = {i: position for position, i in enumerate(i for i in range(3) if mask[i])}
    # grad_weight first: its PSUM accumulators are allocated while no other pass holds PSUM tiles
    if mask[1]:
        c = _grad_weight_pass(ctx.tile, g, dtype)
        c.update(grad=0, src=1, out=out_index[1])
        passes.append(c)
        flops += _conv_flops(g)
    if mask[0]:
        c = _conv_pass(ctx.tile, g, dtype, grad_input=True)
        c.update(src=0, weight_arg=2, bias_arg=None, out=out_index[0])
        passes.append(c)
        flops += _conv_flops(g)
    if mask[2]:
        c = _grad_bias_pass(ctx.tile, g)
        c.update(grad=0, out=out_index[2])
        passes.append(c)
    if not passes:
        raise Unsupported("convolution_backward with an empty output mask")
    return KernelSpec("convolution", {"spatial_rank": g["rank"], "passes": passes}, inputs, outputs, flops=flops)
