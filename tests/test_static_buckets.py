"""`dynamic=False`: static graphs of one structure map to buckets through the symbolic form that
`neuron_inductor.generalize` re-derives from two lengths.

Most cases run every op on the host (`host_only`) to test the fitting, instance checks and the
padded runtime path in isolation; one runs the real kernel families. Tolerance: fp32, rtol 1e-5
(gradient atol 1e-6 of the largest gradient: sums over up to ~600 padded-then-masked terms run in
another order than eager's).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_inductor import cache as cache_module
from neuron_inductor import config, generalize
from neuron_inductor.observe import session
from neuron_inductor.bucketing import BucketPolicy
from neuron_inductor.cache import cache_stats
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig
from tests.host_lowering import host_only  # noqa: F401  (fixture)

POLICY = BucketPolicy.parse("128")


@pytest.fixture(autouse=True)
def fresh_families():
    generalize.reset()
    yield
    generalize.reset()


def _sample(fn, *inputs) -> generalize.Sample:
    return generalize.Sample.of(make_fx(fn, tracing_mode="fake")(*inputs), "forward", "test")


def _flatten_rows(x):
    return x.reshape(x.shape[0] * x.shape[1], -1).sum(1) + torch.arange(x.shape[1]).repeat(x.shape[0])


def test_fit_finds_affine_literals_and_the_base_dim():
    a, b = _sample(_flatten_rows, torch.randn(2, 5, 3)), _sample(_flatten_rows, torch.randn(2, 9, 3))
    assert a.key == b.key and a.literals != b.literals
    found = generalize.fit(a, b)
    assert found is not None and a.dim_positions[found.base] == (0, 1)
    assert sorted({(f.slope, f.offset) for f in found.literals if f.slope}) == [(1, 0), (2, 0)]  # arange end, 2*s
    assert found.matches(_sample(_flatten_rows, torch.randn(2, 130, 3)))
    assert not found.matches(_sample(_flatten_rows, torch.randn(3, 130, 3)))  # the batch is a constant here


@pytest.mark.parametrize("fn, lengths", [
    (lambda x: x * (x.shape[1] // 2), (5, 8)),  # 2 -> 4 over 5 -> 8: not an integer slope
    (lambda x: x.sum(1) + 0, (1, 4)),  # size 1: broadcasting / guard special case
])
def test_fit_refuses_what_one_affine_length_cannot_explain(fn, lengths):
    a, b = (_sample(fn, torch.randn(2, n)) for n in lengths)
    assert generalize.fit(a, b) is None


def test_structure_key_separates_other_constants():
    a = _sample(lambda x: x * 0.5, torch.randn(2, 5))
    b = _sample(lambda x: x * 0.25, torch.randn(2, 9))
    assert a.key != b.key


def _compile_static(fn, tmp_path):
    return torch.compile(fn, backend="neuron", dynamic=False,
                         options={"cache_dir": str(tmp_path), "fallback": "allow"})


def _compiled_buckets(before: int) -> list[str]:
    """What each program compiled since `before` runs at: "static" or its bucket size (symbol names vary)."""
    return [p.plan.split("=")[-1] for p in session.BUCKETS[before:] if p.source == "compiled"]


def test_a_length_outside_the_fit_runs_exact_and_correct(host_only, tmp_path):
    """A literal that is really quadratic in the length fits lengths 3 and 5 as 8*s-15; length 7's graph
    is no instance of that form (41 != 49), so it runs at exact shapes and stays right."""
    fn = lambda x: x.softmax(1) * (x.shape[1] ** 2)  # noqa: E731
    compiled = _compile_static(fn, tmp_path)
    before = len(session.BUCKETS)
    for n in (3, 5, 7):
        x = torch.randn(2, n, 4, generator=torch.Generator().manual_seed(n))
        assert torch.allclose(compiled(x), fn(x), rtol=1e-5), n
    assert _compiled_buckets(before) == ["static", "128", "static"]


def _llama_step(model, ids):
    model.zero_grad()
    loss = model(ids, ids)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


class _StaticLlama:
    """One compiled tiny Llama for every hypothesis example, and every length it has run."""

    cfg = TinyLlamaConfig(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)

    def __init__(self, tmp_path) -> None:
        self.model, self.reference = TinyLlama(self.cfg), TinyLlama(self.cfg)
        self.compiled = _compile_static(self.model, tmp_path)
        self.lengths: list[int] = []
        self.before = len(session.BUCKETS)


_LLAMA: dict[str, _StaticLlama] = {}


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(3, 300), min_size=2, max_size=3))
def test_static_training_equals_eager_with_one_kernel_set_per_bucket(lengths, host_only, tmp_path_factory):
    """Lengths from 3: at length 2 the shifted labels have one position, a size-1 dim that Dynamo and
    AOTAutograd specialise, so its graphs have another structure (a family of their own)."""
    torch.set_num_threads(1)
    if "llama" not in _LLAMA:
        _LLAMA["llama"] = _StaticLlama(tmp_path_factory.mktemp("static_llama"))
    llama = _LLAMA["llama"]
    for n in lengths:
        ids = torch.randint(0, llama.cfg.vocab_size, (2, n), generator=torch.Generator().manual_seed(n))
        loss, grads = _llama_step(llama.compiled, ids)
        expected_loss, expected_grads = _llama_step(llama.reference, ids)
        assert torch.allclose(loss, expected_loss, rtol=1e-5), (n, loss.item(), expected_loss.item())
        for grad, expected in zip(grads, expected_grads):
            assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item()), n
        llama.lengths.append(n)
    # The first length runs exact (forward + backward); every later one in a bucket compiled once per kind.
    distinct = list(dict.fromkeys(llama.lengths))
    compiled = _compiled_buckets(llama.before)
    assert compiled.count("static") == 2, compiled
    assert sorted(b for b in compiled if b != "static") == sorted(
        str(b) for b in {POLICY.bucket(n) for n in distinct[1:]} for _ in ("forward", "backward")), (distinct, compiled)


def test_real_kernels_static_training_matches_eager(tmp_path):
    """Through the generated kernels: lengths 5 (exact), 9 and 100 (bucket 128: compiled once), 131."""
    torch.set_num_threads(1)
    cfg = _StaticLlama.cfg
    model, reference = TinyLlama(cfg), TinyLlama(cfg)
    compiled = _compile_static(model, tmp_path)
    before = len(session.BUCKETS)
    for n in (5, 9, 100, 131):
        ids = torch.randint(0, cfg.vocab_size, (2, n), generator=torch.Generator().manual_seed(n))
        loss, grads = _llama_step(compiled, ids)
        expected_loss, expected_grads = _llama_step(reference, ids)
        assert torch.allclose(loss, expected_loss, rtol=1e-5), (n, loss.item(), expected_loss.item())
        for grad, expected in zip(grads, expected_grads):
            assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item()), n
    assert _compiled_buckets(before) == ["static", "static", "128", "128", "256", "256"]
    padded = [p for p in session.BUCKETS[before:] if p.plan != "static"]
    assert all(p.artifact.meta["kernels"] for p in padded), "expected generated kernels, not only host steps"


def _softmax_twice(x):
    return (x.softmax(1) * 2).sum(1)


def test_warm_process_compiles_nothing(host_only, tmp_path):
    def run():
        torch._dynamo.reset()
        generalize.reset()
        compiled = _compile_static(_softmax_twice, tmp_path)
        for n in (5, 9, 200, 100):
            x = torch.randn(2, n, 3)
            assert torch.allclose(compiled(x), _softmax_twice(x), rtol=1e-5)

    with config.patch(cache_dir=str(tmp_path)):
        before = cache_stats()
        run()
        cold = cache_stats()
        cache_module._caches.clear()  # forget the memory tier: as a new process would
        run()
        warm = cache_stats()
    assert cold["compiles"] - before["compiles"] == 3  # length 5 exact, buckets 128 and 256
    assert warm["compiles"] == 0 and warm["disk_hits"] == 3


_WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch
    from neuron_inductor import compiler, cache
    from tests.host_lowering import lower_on_host
    compiler.lower_graph = lower_on_host
    compiled = torch.compile(lambda x: (x.softmax(1) * 2).sum(1), backend="neuron", dynamic=False,
                             options={{"cache_dir": {folder!r}, "fallback": "allow"}})
    for n in (5, 9, 200, 100):
        x = torch.randn(2, n, 3)
        assert torch.allclose(compiled(x), (x.softmax(1) * 2).sum(1), rtol=1e-5)
    stats = cache.cache_stats()
    print(stats["compiles"], stats["disk_hits"])
""")


