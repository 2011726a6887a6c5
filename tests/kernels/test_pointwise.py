"""Pointwise family: fused elementwise kernels run in the NKI interpreter vs eager PyTorch.

Each case traces a function with make_fx (Neuron decompositions), lowers all its pointwise nodes
as one group, renders the kernel, runs it in the interpreter on the real inputs and compares
every graph output with eager. Tolerances: fp32 rtol 1e-5 / atol 1e-6 for exact ALU ops and
rtol 1e-4 / atol 1e-5 for composed transcendental ones. The kernel keeps fp32 intermediates and
rounds once on store, so low-precision results are compared with eager run on the same inputs
upcast to fp32 (then checked for dtype), atol = rtol = 2e-2: a few bf16 ulps (2**-8 relative).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import neuron_inductor.sim as sim
from neuron_inductor.lowering import pointwise
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.sim import rules
from neuron_inductor.tile_program.partitions import fold_leads

from .harness import CTX, aten_graph, as_tuple, call_kernel, compiled_forward_backward, load_kernel, widen_int64

FP32 = dict(rtol=1e-5, atol=1e-6)
FP32_COMPOSED = dict(rtol=1e-4, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)


def lower(fn, *args, ctx=CTX):
    """(kernel spec, graph) for the pointwise nodes of fn's ATen graph, tiled for `ctx`."""
    graph = aten_graph(fn, *args)
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert nodes and all(pointwise.is_pointwise(n) for n in nodes), [str(n.target) for n in nodes]
    result = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    outputs = list(result) if isinstance(result, (list, tuple)) else [result]
    return pointwise.lower_pointwise_group(ctx, nodes, outputs), graph


def run_kernel(fn, *args, ctx=CTX):
    """Run fn's fused kernel in the interpreter; returns (outputs, trace)."""
    spec, graph = lower(fn, *args, ctx=ctx)
    kernel = load_kernel(spec, ctx=ctx)
    values = dict(zip([n for n in graph.graph.nodes if n.op == "placeholder"], args))
    with sim.trace() as trace:
        result = call_kernel(kernel, spec, [values[n] for n in spec.inputs])
    return result, trace


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def check(fn, *args, ctx=CTX, **tolerance):
    results, trace = run_kernel(fn, *args, ctx=ctx)
    expected = as_tuple(fn(*args))
    low_precision = any(a.dtype in (torch.bfloat16, torch.float16) for a in args)
    reference = as_tuple(fn(*[a.float() if a.dtype == torch.bfloat16 else a for a in args])) if low_precision \
        else expected
    assert len(results) == len(expected)
    for got, want, ref in zip(results, expected, reference):
        got = widen_int64(got, want)
        assert got.dtype == want.dtype and got.shape == want.shape
        if low_precision and got.is_floating_point():
            got, ref = got.float(), ref.float()
        torch.testing.assert_close(got, ref.to(got.dtype), equal_nan=True, **tolerance)
    # The work ran as NKI instructions: DMA in and out plus the compute engines.
    engines = {i.engine for i in trace.instructions}
    assert "dma" in engines
    return trace


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype)


def positive(*shape, dtype=torch.float32):
    return (torch.rand(shape) * 4 + 0.05).to(dtype)


def angles(*shape, dtype=torch.float32):
    return ((torch.rand(shape) - 0.5) * 2000).to(dtype)


