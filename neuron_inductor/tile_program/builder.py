"""Building tile programs: primitives that fold immediates, and the numerics composites ATen ops share.

Numerics: every instruction computes in fp32 on chip (the engines do) and intermediates stay
fp32; results are rounded once, when stored in the node's dtype (bf16 chains therefore differ
from eager's per-op rounding by at most about one bf16 ulp). Integer values live in int32 tiles
(int64 graph values are int32 on chip: exact for |x| < 2**31, and arithmetic with immediates is
exact for |x| < 2**24 because tensor_scalar computes in fp32). Booleans are 1.0 / 0.0 in fp32
tiles and stored as bool. `where` is an exact bit select (int32 views), not arithmetic, so
inf / NaN in the unselected branch never leak. floor / ceil / round / trunc go through an
int32 conversion and are exact for every finite fp32 value. sin / cos reduce their argument to
[-pi, pi] first (the ScalarE polynomial's range) with a two-constant Cody-Waite step; arguments
beyond about 2**22 * 2 pi lose precision. erfc / erfcx use Numerical Recipes' erfcc rational
approximation (fractional error 1.2e-7, plus exp's rounding of arguments up to x * x: about 1e-5
relative in erfc's far tail); cosh / sinh stay finite up to their fp32 overflow at |x| = 89.4.
ScalarE activations see only inputs inside their valid ranges (nki.api.shared.rst): sqrt runs as
the ALU power operator, rsqrt as GpSimd's tensor_scalar rsqrt, log as 4 log(x ** 0.25) with eager's
values at 0, inf, negatives and NaN (`_RANGE_SAFE`), sin on an argument clamped to [-pi, pi].
Division is reciprocal + multiply (one extra rounding), with a correction step before floor /
trunc rounding modes.
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from ..lowering.common import bind_arguments, float32_bits
from ..lowering.registry import LOWERINGS
from ..lowering.unit_views import in_group_dims
from .ir import SUPPORTED_DTYPES, Instr, PointwiseProgram, ProgramInput, Ref, is_imm

aten = torch.ops.aten

_PY_ALU: dict[str, Callable] = {
    "add": operator.add, "subtract": operator.sub, "multiply": operator.mul,
    "maximum": max, "minimum": min, "power": lambda a, b: float(a) ** b,
    "equal": lambda a, b: float(a == b), "not_equal": lambda a, b: float(a != b),
    "greater": lambda a, b: float(a > b), "greater_equal": lambda a, b: float(a >= b),
    "less": lambda a, b: float(a < b), "less_equal": lambda a, b: float(a <= b),
    "logical_and": lambda a, b: float(bool(a) and bool(b)), "logical_or": lambda a, b: float(bool(a) or bool(b)),
    "logical_xor": lambda a, b: float(bool(a) != bool(b)),
}
_COMMUTATIVE = {"add", "multiply", "maximum", "minimum", "equal", "not_equal", "logical_and", "logical_or",
                "logical_xor"}
_TORCH_UNARY: dict[str, Callable] = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "relu": torch.relu, "erf": torch.erf, "sin": torch.sin, "abs": torch.abs,
    "sign": torch.sign, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
    "gelu_apprx_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def _fold_unary(func: str, value: float) -> float:
    """An activation of an immediate, computed in fp32 like the engine."""
    return float(_TORCH_UNARY[func](torch.tensor(value, dtype=torch.float32)))


TWO_PI_HI = 6.28125              # 2 pi split for Cody-Waite reduction: k * TWO_PI_HI is exact in fp32
TWO_PI_LO = 2 * math.pi - TWO_PI_HI
ROUND_CLAMP = float(2 ** 30)     # |x| beyond this is an integer already; keeps the int32 cast in range
# Numerical Recipes' erfcc: erfc(z) = t * exp(-z * z + P(t)), t = 1 / (1 + z / 2), z >= 0, P with
# these coefficients (constant term first); fractional error below 1.2e-7 for every z.
ERFC_COEFFICIENTS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
                     1.48851587, -0.82215223, 0.17087277)


class ProgramBuilder:
    """Builds a PointwiseProgram; each primitive folds immediates and trivial identities."""

    def __init__(self, shape: tuple[int, ...] | None = None, aliases: dict[fx.Node, fx.Node] | None = None) -> None:
        self.inputs: list[ProgramInput] = []
        self.instrs: list[Instr] = []
        self.env: dict[fx.Node, Ref] = {}
        self.node_dtype = "float32"  # result tile dtype of the node being lowered
        # The iteration shape, and the shape of the node being lowered (equal up to size-1 dims);
        # `aliases` maps unit views (lowering/unit_views.py) to the value they view.
        self.shape, self.node_shape = shape, shape
        self.aliases = aliases or {}
        self._mapped_inputs: dict[tuple, str] = {}

    # -- values
    def ref(self, arg) -> Ref:
        """The program value of a node argument (input, earlier result, or immediate)."""
        if isinstance(arg, fx.Node):
            seen = arg  # the value the node reads: a unit view's own shape and strides
            while arg not in self.env and arg in self.aliases:
                arg = self.aliases[arg]
            if arg in self.env:
                return self.env[arg]
            const = constant_scalar(arg)
            if const is not None:
                return const
            val, seen_val = arg.meta["val"], seen.meta["val"]
            shape, stride = in_group_dims(seen_val.shape, seen_val.stride(), self.node_shape or seen_val.shape,
                                          self.shape or self.node_shape or seen_val.shape)
            shape, stride = tuple(int(s) for s in shape), tuple(int(s) for s in stride)
            key = (arg, shape, stride)
            if key in self._mapped_inputs:
                return self._mapped_inputs[key]
            name = f"x{len(self.inputs)}"
            self.inputs.append(ProgramInput(name, arg, shape, stride, val.dtype))
            self._mapped_inputs[key] = name
            if (shape, stride) == (tuple(val.shape), tuple(val.stride())):
                self.env[arg] = name
            return name
        if isinstance(arg, bool):
            return int(arg)
        return arg

    def dtype_of(self, ref: Ref) -> str:
        if is_imm(ref):
            return "int32" if isinstance(ref, int) else "float32"
        for inp in self.inputs:
            if inp.name == ref:
                return inp.tile_dtype
        return next(i.dtype for i in reversed(self.instrs) if i.out == ref)

    def emit(self, kind: str, operands: tuple, dtype: str | None = None, bits: bool = False, **attrs) -> str:
        name = f"t{len(self.instrs)}"
        self.instrs.append(Instr(name, kind, operands, dtype or self.node_dtype, tuple(sorted(attrs.items())), bits))
        return name

    # -- primitives
    def act(self, func: str, x: Ref, scale: float = 1.0, bias: float = 0.0, dtype: str | None = None) -> Ref:
        if is_imm(x):
            return _fold_unary(func, x * scale + bias)
        if func in _RANGE_SAFE:  # ScalarE's log / sqrt / rsqrt are valid on part of their domain only
            if scale != 1.0 or bias != 0.0:
                x = self.ts(x, "multiply", scale, "add", bias, dtype="float32")
            return _RANGE_SAFE[func](self, x, dtype)
        return self.emit("act", (x, scale, bias), dtype, func=func)

    def log(self, x: Ref, dtype: str | None = None) -> Ref:
        """log(x) = 4 log(x ** 0.25): the fourth root of every positive finite fp32 (denormals too) lies in
        [2**-37.25, 2**32], inside ScalarE log's valid input range [2**-64, 2**64]; 0 and inf are clamped
        into it and then given eager's -inf / inf by an overflowing term; negatives and NaN are NaN
        through the root (-inf by `nan_at_minus_inf`). About 2e-7 absolute error over eager (the root's
        rounding, times 4)."""
        root = self.ts(x, "power", 0.25, "maximum", 2.0 ** -64, dtype="float32")
        root = self.ts(root, "minimum", 2.0 ** 64, dtype="float32")
        logs = self.emit("act", (root, 1.0, 0.0), "float32", func="log")
        is_inf = self.ts(x, "equal", math.inf, dtype="float32")
        edge = self.stt(x, "equal", 0.0, "subtract", is_inf, "float32")  # 1 at +-0, -1 at inf, else 0
        blow_up = self.ts(edge, "multiply", -(2.0 ** 127), "multiply", 4.0, dtype="float32")  # -inf, inf or 0
        return self.nan_at_minus_inf(x, self.stt(logs, "multiply", 4.0, "add", blow_up, "float32"), dtype)

    def nan_at_minus_inf(self, x: Ref, y: Ref, dtype: str | None = None) -> Ref:
        """y, NaN where x is -inf (or NaN): min(x + inf, y), as x + inf is inf except at -inf (NaN).
        The ALU power operator gives inf / 0 at -inf where eager's sqrt / rsqrt / log give NaN."""
        return self.stt(x, "add", math.inf, "minimum", y, dtype)

    def ts(self, x: Ref, op0: str, a0, op1: str | None = None, a1=None, rev0=False, rev1=False,
           dtype: str | None = None) -> Ref:
        if is_imm(x):
            value = _PY_ALU[op0](a0, x) if rev0 else _PY_ALU[op0](x, a0)
            if op1 is not None:
                value = _PY_ALU[op1](a1, value) if rev1 else _PY_ALU[op1](value, a1)
            return value
        return self.emit("ts", (x, a0, a1), dtype, op0=op0, op1=op1, rev0=rev0, rev1=rev1)

    def alu(self, op: str, x: Ref, y: Ref, dtype: str | None = None) -> Ref:
        """x op y for any mix of values and immediates."""
        if is_imm(x) and is_imm(y):
            return _PY_ALU[op](x, y)
        if is_imm(y):
            if (op in ("add", "subtract") and y == 0) or (op == "multiply" and y == 1):
                return x if dtype is None or dtype == self.dtype_of(x) else self.cast(x, dtype)
            return self.ts(x, op, y, dtype=dtype)
        if is_imm(x):
            if op in ("add", "multiply") and x == (0 if op == "add" else 1):
                return y if dtype is None or dtype == self.dtype_of(y) else self.cast(y, dtype)
            return self.ts(y, op, x, rev0=op not in _COMMUTATIVE, dtype=dtype)
        return self.emit("tt", (x, y), dtype, op=op)

    def stt(self, x: Ref, op0: str, a0, op1: str, y: Ref, dtype: str | None = None) -> Ref:
        """(x op0 a0) op1 y."""
        if is_imm(x) or is_imm(y):
            return self.alu(op1, self.ts(x, op0, a0, dtype="float32"), y, dtype)
        return self.emit("stt", (x, a0, y), dtype, op0=op0, op1=op1)

    def recip(self, x: Ref, dtype: str | None = None) -> Ref:
        if is_imm(x):
            return 1.0 / x if x != 0 else math.copysign(math.inf, x)
        return self.emit("recip", (x,), dtype)

    def cast(self, x: Ref, dtype: str) -> Ref:
        if is_imm(x):
            return int(round(x)) if dtype == "int32" else float(x)
        if self.dtype_of(x) == dtype:
            return x
        return self.emit("cast", (x,), dtype)

    def as_float32(self, x: Ref) -> Ref:
        return float(x) if is_imm(x) else self.cast(x, "float32")

    # -- composites shared by several ATen ops
    def div(self, x: Ref, y: Ref, dtype: str | None = None) -> Ref:
        if is_imm(y):
            return self.alu("multiply", x, self.recip(float(y)), dtype)
        return self.alu("multiply", x, self.recip(y, dtype="float32"), dtype)

    def exact_div(self, x: Ref, y: Ref) -> Ref:
        """x / y with one correction step, q + (x - q*y) / y: right on exact integer quotients."""
        r = self.recip(float(y) if is_imm(y) else y, dtype="float32")
        q = self.alu("multiply", x, r, "float32")
        if is_imm(q):
            return q
        residual = self.alu("subtract", x, self.alu("multiply", q, y, "float32"), "float32")
        return self.alu("add", q, self.alu("multiply", residual, r, "float32"), "float32")

    def select(self, cond: Ref, a: Ref, b: Ref) -> Ref:
        """where(cond, a, b) as a bit select: b ^ ((a ^ b) & mask), mask = -cond as int32."""
        if is_imm(cond):
            return a if cond else b
        if a == b and is_imm(a):
            return a
        if self.node_dtype == "float32":
            a, b = self.as_float32(a), self.as_float32(b)
            a_bits = float32_bits(a) if is_imm(a) else a
            b_bits = float32_bits(b) if is_imm(b) else b
        else:
            a, b = self.cast(a, "int32"), self.cast(b, "int32")
            a_bits, b_bits = a, b
        mask = self.ts(cond, "multiply", -1, dtype="int32")
        result_dtype = self.node_dtype
        bits = result_dtype == "float32"
        if is_imm(a_bits) and is_imm(b_bits):
            return self.emit("ts", (mask, a_bits ^ b_bits, b_bits), result_dtype, bits=bits,
                             op0="bitwise_and", op1="bitwise_xor", rev0=False, rev1=False)
        if is_imm(a_bits) or is_imm(b_bits):
            # Select the tile where the mask says so, then xor the immediate back in.
            tile, imm = (b_bits, a_bits) if is_imm(a_bits) else (a_bits, b_bits)
            if is_imm(a_bits):  # the tile is taken where cond is false: invert the mask
                mask = self.emit("ts", (mask, -1, None), "int32", op0="bitwise_xor", op1=None, rev0=False, rev1=False)
            if imm == 0:
                return self.emit("tt", (tile, mask), result_dtype, bits=bits, op="bitwise_and")
            diff = self.emit("ts", (tile, imm, None), result_dtype, bits=bits, op0="bitwise_xor", op1=None,
                             rev0=False, rev1=False)
            diff = self.emit("tt", (diff, mask), result_dtype, bits=bits, op="bitwise_and")
            return self.emit("ts", (diff, imm, None), result_dtype, bits=bits, op0="bitwise_xor", op1=None,
                             rev0=False, rev1=False)
        diff = self.emit("tt", (a_bits, b_bits), result_dtype, bits=bits, op="bitwise_xor")
        diff = self.emit("tt", (diff, mask), result_dtype, bits=bits, op="bitwise_and")
        return self.emit("tt", (diff, b_bits), result_dtype, bits=bits, op="bitwise_xor")

    def round_even(self, x: Ref) -> tuple[Ref, Ref]:
        """(clamped x, clamped x rounded half-to-even as int32)."""
        clamped = self.ts(x, "maximum", -ROUND_CLAMP, "minimum", ROUND_CLAMP, dtype="float32")
        return clamped, self.cast(clamped, "int32")

    def integral(self, x: Ref, mode: str) -> Ref:
        """floor / ceil / round / trunc of a float value, exact for all finite fp32 values."""
        if is_imm(x):
            return float({"floor": math.floor, "ceil": math.ceil, "trunc": math.trunc,
                          "round": round}[mode](x))
        if mode == "trunc":
            magnitude = self.act("abs", x, dtype="float32")
            clamped, r = self.round_even(magnitude)
            below = self.alu("subtract", r, self.alu("greater", r, clamped, "float32"), "float32")
            frac = self.alu("subtract", clamped, below, "float32")
            signed = self.alu("multiply", self.act("sign", x, dtype="float32"), frac, "float32")
            return self.alu("subtract", x, signed)
        clamped, r = self.round_even(x)
        if mode == "round":
            integral = r
        elif mode == "floor":
            integral = self.alu("subtract", r, self.alu("greater", r, clamped, "float32"), "float32")
        else:
            integral = self.alu("add", r, self.alu("less", r, clamped, "float32"), "float32")
        frac = self.alu("subtract", clamped, integral, "float32")
        return self.alu("subtract", x, frac)

    def sin(self, x: Ref, cosine: bool = False) -> Ref:
        """sin / cos with the argument reduced to [-pi, pi] (the ScalarE table's range)."""
        if is_imm(x):
            return math.cos(x) if cosine else math.sin(x)
        turns = self.ts(x, "multiply", 1.0 / (2 * math.pi), dtype="float32")
        k = self.cast(turns, "int32")
        reduced = self.stt(k, "multiply", -TWO_PI_HI, "add", x, "float32")
        reduced = self.stt(k, "multiply", -TWO_PI_LO, "add", reduced, "float32")
        # Rounding can leave the reduced argument an ulp outside ScalarE sin's valid range [-pi, pi].
        reduced = self.ts(reduced, "maximum", -math.pi, "minimum", math.pi, dtype="float32")
        if cosine:  # cos(r) = sin(pi/2 - |r|), whose argument stays in [-pi/2, pi/2]
            reduced = self.act("abs", reduced, dtype="float32")
            return self.act("sin", reduced, scale=-1.0, bias=math.pi / 2)
        return self.act("sin", reduced)

    def expm1(self, x: Ref, scale: float = 1.0, dtype: str | None = None) -> Ref:
        """expm1(x * scale) = tanh(x * scale / 2) * (exp(x * scale) + 1): no cancellation near 0,
        exact limits at +-inf."""
        half_tanh = self.act("tanh", x, scale=0.5 * scale, dtype="float32")
        return self.stt(self.act("exp", x, scale=scale, dtype="float32"), "add", 1.0, "multiply", half_tanh, dtype)

    def cosh(self, x: Ref) -> Ref:
        """cosh(x) = exp(|x| - ln 2) + exp(-|x| - ln 2): finite wherever cosh is (e**|x| alone
        overflows from |x| = 88.7, cosh from 89.4)."""
        magnitude = self.act("abs", x, dtype="float32")
        half_grow = self.act("exp", magnitude, bias=-math.log(2.0), dtype="float32")
        half_decay = self.act("exp", magnitude, scale=-1.0, bias=-math.log(2.0), dtype="float32")
        return self.alu("add", half_grow, half_decay, "float32")

    def erfc_factors(self, x: Ref) -> tuple[Ref, Ref, Ref]:
        """(|x|, t, Q) of erfc(|x|) = t * exp(-x * x + c0 + Q) (ERFC_COEFFICIENTS, c0 their first)."""
        magnitude = self.act("abs", x, dtype="float32")
        t = self.recip(self.ts(magnitude, "multiply", 0.5, "add", 1.0, dtype="float32"), dtype="float32")
        q = self.ts(t, "multiply", ERFC_COEFFICIENTS[-1], dtype="float32")
        for coefficient in reversed(ERFC_COEFFICIENTS[1:-1]):  # Horner: q = (q + c) * t
            q = self.stt(q, "add", coefficient, "multiply", t, "float32")
        return magnitude, t, q