@pytest.mark.slow
def test_four_processes_on_an_empty_cache_compile_each_key_once(tmp_path):
    """Through the backend with dynamic=False: 4 processes started together, 3 keys (length 5 exact,
    buckets 128 and 256); each key is compiled by one process and loaded from disk by the others."""
    script = _WORKER.format(root=str(Path(__file__).resolve().parents[1]), folder=str(tmp_path / "cache"))
    workers = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    results = [w.communicate(timeout=600)[0].split() for w in workers]
    assert all(w.returncode == 0 for w in workers)
    assert sum(int(compiles) for compiles, _ in results) == 3
    assert all(int(compiles) + int(hits) == 3 for compiles, hits in results)


@pytest.mark.slow
def test_hugging_face_llama_with_padding_mask_reuses_bucket_kernels(host_only, tmp_path):
    """The Trainer's case: a transformers causal LM compiled with dynamic=False, an attention mask with
    left padding and labels (which its loss shifts with F.pad): loss and gradients equal eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model, reference = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
    reference.load_state_dict(model.state_dict())
    compiled = _compile_static(model, tmp_path)
    before = len(session.BUCKETS)
    for n in (5, 9, 30, 131):
        ids = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, : n // 3] = 0
        losses = []
        for net in (compiled, reference):
            loss = net(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.allclose(losses[0], losses[1], rtol=1e-5), (n, losses)
        for param, expected in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(param.grad, expected.grad, rtol=1e-5, atol=1e-6 * expected.grad.abs().max().item()), n
        model.zero_grad()
        reference.zero_grad()
    assert _compiled_buckets(before) == ["static", "static", "128", "128", "256", "256"]