# name -> (function, input factory, fp32 tolerance)
UNARY = {
    "neg": (torch.neg, randn, FP32),
    "reciprocal": (torch.reciprocal, positive, FP32_COMPOSED),
    "abs": (torch.abs, randn, FP32),
    "sign": (torch.sign, randn, FP32),
    "exp": (torch.exp, randn, FP32_COMPOSED),
    "exp2": (torch.exp2, randn, FP32_COMPOSED),
    "expm1": (torch.expm1, lambda *s, **k: randn(*s, scale=1e-3, **k), FP32_COMPOSED),
    "log": (torch.log, positive, FP32_COMPOSED),
    "log1p": (torch.log1p, lambda *s, **k: randn(*s, scale=1e-4, **k), FP32_COMPOSED),
    "log2": (torch.log2, positive, FP32_COMPOSED),
    "sqrt": (torch.sqrt, positive, FP32_COMPOSED),
    "rsqrt": (torch.rsqrt, positive, FP32_COMPOSED),
    "pow2": (lambda x: x ** 2, randn, FP32),
    "pow3": (lambda x: x ** 3, randn, FP32_COMPOSED),
    "pow_half": (lambda x: x ** 0.5, positive, FP32_COMPOSED),
    "pow_minus1": (lambda x: x ** -1, positive, FP32_COMPOSED),
    "pow_1_7": (lambda x: x ** 1.7, positive, FP32_COMPOSED),
    "rpow": (lambda x: 2.0 ** x, randn, FP32_COMPOSED),
    "sigmoid": (torch.sigmoid, randn, FP32_COMPOSED),
    "tanh": (torch.tanh, randn, FP32_COMPOSED),
    "relu": (torch.relu, randn, FP32),
    "silu": (lambda x: F.silu(x), randn, FP32_COMPOSED),
    "gelu": (lambda x: F.gelu(x), randn, FP32_COMPOSED),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), randn, FP32_COMPOSED),
    "erf": (torch.erf, randn, FP32_COMPOSED),
    "erfc": (torch.erfc, lambda *s, **k: randn(*s, scale=2, **k), FP32_COMPOSED),
    "erfcx": (torch.special.erfcx, lambda *s, **k: randn(*s, scale=3, **k), FP32_COMPOSED),
    "cosh": (torch.cosh, lambda *s, **k: randn(*s, scale=5, **k), FP32_COMPOSED),
    "sinh": (torch.sinh, lambda *s, **k: randn(*s, scale=5, **k), FP32_COMPOSED),
    "elu": (lambda x: F.elu(x), randn, FP32_COMPOSED),
    "elu_alpha": (lambda x: F.elu(x, alpha=0.3), randn, FP32_COMPOSED),
    "selu": (lambda x: F.selu(x), randn, FP32_COMPOSED),
    "celu": (lambda x: F.celu(x, alpha=0.5), randn, FP32_COMPOSED),
    "sin": (torch.sin, angles, dict(rtol=1e-4, atol=1e-4)),
    "cos": (torch.cos, angles, dict(rtol=1e-4, atol=1e-4)),
    "floor": (torch.floor, lambda *s, **k: randn(*s, scale=50, **k), FP32),
    "ceil": (torch.ceil, lambda *s, **k: randn(*s, scale=50, **k), FP32),
    "round": (torch.round, lambda *s, **k: randn(*s, scale=50, **k), FP32),
    "round_decimals_0": (lambda x: torch.round(x, decimals=0), lambda *s, **k: randn(*s, scale=50, **k), FP32),
    "round_decimals_3": (lambda x: torch.round(x, decimals=3), lambda *s, **k: randn(*s, scale=50, **k), FP32),
    "trunc": (torch.trunc, lambda *s, **k: randn(*s, scale=50, **k), FP32),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), randn, FP32),
    "clamp_min": (lambda x: x.clamp(min=-0.5), randn, FP32),
    "clamp_max": (lambda x: x.clamp(max=0.5), randn, FP32),
    "hardtanh": (lambda x: F.hardtanh(x), randn, FP32),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.1), randn, FP32),
    "add_scalar": (lambda x: x + 2.5, randn, FP32),
    "rsub_scalar": (lambda x: 1 - x, randn, FP32),
    "mul_scalar": (lambda x: x * 3, randn, FP32),
    "div_scalar": (lambda x: x / 3, randn, FP32),
    "fmod_scalar": (lambda x: torch.fmod(x, 1.5), lambda *s, **k: randn(*s, scale=5, **k), FP32_COMPOSED),
    "remainder_scalar": (lambda x: torch.remainder(x, 1.5), lambda *s, **k: randn(*s, scale=5, **k),
                         FP32_COMPOSED),
    "masked_fill": (lambda x: x.masked_fill(x > 0, -math.inf), randn, FP32),
    "nan_to_num": (lambda x: torch.nan_to_num(torch.log(x)), randn, FP32_COMPOSED),
    "softplus": (lambda x: F.softplus(x), randn, FP32_COMPOSED),
    "mish": (lambda x: F.mish(x), randn, FP32_COMPOSED),
    "hardswish": (lambda x: F.hardswish(x), randn, FP32),
    "to_bf16": (lambda x: x.to(torch.bfloat16), randn, FP32),
    "to_int32": (lambda x: x.to(torch.int32), lambda *s, **k: randn(*s, scale=50, **k), FP32),
    "to_bool": (lambda x: torch.relu(x).to(torch.bool), randn, FP32),
    "clone": (torch.clone, randn, FP32),
}

