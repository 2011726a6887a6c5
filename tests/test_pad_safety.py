"""Padding must be invisible: bucketed results equal unpadded eager, for every op class that could
let padded values reach real outputs, over random lengths (hypothesis).

Each case compiles a function whose length dim is dynamic (`mark_dynamic`), so the backend gets one
symbolic graph and runs every length padded to its bucket (default policy: next multiple of 128).
The graphs run with every op on the host (`host_only`): this tests the pad-safety rewrite and the
pad / slice runtime in isolation from the kernel families (tests/kernels cover those). Tolerance:
fp32, rtol 1e-5 (atol 1e-5 for sums of up to ~300 terms, whose order differs from eager's).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_inductor.observe import session
from neuron_inductor.passes.pad_safety import make_pad_safe
from tests.host_lowering import host_only  # noqa: F401  (fixture)
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

LENGTHS = st.lists(st.integers(min_value=3, max_value=300), min_size=2, max_size=3)
SETTINGS = settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _rand(*shape, generator, grad=False):
    return torch.randn(*shape, generator=generator).requires_grad_(grad)


def _run(fn, inputs):
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = ()
    differentiable = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if differentiable:
        total = sum((o.float() * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum()
                    for o in outputs if o.is_floating_point())
        grads = torch.autograd.grad(total, differentiable)
    return outputs, grads


class Case:
    """fn over inputs made by make(length, generator); `dynamic`: (input index, dim) of the length."""

    def __init__(self, fn, make, dynamic, mode="padded"):
        self.fn, self.make, self.dynamic, self.mode = fn, make, dynamic, mode


def _seq(batch=2, dim=3, grad=False):
    return lambda n, g: [_rand(batch, n, dim, generator=g, grad=grad)]


def _with_static(count):
    """A [2, n, 3] tensor with a dynamic length and `count` more static [2, 1, 3] inputs, one tensor."""
    return lambda n, g: [_rand(2, n, 3, generator=g, grad=True), _rand(2, count, 3, generator=g, grad=True)]


def _ids(n, g, vocab=11):
    return torch.randint(0, vocab, (2, n), generator=g)


def _cross_entropy(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _labels_with_ignored(n, g):
    labels = torch.randint(0, 7, (2, n), generator=g)
    labels[torch.rand(2, n, generator=g) < 0.3] = -100
    return labels


CASES = {
    "sum": Case(lambda x: x.sum(1), _seq(), [(0, 1)]),
    "sum_all": Case(lambda x: x.sum(), _seq(), [(0, 1)]),
    "mean": Case(lambda x: x.mean(1), _seq(), [(0, 1)]),
    "var": Case(lambda x: (x.var(1), x.std(1, correction=0)), _seq(), [(0, 1)]),
    "amax_amin": Case(lambda x: (x.amax(1), x.amin(1)), _seq(), [(0, 1)]),
    "argmax_argmin": Case(lambda x: (x.argmax(1), x.argmin(1)), _seq(), [(0, 1)]),
    "logsumexp": Case(lambda x: torch.logsumexp(x, 1), _seq(), [(0, 1)]),
    "softmax_fwd_bwd": Case(lambda x: (torch.softmax(x, 1), torch.log_softmax(x, 1)), _seq(grad=True), [(0, 1)]),
    "norm_over_length": Case(lambda x: (F.normalize(x, dim=1), torch.linalg.vector_norm(x, dim=1)),
                             _seq(grad=True), [(0, 1)]),
    "norm_negative_orders": Case(lambda x: tuple(torch.linalg.vector_norm(x, ord=p, dim=1) for p in (-2, -0.5, -math.inf)),
                                 _seq(), [(0, 1)]),
    "rms_norm_over_length": Case(lambda x: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6),
                                 _seq(grad=True), [(0, 1)]),
    "layer_norm_over_length_runs_unpadded": Case(
        lambda x: F.layer_norm(x.transpose(1, 2), x.shape[1:2]), _seq(), [(0, 1)], mode="exact"),
    "bmm_contraction": Case(lambda x, y: x.transpose(1, 2) @ y,
                            lambda n, g: [_rand(2, n, 3, generator=g, grad=True), _rand(2, n, 5, generator=g, grad=True)],
                            [(0, 1), (1, 1)]),
    "mm_contraction": Case(lambda x, y: x.t() @ y,
                           lambda n, g: [_rand(n, 3, generator=g, grad=True), _rand(n, 4, generator=g, grad=True)],
                           [(0, 0), (1, 0)]),
    "embedding_backward": Case(lambda ids, w: F.embedding(ids, w),
                               lambda n, g: [_ids(n, g), _rand(11, 4, generator=g, grad=True)], [(0, 1)]),
    "index_add": Case(lambda ids, src: torch.zeros(11, 4).index_add(0, ids, src),
                      lambda n, g: [torch.randint(0, 11, (n,), generator=g), _rand(n, 4, generator=g)],
                      [(0, 0), (1, 0)]),
    "scatter_add": Case(lambda ids, src: torch.zeros(2, 11).scatter_add(1, ids, src),
                        lambda n, g: [_ids(n, g), _rand(2, n, generator=g)], [(0, 1), (1, 1)]),
    "cumsum": Case(lambda x: (x.cumsum(1), torch.logcumsumexp(x, 1)), _seq(), [(0, 1)]),
    "pad_past_the_real_end": Case(lambda x: F.pad(x.transpose(1, 2), (1, 2), value=-3.0).cumsum(-1), _seq(),
                                  [(0, 1)]),
    "labels_shifted_by_padding": Case(  # Hugging Face's causal-LM loss shifts labels this way
        lambda logits, labels: F.cross_entropy(logits.reshape(-1, 7), F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1),
                                               ignore_index=-100),
        lambda n, g: [_rand(2, n, 7, generator=g, grad=True), _labels_with_ignored(n, g)], [(0, 1), (1, 1)]),
    "cumsum_from_the_end_runs_unpadded": Case(lambda x: x.flip(1).cumsum(1).flip(1), _seq(), [(0, 1)], mode="exact"),
    "cross_entropy_ignore_index": Case(_cross_entropy, lambda n, g: [_rand(2, n, 7, generator=g, grad=True),
                                                                     _labels_with_ignored(n, g)], [(0, 1), (1, 1)]),
    # F.mse_loss itself decomposes to a prims op the host wrapper cannot call yet; same math:
    "squared_error_mean": Case(lambda x, y: ((x - y) ** 2).mean(), lambda n, g: [_rand(2, n, generator=g, grad=True),
                                                                       _rand(2, n, generator=g)], [(0, 1), (1, 1)]),
    "last_token_select": Case(lambda x: x[:, -1] * 2, _seq(), [(0, 1)]),
    "slice_from_end": Case(lambda x: x[:, -2:] + 1, _seq(), [(0, 1)]),
    "narrow_at_real_end": Case(lambda x: x.narrow(1, x.shape[1] - 2, 2) * 3, _seq(), [(0, 1)]),
    "size_used_as_number": Case(lambda x: x * x.shape[1], _seq(), [(0, 1)]),
    # Ops that place data by position along a padded dim: rewritten to exact positions, or unpadded.
    "cat_padded_part_first": Case(lambda x, y: torch.cat([x, y], 1) * 2, _with_static(1), [(0, 1)]),
    "cat_padded_part_between": Case(lambda x, y: torch.cat([y, x, y * 3], 1).softmax(1), _with_static(2), [(0, 1)]),
    "cat_padded_part_last": Case(lambda x, y: torch.cat([y, x], 1).softmax(1), _with_static(1), [(0, 1)]),
    "cat_two_padded_parts": Case(lambda x: (torch.cat([x, x[:, 1:] * 2], 1).softmax(1), torch.cat([x, -x], 1)),
                                 _seq(grad=True), [(0, 1)]),
    "cat_along_an_unpadded_dim": Case(lambda x, z: torch.cat([x, z], 2).softmax(1),
                                      lambda n, g: [_rand(2, n, 3, generator=g, grad=True),
                                                    _rand(2, n, 4, generator=g, grad=True)], [(0, 1), (1, 1)]),
    "stack": Case(lambda x: (torch.stack([x, x * 2], 1).sum(2), torch.stack([x, -x], -1)), _seq(), [(0, 1)]),
    "kv_cache_append_then_attention": Case(
        lambda q, pk, pv, k, v: F.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2)),
        lambda n, g: [_rand(1, 2, 1, 8, generator=g), _rand(1, 2, n, 8, generator=g), _rand(1, 2, n, 8, generator=g),
                      _rand(1, 2, 1, 8, generator=g), _rand(1, 2, 1, 8, generator=g)], [(1, 2), (2, 2)]),
    "split_and_unbind_along_unpadded_dims": Case(lambda x: sum(p.sum(2) for p in x.split([1, 2], 2)) * x.unbind(2)[1],
                                                 _seq(grad=True), [(0, 1)]),
    "chunk_along_the_padded_dim_runs_unpadded": Case(lambda x: x.chunk(2, 1)[1] * 2, _seq(), [(0, 1)], mode="exact"),
    "slice_backward_writes_the_base": Case(lambda x: ((x[:, :-1] * 3).softmax(1), x[:, 1:] * 2), _seq(grad=True),
                                           [(0, 1)]),
    "negative_indices_count_from_the_real_end": Case(
        lambda x, idx: x[:, idx] * 2, lambda n, g: [_rand(2, n, 3, generator=g), torch.tensor([-1, 0, -2])], [(0, 1)]),
    "index_put_accumulate_along_the_padded_dim": Case(
        lambda x, idx, v: x.index_put((idx,), v, accumulate=True),
        lambda n, g: [_rand(n, 3, generator=g), torch.tensor([0, -1, 0]), _rand(3, 3, generator=g)], [(0, 0)]),
    "repeat_of_an_unpadded_dim": Case(lambda x: x.repeat(2, 1, 3), _seq(), [(0, 1)]),
    "roll_runs_unpadded": Case(lambda x: x.roll(1, 1), _seq(), [(0, 1)], mode="exact"),
    "flip_runs_unpadded": Case(lambda x: x.flip(1) * 2, _seq(), [(0, 1)], mode="exact"),
    "merged_batch_major_output": Case(lambda x: x.reshape(-1, 3) * 2, _seq(), [(0, 1)]),
    "merged_length_major_output_runs_unpadded": Case(lambda x: x.transpose(0, 1).reshape(-1, 3) * 2, _seq(),
                                                     [(0, 1)], mode="exact"),
    "view_of_an_input_at_the_real_end": Case(lambda x: (x.narrow(1, x.shape[1] - 2, 2), x[:, 1:], x * 2),
                                             _seq(), [(0, 1)]),
    "positions_computed_from_the_size": Case(
        lambda x: x.index_select(1, torch.arange(x.shape[1] - 1, -1, -1)) + torch.arange(x.shape[1] + 1, 1, -1)[:, None],
        _seq(), [(0, 1)]),
    "as_strided_runs_unpadded": Case(lambda x: x.as_strided((2, 2), (1, 1)) * 2,
                                     lambda n, g: [_rand(n, generator=g)], [(0, 0)], mode="exact"),
}


def _close(actual, expected):
    if not expected.is_floating_point():
        return torch.equal(actual, expected)
    return torch.allclose(actual, expected, rtol=1e-5, atol=1e-5)


def _check_lengths(case: Case, compiled, lengths: list[int]) -> list[str]:
    seen = []
    for n in lengths:
        inputs = case.make(n, torch.Generator().manual_seed(n))
        for index, dim in case.dynamic:
            torch._dynamo.mark_dynamic(inputs[index], dim)
        before = len(session.BUCKETS)
        expected_out, expected_grads = _run(case.fn, inputs)
        actual_out, actual_grads = _run(compiled, inputs)
        for actual, expected in zip(actual_out + actual_grads, expected_out + expected_grads):
            assert actual.shape == expected.shape, f"length {n}: shape {actual.shape} != {expected.shape}"
            assert _close(actual, expected), f"length {n}: max error {(actual - expected).abs().max()}"
        seen += [p.plan for p in session.BUCKETS[before:]]
    return seen


@pytest.mark.parametrize("name", sorted(CASES))
@SETTINGS
@given(lengths=LENGTHS)
def test_bucketed_equals_unpadded_eager(name, lengths, host_only, tmp_path_factory, caplog):
    _check_case(name, lengths, tmp_path_factory, caplog, "random")


@pytest.mark.parametrize("name", sorted(CASES))
def test_below_at_and_just_above_a_bucket_boundary(name, host_only, tmp_path_factory, caplog):
    """127 pads by one, 128 fills its bucket exactly, 129 pads by 127 in the next bucket."""
    _check_case(name, [127, 128, 129], tmp_path_factory, caplog, "boundary")


def _check_case(name, lengths, tmp_path_factory, caplog, test):
    """Results equal eager at every length, and the graphs run padded (or, for `exact` cases, the
    pad-safety pass refuses them, saying why). A backward whose inputs carry no length (the gradient
    of a reduction over it) has nothing to pad: it runs at exact shapes without a verdict."""
    torch.set_num_threads(1)
    case = CASES[name]
    with caplog.at_level("INFO", logger="neuron_inductor"):
        signatures = _check_lengths(case, _compiled(name, tmp_path_factory, test), lengths)
    refused = "runs UNPADDED" in caplog.text
    if case.mode == "exact":
        assert refused and all(s.startswith("exact") for s in signatures), signatures
    else:
        padded_first = all(not s.startswith(("exact", "static")) for s in signatures[:1])  # [] when all cached
        assert not refused and padded_first, (signatures, caplog.text[-2000:])


_COMPILED: dict[tuple[str, str], object] = {}


def _compiled(name: str, tmp_path_factory, test: str):
    """One compiled function per case and test for all hypothesis examples (Dynamo keeps its
    symbolic graph), compiling into its own cache so that each test sees its pad-safety verdicts."""
    if (name, test) not in _COMPILED:
        if any(key[0] == name for key in _COMPILED):
            torch._dynamo.reset()  # Dynamo caches graphs by code object: forget the other test's
        folder = tmp_path_factory.mktemp(f"cache_{name}_{test}")
        _COMPILED[name, test] = torch.compile(CASES[name].fn, backend="neuron",
                                              options={"cache_dir": str(folder), "fallback": "allow"})
    return _COMPILED[name, test]


def test_each_length_in_a_bucket_reuses_one_program(host_only, tmp_path):
    compiled = torch.compile(lambda x: x.softmax(1), backend="neuron",
                             options={"cache_dir": str(tmp_path), "fallback": "allow"})
    signatures = _check_lengths(Case(lambda x: x.softmax(1), _seq(), [(0, 1)]), compiled, [5, 100, 128, 129, 250])
    # Forward graphs only (no grad): one program for 5, 100, 128 and one for 129, 250.
    assert [s.split("=")[1] for s in signatures] == ["128", "256"], signatures


def test_unpadded_backward_takes_activations_the_forward_saved_padded(host_only, tmp_path):
    # cumsum pads safely; its backward flips the length, so the backward runs at exact shapes and
    # must cut the activations saved at the forward's bucket back to the real length.
    fn = lambda x: x.cumsum(1) * x.sin()  # noqa: E731
    compiled = torch.compile(fn, backend="neuron", options={"cache_dir": str(tmp_path), "fallback": "allow"})
    signatures = _check_lengths(Case(fn, _seq(grad=True), [(0, 1)]), compiled, [40, 200])
    assert [s.startswith("exact") for s in signatures] == [False, True, False, True], signatures


@pytest.fixture(scope="module")
def llama():
    return TinyLlama(TinyLlamaConfig(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64))


@SETTINGS
@given(lengths=LENGTHS)
def test_llama_loss_gradients_and_last_token_logits(lengths, llama, host_only, tmp_path_factory):
    torch.set_num_threads(1)
    if "llama" not in _COMPILED:
        _COMPILED["llama"] = torch.compile(llama, backend="neuron", options={
            "cache_dir": str(tmp_path_factory.mktemp("llama")), "fallback": "allow"})
    compiled = _COMPILED["llama"]
    for n in lengths:
        ids = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n))
        labels = ids.clone()
        labels[:, : n // 3] = -100
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(labels, 1)
        before = len(session.BUCKETS)
        llama.zero_grad()
        loss = compiled(ids, labels)
        loss.backward()
        grads = [p.grad.clone() for p in llama.parameters()]
        llama.zero_grad()
        expected = llama(ids, labels)
        expected.backward()
        assert torch.allclose(loss, expected, rtol=1e-5), (n, loss.item(), expected.item())
        for grad, param in zip(grads, llama.parameters()):
            assert torch.allclose(grad, param.grad, rtol=1e-5, atol=1e-6 * param.grad.abs().max().item())
        with torch.no_grad():
            last = compiled(ids)[:, -1]
            assert torch.allclose(last, llama(ids)[:, -1], rtol=1e-5, atol=1e-5)
        assert all(not p.plan.startswith(("exact", "static")) for p in session.BUCKETS[before:])


def test_unsafe_op_is_reported_by_name():
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(lambda x: x.flip(1).sum(1), tracing_mode="symbolic")(torch.randn(2, 5, 3))
    symbols = {s for node in traced.graph.nodes if node.op == "placeholder"
               for s in (node.meta["val"].shape[1].node.expr.free_symbols)}
    _, _, report = make_pad_safe(traced, symbols)
    assert not report.safe
    assert any(line.startswith("flip") and "reverses a padded dim" in line for line in report.unsafe), report.unsafe


@pytest.mark.parametrize("fn, reason", [
    (lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), "the head dim is padded"),
    (lambda x: x + torch.rand_like(x), "draws random numbers over a padded dim"),
    (lambda x: x * torch.rand(x.shape[2], 1), "draws random numbers over a padded dim"),
])
def test_padded_head_dim_and_random_draws_are_unsafe(fn, reason):
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(fn, tracing_mode="symbolic")(torch.randn(2, 3, 6, 5))  # [batch, heads, length, head dim]
    symbols = {s for node in traced.graph.nodes if node.op == "placeholder"
               for size in node.meta["val"].shape[2:] for s in size.node.expr.free_symbols}
    _, _, report = make_pad_safe(traced, symbols)
    assert any(reason in line for line in report.unsafe), report.unsafe


def test_contraction_masks_both_operands():
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(lambda x, y: x.t() @ y, tracing_mode="symbolic")(torch.randn(5, 3), torch.randn(5, 4))
    symbols = {s for node in traced.graph.nodes if node.op == "placeholder" for s in
               node.meta["val"].shape[0].node.expr.free_symbols}
    rewritten, extra, report = make_pad_safe(traced, symbols)
    mm = next(n for n in rewritten.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert all(arg.target is torch.ops.aten.where.self for arg in mm.args), [a.target for a in mm.args]
    assert [e.kind for e in extra] == ["valid"]
    # Padded garbage may be inf / NaN: masking (not multiplying) keeps the result finite and exact.
    x, y = torch.randn(8, 3), torch.randn(8, 4)
    x[5:], y[5:] = math.inf, math.nan
    valid = torch.arange(8) < 5
    out = rewritten(x, y, valid)
    assert torch.allclose(out, x[:5].t() @ y[:5])
