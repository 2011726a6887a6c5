"""The math operators: one NkiOp per `nl` function, which is also the `op=` token of `nisa` calls.

NKI passes operators as the `nl` functions themselves (`nisa.tensor_tensor(..., op=nl.add)`,
`nisa.activation(op=nl.exp, ...)`), and the same names are callable tile functions
(`nl.add(x, y)`). An NkiOp carries the fp32 torch semantics, its kind, whether ScalarE
implements it as an activation function, and its reduction (for `tensor_reduce`);
`language.py` installs the tile-level call.

Kinds: "arith" and "compare" binary ALU ops (compare yields 1.0 / 0.0), "logical",
"bitvec" (integer-only), "unary" math, and "reduce" (nl.sum, nl.max, ...).
Activation formulas follow the textbook definitions; the hardware's piece-wise
polynomial approximations are not modelled, their valid input ranges are (rules.py:
outside them the output is NaN, or an error in strict mode).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class NkiOp:
    __slots__ = ("name", "kind", "fn", "int_fn", "activation", "reduce", "unsupported", "min_nc_version", "call")

    def __init__(self, name, kind, fn=None, int_fn=None, activation=False, reduce=None, unsupported=None,
                 min_nc_version=2):
        self.name = name
        self.kind = kind
        self.fn = fn                # fp32 semantics
        self.int_fn = int_fn        # exact int64 semantics (None: integers go through fp32)
        self.activation = activation  # a ScalarE activation function
        self.reduce = reduce        # (values [P, F] fp32, dim) -> [P] for tensor_reduce
        self.unsupported = unsupported  # why the hardware rejects it, if it does
        self.min_nc_version = min_nc_version  # the first NeuronCore version that has it
        self.call = None            # the nl-level tile function, set by language.py

    def __call__(self, *args, **kwargs):
        return self.call(self, *args, **kwargs)

    def __repr__(self):
        return f"nl.{self.name}"


def _sum(x, dim):
    return x.sum(dim)


def _prod(x, dim):
    return x.prod(dim)


def _amax(x, dim):
    return x.amax(dim)


def _amin(x, dim):
    return x.amin(dim)


def _all(x, dim):
    return (x != 0).all(dim).float()


def _any(x, dim):
    return (x != 0).any(dim).float()


def _compare(fn):
    """1.0 / 0.0 in fp32, written by the comparison itself (out=): several times faster than a bool
    tensor and then .float(), which is two full passes, the first poorly vectorized."""
    def compare(a, b):
        return fn(a, b, out=torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.float32))
    return compare


def _logical(fn):
    return lambda a, b: fn(a != 0, b != 0).float()


_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2 * math.pi)


# exp(x) is +0 in fp32 for every x below this (the largest such x is -103.972...)
EXP_ZERO_BELOW = -104.0


def _exp(x):
    """torch.exp, bit for bit, without most of the slow path the vectorised exp takes for inputs that
    underflow (a causal mask's -1e30 / -3e38 scores: ~17x slower per element; -inf: ~4x): every input
    at or below EXP_ZERO_BELOW becomes -inf first (exp is +0 there either way, NaN stays NaN). One
    pass and an in-place exp, where a mask, two fills and the exp took four."""
    if x.dtype is not torch.float32:
        return torch.exp(x)
    return torch.threshold(x, EXP_ZERO_BELOW, -math.inf).exp_()


def _gelu_dx(x):
    return 0.5 * (1 + torch.erf(x * _SQRT_HALF)) + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)


def _gelu_apprx_sigmoid_dx(x):
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1 - s)


def _silu_dx(x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _abs_max(x, y):
    """x where |x| > |y|, else y (ties return y: nl.abs_max docstring)."""
    return torch.where(x.abs() > y.abs(), x, y)


def _abs_min(x, y):
    return torch.where(x.abs() < y.abs(), x, y)


def _unary(name, fn, activation=True):
    return NkiOp(name, "unary", fn, activation=activation)


OPS = {op.name: op for op in [
    # Binary arithmetic (ALU).
    NkiOp("add", "arith", torch.add, torch.add, reduce=_sum),
    NkiOp("subtract", "arith", torch.sub, torch.sub),
    NkiOp("multiply", "arith", torch.mul, torch.mul, reduce=_prod),
    NkiOp("maximum", "arith", torch.maximum, torch.maximum, reduce=_amax),
    NkiOp("minimum", "arith", torch.minimum, torch.minimum, reduce=_amin),
    NkiOp("power", "arith", torch.pow),
    NkiOp("divide", "arith", torch.div, unsupported="the ALU has no divide; use reciprocal then multiply"),
    NkiOp("fmod", "arith", torch.fmod, unsupported="fmod runs only in the simulator, not on the hardware"),
    NkiOp("mod", "arith", torch.remainder, unsupported="mod runs only in the simulator, not on the hardware"),
    NkiOp("abs_max", "arith", _abs_max, _abs_max, min_nc_version=4),
    NkiOp("abs_min", "arith", _abs_min, _abs_min, min_nc_version=4),
    # Comparisons: 1.0 where true, 0.0 where false.
    NkiOp("equal", "compare", _compare(torch.eq), _compare(torch.eq)),
    NkiOp("not_equal", "compare", _compare(torch.ne), _compare(torch.ne)),
    NkiOp("greater", "compare", _compare(torch.gt), _compare(torch.gt)),
    NkiOp("greater_equal", "compare", _compare(torch.ge), _compare(torch.ge)),
    NkiOp("less", "compare", _compare(torch.lt), _compare(torch.lt)),
    NkiOp("less_equal", "compare", _compare(torch.le), _compare(torch.le)),
    NkiOp("logical_and", "logical", _logical(torch.logical_and), reduce=_all),
    NkiOp("logical_or", "logical", _logical(torch.logical_or), reduce=_any),
    NkiOp("logical_xor", "logical", _logical(torch.logical_xor)),
    # Bit-vector ops: integer dtypes only, exact.
    NkiOp("bitwise_and", "bitvec", int_fn=torch.bitwise_and),
    NkiOp("bitwise_or", "bitvec", int_fn=torch.bitwise_or),
    NkiOp("bitwise_xor", "bitvec", int_fn=torch.bitwise_xor),
    NkiOp("left_shift", "bitvec", int_fn=torch.bitwise_left_shift),
    NkiOp("right_shift", "bitvec", int_fn=torch.bitwise_right_shift),
    NkiOp("invert", "bitvec_unary", int_fn=torch.bitwise_not),
    NkiOp("logical_not", "unary", lambda x: (x == 0).float(), activation=False),
    # Unary math; activation=True marks ScalarE activation functions (§1 list).
    _unary("copy", lambda x: x),
    _unary("square", torch.square),
    _unary("sigmoid", torch.sigmoid),
    _unary("relu", torch.relu),
    _unary("prelu", torch.relu),  # slope relu_param for x < 0 (activate2); the other instructions pass none: 0
    _unary("gelu", lambda x: F.gelu(x)),
    _unary("gelu_dx", _gelu_dx),
    _unary("gelu_apprx_tanh", lambda x: F.gelu(x, approximate="tanh")),
    _unary("gelu_apprx_sigmoid", lambda x: x * torch.sigmoid(1.702 * x)),
    _unary("gelu_apprx_sigmoid_dx", _gelu_apprx_sigmoid_dx),
    _unary("silu", F.silu),
    _unary("silu_dx", _silu_dx),
    _unary("tanh", torch.tanh),
    _unary("softplus", F.softplus),
    _unary("mish", F.mish),
    _unary("erf", torch.erf),
    _unary("erf_dx", lambda x: (2.0 / math.sqrt(math.pi)) * torch.exp(-x * x)),
    _unary("exp", _exp),
    _unary("sign", torch.sign),
    _unary("abs", torch.abs),
    _unary("log", torch.log),
    _unary("sin", torch.sin),
    _unary("arctan", torch.atan),
    _unary("sqrt", torch.sqrt),
    _unary("rsqrt", torch.rsqrt),
    _unary("reciprocal", torch.reciprocal),
    _unary("negative", torch.neg, activation=False),
    _unary("cos", torch.cos, activation=False),
    _unary("tan", torch.tan, activation=False),
    _unary("ceil", torch.ceil, activation=False),
    _unary("floor", torch.floor, activation=False),
    _unary("trunc", torch.trunc, activation=False),
    # Reductions (nl.sum(x, axis) ...); also accepted as tensor_reduce ops.
    NkiOp("sum", "reduce", reduce=_sum),
    NkiOp("prod", "reduce", reduce=_prod),
    NkiOp("max", "reduce", reduce=_amax),
    NkiOp("min", "reduce", reduce=_amin),
    NkiOp("all", "reduce", reduce=_all),
    NkiOp("mean", "reduce"),
    NkiOp("var", "reduce"),
    # The "no operation" stage of activate2's tensor-scalar pipeline.
    NkiOp("bypass", "bypass", lambda x: x),
    # Declared by nki.language without a docstring or a semantics: present so kernels import, refused on use.
    NkiOp("average", "undocumented"),
]}

# ALU ops legal in tensor_tensor / tensor_scalar / scalar_tensor_tensor.
ALU_KINDS = frozenset({"arith", "compare", "logical", "bitvec"})
# The "Arithmetic Unary" ALU operators of tensor_scalar (nki.api.shared.rst, tbl-aluop).
ALU_UNARY = frozenset({"abs", "square", "relu", "rsqrt", "reciprocal"})
