"""passes/half_split.py: pointwise math around a `cat` of two last-dim halves (RoPE's rotate_half) runs per
half as one pointwise group plus one `cat`, forward and backward, bit-equal to the unsplit graph and
matching eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_inductor.decompositions import neuron_decompositions
from neuron_inductor.observe import session
from neuron_inductor.passes.half_split import split_concatenated_halves
from neuron_inductor.testing import apply_rotary, rotary_tables

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# bf16: the halves compute in fp32 and round once where eager rounds after every op (x * cos - x2 * sin
# cancels: an absolute bf16 ulp or two of the inputs)
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _rope(x, cos, sin):
    return apply_rotary(x.transpose(1, 2), cos, sin)  # [B, S, H, D] -> [B, H, S, D], as attention does


def _run(fn, x, *rest, dynamic_seq=False):
    """Compiled forward + backward of sum(fn(x, *rest)^2) against eager; -> kernel families per program."""
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf, *rest)
    out.float().square().sum().backward()
    expected = (out.detach(), leaf.grad)
    leaf = x.detach().clone().requires_grad_()
    if dynamic_seq:
        torch._dynamo.mark_dynamic(leaf, 1)
    first = len(session.BUCKETS)
    got = torch.compile(fn, backend="neuron", options={"fallback": "error"})(leaf, *rest)
    got.float().square().sum().backward()
    for actual, want in zip((got.detach(), leaf.grad), expected):
        torch.testing.assert_close(actual, want, **TOLERANCES[x.dtype])
    return [[k["family"] for k in p.artifact.meta["kernels"]] for p in session.BUCKETS[first:]]


def _tables(seq, dim, dtype):
    return tuple(t.to(dtype) for t in rotary_tables(seq, dim, 10000.0))


@pytest.mark.parametrize("seq", [128, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_is_one_pointwise_kernel_and_a_cat_each_way(dtype, seq):
    torch.manual_seed(0)
    x = torch.randn(1, seq, 4, 64, dtype=dtype)
    forward, backward = _run(_rope, x, *_tables(seq, 64, dtype))
    assert forward == ["pointwise", "copy"], forward
    assert backward.count("copy") == 1 and backward.count("pointwise") <= 2, backward


def test_padded_sequence_bucket_matches_eager():
    """130 positions bucketed to 256: the halves are split along the head dim, never the padded one."""
    torch.manual_seed(0)

    def f(x, cos, sin):
        return _rope(x, cos[: x.shape[1]], sin[: x.shape[1]])
    _run(f, torch.randn(1, 130, 2, 32), *_tables(256, 32, torch.float32), dynamic_seq=True)


def _split_graph(fn, *args):
    """fn's ATen graph before and after the pass, and how many regions it rewrote."""
    gm = make_fx(fn, decomposition_table=neuron_decompositions(), tracing_mode="fake")(*args)
    original = copy.deepcopy(gm)
    return original, gm, split_concatenated_halves(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_graph_is_bit_equal_to_the_original(dtype):
    torch.manual_seed(0)
    x, (cos, sin) = torch.randn(1, 130, 4, 64, dtype=dtype), _tables(130, 64, dtype)
    original, split, regions = _split_graph(_rope, x, cos, sin)
    assert regions == 1
    # one cat left: the result's two halves, joined for the graph's output (rotate_half's cat is gone)
    cats = [n for n in split.graph.nodes if n.target is torch.ops.aten.cat.default]
    output = next(n for n in split.graph.nodes if n.op == "output")
    assert len(cats) == 1 and cats[0] in output.all_input_nodes
    assert torch.equal(split(x, cos, sin), original(x, cos, sin))


@pytest.mark.parametrize("fn, shapes", [
    (lambda x, y: torch.cat([x.neg(), y], dim=-1) * 2.0, [(5, 24), (5, 40)]),    # unequal pieces
    (lambda x, y: torch.cat([x.neg(), y], dim=0) * 2.0, [(6, 16), (6, 16)]),     # along another dim
    (lambda x, y: torch.cat([x, y], dim=-1).sum(-1), [(6, 16), (6, 16)]),         # read by a reduction only
])
def test_other_cats_are_left_alone(fn, shapes):
    _, _, regions = _split_graph(fn, *(torch.randn(s) for s in shapes))
    assert regions == 0


_PIECE_OPS = [torch.neg, torch.sigmoid, lambda t: t * 0.5, lambda t: t]
_WHOLE_OPS = [lambda t, y: t * y, lambda t, y: t + y, lambda t, y: torch.tanh(t) - y, lambda t, y: t * 2.0]


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.sampled_from(range(len(_PIECE_OPS))), second=st.sampled_from(range(len(_PIECE_OPS))),
       swap=st.booleans(), chain=st.lists(st.sampled_from(range(len(_WHOLE_OPS))), min_size=1, max_size=3),
       rows=st.sampled_from([3, 128, 130]), bf16=st.booleans())
def test_random_regions_match_eager(first, second, swap, chain, rows, bf16):
    """cat of two functions of x's halves (in either order), then a chain of pointwise ops with a
    full-width operand: split per half, equal to eager."""
    dtype = torch.bfloat16 if bf16 else torch.float32

    def f(x, y):
        lo, hi = x.chunk(2, dim=-1)
        pieces = [_PIECE_OPS[first](hi), _PIECE_OPS[second](lo)]
        t = torch.cat(pieces[::-1] if swap else pieces, dim=-1)
        for op in chain:
            t = _WHOLE_OPS[op](t, y)
        return t
    torch._dynamo.reset()
    torch.manual_seed(0)
    forward, _ = _run(f, torch.randn(rows, 48, dtype=dtype), torch.randn(rows, 48, dtype=dtype))
    assert forward == ["pointwise", "copy"], forward