BINARY = {
    "add": (torch.add, FP32),
    "add_alpha": (lambda x, y: torch.add(x, y, alpha=2), FP32),
    "sub": (torch.sub, FP32),
    "sub_alpha": (lambda x, y: torch.sub(x, y, alpha=0.5), FP32),
    "rsub_alpha": (lambda x, y: torch.rsub(x, y, alpha=2), FP32),
    "mul": (torch.mul, FP32),
    "div": (torch.div, FP32_COMPOSED),
    "div_floor": (lambda x, y: torch.div(x * 10, y, rounding_mode="floor"), FP32_COMPOSED),
    "div_trunc": (lambda x, y: torch.div(x * 10, y, rounding_mode="trunc"), FP32_COMPOSED),
    "remainder": (lambda x, y: torch.remainder(x * 10, y), dict(rtol=1e-4, atol=1e-4)),
    "pow": (lambda x, y: torch.pow(x.abs() + 0.1, y), FP32_COMPOSED),
    "maximum": (torch.maximum, FP32),
    "minimum": (torch.minimum, FP32),
    "where": (lambda x, y: torch.where(x > y, x, y), FP32),
    "clamp_tensor": (lambda x, y: x.clamp(min=y), FP32),
    "eq": (lambda x, y: torch.eq(x.round(), y.round()), FP32),
    "ne": (lambda x, y: x.round() != y.round(), FP32),
    "lt": (torch.lt, FP32),
    "le": (torch.le, FP32),
    "gt": (torch.gt, FP32),
    "ge": (torch.ge, FP32),
    "logical_and": (lambda x, y: torch.logical_and(x > 0, y > 0), FP32),
    "logical_or": (lambda x, y: torch.logical_or(x > 0, y > 0), FP32),
    "logical_xor": (lambda x, y: torch.logical_xor(x > 0, y > 0), FP32),
    "logical_not": (lambda x, y: torch.logical_not(x > y), FP32),
    "bitwise_bool": (lambda x, y: ((x > 0) & (y > 0)) | ~(x > y), FP32),
    "isnan": (lambda x, y: torch.isnan(torch.log(x) + y), FP32),
    "isinf": (lambda x, y: torch.isinf(x / (y > 0)), FP32),
    "mul_bool": (lambda x, y: x * (y > 0), FP32),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_fp32(name):
    fn, make, tolerance = UNARY[name]
    check(fn, make(3, 130, 70), **tolerance)


@pytest.mark.parametrize("name", ["exp", "silu", "gelu", "sigmoid", "rsqrt", "floor", "sin", "to_int32",
                                  "masked_fill", "add_scalar", "erfc", "cosh", "sinh", "elu", "selu",
                                  "round_decimals_3"])
def test_unary_bf16(name):
    fn, make, _ = UNARY[name]
    check(fn, make(257, 96, dtype=torch.bfloat16), **BF16)


EXTREMES = [0.0, -0.0, 1e-6, -1e-6, 1e-3, -0.7, 5.0, -5.0, 8.1, 9.0, -9.0, 9.5, 26.0, -30.0, 88.5, 89.0, 89.3,
            -89.3, 90.0, 100.0, 1e30, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("name", ["erfc", "erfcx", "cosh", "sinh", "elu", "selu"])
def test_special_functions_at_extremes(name):
    """Against float64 rounded to fp32, rtol 2e-5: erfc tails down to fp32's subnormals (and 0 past
    them), erfcx where exp(x * x) overflows, cosh / sinh up to their fp32 overflow at 89.4 (eager's
    vectorized CPU kernel already returns inf from 88.7), tiny sinh arguments (no cancellation),
    and +-inf / NaN where each function has them."""
    fn = UNARY[name][0]
    x = torch.tensor(EXTREMES)
    (out,), _ = run_kernel(fn, x)
    expected = fn(x.double()).float()
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=1e-40, equal_nan=True)


def test_round_decimals_halves_and_unsupported_negative_decimals():
    """Values whose x * 1000 lands on or next to k + 0.5 (the same fp32 product as eager's) round
    half to even as eager's nearbyint does; negative decimals (division before the rounding) are
    left to the host."""
    x = torch.cat([torch.arange(-2000, 2000) / 1000 + 0.0005, torch.tensor([1e30, math.inf, -math.inf, math.nan])])
    check(lambda t: torch.round(t, decimals=3), x, rtol=1e-6, atol=0.0)
    graph = aten_graph(lambda t: torch.round(t, decimals=-2), x)
    node = next(n for n in graph.graph.nodes if n.target is torch.ops.aten.round.decimals)
    assert not pointwise.is_pointwise(node)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_fp32(name):
    fn, tolerance = BINARY[name]
    check(fn, randn(2, 129, 33), randn(2, 129, 33) + 0.05, **tolerance)


@pytest.mark.parametrize("name", ["add", "mul", "div", "where", "maximum", "gt"])
def test_binary_bf16(name):
    fn, _ = BINARY[name]
    check(fn, randn(300, 40, dtype=torch.bfloat16), randn(300, 40, dtype=torch.bfloat16), **BF16)


# Broadcasting: [B, S, D] against [D], [B, S, 1], [1, S, D], [S, 1], a 0-d tensor, and a Python scalar.
@pytest.mark.parametrize("other_shape", [(64,), (2, 200, 1), (1, 200, 64), (200, 1), (), (1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broadcast(other_shape, dtype):
    x, other = randn(2, 200, 64, dtype=dtype), randn(*other_shape, dtype=dtype)
    check(lambda x, y: torch.sigmoid(x) * y - y, x, other, **(FP32_COMPOSED if dtype == torch.float32 else BF16))


# A row or scalar operand reaches every partition in one DMA from a stride-0 HBM view, not by copies
# between SBUF partitions: fewer rows than partitions, rows off the tile, a column-chunked free dim,
# a [1, 1, D] row, a 0-d scalar, fp32 and bf16.
@pytest.mark.parametrize("x_shape, other_shape", [((4, 256, 64), (64,)), ((5, 64), (64,)), ((2, 200, 64), (1, 1, 64)),
                                                  ((130, 9000), (9000,)), ((2, 200, 64), ())])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broadcast_operands_load_in_one_dma_from_hbm(x_shape, other_shape, dtype):
    x, other = randn(*x_shape, dtype=dtype), randn(*other_shape, dtype=dtype)
    trace = check(lambda x, y: x * y + y, x, other, **(FP32 if dtype == torch.float32 else BF16))
    copies = [i for i in trace.instructions if i.engine == "dma"]
    assert not [i.shapes for i in copies if all(o.buffer == "sbuf" for o in i.operands)]


@pytest.mark.parametrize("shape", [(), (1,), (5,), (128,), (300,), (128 * 70 + 3,), (1, 1), (7, 1),
                                   (1, 129), (128, 128), (3, 4, 5, 6), (2, 1, 3, 1, 200)])
def test_shapes(shape):
    check(lambda x, y: torch.tanh(x) + y * 2, randn(*shape), randn(*shape), **FP32_COMPOSED)


def test_large_free_dim_is_chunked():
    # 20000 columns exceed one free tile; a column operand forces a 2-D layout.
    check(lambda x, y: x * y + 1, randn(3, 20000), randn(3, 1), **FP32)


def test_strided_inputs():
    base = randn(64, 3, 130)
    permuted = base.permute(1, 2, 0)              # [3, 130, 64], non-contiguous
    expanded = randn(130, 1).expand(130, 64)      # stride-0 view with a real size
    sliced = randn(3, 260, 64)[:, ::2]            # step-2 view
    check(lambda a, b, c: a * b + c, permuted, expanded, sliced, **FP32)


def test_zero_d_constant_becomes_immediate():
    spec, _ = lower(lambda x: torch.where(x > 0, x, 0.5), randn(10, 10))  # a scalar_tensor node
    sources = []
    load_kernel(spec, sources.append)
    assert len(spec.inputs) == 1 and "0.5" not in sources[0]  # folded into the select's bit pattern
    check(lambda x: torch.where(x > 0, x, 0.5), randn(10, 10), **FP32)


def test_where_does_not_leak_inf_or_nan():
    x = torch.tensor([[1.0, -1.0, math.inf, -math.inf, math.nan, 0.0]] * 3)
    check(lambda x: torch.where(x > 0, torch.zeros_like(x), x), x, **FP32)
    check(lambda x: torch.where(torch.isfinite(x), x, -1.0), x, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_constants_are_written_as_float_calls(dtype):
    """+-inf / NaN immediates and fills render as float('inf') etc. (a bare `inf` is an undefined name)."""
    fn = lambda x: (x + math.inf, math.inf - x, x * math.nan, torch.full_like(x, -math.inf),  # noqa: E731
                    x.clamp(min=-math.inf, max=1.0))
    sources = []
    load_kernel(lower(fn, randn(130, 70, dtype=dtype))[0], sources.append)
    assert all(f"float('{v}')" in sources[0] for v in ("inf", "-inf", "nan"))
    check(fn, randn(130, 70, dtype=dtype), **(FP32 if dtype == torch.float32 else BF16))


def test_floor_and_round_exact_for_large_and_half_values():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 3.0e9, -3.0e9, 1.0e20, 8388609.0, -7.25, 2.0 ** 24 + 2]])
    for fn in (torch.floor, torch.ceil, torch.round, torch.trunc):
        check(fn, x, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_math(dtype):
    a = torch.randint(-1000, 1000, (50, 70), dtype=dtype)
    b = torch.randint(1, 50, (50, 70), dtype=dtype)
    check(lambda a, b: (a + b * 3 - 7, a // b, torch.remainder(a, b), a * b, torch.maximum(a, b), (a > b) & (b < 25)),
          a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("shape", [(), (300, 1)])
def test_integer_column_operands_stay_integers(dtype, shape):
    """0-d and [P, 1] integer inputs are int32 columns: where's bit select and exact integer math
    need integer operands (an fp32 column broke the bitvec dtype rule)."""
    a = torch.randint(-(2 ** 30), 2 ** 30, shape, dtype=dtype)
    a.view(-1)[0] = -1
    wide = torch.randint(-1000, 1000, (300, 64), dtype=dtype)
    check(lambda a: torch.where(a == -1, 0, a), a, rtol=0, atol=0)
    check(lambda a, w: torch.where(a > 0, a, w), a, wide, rtol=0, atol=0)


def test_creation_ops():
    check(lambda x: (torch.full_like(x, 3.5), torch.zeros_like(x, dtype=torch.int32), torch.ones_like(x) + x),
          randn(20, 30), **FP32)
    check(lambda x: torch.full((130, 7), -2.0) * x, randn(130, 7), **FP32)


@pytest.mark.parametrize("args", [(10,), (1, 300, 2), (0.5, 200.0, 0.25), (5, -700, -3), (128 * 40,)])
def test_arange(args):
    check(lambda x: torch.arange(*args, dtype=torch.float32) * x, torch.tensor(1.5), **FP32)
    if all(isinstance(a, int) for a in args):
        check(lambda x: torch.arange(*args, dtype=torch.int32) * 2 + x, torch.tensor(1, dtype=torch.int32),
              rtol=0, atol=0)


def test_arange_int64():
    check(lambda x: torch.arange(300) + x, torch.tensor(1), rtol=0, atol=0)


def test_multiple_outputs_and_dtypes():
    fn = lambda x, y: (x.float() * 2, (x > 0), (x.float() + y).to(torch.bfloat16))
    check(fn, randn(40, 50, dtype=torch.bfloat16), randn(40, 50), **BF16)


# Fused chains from real models.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(dtype):
    check(lambda a, b: F.silu(a) * b, randn(4, 100, 352, dtype=dtype), randn(4, 100, 352, dtype=dtype),
          **(FP32_COMPOSED if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_tail(dtype):
    x, mean, w = randn(2, 130, 64, dtype=dtype), positive(2, 130, 1), randn(64, dtype=dtype)
    check(lambda x, m, w: (x.float() * torch.rsqrt(m + 1e-6)).to(dtype) * w, x, mean, w,
          **(FP32_COMPOSED if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary(dtype):
    def rotary(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    x, cos, sin = randn(2, 4, 100, 64, dtype=dtype), randn(100, 64, dtype=dtype), randn(100, 64, dtype=dtype)
    # cat is not pointwise: lower the tail with the rotated half as an input.
    check(lambda x, r, c, s: x * c + r * s, x, torch.cat((-x[..., 32:], x[..., :32]), -1), cos, sin,
          **(FP32_COMPOSED if dtype == torch.float32 else BF16))
    assert rotary(x, cos, sin).shape == x.shape


def test_gelu_backward_chain():
    check(lambda g, x: torch.ops.aten.gelu_backward(g, x), randn(130, 200), randn(130, 200), **FP32_COMPOSED)


def test_silu_backward_chain_bf16():
    check(lambda g, x: torch.ops.aten.silu_backward(g, x), randn(64, 513, dtype=torch.bfloat16),
          randn(64, 513, dtype=torch.bfloat16), **BF16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_silu_backward_stays_whole_and_matches_eager(dtype, tmp_path):
    from neuron_inductor.decompositions import neuron_decompositions
    assert torch.ops.aten.silu_backward.default not in neuron_decompositions()
    x, grad = randn(130, 300, dtype=dtype), randn(130, 300, dtype=dtype)
    out, x_grad = compiled_forward_backward(lambda t: F.silu(t) * 3, x, grad, tmp_path)
    eager = x.detach().clone().requires_grad_()
    (F.silu(eager) * 3).backward(grad)
    tolerance = FP32_COMPOSED if dtype == torch.float32 else BF16
    torch.testing.assert_close(out.float(), (F.silu(x) * 3).float(), **tolerance)
    torch.testing.assert_close(x_grad.float(), eager.grad.float(), **tolerance)


def test_instruction_count_is_small():
    # [256, 512] contiguous coalesces to [128, 1024], one [128, 512] tile per LNC=2 program: two loads, one
    # instruction per op, one store (the + 1 on ScalarE beside the silu: VectorE has the product, engines.py).
    trace = check(lambda x, y: F.silu(x) * y + 1, randn(256, 512), randn(256, 512), **FP32_COMPOSED)
    for program in ((0,), (1,)):
        ops = [i.op for i in trace.instructions if i.program_id == program]
        assert ops == ["dma_copy", "dma_copy", "activation", "tensor_tensor", "activation", "dma_copy"]


def test_is_pointwise_rejects_unsupported():
    graph = make_fx(lambda x: (x.double() + 1, x.sum()), pre_dispatch=False)(randn(4))
    nodes = {str(n.target): n for n in graph.graph.nodes if n.op == "call_function"}
    assert not pointwise.is_pointwise(nodes["aten._to_copy.default"])  # float64
    assert not pointwise.is_pointwise(nodes["aten.sum.default"])


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 140), min_size=1, max_size=3),
       mask=st.lists(st.booleans(), min_size=3, max_size=3), drop=st.integers(0, 2))
def test_random_broadcasts(shape, mask, drop):
    other = [1 if m else s for s, m in zip(shape, mask)][drop:]
    check(lambda x, y: torch.exp(x) * y + x, randn(*shape), randn(*other), **FP32_COMPOSED)


def test_constant_operands_fold():
    check(lambda x: F.silu(torch.full_like(x, 2.0)) + x, randn(5, 7), **FP32_COMPOSED)


@pytest.mark.parametrize("shape", [(0, 7), (0, 0, 0), (2, 0, 5), (3, 4, 0)], ids=str)
def test_empty_tensor(shape):
    """No instruction for no element, at every rank (the row-layout choice prices rank-3 grids: roll's
    OpInfo sample is (0, 0, 0))."""
    (result,), trace = run_kernel(lambda x: x * 2 + 1, randn(*shape))
    assert result.shape == shape and result.dtype == torch.float32 and not trace.instructions


EDGE_VALUES = [0.0, -0.0, -1.0, -3.5, math.inf, -math.inf, math.nan, 2.0 ** -70, 2.0 ** -149, 1e-30, 3e38, 2.0 ** 70,
               1.0, 1.0 + 2.0 ** -20, 0.3, 7.0]


@pytest.mark.parametrize("fn", [torch.log, torch.sqrt, torch.rsqrt, torch.log2, torch.log10, torch.log1p,
                                lambda x: x ** 0.5, lambda x: x ** -0.5],
                         ids=["log", "sqrt", "rsqrt", "log2", "log10", "log1p", "pow_half", "pow_minus_half"])
def test_ranged_activations_match_eager_everywhere_in_strict_mode(fn, monkeypatch):
    """The ScalarE log / sqrt / rsqrt are valid on part of their domain only (strict mode raises outside it):
    the lowerings keep their inputs inside and match eager at 0, inf, negatives, NaN, denormals and
    beyond 2**+-64."""
    monkeypatch.setenv(rules.STRICT_ENV, "1")
    x = torch.tensor(EDGE_VALUES * 8, dtype=torch.float32).reshape(8, -1)
    check(fn, x, rtol=2e-6, atol=1e-6)


def test_sin_argument_reduction_stays_in_range_in_strict_mode(monkeypatch):
    monkeypatch.setenv(rules.STRICT_ENV, "1")
    x = torch.linspace(-100.0, 100.0, 4096).reshape(32, 128)
    check(torch.sin, x, **FP32_COMPOSED)
    check(torch.cos, x, **FP32_COMPOSED)


# Grids whose second-to-last coalesced dim is short (partitions.py): the last dim split onto the
# partitions, or a longer dim put there; S on and off 128, fp32 and bf16.
def _rows_of(fn, *args) -> int:
    """How many rows the kernel's row tiles walk (the extent on the partitions)."""
    spec, _ = lower(fn, *args)
    (region,) = spec.params["regions"]
    return sum((v["count"] or 1) * v["size"] for v in region["levels"][-1]["variants"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [128, 130])
def test_few_rows_times_a_broadcast_operand_fill_the_partitions(seq, dtype):
    # rotary's x * cos + r: [B, H, S, D] * [S, D] coalesces to [H, S*D], only H rows
    x, cos, r = randn(1, 3, seq, 64, dtype=dtype), randn(seq, 64, dtype=dtype), randn(1, 3, seq, 64, dtype=dtype)
    fn = lambda x, c, r: x * c + r  # noqa: E731
    assert _rows_of(fn, x, cos, r) == 128
    check(fn, x, cos, r, **(FP32 if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [128, 130])
def test_permuted_copy_walks_the_long_dim_on_partitions(seq, dtype):
    # attention's out.transpose(1, 2).reshape(...): [B, H, S, D] -> [B, S, H, D]
    # with a per-(b, s) scale: a "col" operand of the permuted layout
    x, scale = randn(2, 4, seq, 64, dtype=dtype).transpose(1, 2), randn(2, seq, 1, 1, dtype=dtype)
    assert _rows_of(lambda t, s: t.contiguous() * s, x, scale) == seq
    check(lambda t, s: t.contiguous() * s, x, scale, **(FP32 if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda x: x.transpose(1, 2), lambda x: x[:, :, :, None].expand(2, 4, 130, 3, 64),
                                  lambda x: x], ids=["permuted", "expanded", "contiguous"])
def test_a_lone_copy_moves_hbm_to_hbm(make, dtype):
    # clone / .contiguous() of a (permuted, expanded) view, nothing else in the group: a copy kernel,
    # no engine and no SBUF tile
    x = make(randn(2, 4, 130, 64, dtype=dtype))
    spec, _ = lower(lambda t: t.contiguous() if not t.is_contiguous() else t.clone(), x)
    assert spec.family == "copy"
    (result,), trace = run_kernel(lambda t: t.contiguous() if not t.is_contiguous() else t.clone(), x)
    assert result.is_contiguous() and torch.equal(result, x.contiguous())
    assert {i.engine for i in trace.instructions} == {"dma"}


def test_copies_that_cast_stay_pointwise():
    spec, _ = lower(lambda t: t.to(torch.bfloat16), randn(130, 64))
    assert spec.family == "pointwise"


def test_short_rows_keep_their_layout_when_no_other_pays():
    # [8, 91]: 91 = 7 * 13 splits only into narrow columns, and no longer dim exists
    x, y = randn(2, 4, 7, 13), randn(7, 13)
    assert _rows_of(lambda a, b: a * b, x, y) == 8
    check(lambda a, b: a * b, x, y, **FP32)


# VectorE / ScalarE balance (tile_program/engines.py): fp32 and bf16, tile and ragged shapes.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 512), (130, 77)], ids=str)
def test_silu_backward_is_one_activation_and_one_product(shape, dtype):
    g, x = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    trace = check(lambda g, x: torch.ops.aten.silu_backward(g, x), g, x,
                  **(FP32_COMPOSED if dtype == torch.float32 else BF16))
    counts = trace.counts()
    # silu_dx(x) on ScalarE, grad * silu_dx(x) on VectorE, per tile (decomposed: three VectorE products)
    assert counts[("scalar", "activation")] == counts[("vector", "tensor_tensor")]
    assert {engine for engine, _ in counts} == {"dma", "scalar", "vector"}
    assert ("vector", "tensor_scalar") not in counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_balance_keeps_results_with_columns_casts_and_numbers(dtype):
    # a [P, 1] scale (RMSNorm backward's rstd), an fp32 -> bf16 cast, subtract / reversed subtract
    a, b, rstd = randn(130, 300, dtype=dtype), randn(130, 300, dtype=dtype), randn(130, 1, dtype=dtype)
    fn = lambda a, b, r: ((a + b) * (b * r), (a * b - 2.5), 3.0 - a * b * b)  # noqa: E731
    trace = check(fn, a, b, rstd, **(FP32_COMPOSED if dtype == torch.float32 else BF16))
    assert ("scalar", "activation") in trace.counts()


def test_engine_balance_needs_a_column_bias_before_neuroncore_v3():
    from neuron_inductor.lowering.context import LoweringContext
    from neuron_inductor.tile_program import engines
    ins = {"op": "tensor_scalar", "dst": {"imm": None, "var": "v1", "col": False, "hoisted": False, "bits": False},
           "alloc": "nl.float32", "col": False, "data": {"imm": None, "var": "x0", "col": False, "hoisted": False,
                                                          "bits": False},
           "op0": "add", "operand0": {"imm": 1.0, "var": None, "col": True, "hoisted": False, "bits": False},
           "rev0": False, "op1": None, "operand1": None, "rev1": False}
    busy = [dict(ins, op="tensor_tensor")] * 2 + [ins]
    dtypes = {"v1": "float32", "x0": "float32"}
    assert not LoweringContext.for_target("trn1").tile.scalar_imm_bias
    assert engines.balance(busy, dtypes, imm_bias=False)[-1]["op"] == "tensor_scalar"
    moved = engines.balance(busy, dtypes, imm_bias=True)[-1]
    assert moved["op"] == "activation" and moved["bias"]["imm"] == 1.0 and moved["scale"]["imm"] == 1.0


def _free_size(fn, *args, ctx=CTX) -> int:
    """Elements per partition of the kernel's tiles (its column level's widest chunk)."""
    spec, _ = lower(fn, *args, ctx=ctx)
    (region,) = spec.params["regions"]
    column_level = next(level for level in region["levels"] if level["var"] == "c")
    return max(v["size"] for v in column_level["variants"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [256, 260, 384], ids=str)
def test_narrow_rows_of_a_long_dim_widen_onto_the_free_axis(seq, dtype):
    # rotary on q seen through a transpose: [B, S, H, D] -> [B, H, S, D] times cos [S, D] plus r; D = 64
    # columns only, so each tile takes k rows of S beside them ([S / k, k * D] tiles)
    q = randn(1, seq, 3, 64, dtype=dtype).transpose(1, 2)
    cos, r = randn(seq, 64, dtype=dtype), randn(1, 3, seq, 64, dtype=dtype)
    fn = lambda q, c, r: q * c + r  # noqa: E731
    assert _free_size(fn, q, cos, r) == 64 * (seq // 128)
    check(fn, q, cos, r, **(FP32 if dtype == torch.float32 else BF16))
    check(lambda q: -q, q, **FP32)


def test_broadcast_columns_keep_narrow_rows():
    # a [S, 1] operand broadcast along D would need its tile replicated along k: no widening
    q, scale = randn(1, 256, 3, 64).transpose(1, 2), randn(256, 1)
    assert _free_size(lambda q, s: q * s, q, scale) == 64
    check(lambda q, s: q * s, q, scale, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_permuted_grid_with_a_chosen_row_dim_widens_too(dtype):
    # [2, 4, 256, 64].transpose(1, 2): S (not the short H) on the partitions, then [S / 2, 2 * 64] tiles,
    # with H folded beside them (fold_leads; B stays a loop for the two LNC programs)
    x = randn(2, 4, 256, 64, dtype=dtype).transpose(1, 2)
    fn = lambda t: t.contiguous() * 2.0  # noqa: E731
    assert _rows_of(fn, x) == 128 and _free_size(fn, x) == 4 * 2 * 64
    check(fn, x, **(FP32 if dtype == torch.float32 else BF16))


# Lead dims taken onto the free axis (partitions.fold_leads): rotary's pieces on q seen through a transpose,
# [B, H, S, D], times a broadcast [S, D] operand; S on and off 128 (after widen_rows' [S / 2, 2] split),
# fp32 and bf16, two LNC programs (B stays the loop they share) and one (B folds too).
LNC1 = LoweringContext.for_target("trn2", lnc=1)


def _dmas(trace) -> int:
    return sum(i.engine == "dma" for i in trace.instructions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [256, 260], ids=str)
def test_lead_dims_fold_onto_the_free_axis(seq, dtype):
    q = randn(4, seq, 4, 16, dtype=dtype).transpose(1, 2)
    cos, r = randn(seq, 16, dtype=dtype), randn(4, 4, seq, 16, dtype=dtype)
    fn = lambda q, c, r: q * c + r  # noqa: E731
    tolerance = FP32 if dtype == torch.float32 else BF16
    row_tiles = -(-(seq // 2) // 128)
    spec, _ = lower(fn, q, cos, r)
    assert spec.grid == 2 and _free_size(fn, q, cos, r) == 4 * 2 * 16  # [S / 2, H * 2 * D] tiles
    assert _dmas(check(fn, q, cos, r, **tolerance)) == 4 * row_tiles * 4  # per b and row tile: 3 loads, 1 store
    assert _free_size(fn, q, cos, r, ctx=LNC1) == 4 * 4 * 2 * 16
    assert _dmas(check(fn, q, cos, r, ctx=LNC1, **tolerance)) == row_tiles * 4
    half = q[..., 8:]  # rotate_half's slice, negated
    assert _dmas(check(lambda h: -h, half, ctx=LNC1, **tolerance)) == row_tiles * 2


def test_a_scalar_operand_keeps_the_leads_it_steps_along():
    # s[b] would vary along the free axis of a tile with B folded: B stays a loop, H folds
    x, s, cos = randn(3, 256, 2, 16).transpose(1, 2), randn(3, 1, 1, 1), randn(256, 16)
    fn = lambda x, s, c: x * s + c  # noqa: E731
    check(fn, x, s, cos, ctx=LNC1, **FP32)
    spec, _ = lower(fn, x, s, cos, ctx=LNC1)
    (region,) = spec.params["regions"]
    assert [level["variants"][0]["count"] for level in region["levels"] if level["var"].startswith("l")] == [3]
    assert _free_size(fn, x, s, cos, ctx=LNC1) == 2 * 2 * 16


def test_fold_leads_stops_at_four_free_dims_wide_tiles_shared_loops_and_broadcast_columns():
    tile = [[2048, 1024, 512, 256, 2, 1]]
    # [2, 2, 2, 2 | 128 rows | 2 cols]: three leads and the columns make four free dims
    assert fold_leads([2, 2, 2, 2, 128, 2], tile, list(range(6)), None, ["tile"], 8192, 1) == [1, 2, 3]
    # with a whole k dim (widen_rows) beside the columns, two leads
    widened = [[4096, 2048, 1024, 512, 4, 2, 1]]
    assert fold_leads([2, 2, 2, 2, 64, 2, 2], widened, [0, 1, 2, 3, 4, 6], 5, ["tile"], 8192, 1) == [2, 3]
    # tiles stay within 512 columns (wider ones only lose the overlap of loads, compute and stores)
    assert fold_leads([4, 128, 256], [[32768, 256, 1]], [0, 1, 2], None, ["tile"], 8192, 1) == []
    assert fold_leads([2, 128, 256], [[32768, 256, 1]], [0, 1, 2], None, ["tile"], 8192, 1) == [0]
    # two LNC programs keep the innermost loop that still has two iterations
    assert fold_leads([4, 4, 128, 16], [[8192, 2048, 16, 1]], [0, 1, 2, 3], None, ["tile"], 8192, 2) == [1]
    assert fold_leads([3, 128, 16], [[2048, 16, 1]], [0, 1, 2], None, ["tile"], 8192, 2) == []
    # a row or column operand would need its tile repeated along the folded dims
    assert fold_leads([4, 128, 16], [[2048, 16, 1]] * 2, [0, 1, 2], None, ["tile", "col"], 8192, 1) == []
