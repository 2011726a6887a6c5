"""passes/gqa_attention.py: key / value heads repeated for grouped-query attention (repeat_interleave,
or Hugging Face's expand + reshape) reach SDPA as enable_gqa=True: no repeated copies in the forward,
no sum over the repeated heads in the backward, and values and gradients equal eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuron_inductor.observe import session

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

TOLERANCES = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _interleave(k, r):
    return k.repeat_interleave(r, dim=1)


def _repeat_kv(k, r):  # transformers' repeat_kv
    b, h, s, d = k.shape
    return k[:, :, None, :, :].expand(b, h, r, s, d).reshape(b, h * r, s, d)


def _attention(repeat):
    def f(q, k, v):
        r = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat(k, r), repeat(v, r), is_causal=True)
    return f


def _run(fn, q, k, v, dynamic_seq=False):
    """Compiled forward + backward against eager; -> (forward, backward) kernel families."""
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*inputs)
    out.float().square().sum().backward()
    expected = [out.detach()] + [t.grad for t in inputs]
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if dynamic_seq:
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 2)
    first = len(session.BUCKETS)
    got = torch.compile(fn, backend="neuron", options={"fallback": "error"})(*inputs)
    got.float().square().sum().backward()
    for actual, want in zip([got.detach()] + [t.grad for t in inputs], expected):
        torch.testing.assert_close(actual, want, **TOLERANCES[q.dtype])
    return [[k["family"] for k in p.artifact.meta["kernels"]] for p in session.BUCKETS[first:]]


def _qkv(dtype, seq, heads=4, kv_heads=2, dim=32):
    torch.manual_seed(0)
    return (torch.randn(1, heads, seq, dim, dtype=dtype), torch.randn(1, kv_heads, seq, dim, dtype=dtype),
            torch.randn(1, kv_heads, seq, dim, dtype=dtype))


@pytest.mark.parametrize("repeat", [_interleave, _repeat_kv], ids=["repeat_interleave", "repeat_kv"])
@pytest.mark.parametrize("seq", [128, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_repeated_heads_become_enable_gqa(repeat, seq, dtype, caplog):
    with caplog.at_level("INFO", logger="neuron_inductor"):
        forward, backward = _run(_attention(repeat), *_qkv(dtype, seq))
    assert "enable_gqa=True" in caplog.text
    assert forward == ["attention_fwd"], forward
    assert "reduction" not in backward and backward.count("attention_bwd") == 1, backward


def test_padded_sequence_bucket_matches_eager():
    """130 keys and queries bucketed to 256: the padded keys stay masked with the group's heads shared."""
    forward, _ = _run(_attention(_interleave), *_qkv(torch.float32, 130), dynamic_seq=True)
    assert "attention_fwd" in forward


def test_repeated_heads_read_elsewhere_keep_the_copies(caplog):
    def f(q, k, v):
        k2, v2 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return F.scaled_dot_product_attention(q, k2, v2) + k2
    with caplog.at_level("INFO", logger="neuron_inductor"):
        forward, _ = _run(f, *_qkv(torch.float32, 64))
    assert "enable_gqa=True" not in caplog.text
    assert "pointwise" in forward  # the repeated keys are materialised for the add


def test_other_repeat_dims_are_not_matched(caplog):
    def f(q, k, v):  # repeats the sequence, not the heads: not GQA
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2))
    q, k, v = _qkv(torch.float32, 64, heads=2, kv_heads=2)
    with caplog.at_level("INFO", logger="neuron_inductor"):
        _run(f, q, k[:, :, :32], v[:, :, :32])
    assert "enable_gqa=True" not in caplog.text
