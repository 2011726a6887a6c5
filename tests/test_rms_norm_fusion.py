"""passes/rms_norm_fusion.py: decomposed RMSNorm forwards (hand-written and Hugging Face's), with the
residual add before them, become one rms_norm kernel, and the step still matches eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from neuron_inductor.observe import session
from neuron_inductor.testing import RMSNorm, TinyLlama, TinyLlamaConfig

# each test compiles into a fresh cache: a disk hit would skip the pass whose log a test reads
pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# bf16: the fused kernel computes in fp32 and rounds once where eager rounds after every op
# (a few bf16 ulps on values of magnitude ~1).
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}
# D = 64 fits one column chunk, 1000 is not a multiple of the 512-column chunks; 2 x 65 rows straddle a
# row tile of 128 partitions; 9000 columns take two column chunks (two passes over HBM).
SHAPES = [(2, 8, 64), (2, 65, 1000), pytest.param((3, 9000), marks=pytest.mark.slow)]  # ~20 s each


class ResidualNorm(nn.Module):
    """h = a + b; out = lin(norm(h)) + h: the residual add, the norm, and h read again after it."""

    def __init__(self, norm: nn.Module, dim: int) -> None:
        super().__init__()
        self.norm = norm
        self.lin = nn.Linear(dim, dim, bias=False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = a + b
        return self.lin(self.norm(h)) + h


def _families(first: int) -> list[list[str]]:
    return [[k["family"] for k in p.artifact.meta["kernels"]] for p in session.BUCKETS[first:]]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_cls", [RMSNorm, LlamaRMSNorm])
def test_residual_rms_norm_is_one_kernel_and_matches_eager(norm_cls, dtype, shape):
    torch.manual_seed(0)
    dim = shape[-1]
    model = ResidualNorm(norm_cls(dim, 1e-6), dim).to(dtype)
    with torch.no_grad():
        model.norm.weight.copy_(torch.rand(dim) + 0.5)
    a = torch.randn(shape, dtype=dtype, requires_grad=True)
    b = torch.randn(shape, dtype=dtype)
    expected = model(a, b)
    expected.float().square().mean().backward()
    grads = [a.grad.clone(), model.norm.weight.grad.clone()]
    a.grad = None
    model.zero_grad()

    first = len(session.BUCKETS)
    compiled = torch.compile(model, backend="neuron", options={"fallback": "error"})
    out = compiled(a, b)
    out.float().square().mean().backward()
    forward = _families(first)[0]
    assert forward.count("rms_norm") == 1 and "reduction" not in forward, forward
    # the residual add and the norm's pointwise ops are in the norm kernel: at most the final `+ h` remains
    assert forward.count("pointwise") <= 1, forward
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    for got, want in zip([a.grad, model.norm.weight.grad], grads):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_norm_whose_intermediate_is_read_elsewhere_stays_decomposed(caplog):
    """Default-deny: the mean of squares returned as well is not recomputed or exposed by the kernel."""

    def f(x, w):
        mean_square = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(mean_square + 1e-6) * w, mean_square

    x, w = torch.randn(4, 32), torch.rand(32)
    first = len(session.BUCKETS)
    with caplog.at_level("DEBUG", logger="neuron_inductor"):
        out, mean_square = torch.compile(f, backend="neuron")(x, w)
    assert "rms_norm" not in _families(first)[0]
    assert "is also read by" in caplog.text
    want_out, want_mean_square = f(x, w)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean_square, want_mean_square, rtol=1e-5, atol=1e-5)


def test_tiny_llama_step_fuses_every_norm_and_matches_eager():
    torch.manual_seed(0)
    cfg = TinyLlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    model = TinyLlama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    expected = model(ids, ids)
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    first = len(session.BUCKETS)
    loss = torch.compile(model, backend="neuron", options={"fallback": "error"})(ids, ids)
    loss.backward()
    assert _families(first)[0].count("rms_norm") == 2 * cfg.n_layers + 1
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for got, want in zip((p.grad for p in model.parameters()), grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def _rsqrt_read_before_the_result(x, w):
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    total = rstd.sum()  # traced before x * rstd * w
    return x * rstd * w, total


def _mean_over_the_first_dim(x, w):
    return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w


def _mean_of_cubes(x, w):
    return x * torch.rsqrt(x.pow(3).abs().mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize("fn, reason", [
    (_rsqrt_read_before_the_result, "is read before the norm's result"),
    (_mean_over_the_first_dim, "is not a keepdim mean over the last dim"),
    (_mean_of_cubes, "is not aten.pow.Tensor_Scalar / aten.mul.Tensor"),
])
def test_unproven_forms_stay_decomposed_with_the_reason_logged(fn, reason, caplog):
    from torch.fx.experimental.proxy_tensor import make_fx
    from neuron_inductor.passes.rms_norm_fusion import fuse_rms_norms

    x, w = torch.randn(4, 32), torch.rand(32)
    gm = make_fx(fn, tracing_mode="fake")(x, w)
    with caplog.at_level("DEBUG", logger="neuron_inductor"):
        assert fuse_rms_norms(gm) == 0
    assert reason in caplog.text
    torch.testing.assert_close(gm(x, w), fn(x, w))


def test_hugging_face_llama_step_fuses_every_norm_and_matches_eager():
    """The real AOT graphs of a tiny transformers LlamaForCausalLM (fp32), fallback='error'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()  # eval: no dropout (its rate is 0 anyway)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    first = len(session.BUCKETS)
    compiled = torch.compile(model, backend="neuron", options={"fallback": "error"})
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert _families(first)[0].count("rms_norm") == 2 * config.num_hidden_layers + 1
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for got, want in zip((p.grad for p in model.parameters()), grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
