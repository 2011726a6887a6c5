"""The pointwise family: ATen elementwise ops as tile programs, fused into `pointwise` kernels.

Each op registers in the one lowering registry with `register_pointwise(op, refuses=...)`: an
emit rule writing the op's tile-program instructions (`ProgramBuilder` primitives and numerics
composites, see `neuron_inductor/tile_program`) and, optionally, an argument check saying why
some arguments are not taken. The graph
lowering (`lowering/graph.py`) gathers pointwise nodes of one output shape into groups:
- `is_pointwise(node)`: the node is an elementwise op this family computes for these arguments;
  `refusal(node)` says why not (None when it is).
- `lower_pointwise_group(ctx, nodes, outputs) -> KernelSpec`: one `pointwise` kernel computing `nodes`
  (topologically ordered, one output shape) and returning the values of `outputs`.
  Values produced outside the group become HBM inputs read with their own logical shape
  (strided / permuted / expanded views are fine: the kernel reshapes them to the coalesced
  iteration shape and the DMA reads through the strides); Python scalars and 0-d constants
  (`scalar_tensor`, `full([], v)`) become immediates. A 0-d constant node needs no kernel of its
  own when every user is pointwise: its users fold it.
A pointwise op's registry entry lowered on its own (`LOWERINGS[op](ctx, node)`) is a group of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from ..tile_program import (ERFC_COEFFICIENTS, SUPPORTED_DTYPES, ProgramBuilder, Ref, build_program,
                            is_imm, plan_kernel)
from . import copy
from .common import bind_arguments, val
from .context import LoweringContext
from .ir import KernelSpec, Unsupported
from .lnc import split_nest
from .registry import LOWERINGS, register_lowering

aten = torch.ops.aten

EmitRule = Callable[[ProgramBuilder, dict], Ref]
ArgumentCheck = Callable[[fx.Node, dict], "str | None"]


@dataclass(frozen=True)
class PointwiseLowering:
    """A pointwise op's registry entry. `emit(builder, arguments)` writes the op's instructions
    and returns its value (arguments as `tile_program.node_arguments` binds them); `refuses(node,
    bound_arguments)` says why the kernels do not take these arguments of the op (None: they do;
    no check: every argument is taken)."""

    emit: EmitRule
    refuses: ArgumentCheck | None = None

    def refusal(self, node: fx.Node) -> str | None:
        """Why the pointwise kernels do not compute this node (None: they do): a result that is not
        a tensor, a dtype with no on-chip type (float64, complex), or arguments they do not take."""
        values = [node.meta.get("val")] + [arg.meta.get("val") for arg in node.all_input_nodes]
        if not isinstance(values[0], torch.Tensor):
            return "its result is not a tensor"
        unsupported = sorted({str(v.dtype).removeprefix("torch.") for v in values
                              if isinstance(v, torch.Tensor) and v.dtype not in SUPPORTED_DTYPES})
        if unsupported:
            return f"dtype {', '.join(unsupported)} has no on-chip type"
        if any(isinstance(v, complex) for v in (*node.args, *node.kwargs.values())):
            return "a complex scalar argument"
        refused = None if self.refuses is None else self.refuses(node, bind_arguments(node))
        return None if refused is None else f"the pointwise kernels do not take {refused}"

    def __call__(self, ctx: LoweringContext, node: fx.Node) -> KernelSpec:
        refused = self.refusal(node)
        if refused is not None:
            raise Unsupported(refused)
        return lower_pointwise_group(ctx, [node], [node])


def register_pointwise(*ops: torch._ops.OpOverload,
                       refuses: ArgumentCheck | None = None) -> Callable[[EmitRule], EmitRule]:
    """Register `ops` as pointwise (the Inductor `make_pointwise` of this backend): the decorated
    function is their emit rule; `refuses` names arguments they do not take."""
    def decorate(emit: EmitRule) -> EmitRule:
        register_lowering(*ops)(PointwiseLowering(emit, refuses))
        return emit

    return decorate


def refusal(node: fx.Node) -> str | None:
    """Why this family does not compute `node` (None: it does)."""
    entry = LOWERINGS.get(node.target) if node.op == "call_function" else None
    if not isinstance(entry, PointwiseLowering):
        return "not an elementwise op"
    return entry.refusal(node)


def is_pointwise(node: fx.Node) -> bool:
    """True if `node` is an elementwise op this family computes (op supported for these args/dtypes)."""
    return refusal(node) is None


def lower_pointwise_group(ctx: LoweringContext, nodes: list[fx.Node], outputs: list[fx.Node],
                          shape: tuple[int, ...] | None = None,
                          aliases: dict[fx.Node, fx.Node] | None = None) -> KernelSpec:
    """One kernel computing every node of `nodes` over `shape` (see `build_program`: the nodes'
    shapes may differ from it by size-1 dims; `aliases` are the unit views they read members
    through), returning the values of `outputs`, tiled for the context's target."""
    lone = None if aliases else copy.lone_copy(nodes, outputs)  # a copy read through no unit view
    if lone is not None and shape in (None, tuple(val(lone).shape)):
        return copy.lower_lone_copy(ctx, lone)
    program = build_program(nodes, outputs, shape, aliases)
    numel = math.prod(program.shape)
    params = plan_kernel(program, ctx.tile, ctx.lnc)
    split = _deal_regions(ctx, params["regions"])
    flops = numel * sum(1 for i in program.instrs if i.kind != "cast")
    return KernelSpec("pointwise", params, [inp.value for inp in program.inputs], list(outputs), flops=flops,
                      grid=ctx.lnc if split else 1)


