"""The pointwise family: fused elementwise chains, and the reusable pointwise program.

Graph-lowering API (called by `lowering/graph.py`):
- `is_pointwise(node)`: the node is an elementwise op this family computes for these arguments.
- `lower_pointwise_group(nodes, outputs) -> KernelSpec`: one `pointwise` kernel computing `nodes`
  (topologically ordered, one output shape) and returning the values of `outputs`.
  Values produced outside the group become HBM inputs read with their own logical shape
  (strided / permuted / expanded views are fine: the kernel reshapes them to the coalesced
  iteration shape and the DMA reads through the strides); Python scalars and 0-d constants
  (`scalar_tensor`, `full([], v)`) become immediates. A 0-d constant node needs no kernel of its
  own when every user is pointwise: its users fold it.

Reusable pieces (for epilogues / prologues of the matmul, reduction and norm families):
- `build_program(nodes, outputs) -> PointwiseProgram`: the group as a small SSA program over
  tile values. `program.inputs` are the external tensors (each a `ProgramInput` with the SSA
  name it binds), `program.instrs` the primitive instructions (`Instr`: act / ts / tt / stt /
  recip / cast / iota, mirroring nisa.activation, tensor_scalar, tensor_tensor,
  scalar_tensor_tensor, reciprocal, tensor_copy, iota), `program.results` what each output is
  (an SSA name or an immediate). The program is layout-free: it never says how tiles are shaped.
- `resolve_program(program, kinds, hoisted, store_dtypes) -> ResolvedProgram`: binds every input
  to an operand kind ("tile" = a [P, F] tile, "col" = a [P, 1] column broadcast along the
  free dim, fp32 or, for integer inputs, int32), selects the nisa form of each instruction for those kinds (e.g. tensor_tensor with a
  column becomes tensor_scalar), reuses dead tiles in place and plans the casts of the stores.
  Its `instrs` are plain dicts rendered by `codegen_templates/_pointwise_ops.py.j2`
  (`{% from "_pointwise_ops.py.j2" import instruction %}`, one call per instruction with the
  tile sizes of the current iteration).
- `on_chip_name(dtype)`: the tile dtype name a graph dtype is held in (and stored from).

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
the ALU power operator, rsqrt as GpSimd's tensor_scalar rsqrt, log as 4 log(x ** 0.25) with eager's values at 0, inf, negatives
and NaN (`_RANGE_SAFE`), sin on an argument clamped to [-pi, pi]. Division is reciprocal +
multiply (one extra rounding), with a correction step before floor / trunc rounding modes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.fx as fx

from .common import bind_arguments, float32_bits
from .ir import KernelSpec

aten = torch.ops.aten

PMAX = 128                 # partitions per tile
FREE_TILE_MAX = 8192       # elements per partition of one tile
FREE_TILE_MIN = 512
SBUF_BYTES_PER_ITERATION = 64 * 1024  # per partition; the next iteration's tiles double it

Ref = Union[str, float, int]  # an SSA value name, or an immediate


def _is_imm(value) -> bool:
    return not isinstance(value, str)


# ---------------------------------------------------------------------------- the program

@dataclass(frozen=True)
class Instr:
    """One primitive instruction of a pointwise program.

    kind and operands:
      act    (data, scale, bias)   func(data * scale + bias); attrs: func (nl name)
      ts     (data, a0, a1)        (data op0 a0) op1 a1, a0 / a1 immediates; attrs: op0, op1, rev0, rev1
      tt     (x, y)                x op y; attrs: op
      stt    (data, a0, y)         (data op0 a0) op1 y, a0 immediate; attrs: op0, op1
      recip  (x,)                  1 / x
      cast   (x,)                  x converted to `dtype` (float -> int rounds half to even)
      iota   ()                    the flat element index of a 1-D iteration (int32)
    `bits` marks bit-level ops: float32 operands and results are read / written as int32 views.
    `dtype` is the on-chip dtype name of the result tile.
    """

    out: str
    kind: str
    operands: tuple
    dtype: str = "float32"
    attrs: tuple = ()
    bits: bool = False

    def attr(self, name: str, default=None):
        return dict(self.attrs).get(name, default)


@dataclass(frozen=True)
class ProgramInput:
    name: str                # SSA value it binds
    value: fx.Node           # the graph value read from HBM
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def tile_dtype(self) -> str:
        return on_chip_name(self.dtype)

    @property
    def column_dtype(self) -> str:
        """The dtype of the [P, 1] column a broadcast input is read into: int32 for integers (bit
        selects and exact integer math need integer operands), fp32 for the rest."""
        return "int32" if self.tile_dtype in ("int32", "int16", "int8") else "float32"


@dataclass
class PointwiseProgram:
    shape: tuple[int, ...]
    inputs: list[ProgramInput]
    instrs: list[Instr]
    results: list[tuple[fx.Node, Ref]]

    def value_dtype(self, ref: str) -> str:
        for inp in self.inputs:
            if inp.name == ref:
                return inp.tile_dtype
        return next(i.dtype for i in self.instrs if i.out == ref)


def on_chip_name(dtype: torch.dtype) -> str:
    """The dtype name of the on-chip tile holding a value of `dtype` (int64 -> int32, bool -> uint8)."""
    if dtype.is_floating_point:
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return "uint8" if dtype in (torch.bool, torch.uint8) else "int8" if dtype == torch.int8 else (
        "int16" if dtype == torch.int16 else "int32")


SUPPORTED_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
                    torch.int8, torch.uint8, torch.bool}


# ---------------------------------------------------------------------------- building programs

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

    def __init__(self) -> None:
        self.inputs: list[ProgramInput] = []
        self.instrs: list[Instr] = []
        self.env: dict[fx.Node, Ref] = {}
        self.node_dtype = "float32"  # result tile dtype of the node being lowered

    # -- values
    def ref(self, arg) -> Ref:
        """The program value of a node argument (input, earlier result, or immediate)."""
        if isinstance(arg, fx.Node):
            if arg in self.env:
                return self.env[arg]
            const = constant_scalar(arg)
            if const is not None:
                return const
            val = arg.meta["val"]
            name = f"x{len(self.inputs)}"
            self.inputs.append(ProgramInput(name, arg, tuple(int(s) for s in val.shape),
                                            tuple(int(s) for s in val.stride()), val.dtype))
            self.env[arg] = name
            return name
        if isinstance(arg, bool):
            return int(arg)
        return arg

    def dtype_of(self, ref: Ref) -> str:
        if _is_imm(ref):
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
        if _is_imm(x):
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
        if _is_imm(x):
            value = _PY_ALU[op0](a0, x) if rev0 else _PY_ALU[op0](x, a0)
            if op1 is not None:
                value = _PY_ALU[op1](a1, value) if rev1 else _PY_ALU[op1](value, a1)
            return value
        return self.emit("ts", (x, a0, a1), dtype, op0=op0, op1=op1, rev0=rev0, rev1=rev1)

    def alu(self, op: str, x: Ref, y: Ref, dtype: str | None = None) -> Ref:
        """x op y for any mix of values and immediates."""
        if _is_imm(x) and _is_imm(y):
            return _PY_ALU[op](x, y)
        if _is_imm(y):
            if (op in ("add", "subtract") and y == 0) or (op == "multiply" and y == 1):
                return x if dtype is None or dtype == self.dtype_of(x) else self.cast(x, dtype)
            return self.ts(x, op, y, dtype=dtype)
        if _is_imm(x):
            if op in ("add", "multiply") and x == (0 if op == "add" else 1):
                return y if dtype is None or dtype == self.dtype_of(y) else self.cast(y, dtype)
            return self.ts(y, op, x, rev0=op not in _COMMUTATIVE, dtype=dtype)
        return self.emit("tt", (x, y), dtype, op=op)

    def stt(self, x: Ref, op0: str, a0, op1: str, y: Ref, dtype: str | None = None) -> Ref:
        """(x op0 a0) op1 y."""
        if _is_imm(x) or _is_imm(y):
            return self.alu(op1, self.ts(x, op0, a0, dtype="float32"), y, dtype)
        return self.emit("stt", (x, a0, y), dtype, op0=op0, op1=op1)

    def recip(self, x: Ref, dtype: str | None = None) -> Ref:
        if _is_imm(x):
            return 1.0 / x if x != 0 else math.copysign(math.inf, x)
        return self.emit("recip", (x,), dtype)

    def cast(self, x: Ref, dtype: str) -> Ref:
        if _is_imm(x):
            return int(round(x)) if dtype == "int32" else float(x)
        if self.dtype_of(x) == dtype:
            return x
        return self.emit("cast", (x,), dtype)

    def as_float32(self, x: Ref) -> Ref:
        return float(x) if _is_imm(x) else self.cast(x, "float32")

    # -- composites shared by several ATen ops
    def div(self, x: Ref, y: Ref, dtype: str | None = None) -> Ref:
        if _is_imm(y):
            return self.alu("multiply", x, self.recip(float(y)), dtype)
        return self.alu("multiply", x, self.recip(y, dtype="float32"), dtype)

    def exact_div(self, x: Ref, y: Ref) -> Ref:
        """x / y with one correction step, q + (x - q*y) / y: right on exact integer quotients."""
        r = self.recip(float(y) if _is_imm(y) else y, dtype="float32")
        q = self.alu("multiply", x, r, "float32")
        if _is_imm(q):
            return q
        residual = self.alu("subtract", x, self.alu("multiply", q, y, "float32"), "float32")
        return self.alu("add", q, self.alu("multiply", residual, r, "float32"), "float32")

    def select(self, cond: Ref, a: Ref, b: Ref) -> Ref:
        """where(cond, a, b) as a bit select: b ^ ((a ^ b) & mask), mask = -cond as int32."""
        if _is_imm(cond):
            return a if cond else b
        if a == b and _is_imm(a):
            return a
        if self.node_dtype == "float32":
            a, b = self.as_float32(a), self.as_float32(b)
            a_bits = float32_bits(a) if _is_imm(a) else a
            b_bits = float32_bits(b) if _is_imm(b) else b
        else:
            a, b = self.cast(a, "int32"), self.cast(b, "int32")
            a_bits, b_bits = a, b
        mask = self.ts(cond, "multiply", -1, dtype="int32")
        result_dtype = self.node_dtype
        bits = result_dtype == "float32"
        if _is_imm(a_bits) and _is_imm(b_bits):
            return self.emit("ts", (mask, a_bits ^ b_bits, b_bits), result_dtype, bits=bits,
                             op0="bitwise_and", op1="bitwise_xor", rev0=False, rev1=False)
        if _is_imm(a_bits) or _is_imm(b_bits):
            # Select the tile where the mask says so, then xor the immediate back in.
            tile, imm = (b_bits, a_bits) if _is_imm(a_bits) else (a_bits, b_bits)
            if _is_imm(a_bits):  # the tile is taken where cond is false: invert the mask
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
        if _is_imm(x):
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
        if _is_imm(x):
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


# ---------------------------------------------------------------------------- ATen op handlers

Handler = Callable[[ProgramBuilder, dict], Ref]
HANDLERS: dict[torch._ops.OpOverload, Handler] = {}


def _handles(*ops):
    def register(fn: Handler) -> Handler:
        for op in ops:
            HANDLERS[op] = fn
        return fn
    return register


@_handles(aten.add.Tensor, aten.add.Scalar)
def _add(b, a):
    x, y, alpha = b.ref(a["self"]), b.ref(a["other"]), a.get("alpha", 1)
    return b.alu("add", x, y) if alpha == 1 else b.stt(y, "multiply", alpha, "add", x)


@_handles(aten.sub.Tensor, aten.sub.Scalar)
def _sub(b, a):
    x, y, alpha = b.ref(a["self"]), b.ref(a["other"]), a.get("alpha", 1)
    return b.alu("subtract", x, y) if alpha == 1 else b.stt(y, "multiply", -alpha, "add", x)


@_handles(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(b, a):
    x, y, alpha = b.ref(a["other"]), b.ref(a["self"]), a.get("alpha", 1)
    return b.alu("subtract", x, y) if alpha == 1 else b.stt(y, "multiply", -alpha, "add", x)


@_handles(aten.mul.Tensor, aten.mul.Scalar)
def _mul(b, a):
    return b.alu("multiply", b.ref(a["self"]), b.ref(a["other"]))


@_handles(aten.div.Tensor, aten.div.Scalar)
def _div(b, a):
    return b.div(b.ref(a["self"]), b.ref(a["other"]))


@_handles(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(b, a):
    x, y, mode = b.ref(a["self"]), b.ref(a["other"]), a["rounding_mode"]
    if mode is None:
        return b.div(x, y)
    return b.cast(b.integral(b.exact_div(x, y), mode), b.node_dtype)


@_handles(aten.fmod.Tensor, aten.fmod.Scalar, aten.remainder.Tensor, aten.remainder.Scalar)
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
    HANDLERS[_op.default] = _unary(_func)


@_handles(aten.relu.default)
def _relu(b, a):
    return b.ts(b.ref(a["self"]), "maximum", 0.0)


@_handles(aten.silu.default)
def _silu(b, a):
    return b.act("silu", b.ref(a["self"]))


@_handles(aten.gelu.default)
def _gelu(b, a):
    return b.act("gelu" if a["approximate"] == "none" else "gelu_apprx_tanh", b.ref(a["self"]))


@_handles(aten.neg.default)
def _neg(b, a):
    return b.ts(b.ref(a["self"]), "multiply", -1.0)


@_handles(aten.reciprocal.default)
def _reciprocal(b, a):
    return b.recip(b.ref(a["self"]))


@_handles(aten.exp2.default)
def _exp2(b, a):
    return b.act("exp", b.ref(a["self"]), scale=math.log(2.0))


@_handles(aten.expm1.default)
def _expm1(b, a):
    return b.expm1(b.ref(a["self"]))


@_handles(aten.elu.default)
def _elu(b, a):
    # scale * max(x, 0) + alpha * scale * expm1(min(x, 0) * input_scale): the exponential only
    # sees x <= 0, so no branch overflows (selu and elu arrive here; celu decomposes to expm1).
    x = b.ref(a["self"])
    alpha, scale, input_scale = float(a["alpha"]), float(a["scale"]), float(a["input_scale"])
    negative = b.ts(x, "minimum", 0.0, dtype="float32")
    decay = b.expm1(negative, input_scale, "float32")
    positive = b.ts(x, "maximum", 0.0, "multiply", scale, dtype="float32")
    return b.stt(decay, "multiply", alpha * scale, "add", positive)


@_handles(aten.log1p.default)
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


@_handles(aten.log2.default)
def _log2(b, a):
    return b.ts(b.act("log", b.ref(a["self"]), dtype="float32"), "multiply", 1.0 / math.log(2.0))


@_handles(aten.log10.default)
def _log10(b, a):
    return b.ts(b.act("log", b.ref(a["self"]), dtype="float32"), "multiply", 1.0 / math.log(10.0))


@_handles(aten.sin.default)
def _sin(b, a):
    return b.sin(b.ref(a["self"]))


@_handles(aten.cos.default)
def _cos(b, a):
    return b.sin(b.ref(a["self"]), cosine=True)


@_handles(aten.cosh.default)
def _cosh(b, a):
    return b.cosh(b.ref(a["self"]))


@_handles(aten.sinh.default)
def _sinh(b, a):
    # sinh(x) = tanh(x) * cosh(x): accurate near 0 (no e**x - e**-x cancellation), finite up to 89.4
    x = b.ref(a["self"])
    return b.alu("multiply", b.act("tanh", x, dtype="float32"), b.cosh(x))


@_handles(aten.erfc.default)
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


@_handles(aten.special_erfcx.default)
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


@_handles(aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default)
def _integral(b, a):
    x = b.ref(a["self"])
    if b.dtype_of(x) == "int32" or b.node_dtype == "int32":
        return x  # integers are integral already
    return b.integral(x, a["__op__"].__name__.split(".")[-1])


@_handles(aten.round.decimals)
def _round_decimals(b, a):
    # eager: nearbyint(x * 10**d) / 10**d in fp32 (bf16 too); the division is reciprocal + multiply
    # (one extra rounding)
    ten_pow = float(torch.tensor(10.0 ** a["decimals"], dtype=torch.float32))
    scaled = b.ts(b.ref(a["self"]), "multiply", ten_pow, dtype="float32")
    return b.div(b.integral(scaled, "round"), ten_pow)


@_handles(aten.pow.Tensor_Scalar)
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


@_handles(aten.pow.Tensor_Tensor)
def _pow_tensor(b, a):
    return b.alu("power", b.ref(a["self"]), b.ref(a["exponent"]))


@_handles(aten.pow.Scalar)
def _pow_base(b, a):
    base, x = a["self"], b.ref(a["exponent"])
    return b.act("exp", x, scale=math.log(base))


@_handles(aten.maximum.default, aten.minimum.default)
def _max_min(b, a):
    op = "maximum" if a["__op__"] is aten.maximum else "minimum"
    return b.alu(op, b.ref(a["self"]), b.ref(a["other"]))


@_handles(aten.clamp.default, aten.clamp.Tensor, aten.hardtanh.default, aten.clamp_min.default,
          aten.clamp_max.default)
def _clamp(b, a):
    x = b.ref(a["self"])
    low = a.get("min", a.get("min_val"))
    high = a.get("max", a.get("max_val"))
    low, high = (None if v is None else b.ref(v) for v in (low, high))
    if low is not None and high is not None and _is_imm(low) and _is_imm(high):
        return b.ts(x, "maximum", low, "minimum", high)
    if low is not None:
        x = b.alu("maximum", x, low)
    if high is not None:
        x = b.alu("minimum", x, high)
    return x


@_handles(aten.leaky_relu.default)
def _leaky_relu(b, a):
    x, slope = b.ref(a["self"]), a["negative_slope"]
    return b.stt(x, "multiply", slope, "maximum" if slope <= 1 else "minimum", x)


@_handles(aten.where.self)
def _where(b, a):
    return b.select(b.ref(a["condition"]), b.ref(a["self"]), b.ref(a["other"]))


@_handles(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(b, a):
    return b.select(b.ref(a["mask"]), b.ref(a["value"]), b.ref(a["self"]))


_COMPARE = {aten.eq: "equal", aten.ne: "not_equal", aten.lt: "less", aten.le: "less_equal",
            aten.gt: "greater", aten.ge: "greater_equal"}
for _packet in _COMPARE:
    HANDLERS[_packet.Tensor] = HANDLERS[_packet.Scalar] = (
        lambda b, a: b.alu(_COMPARE[a["__op__"]], b.ref(a["self"]), b.ref(a["other"])))

_LOGICAL = {aten.logical_and: "logical_and", aten.logical_or: "logical_or", aten.logical_xor: "logical_xor",
            aten.bitwise_and: "logical_and", aten.bitwise_or: "logical_or", aten.bitwise_xor: "logical_xor"}
for _packet in _LOGICAL:
    for _overload in ("default", "Tensor"):
        if hasattr(_packet, _overload):
            HANDLERS[getattr(_packet, _overload)] = (
                lambda b, a: b.alu(_LOGICAL[a["__op__"]], b.ref(a["self"]), b.ref(a["other"])))


@_handles(aten.logical_not.default, aten.bitwise_not.default)
def _logical_not(b, a):
    return b.ts(b.ref(a["self"]), "equal", 0.0)


@_handles(aten.isnan.default)
def _isnan(b, a):
    x = b.ref(a["self"])
    return b.alu("not_equal", x, x)


@_handles(aten.isinf.default)
def _isinf(b, a):
    return b.ts(b.act("abs", b.ref(a["self"]), dtype="float32"), "equal", math.inf)


@_handles(aten._to_copy.default, aten.clone.default)
def _copy(b, a):
    x = b.ref(a["self"])
    if b.node_dtype == "int32" and b.dtype_of(x) not in ("int32", "uint8", "int8", "int16"):
        x = b.integral(x, "trunc")  # float -> int truncates toward zero
    if a["__out_dtype__"] == torch.bool:
        return b.ts(x, "not_equal", 0.0)
    return x  # value unchanged: a store rounds it to the output dtype


@_handles(aten.full.default, aten.full_like.default, aten.scalar_tensor.default)
def _full(b, a):
    value = a["fill_value"] if "fill_value" in a else a["s"]
    return float(value) if b.node_dtype == "float32" else int(value)


@_handles(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(b, a):
    start, step = a.get("start", 0), a.get("step", 1)
    index = b.emit("iota", (), "int32")
    return b.ts(index, "multiply", step, "add", start)


# Memory formats a copy may ask for. Kernels write contiguous tensors and every reader (kernel,
# host view, fallback) goes through the strides the value really has (graph.py tracks them), so a
# copy into channels_last is the same values in another layout: a layout no-op for our kernels.
_STRIDED_MEMORY_FORMATS = (None, torch.preserve_format, torch.contiguous_format, torch.channels_last,
                           torch.channels_last_3d)


def _argument_refusal(node: fx.Node, a: dict) -> str | None:
    """Why the kernels do not take these arguments of the op (None: they do)."""
    target = node.target
    if target in (aten._to_copy.default, aten.clone.default):
        if a.get("layout") not in (None, torch.strided):
            return f"layout {a['layout']} (only strided tensors live in HBM)"
        if a.get("memory_format") not in _STRIDED_MEMORY_FORMATS:
            return f"memory_format {a['memory_format']}"
        return None
    if target in (aten.arange.start_step, aten.arange.start, aten.arange.default):
        if not all(isinstance(a.get(k, 0), (int, float)) for k in ("start", "end", "step")):
            return "start / end / step known only at run time"
        return None
    if target in (aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor,
                  aten.bitwise_not.default):
        return None if node.meta["val"].dtype == torch.bool else "bitwise ops on integers (only on bool)"
    if target is aten.pow.Scalar:
        return None if isinstance(a["self"], (int, float)) and a["self"] > 0 else "a base that is not a positive number"
    if target is aten.pow.Tensor_Scalar:
        return None if isinstance(a["exponent"], (int, float)) else "an exponent that is not a real number"
    if target is aten.round.decimals:
        # negative decimals divide before rounding: reciprocal + multiply could move ties
        if not node.meta["val"].dtype.is_floating_point or a["decimals"] < 0:
            return "negative decimals or an integer input"
        return None
    if target is aten.elu.default:
        if not all(isinstance(a[k], (int, float)) for k in ("alpha", "scale", "input_scale")):
            return "alpha / scale / input_scale that are not real numbers"
    return None


def _node_args(node: fx.Node) -> dict:
    a = bind_arguments(node)
    a["__op__"] = node.target.overloadpacket
    a["__out_dtype__"] = node.meta["val"].dtype
    return a


# ---------------------------------------------------------------------------- public API

def refusal(node: fx.Node) -> str | None:
    """Why this family does not compute `node` (None: it does): not an elementwise op, a dtype with no
    on-chip type (float64, complex), or arguments the kernels do not take."""
    if node.op != "call_function" or node.target not in HANDLERS:
        return "not an elementwise op"
    values = [node.meta.get("val")] + [arg.meta.get("val") for arg in node.all_input_nodes]
    if not isinstance(values[0], torch.Tensor):
        return "its result is not a tensor"
    unsupported = sorted({str(v.dtype).removeprefix("torch.") for v in values
                          if isinstance(v, torch.Tensor) and v.dtype not in SUPPORTED_DTYPES})
    if unsupported:
        return f"dtype {', '.join(unsupported)} has no on-chip type"
    if any(isinstance(v, complex) for v in (*node.args, *node.kwargs.values())):
        return "a complex scalar argument"
    refused = _argument_refusal(node, bind_arguments(node))
    return None if refused is None else f"the pointwise kernels do not take {refused}"


def is_pointwise(node: fx.Node) -> bool:
    """True if `node` is an elementwise op this family computes (op supported for these args/dtypes)."""
    return refusal(node) is None


def build_program(nodes: list[fx.Node], outputs: list[fx.Node]) -> PointwiseProgram:
    """The group as an SSA program (see the module docstring)."""
    builder = ProgramBuilder()
    shape = tuple(int(s) for s in nodes[-1].meta["val"].shape) if nodes else ()
    for node in nodes:
        dtype = node.meta["val"].dtype
        builder.node_dtype = "float32" if dtype.is_floating_point or dtype == torch.bool else "int32"
        builder.env[node] = HANDLERS[node.target](builder, _node_args(node))
    results = [(out, builder.env[out]) for out in outputs]
    return PointwiseProgram(shape, builder.inputs, builder.instrs, results)


def lower_pointwise_group(nodes: list[fx.Node], outputs: list[fx.Node]) -> KernelSpec:
    """One kernel computing every node of `nodes`, returning the values of `outputs`."""
    program = build_program(nodes, outputs)
    numel = math.prod(program.shape)
    params = plan_kernel(program)
    flops = numel * sum(1 for i in program.instrs if i.kind != "cast")
    return KernelSpec("pointwise", params, [inp.value for inp in program.inputs], list(outputs), flops=flops)


# ---------------------------------------------------------------------------- resolution

_NL_DTYPE = {"float32": "nl.float32", "bfloat16": "nl.bfloat16", "float16": "nl.float16", "int32": "nl.int32",
             "int16": "nl.int16", "int8": "nl.int8", "uint8": "nl.uint8"}
# Bit ops take integer column operands as they are (tensor_scalar wants fp32 columns otherwise).
_BITVEC = {"bitwise_and", "bitwise_or", "bitwise_xor"}


@dataclass
class ResolvedProgram:
    """Instructions (plain dicts for `_pointwise_ops.py.j2`) and the tile each result is stored from.

    Each instruction dict has `op` (the nisa call: activation, tensor_scalar, tensor_tensor,
    scalar_tensor_tensor, reciprocal, tensor_copy, iota, memset), `dst` (an operand),
    `alloc` (dtype expression when dst is a fresh tile, else None), `col` (dst is [P, 1]) and the
    op's fields; operands are dicts {var, col, hoisted, bits} or {imm} (a Python number, written out
    by the templates' `literal` filter). `stores[i]` is the operand holding result i in its store
    dtype, for every result.
    """

    instrs: list[dict]
    stores: list[dict]
    tile_bytes: int  # bytes per free element of every [P, F] tile allocated per iteration


class _Resolver:
    def __init__(self, program: PointwiseProgram, kinds: dict[str, str], hoisted: set[str]):
        self.program = program
        self.col = {name: kind == "col" for name, kind in kinds.items()}
        self.dtype = {inp.name: (inp.column_dtype if kinds[inp.name] == "col" else inp.tile_dtype)
                      for inp in program.inputs}
        self.var = {name: name for name in kinds}
        self.alloc_dtype = dict(self.dtype)  # dtype a tile variable was allocated with
        self.hoisted = set(hoisted)
        self.out: list[dict] = []
        self.tiles: dict[str, str] = {}  # [P, F] tile vars allocated per iteration -> dtype
        self.temp = 0

    def operand(self, ref: Ref, bits: bool = False) -> dict:
        if _is_imm(ref):
            return {"imm": ref, "var": None, "col": True, "hoisted": False, "bits": False}
        var = self.var[ref]
        return {"imm": None, "var": var, "col": self.col[ref], "hoisted": var in self.hoisted,
                "bits": bits and self.alloc_dtype[var] != "int32"}

    def new_var(self, dtype: str, col: bool, reuse: str | None = None) -> tuple[str, str | None]:
        if reuse is not None:
            return reuse, None
        self.temp += 1
        var = f"v{self.temp}"
        self.alloc_dtype[var] = dtype
        if not col:
            self.tiles[var] = dtype
        return var, _NL_DTYPE[dtype]

    def define(self, ref: str, dtype: str, col: bool, reuse: str | None = None) -> tuple[dict, str | None]:
        var, alloc = self.new_var(dtype, col, reuse)
        self.var[ref], self.dtype[ref], self.col[ref] = var, dtype, col
        return {"imm": None, "var": var, "col": col, "hoisted": False, "bits": False}, alloc

    def emit(self, op: str, dst: dict, alloc: str | None, bits: bool = False, **fields) -> None:
        dst = dict(dst, bits=bits and alloc != "nl.int32" and self.alloc_dtype[dst["var"]] != "int32")
        self.out.append({"op": op, "dst": dst, "alloc": alloc, "col": dst["col"], **fields})

    def float_col(self, ref: Ref) -> Ref:
        """A column operand for tensor_scalar must be fp32."""
        if _is_imm(ref) or self.dtype[ref] == "float32":
            return ref
        name = f"{ref}_f32"
        if name not in self.var:
            dst, alloc = self.define(name, "float32", True)
            self.emit("tensor_copy", dst, alloc, src=self.operand(ref))
        return name


def resolve_program(program: PointwiseProgram, kinds: dict[str, str], hoisted: set[str],
                    store_dtypes: list[str]) -> ResolvedProgram:
    """Bind inputs to operand kinds ("tile" / "col") and pick each instruction's nisa form.

    `hoisted` names input tiles loaded outside the iteration (never overwritten in place);
    `store_dtypes[i]` is the on-chip dtype result i must have for its store.
    """
    r = _Resolver(program, kinds, hoisted)
    instrs = program.instrs
    last_use: dict[str, int] = {}
    for i, instr in enumerate(instrs):
        for operand in instr.operands:
            if isinstance(operand, str):
                last_use[operand] = i
    result_refs = {ref for _, ref in program.results if isinstance(ref, str)}
    for ref in result_refs:
        last_use[ref] = max(last_use.get(ref, -1), len(instrs))
    # Results nothing else reads are computed straight into their store dtype.
    retarget: dict[str, str] = {}
    for (node, ref), dtype in zip(program.results, store_dtypes):
        producer = next((ins for ins in instrs if ins.out == ref), None)
        if producer is not None and not producer.bits and not any(ref in ins.operands for ins in instrs):
            retarget[ref] = dtype if retarget.get(ref, dtype) == dtype else producer.dtype

    def reusable(ref: Ref, i: int, dtype: str, col: bool) -> str | None:
        if _is_imm(ref) or last_use.get(ref) != i or ref in result_refs:
            return None
        var = r.var[ref]
        if var in r.hoisted or r.col[ref] != col or r.alloc_dtype[var] != dtype:
            return None
        return var

    for i, ins in enumerate(instrs):
        dtype = retarget.get(ins.out, ins.dtype)
        alloc_dtype = "float32" if ins.bits else dtype
        ops = ins.operands
        if ins.kind == "iota":
            dst, alloc = r.define(ins.out, dtype, False)
            r.emit("iota", dst, alloc)
            continue
        x = ops[0]
        col = r.col[x] and all(_is_imm(o) or o is None or r.col[o] for o in ops[1:])
        if ins.kind in ("tt", "stt"):
            other = ops[1] if ins.kind == "tt" else ops[2]
            if r.col[x] and not r.col[other]:
                if ins.kind == "tt":  # col op tile -> tensor_scalar on the tile, operand reversed
                    reuse = reusable(other, i, alloc_dtype, False)
                    dst, alloc = r.define(ins.out, alloc_dtype, False, reuse)
                    operand = x if ins.bits or ins.attr("op") in _BITVEC else r.float_col(x)
                    r.emit("tensor_scalar", dst, alloc, ins.bits, data=r.operand(other, ins.bits),
                           op0=ins.attr("op"), operand0=r.operand(operand, ins.bits),
                           rev0=True, op1=None, operand1=None, rev1=False)
                else:  # (col op0 a0) op1 tile -> a column temporary, then tensor_scalar
                    temp = f"{ins.out}_col"
                    tdst, talloc = r.define(temp, "float32", True)
                    r.emit("tensor_scalar", tdst, talloc, data=r.operand(x), op0=ins.attr("op0"),
                           operand0=r.operand(ops[1]), rev0=False, op1=None, operand1=None, rev1=False)
                    reuse = reusable(other, i, alloc_dtype, False)
                    dst, alloc = r.define(ins.out, alloc_dtype, False, reuse)
                    r.emit("tensor_scalar", dst, alloc, data=r.operand(other), op0=ins.attr("op1"),
                           operand0=r.operand(temp), rev0=True, op1=None, operand1=None, rev1=False)
                continue
            if not r.col[x] and r.col[other]:
                reuse = reusable(x, i, alloc_dtype, False)
                operand = other if ins.bits or (ins.kind == "tt" and ins.attr("op") in _BITVEC) else r.float_col(other)
                dst, alloc = r.define(ins.out, alloc_dtype, False, reuse)
                if ins.kind == "tt":
                    r.emit("tensor_scalar", dst, alloc, ins.bits, data=r.operand(x, ins.bits), op0=ins.attr("op"),
                           operand0=r.operand(operand, ins.bits), rev0=False, op1=None, operand1=None, rev1=False)
                else:
                    r.emit("tensor_scalar", dst, alloc, data=r.operand(x), op0=ins.attr("op0"),
                           operand0=r.operand(ops[1]), rev0=False, op1=ins.attr("op1"),
                           operand1=r.operand(operand), rev1=False)
                continue
        reuse = reusable(x, i, alloc_dtype, col)
        if reuse is None and ins.kind == "tt":
            reuse = reusable(ops[1], i, alloc_dtype, col)
        dst, alloc = r.define(ins.out, alloc_dtype, col, reuse)
        if ins.kind == "act":
            r.emit("activation", dst, alloc, func=ins.attr("func"), data=r.operand(x),
                   scale=r.operand(ops[1]), bias=None if ops[2] == 0 else r.operand(ops[2]))
        elif ins.kind == "ts":
            r.emit("tensor_scalar", dst, alloc, ins.bits, data=r.operand(x, ins.bits), op0=ins.attr("op0"),
                   operand0=r.operand(ops[1]), rev0=ins.attr("rev0"), op1=ins.attr("op1"),
                   operand1=None if ops[2] is None else r.operand(ops[2]), rev1=ins.attr("rev1"),
                   engine=ins.attr("engine"))
        elif ins.kind == "tt":
            r.emit("tensor_tensor", dst, alloc, ins.bits, data1=r.operand(x, ins.bits),
                   data2=r.operand(ops[1], ins.bits), op_name=ins.attr("op"))
        elif ins.kind == "stt":
            r.emit("scalar_tensor_tensor", dst, alloc, data=r.operand(x), op0=ins.attr("op0"),
                   operand0=r.operand(ops[1]), op1=ins.attr("op1"), operand1=r.operand(ops[2]))
        elif ins.kind == "recip":
            r.emit("reciprocal", dst, alloc, data=r.operand(x))
        elif ins.kind == "cast":
            r.emit("tensor_copy", dst, alloc, src=r.operand(x))
        else:
            raise AssertionError(f"unknown pointwise instruction kind {ins.kind}")

    stores = []
    for (node, ref), dtype in zip(program.results, store_dtypes):
        if _is_imm(ref):
            dst, alloc = r.define(f"fill{len(stores)}", dtype, False)
            r.emit("memset", dst, alloc, value=int(ref) if dtype not in ("float32", "bfloat16", "float16")
                   else float(ref))
        elif r.col[ref]:  # a [P, 1] value stored as a [P, F] tile: broadcast along the free dim
            dst, alloc = r.define(f"bcast{len(stores)}", dtype, False)
            r.emit("memset", dst, alloc, value=0 if dtype not in ("float32", "bfloat16", "float16") else 0.0)
            r.emit("tensor_scalar", dst, None, data=dict(dst), op0="add", operand0=r.operand(r.float_col(ref)),
                   rev0=False, op1=None, operand1=None, rev1=False)
        elif r.dtype[ref] != dtype:
            dst, alloc = r.define(f"store{len(stores)}", dtype, False)
            r.emit("tensor_copy", dst, alloc, src=r.operand(ref))
        else:
            dst = r.operand(ref)
        stores.append(dst)
    tile_bytes = sum(_ITEMSIZE[d] for d in r.tiles.values())
    tile_bytes += sum(_ITEMSIZE[r.dtype[name]] for name, kind in kinds.items() if kind == "tile")
    return ResolvedProgram(r.out, stores, tile_bytes)


_ITEMSIZE = {"float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "int16": 2, "int8": 1, "uint8": 1}


# ---------------------------------------------------------------------------- layout

def _broadcast_strides(inp: ProgramInput, shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Per group dim: the input's element stride (0 where it broadcasts) and its logical extent."""
    offset = len(shape) - len(inp.shape)
    strides, extents = [], []
    for d, size in enumerate(shape):
        i = d - offset
        if i < 0 or inp.shape[i] != size:
            strides.append(0)
            extents.append(1)
        else:
            strides.append(inp.stride[i] if size != 1 else 0)
            extents.append(size)
    return strides, extents


