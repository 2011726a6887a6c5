"""Bucket policies, pad / slice plans, symbol binding, the recompile-limit guard, and bucketed runs
through the real kernel families."""

from __future__ import annotations

import logging

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_inductor import bucketing
from neuron_inductor.observe import session
from neuron_inductor.bucketing import BucketPolicy, pad_tensor, slice_tensor


@pytest.mark.parametrize("spec, sizes, expected", [
    ("128", [1, 100, 128, 129, 2048], [128, 128, 128, 256, 2048]),
    ("64", [1, 65], [64, 128]),
    ("64,128,512", [1, 64, 65, 300, 513], [64, 64, 128, 512, 513]),
    ("128:512", [100, 512, 513, 1500], [128, 512, 1024, 2048]),
    ("off", [7, 300], [7, 300]),
])
def test_policies(spec, sizes, expected):
    assert [BucketPolicy.parse(spec).bucket(s) for s in sizes] == expected


@pytest.mark.parametrize("spec", ["0", "-5", "128,64", "64,64", "a", "100:50", "128:300"])
def test_bad_policy_names_what_is_accepted(spec):
    with pytest.raises(ValueError, match="accepted"):
        BucketPolicy.parse(spec)


def test_bucket_counts():
    assert BucketPolicy.parse("128").count_up_to(2048) == 16
    assert BucketPolicy.parse("128:1024").count_up_to(4096) == 8 + 2  # 128..1024, then 2048, 4096


@settings(max_examples=25, deadline=None)
@given(real=st.integers(1, 40), extra=st.integers(0, 40))
def test_pad_then_slice_round_trips_simple_and_merged_dims(real, extra):
    s = sympy.Symbol("s0")
    real_b, bucket_b = {s: real}, {s: real + extra}
    x = torch.randn(2, real, 3)
    flat = x.reshape(2 * real, 3)  # a merged dim `2*s`, batch-major
    padded = pad_tensor(x, (sympy.Integer(2), s, sympy.Integer(3)), real_b, bucket_b)
    padded_flat = pad_tensor(flat, (2 * s, sympy.Integer(3)), real_b, bucket_b)
    assert padded.shape == (2, real + extra, 3) and padded_flat.shape == (2 * (real + extra), 3)
    assert torch.equal(padded_flat.view(2, real + extra, 3), padded)  # same layout both ways
    assert torch.equal(padded[:, real:], torch.zeros(2, extra, 3))
    assert torch.equal(slice_tensor(padded, (sympy.Integer(2), s, sympy.Integer(3)), real_b, bucket_b), x)
    assert torch.equal(slice_tensor(padded_flat, (2 * s, sympy.Integer(3)), real_b, bucket_b), flat)


def test_binding_prefers_symint_inputs_and_smallest_tensor_dim():
    s, t = sympy.Symbol("s0"), sympy.Symbol("s1")
    specs = [s, (sympy.Integer(2), s), (t,), (t, sympy.Integer(4))]
    args = [100, torch.zeros(2, 128), torch.zeros(256), torch.zeros(200, 4)]  # 2nd/3rd: padded activations
    assert bucketing.bind_symbols(specs, args) == {s: 100, t: 200}


@torch._dynamo.config.patch(recompile_limit=8)
def test_recompile_limit_is_raised_and_its_hit_is_loud():
    bucketing.raise_recompile_limit(BucketPolicy.parse("128"))
    assert torch._dynamo.config.recompile_limit >= BucketPolicy.parse("128").count_up_to(bucketing.COVERED_LENGTH)
    bucketing.watch_recompile_limit()
    with pytest.warns(RuntimeWarning, match="EAGERLY.*NEURON_INDUCTOR_RAISE_RECOMPILE_LIMIT"):
        logging.getLogger("torch._dynamo.convert_frame").warning(
            "torch._dynamo hit config.%s (%s)\n   function: %s", "recompile_limit", 8, "f")


@torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False)
def test_dynamo_limit_hit_in_a_real_run_warns(tmp_path):
    """With the opt-out and a tiny limit, Dynamo's drop to eager is announced, not silent."""
    bucketing.watch_recompile_limit()
    compiled = torch.compile(lambda x: x * 2, backend="neuron", options={
        "cache_dir": str(tmp_path), "raise_recompile_limit": False, "fallback": "allow"})
    with pytest.warns(RuntimeWarning, match="EAGERLY"):
        for n in (3, 4, 5):
            compiled(torch.randn(n))


@settings(max_examples=2, deadline=None)
@given(lengths=st.lists(st.integers(3, 260), min_size=2, max_size=3))
def test_bucketed_kernels_match_eager(lengths, tmp_path_factory):
    """Real kernel families (no host-only lowering): softmax and a masked sum over a padded dim."""
    torch.set_num_threads(1)
    compiled = _compiled_kernel_fn(tmp_path_factory)
    for n in lengths:
        x = torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n))
        torch._dynamo.mark_dynamic(x, 1)
        before = len(session.BUCKETS)
        out = compiled(x)
        expected = _kernel_fn(x)
        for a, e in zip(out, expected):
            assert torch.allclose(a, e, rtol=1e-5, atol=1e-5), (n, (a - e).abs().max())
        for entry in session.BUCKETS[before:]:
            assert not entry.plan.startswith(("exact", "static"))
            assert entry.artifact.meta["kernels"], "expected generated kernels, not only host steps"


def _kernel_fn(x):
    return torch.softmax(x, 1) * 2, (x * x).sum(1)


_KERNEL_COMPILED = {}


def _compiled_kernel_fn(tmp_path_factory):
    if "fn" not in _KERNEL_COMPILED:
        _KERNEL_COMPILED["fn"] = torch.compile(_kernel_fn, backend="neuron", options={
            "cache_dir": str(tmp_path_factory.mktemp("kernels")), "fallback": "allow"})
    return _KERNEL_COMPILED["fn"]