def _deal_regions(ctx: LoweringContext, regions: list[dict]) -> bool:
    """Deal each region's loop nest out over ctx.lnc programs (lowering/lnc.py `split_nest`): sets
    region["split"] (the level dealt out, None: not split) and, for a region with nothing to share in a
    kernel that splits (a flat region's one-partition tail), region["on_last_program"]. Each variant
    of the split level gets "deal", the index of its first iteration in the level. True when the
    kernel splits."""
    for region in regions:
        depth = split_nest(ctx, [[v["count"] for v in level["variants"]] for level in region["levels"]])
        region["split"] = depth
        if depth is not None:
            first = 0
            for variant in region["levels"][depth]["variants"]:
                variant["deal"] = first
                first += variant["count"] or 1
    split = any(region["split"] is not None for region in regions)
    for region in regions:
        region["on_last_program"] = split and region["split"] is None
    return split


@register_pointwise(aten.add.Tensor, aten.add.Scalar)
def _add(b, a):
    x, y, alpha = b.ref(a["self"]), b.ref(a["other"]), a.get("alpha", 1)
    return b.alu("add", x, y) if alpha == 1 else b.stt(y, "multiply", alpha, "add", x)


@register_pointwise(aten.sub.Tensor, aten.sub.Scalar)
def _sub(b, a):
    x, y, alpha = b.ref(a["self"]), b.ref(a["other"]), a.get("alpha", 1)
    return b.alu("subtract", x, y) if alpha == 1 else b.stt(y, "multiply", -alpha, "add", x)