# Activation functions lowered so that ScalarE only sees inputs inside its documented valid ranges
# (nki.api.shared.rst, tbl-act-func): sqrt becomes the ALU power operator, rsqrt the ALU rsqrt (no
# documented range limit, eager's values at 0, inf, negatives and NaN), log the fourth-root form of
# ProgramBuilder.log.
_RANGE_SAFE: dict[str, Callable] = {
    "sqrt": lambda b, x, dtype: b.nan_at_minus_inf(x, b.ts(x, "power", 0.5, dtype="float32"), dtype),
    # GpSimd's tensor_scalar rsqrt (nki.api.shared.rst, "NKI Engine Selection"): eager's -inf at -0.0,
    # which power(-0.5) misses.
    "rsqrt": lambda b, x, dtype: b.emit("ts", (x, 0.0, None), dtype, op0="rsqrt", op1=None, rev0=False, rev1=False,
                                        engine="gpsimd"),
    "log": lambda b, x, dtype: b.log(x, dtype),
}


def constant_scalar(node: fx.Node):
    """The value of a 0-d constant node (scalar_tensor, full([], v)), else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.scalar_tensor.default:
        value = node.args[0]
    elif node.target is aten.full.default and len(node.args[0]) == 0:
        value = node.args[1]
    else:
        return None
    if isinstance(value, fx.Node):
        return None  # a value known only at run time (e.g. from .item())
    dtype = node.meta["val"].dtype
    if dtype.is_floating_point:
        return float(value)
    return int(value) if dtype in SUPPORTED_DTYPES else None


def node_arguments(node: fx.Node) -> dict:
    """What an op's emit rule reads: the bound schema arguments, plus `__op__` (the overload packet)
    and `__out_dtype__` (the result's torch dtype)."""
    a = bind_arguments(node)
    a["__op__"] = node.target.overloadpacket
    a["__out_dtype__"] = node.meta["val"].dtype
    return a


def build_program(nodes: list[fx.Node], outputs: list[fx.Node], shape: tuple[int, ...] | None = None,
                  aliases: dict[fx.Node, fx.Node] | None = None) -> PointwiseProgram:
    """`nodes` (pointwise, topologically ordered) as an SSA program over `shape` (default: the last
    node's; every node's shape equals it up to size-1 dims) returning `outputs`; each node is emitted
    by its op's `register_pointwise` rule. `aliases` maps unit views read by the nodes to their sources."""
    if shape is None:
        shape = tuple(int(s) for s in nodes[-1].meta["val"].shape) if nodes else ()
    builder = ProgramBuilder(tuple(int(s) for s in shape), aliases)
    shape = builder.shape
    for node in nodes:
        builder.node_shape = tuple(int(s) for s in node.meta["val"].shape)
        dtype = node.meta["val"].dtype
        builder.node_dtype = "float32" if dtype.is_floating_point or dtype == torch.bool else "int32"
        builder.env[node] = LOWERINGS[node.target].emit(builder, node_arguments(node))
    results = []
    for out in outputs:
        if out not in builder.env:  # an output no node computes (a matmul epilogue's anchor): stored as read,
            # through the input that already reads it (in any layout: a unit view), else a new one
            read = next((inp.name for inp in builder.inputs if inp.value is out), None)
            if read is None:
                builder.node_shape = tuple(int(s) for s in out.meta["val"].shape)
                read = builder.ref(out)
            builder.env[out] = read
        results.append((out, builder.env[out]))
    return PointwiseProgram(shape, builder.inputs, builder.instrs, results)