def coalesce(shape: tuple[int, ...], strides: list[list[int]], extents: list[list[int]]):
    """Merge adjacent dims every operand steps through uniformly (TensorIterator-style).

    Returns (sizes, strides, extents): the coalesced iteration shape and, per operand, its stride
    (0 = broadcast) and logical extent (its view shape) in every coalesced dim.
    """
    sizes: list[int] = []
    out_strides = [[] for _ in strides]
    out_extents = [[] for _ in strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        if sizes and all(s[-1] == st[d] * size for s, st in zip(out_strides, strides)):
            sizes[-1] *= size
            for k, st in enumerate(strides):
                out_strides[k][-1] = st[d]
                out_extents[k][-1] *= extents[k][d]
            continue
        sizes.append(size)
        for k, st in enumerate(strides):
            out_strides[k].append(st[d])
            out_extents[k].append(extents[k][d])
    return sizes, out_strides, out_extents


def _chunks(extent: int, limit: int) -> list[dict]:
    """Loop variants covering range(extent) in near-equal chunks of at most `limit`."""
    count = -(-extent // limit)
    size = -(-extent // count)
    full, rest = divmod(extent, size)
    variants = [{"count": full if full > 1 else None, "start_full": full > 1, "size": size, "base": 0}]
    if rest:
        variants.append({"count": None, "start_full": False, "size": rest, "base": full * size})
    return variants


def _level(var: str, start: str, extent: int, limit: int) -> dict:
    variants = []
    for v in _chunks(extent, limit):
        expr = f"{var} * {v['size']}" if v["start_full"] else str(v["base"])
        variants.append({"count": v["count"], "start": expr, "size": v["size"]})
    return {"var": var, "start": start, "variants": variants}


def _shape_literal(shape) -> str:
    shape = tuple(shape)
    return repr(shape)


def _view(name: str, logical: tuple[int, ...], view_shape: list[int]) -> str:
    return name if tuple(logical) == tuple(view_shape) else f"{name}.reshape({_shape_literal(view_shape)})"


def plan_kernel(program: PointwiseProgram) -> dict:
    """Template parameters: tiling regions, loads, resolved instructions and stores."""
    shape = program.shape
    broadcast = [_broadcast_strides(inp, shape) for inp in program.inputs]
    out_strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    sizes, strides, extents = coalesce(
        shape, [b[0] for b in broadcast] + [out_strides], [b[1] for b in broadcast] + [list(shape)])

    if len(sizes) >= 2:
        kinds = {}
        for inp, st in zip(program.inputs, strides):
            kinds[inp.name] = {(True, True): "tile", (True, False): "col", (False, True): "row",
                               (False, False): "scalar"}[(st[-2] != 0, st[-1] != 0)]
    else:
        kinds = {inp.name: "tile" if st and st[0] != 0 else "scalar" for inp, st in zip(program.inputs, strides)}
    operand_kinds = {name: "col" if kind in ("col", "scalar") else "tile" for name, kind in kinds.items()}
    hoisted = {name for name, kind in kinds.items() if kind in ("row", "scalar")}
    store_dtypes = [on_chip_name(node.meta["val"].dtype) for node, _ in program.results]
    resolved = resolve_program(program, operand_kinds, hoisted, store_dtypes)
    free_limit = max(FREE_TILE_MIN, min(FREE_TILE_MAX, SBUF_BYTES_PER_ITERATION // max(resolved.tile_bytes, 1)))

    inputs = [(f"in{k}", inp) for k, inp in enumerate(program.inputs)]
    outputs = [(f"out{k}", tuple(int(s) for s in node.meta["val"].shape))
               for k, (node, _) in enumerate(program.results)]
    if math.prod(shape) == 0:
        regions = []  # an empty result: nothing to compute
    elif len(sizes) >= 2:
        regions = [_grid_region(sizes, strides, extents, inputs, outputs, kinds, free_limit)]
    else:
        regions = _flat_regions(sizes[0] if sizes else 1, inputs, outputs, kinds, free_limit)
    for region in regions:
        region["instrs"] = resolved.instrs
        for store, src in zip(region["stores"], resolved.stores):
            store["src"] = src
    return {"regions": regions}


def _load(var: str, view: str, roles: list[str], inp: ProgramInput, kind: str) -> dict:
    dtype = _NL_DTYPE[inp.column_dtype if kind in ("col", "scalar") else inp.tile_dtype]
    return {"var": var, "view": view, "roles": roles, "dtype": dtype, "kind": kind}


def _grid_region(sizes, strides, extents, inputs, outputs, kinds, free_limit) -> dict:
    """[lead..., rows, cols]: rows on partitions in tiles of 128, cols on the free dim in large chunks."""
    n_lead = len(sizes) - 2
    levels = [{"var": f"l{i}", "start": None, "variants": [{"count": sizes[i], "start": f"l{i}", "size": 1}]}
              for i in range(n_lead)]
    levels.append(_level("c", "c0", sizes[-1], free_limit))
    levels.append(_level("r", "r0", sizes[-2], PMAX))
    roles_of_dims = [f"l{i}" for i in range(n_lead)] + ["row", "col"]
    views, loads = [], [[] for _ in range(len(levels) + 1)]
    for (name, inp), st, ext in zip(inputs, strides, extents):
        view = f"{name}_v" if tuple(inp.shape) != tuple(ext) else name
        if view != name:
            views.append({"var": view, "expr": _view(name, inp.shape, ext)})
        roles = [role if s != 0 else "one" for role, s in zip(roles_of_dims, st)]
        kind = kinds[inp.name]
        if kind in ("tile", "col"):
            depth = len(levels)
        elif kind == "row":
            depth = n_lead + 1
        else:
            depth = max((i + 1 for i in range(n_lead) if st[i] != 0), default=0)
        loads[depth].append(_load(inp.name, view, roles, inp, kind))
    stores = []
    for name, out_shape in outputs:
        view = f"{name}_v" if tuple(out_shape) != tuple(sizes) else name
        if view != name:
            views.append({"var": view, "expr": _view(name, out_shape, sizes)})
        stores.append({"view": view, "roles": roles_of_dims})
    return {"views": views, "levels": levels, "loads": loads, "stores": stores,
            "partitions": levels[-1]["variants"][0]["size"], "iota": None}


def _flat_regions(numel, inputs, outputs, kinds, free_limit) -> list[dict]:
    """A 1-D iteration: [128, numel // 128] plus a one-partition tail of numel % 128 elements."""
    per_partition, tail = divmod(numel, PMAX)
    parts = []
    if per_partition:
        parts.append((0, PMAX, per_partition))
    if tail:
        parts.append((PMAX * per_partition, 1, tail))
    regions = []
    for index, (start, rows, cols) in enumerate(parts):
        suffix = "" if len(parts) == 1 else ("_main", "_tail")[index]
        levels = [_level("c", "c0", cols, free_limit), _level("r", "r0", rows, PMAX)]
        views, loads = [], [[] for _ in range(len(levels) + 1)]

        def flat_view(name, logical, var):
            if rows * cols == numel:  # the whole tensor
                expr = name if tuple(logical) == (rows, cols) else f"{name}.reshape(({rows}, {cols}))"
            else:
                flat = name if len(logical) == 1 else f"{name}.reshape(({numel},))"
                expr = f"{flat}[{start}:{start + rows * cols}].reshape(({rows}, {cols}))"
            if expr == name:
                return name
            views.append({"var": var, "expr": expr})
            return var

        for name, inp in inputs:
            kind = kinds[inp.name]
            if kind == "tile":
                view = flat_view(name, inp.shape, f"{name}{suffix}_v")
                loads[len(levels)].append(_load(inp.name, view, ["row", "col"], inp, kind))
            else:
                view = f"{name}_s"
                if index == 0:
                    views.append({"var": view, "expr": f"{name}.reshape((1, {math.prod(inp.shape)}))"})
                loads[0].append(_load(inp.name, view, ["one", "one"], inp, kind))
        stores = [{"view": flat_view(name, shape, f"{name}{suffix}_v"), "roles": ["row", "col"]}
                  for name, shape in outputs]
        regions.append({"views": views, "levels": levels, "loads": loads, "stores": stores,
                        "partitions": rows, "iota": {"base": start, "channel_multiplier": cols if rows > 1 else 0}})
    return regions