@register_pointwise(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(b, a):
    x, y, alpha = b.ref(a["other"]), b.ref(a["self"]), a.get("alpha", 1)
    return b.alu("subtract", x, y) if alpha == 1 else b.stt(y, "multiply", -alpha, "add", x)


@register_pointwise(aten.mul.Tensor, aten.mul.Scalar)
def _mul(b, a):
    return b.alu("multiply", b.ref(a["self"]), b.ref(a["other"]))


@register_pointwise(aten.div.Tensor, aten.div.Scalar)
def _div(b, a):
    return b.div(b.ref(a["self"]), b.ref(a["other"]))


@register_pointwise(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(b, a):
    x, y, mode = b.ref(a["self"]), b.ref(a["other"]), a["rounding_mode"]
    if mode is None:
        return b.div(x, y)
    return b.cast(b.integral(b.exact_div(x, y), mode), b.node_dtype)


@register_pointwise(aten.fmod.Tensor, aten.fmod.Scalar, aten.remainder.Tensor, aten.remainder.Scalar)
def _fmod(b, a):
    x, y = b.ref(a["self"]), b.ref(a["other"])
    mode = "trunc" if a["__op__"] is aten.fmod else "floor"
    quotient = b.integral(b.exact_div(x, y), mode)
    product = b.alu("multiply", quotient, y, "float32")
    return b.alu("subtract", x, product)


def _unary(func: str):
    return lambda b, a: b.act(func, b.ref(a["self"]))


for _op, _func in [(aten.exp, "exp"), (aten.log, "log"), (aten.sqrt, "sqrt"), (aten.rsqrt, "rsqrt"),
                   (aten.sigmoid, "sigmoid"), (aten.tanh, "tanh"), (aten.erf, "erf"), (aten.abs, "abs"),
                   (aten.sign, "sign"), (aten.sgn, "sign")]:
    register_pointwise(_op.default)(_unary(_func))


@register_pointwise(aten.relu.default)
def _relu(b, a):
    return b.ts(b.ref(a["self"]), "maximum", 0.0)


@register_pointwise(aten.silu.default)
def _silu(b, a):
    return b.act("silu", b.ref(a["self"]))


@register_pointwise(aten.silu_backward.default)
def _silu_backward(b, a):
    # grad * silu'(x) with silu' = s * (1 + x * (1 - s)) as one ScalarE activation (silu_dx): decomposed,
    # it is three fp32 tensor_tensor ops on VectorE (6 N cycles, the SwiGLU backward's bound)
    derivative = b.act("silu_dx", b.ref(a["self"]), dtype="float32")
    return b.alu("multiply", b.ref(a["grad_output"]), derivative)


@register_pointwise(aten.gelu.default)
def _gelu(b, a):
    return b.act("gelu" if a["approximate"] == "none" else "gelu_apprx_tanh", b.ref(a["self"]))


@register_pointwise(aten.neg.default)
def _neg(b, a):
    return b.ts(b.ref(a["self"]), "multiply", -1.0)


@register_pointwise(aten.reciprocal.default)
def _reciprocal(b, a):
    return b.recip(b.ref(a["self"]))


@register_pointwise(aten.exp2.default)
def _exp2(b, a):
    return b.act("exp", b.ref(a["self"]), scale=math.log(2.0))


@register_pointwise(aten.expm1.default)
def _expm1(b, a):
    return b.expm1(b.ref(a["self"]))


@register_pointwise(aten.elu.default, refuses=lambda node, a: None if all(
    isinstance(a[k], (int, float)) for k in ("alpha", "scale", "input_scale"))
    else "alpha / scale / input_scale that are not real numbers")
def _elu(b, a):
    # scale * max(x, 0) + alpha * scale * expm1(min(x, 0) * input_scale): the exponential only
    # sees x <= 0, so no branch overflows (selu and elu arrive here; celu decomposes to expm1).
    x = b.ref(a["self"])
    alpha, scale, input_scale = float(a["alpha"]), float(a["scale"]), float(a["input_scale"])
    negative = b.ts(x, "minimum", 0.0, dtype="float32")
    decay = b.expm1(negative, input_scale, "float32")
    positive = b.ts(x, "maximum", 0.0, "multiply", scale, dtype="float32")
    return b.stt(decay, "multiply", alpha * scale, "add", positive)


@register_pointwise(aten.log1p.default)
def _log1p(b, a):
    # log1p(x) = log(u) - ((u - 1) - x) / u with u = 1 + x: corrects the rounding of u. The
    # correction is computed on x clamped to [.., 1e30] and u clamped to [1e-30, ..]: that keeps
    # x = inf at inf (not inf - inf) and x = -1 at log(0) = -inf (not 0 * inf), and changes nothing
    # else (1 + x is exact for x in [-1, -0.5], so u there is 0 or >= 2**-24; for x > 1e30 the
    # correction is 0 anyway).
    x = b.ref(a["self"])
    u = b.ts(x, "add", 1.0, dtype="float32")
    finite_x = b.ts(x, "minimum", 1e30, dtype="float32")
    finite_u = b.ts(finite_x, "add", 1.0, dtype="float32")
    rounding = b.stt(finite_u, "subtract", 1.0, "subtract", finite_x, "float32")
    safe_u = b.ts(finite_u, "maximum", 1e-30, dtype="float32")
    correction = b.alu("multiply", rounding, b.recip(safe_u, dtype="float32"), "float32")
    return b.alu("subtract", b.act("log", u, dtype="float32"), correction)


@register_pointwise(aten.log2.default)
def _log2(b, a):
    return b.ts(b.act("log", b.ref(a["self"]), dtype="float32"), "multiply", 1.0 / math.log(2.0))


@register_pointwise(aten.log10.default)
def _log10(b, a):
    return b.ts(b.act("log", b.ref(a["self"]), dtype="float32"), "multiply", 1.0 / math.log(10.0))


@register_pointwise(aten.sin.default)
def _sin(b, a):
    return b.sin(b.ref(a["self"]))


@register_pointwise(aten.cos.default)
def _cos(b, a):
    return b.sin(b.ref(a["self"]), cosine=True)


@register_pointwise(aten.cosh.default)
def _cosh(b, a):
    return b.cosh(b.ref(a["self"]))


@register_pointwise(aten.sinh.default)
def _sinh(b, a):
    # sinh(x) = tanh(x) * cosh(x): accurate near 0 (no e**x - e**-x cancellation), finite up to 89.4
    x = b.ref(a["self"])
    return b.alu("multiply", b.act("tanh", x, dtype="float32"), b.cosh(x))


@register_pointwise(aten.erfc.default)
def _erfc(b, a):
    # erfc(x) for x >= 0 from erfc_factors; erfc(x) = 2 - erfc(-x) below 0, as
    # erfc(|x|) * (1 - 2s) + 2s with s = (x < 0): exact where s = 0
    x = b.ref(a["self"])
    magnitude, t, q = b.erfc_factors(x)
    exponent = b.stt(b.alu("multiply", magnitude, magnitude, "float32"), "multiply", -1.0, "add", q, "float32")
    tail = b.alu("multiply", t, b.act("exp", exponent, bias=ERFC_COEFFICIENTS[0], dtype="float32"), "float32")
    minus_2s = b.ts(x, "less", 0.0, "multiply", -2.0, dtype="float32")
    flipped = b.stt(minus_2s, "add", 1.0, "multiply", tail, "float32")
    return b.stt(minus_2s, "multiply", -1.0, "add", flipped)


@register_pointwise(aten.special_erfcx.default)
def _erfcx(b, a):
    # erfcx(x) = exp(x * x) * erfc(x) = t * exp(c0 + Q) for x >= 0 (no overflow, no underflow);
    # 2 * exp(x * x) - erfcx(-x) below 0, as erfcx(|x|) * (1 - 2s) + 2s * exp(min(x, 0)**2)
    x = b.ref(a["self"])
    _, t, q = b.erfc_factors(x)
    scaled_tail = b.alu("multiply", t, b.act("exp", q, bias=ERFC_COEFFICIENTS[0], dtype="float32"), "float32")
    minus_2s = b.ts(x, "less", 0.0, "multiply", -2.0, dtype="float32")
    flipped = b.stt(minus_2s, "add", 1.0, "multiply", scaled_tail, "float32")
    negative = b.ts(x, "minimum", 0.0, dtype="float32")
    growth = b.act("exp", b.alu("multiply", negative, negative, "float32"), dtype="float32")
    return b.alu("subtract", flipped, b.alu("multiply", minus_2s, growth, "float32"))


@register_pointwise(aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default)
def _integral(b, a):
    x = b.ref(a["self"])
    if b.dtype_of(x) == "int32" or b.node_dtype == "int32":
        return x  # integers are integral already
    return b.integral(x, a["__op__"].__name__.split(".")[-1])


def _negative_decimals(node, a):
    # negative decimals divide before rounding: reciprocal + multiply could move ties
    if not node.meta["val"].dtype.is_floating_point or a["decimals"] < 0:
        return "negative decimals or an integer input"
    return None


@register_pointwise(aten.round.decimals, refuses=_negative_decimals)
def _round_decimals(b, a):
    # eager: nearbyint(x * 10**d) / 10**d in fp32 (bf16 too); the division is reciprocal + multiply
    # (one extra rounding)
    ten_pow = float(torch.tensor(10.0 ** a["decimals"], dtype=torch.float32))
    scaled = b.ts(b.ref(a["self"]), "multiply", ten_pow, dtype="float32")
    return b.div(b.integral(scaled, "round"), ten_pow)


@register_pointwise(aten.pow.Tensor_Scalar, refuses=lambda node, a: (
    None if isinstance(a["exponent"], (int, float)) else "an exponent that is not a real number"))
def _pow_scalar(b, a):
    x, e = b.ref(a["self"]), a["exponent"]
    if e == 0:
        return 1.0 if b.node_dtype == "float32" else 1
    if e == 0.5:
        return b.act("sqrt", x)
    if e == -0.5:
        return b.act("rsqrt", x)
    if float(e).is_integer() and abs(e) <= 4:
        result = x
        for _ in range(int(abs(e)) - 1):
            result = b.alu("multiply", result, x, "float32" if e < 0 else None)
        return b.recip(result) if e < 0 else result
    return b.ts(x, "power", float(e))


@register_pointwise(aten.pow.Tensor_Tensor)
def _pow_tensor(b, a):
    return b.alu("power", b.ref(a["self"]), b.ref(a["exponent"]))


@register_pointwise(aten.pow.Scalar, refuses=lambda node, a: (
    None if isinstance(a["self"], (int, float)) and a["self"] > 0 else "a base that is not a positive number"))
def _pow_base(b, a):
    base, x = a["self"], b.ref(a["exponent"])
    return b.act("exp", x, scale=math.log(base))


@register_pointwise(aten.maximum.default, aten.minimum.default)
def _max_min(b, a):
    op = "maximum" if a["__op__"] is aten.maximum else "minimum"
    return b.alu(op, b.ref(a["self"]), b.ref(a["other"]))


@register_pointwise(aten.clamp.default, aten.clamp.Tensor, aten.hardtanh.default, aten.clamp_min.default,
          aten.clamp_max.default)
def _clamp(b, a):
    x = b.ref(a["self"])
    low = a.get("min", a.get("min_val"))
    high = a.get("max", a.get("max_val"))
    low, high = (None if v is None else b.ref(v) for v in (low, high))
    if low is not None and high is not None and is_imm(low) and is_imm(high):
        return b.ts(x, "maximum", low, "minimum", high)
    if low is not None:
        x = b.alu("maximum", x, low)
    if high is not None:
        x = b.alu("minimum", x, high)
    return x


@register_pointwise(aten.leaky_relu.default)
def _leaky_relu(b, a):
    x, slope = b.ref(a["self"]), a["negative_slope"]
    return b.stt(x, "multiply", slope, "maximum" if slope <= 1 else "minimum", x)


@register_pointwise(aten.where.self)
def _where(b, a):
    return b.select(b.ref(a["condition"]), b.ref(a["self"]), b.ref(a["other"]))


@register_pointwise(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(b, a):
    return b.select(b.ref(a["mask"]), b.ref(a["value"]), b.ref(a["self"]))


_COMPARE = {aten.eq: "equal", aten.ne: "not_equal", aten.lt: "less", aten.le: "less_equal",
            aten.gt: "greater", aten.ge: "greater_equal"}
register_pointwise(*(overload for packet in _COMPARE for overload in (packet.Tensor, packet.Scalar)))(
    lambda b, a: b.alu(_COMPARE[a["__op__"]], b.ref(a["self"]), b.ref(a["other"])))

_LOGICAL = {aten.logical_and: "logical_and", aten.logical_or: "logical_or", aten.logical_xor: "logical_xor",
            aten.bitwise_and: "logical_and", aten.bitwise_or: "logical_or", aten.bitwise_xor: "logical_xor"}


def _logical(b, a):
    return b.alu(_LOGICAL[a["__op__"]], b.ref(a["self"]), b.ref(a["other"]))


def _not_bool(node, a):
    # bitwise ops are the logical ones only on booleans
    return None if node.meta["val"].dtype == torch.bool else "bitwise ops on integers (only on bool)"


def _logical_not(b, a):
    return b.ts(b.ref(a["self"]), "equal", 0.0)


register_pointwise(aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default)(_logical)
register_pointwise(aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor,
                   refuses=_not_bool)(_logical)
register_pointwise(aten.logical_not.default)(_logical_not)
register_pointwise(aten.bitwise_not.default, refuses=_not_bool)(_logical_not)


@register_pointwise(aten.isnan.default)
def _isnan(b, a):
    x = b.ref(a["self"])
    return b.alu("not_equal", x, x)


@register_pointwise(aten.isinf.default)
def _isinf(b, a):
    return b.ts(b.act("abs", b.ref(a["self"]), dtype="float32"), "equal", math.inf)


# Memory formats a copy may ask for. Kernels write contiguous tensors and every reader (kernel,
# host view, fallback) goes through the strides the value really has (graph.py tracks them), so a
# copy into channels_last is the same values in another layout: a layout no-op for our kernels.
_STRIDED_MEMORY_FORMATS = (None, torch.preserve_format, torch.contiguous_format, torch.channels_last,
                           torch.channels_last_3d)


def _copy_refusal(node, a):
    if a.get("layout") not in (None, torch.strided):
        return f"layout {a['layout']} (only strided tensors live in HBM)"
    if a.get("memory_format") not in _STRIDED_MEMORY_FORMATS:
        return f"memory_format {a['memory_format']}"
    return None


@register_pointwise(aten._to_copy.default, aten.clone.default, refuses=_copy_refusal)
def _copy(b, a):
    x = b.ref(a["self"])
    if b.node_dtype == "int32" and b.dtype_of(x) not in ("int32", "uint8", "int8", "int16"):
        x = b.integral(x, "trunc")  # float -> int truncates toward zero
    if a["__out_dtype__"] == torch.bool:
        return b.ts(x, "not_equal", 0.0)
    return x  # value unchanged: a store rounds it to the output dtype


@register_pointwise(aten.full.default, aten.full_like.default, aten.scalar_tensor.default)
def _full(b, a):
    value = a["fill_value"] if "fill_value" in a else a["s"]
    return float(value) if b.node_dtype == "float32" else int(value)


def _runtime_bounds(node, a):
    if all(isinstance(a.get(k, 0), (int, float)) for k in ("start", "end", "step")):
        return None
    return "start / end / step known only at run time"


@register_pointwise(aten.arange.start_step, aten.arange.start, aten.arange.default, refuses=_runtime_bounds)
def _arange(b, a):
    start, step = a.get("start", 0), a.get("step", 1)
    index = b.emit("iota", (), "int32")
    return b.ts(index, "multiply", step, "add", start)
