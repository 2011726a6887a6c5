"""Fusion through unit views (lowering/unit_views.py): pointwise groups and matmul epilogues read a
member through a view that only inserts or removes size-1 dims ([N, F] <-> [1, N, F]) instead of
materialising it, and everything else that views a member still ends the group (default-deny).
Every compiled case is compared with eager, fp32 and bf16, on and off the 128-row tile."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_inductor.lowering.unit_views import in_group_dims, same_up_to_units, unit_view_source
from neuron_inductor.observe import session
from neuron_inductor.testing import SwiGLU, TinyLlamaConfig

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

aten = torch.ops.aten
# bf16: a fused chain computes in fp32 and rounds once where eager rounds after every op.
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _kernels(first: int) -> list[list[dict]]:
    return [p.artifact.meta["kernels"] for p in session.BUCKETS[first:]]


def _compile_and_compare(fn, *args, dynamic=None):
    expected = fn(*args)
    first = len(session.BUCKETS)
    got = torch.compile(fn, backend="neuron", options={"fallback": "error"}, dynamic=dynamic)(*args)
    dtype = args[0].dtype
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    return _kernels(first)


# --- the rule -----------------------------------------------------------------------------------------


def _view_node(fn, shape):
    gm = torch.fx.symbolic_trace(lambda x: fn(x))
    x = torch.empty(shape)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = x
        elif node.op == "call_function":
            node.meta["val"] = fn(x)
            return node
    raise AssertionError("no call")


@pytest.mark.parametrize("fn, shape", [
    (lambda x: aten.view.default(x, [1, 6, 4]), (6, 4)),
    (lambda x: aten.unsqueeze.default(x, 1), (6, 4)),
    (lambda x: aten.squeeze.dim(x, 0), (1, 6, 4)),
    (lambda x: aten._unsafe_view.default(x, [6, 1, 4, 1]), (1, 6, 4)),
])
def test_unit_views_are_recognised(fn, shape):
    assert unit_view_source(_view_node(fn, shape)) is not None


@pytest.mark.parametrize("fn, shape", [
    (lambda x: aten.view.default(x, [24]), (6, 4)),          # merges two dims of size > 1
    (lambda x: aten.view.default(x, [4, 6]), (6, 4)),        # same numel, other element order
    (lambda x: aten.permute.default(x, [1, 0]), (6, 4)),
    (lambda x: aten.expand.default(x, [3, 6, 4]), (1, 6, 4)),
    (lambda x: aten.slice.Tensor(x, 0, 0, 3), (6, 4)),
    (lambda x: aten.view.dtype(x, torch.int32), (6, 4)),     # reinterprets the bits
])
def test_other_views_are_not_unit_views(fn, shape):
    assert unit_view_source(_view_node(fn, shape)) is None


def test_operands_restated_in_the_group_dims():
    # a [704] row read by a [1, 256, 704] node of a [256, 704] group: a row of the group
    assert in_group_dims((704,), (1,), (1, 256, 704), (256, 704)) == ((1, 704), (0, 1))
    # a [1, 256, 1] column of a [256, 1, 704]-shaped node, in a [256, 704] group
    assert in_group_dims((256, 1, 1), (1, 1, 1), (256, 1, 704), (256, 704)) == ((256, 1), (1, 0))
    # a node of the group's shape, or one that broadcasts against it, keeps its operands as they are
    assert in_group_dims((5, 3), (3, 1), (5, 3), (5, 3)) == ((5, 3), (3, 1))
    assert in_group_dims((), (), (), (300, 64)) == ((), ())
    assert same_up_to_units((1, 256, 704), (256, 1, 704)) and not same_up_to_units((256, 704), (704, 256))


# --- compiled: fused and equal to eager -----------------------------------------------------------------


@pytest.mark.parametrize("rows", [128, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_forward_is_two_matmuls_with_epilogues(dtype, rows):
    """silu(gate(x)) * up(x) with x [1, rows, d]: both linears give [rows, F] read as [1, rows, F]; the
    silu is the gate matmul's epilogue and the product the up matmul's, no pointwise kernel left."""
    cfg = TinyLlamaConfig(dim=64, ffn_dim=96)
    torch.manual_seed(0)
    mlp = SwiGLU(cfg).to(dtype)
    x = torch.randn(1, rows, 64, dtype=dtype)
    with torch.no_grad():
        kernels = _compile_and_compare(mlp, x)
    families = [k["family"] for k in kernels[0]]
    assert families == ["matmul", "matmul", "matmul"], families
    fused_ops = [op for k in kernels[0] for op in k["ops"]]
    assert "aten.silu.default" in fused_ops and "aten.mul.Tensor" in fused_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_forward_and_backward_match_eager(dtype):
    cfg = TinyLlamaConfig(dim=64, ffn_dim=96)
    torch.manual_seed(0)
    mlp = SwiGLU(cfg).to(dtype)
    x = torch.randn(1, 130, 64, dtype=dtype, requires_grad=True)
    mlp(x).float().square().mean().backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    first = len(session.BUCKETS)
    torch.compile(mlp, backend="neuron", options={"fallback": "error"})(x).float().square().mean().backward()
    for got, want in zip([x.grad] + [p.grad for p in mlp.parameters()], expected):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    forward, backward = ([k["family"] for k in program] for program in _kernels(first))
    assert forward.count("pointwise") <= 1, forward  # at most the loss's square
    # the gradient of silu(g) * u reads both matmul results through their [1, rows, F] views
    assert backward.count("pointwise") <= 3, backward


@pytest.mark.parametrize("rows", [128, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chain_across_unit_views_is_one_kernel(dtype, rows):
    def f(x, y, w):
        a = torch.sigmoid(x) * w                     # [rows, 48]
        b = a.unsqueeze(0) + y                       # [1, rows, 48]
        c = torch.tanh(b).view(rows, 1, 48) * 2.0    # [rows, 1, 48]
        return c.squeeze(1) - x                      # [rows, 48]
    x, y, w = (torch.randn(s, dtype=dtype) for s in [(rows, 48), (1, rows, 48), (48,)])
    kernels = _compile_and_compare(f, x, y, w)
    assert [k["family"] for k in kernels[0]] == ["pointwise"], kernels


def test_a_view_that_is_not_a_unit_view_still_ends_the_group():
    def f(x):
        a = torch.exp(x)                             # [6, 40]
        return a.view(240) * 3.0 + a.reshape(240)    # merges dims of size > 1: a materialised copy of a
    kernels = _compile_and_compare(f, torch.randn(6, 40))
    assert len([k for k in kernels[0] if k["family"] == "pointwise"]) == 2, kernels


def test_padded_bucket_matches_eager():
    """A dynamic row count (130, bucketed to 256): the padded rows never reach the real ones."""
    def f(x, y, w):
        return (torch.sigmoid(x @ w).unsqueeze(0) * y).squeeze(0).sum(-1)
    x, y, w = torch.randn(130, 32), torch.randn(1, 130, 48), torch.randn(32, 48)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 1)
    _compile_and_compare(f, x, y, w)


_UNIT_VIEWS = [lambda t: t.unsqueeze(0), lambda t: t.unsqueeze(-2), lambda t: t.squeeze(0) if t.shape[0] == 1 else t,
               lambda t: t.view(*t.shape, 1), lambda t: t.reshape(1, *t.shape).squeeze(0) if t.dim() else t]
_OPS = [torch.sigmoid, lambda t: t * 1.5, lambda t: t + 0.25, torch.tanh, F.silu, torch.neg]


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, len(_OPS) - 1), st.integers(0, len(_UNIT_VIEWS) - 1)),
                      min_size=1, max_size=5),
       rows=st.sampled_from([3, 128, 130]), bf16=st.booleans())
def test_random_chains_through_unit_views_match_eager(steps, rows, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32

    def f(x, y):
        t = x
        for op, view in steps:
            t = _UNIT_VIEWS[view](_OPS[op](t))
        return t * y.reshape(t.shape)
    x, y = torch.randn(rows, 20, dtype=dtype), torch.randn(rows * 20, dtype=dtype)
    torch._dynamo.reset()
    kernels = _compile_and_compare(f, x, y)
    assert [k["family"] for k in kernels[0]] == ["pointwise"], kernels
