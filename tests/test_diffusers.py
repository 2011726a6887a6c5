"""Diffusers as users run it: tiny UNet2DConditionModel, AutoencoderKL, DiT, PixArt, SD3 and Flux
transformers (examples/diffusers_tiny.py builds them from configs) compiled with `fullgraph=True`,
inference and one training step against eager, with every op in NKI kernels (fallback="error"; Flux's
float64 RoPE tables are the one stated exception), and a DDPMPipeline whose compiled UNet gives
eager's images. The fast tests cover the memory-format copies nearest upsampling inserts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import neuron_inductor
from neuron_inductor import config

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("diffusers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import diffusers_tiny  # noqa: E402

# fp32 kernels against eager fp32. Observed on these tiny models: outputs <= 4e-6 (the VAE's two
# convolution stacks), loss identical to 1e-7, gradients <= 6e-7.
OUTPUT_TOL = {"rtol": 1e-4, "atol": 5e-5}
GRAD_TOL = {"rtol": 1e-3, "atol": 1e-5}
# The only host fallbacks allowed, with their reason: Flux computes its RoPE tables in float64 on a
# CPU tensor (float32 on a Neuron device), and float64 has no on-chip type; DiT drops class labels at
# random in training, and random numbers stay on the host (eager's RNG stream).
HOST_ONLY = {"flux": "dtype float64 has no on-chip type",
             "dit": "random numbers stay on the host so results follow eager's RNG stream"}


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def _fallback_mode(name: str) -> str:
    return "allow" if name in HOST_ONLY else "error"


def _assert_only_expected_fallbacks(name: str) -> None:
    fallbacks = neuron_inductor.report().fallbacks
    if name in HOST_ONLY:
        assert fallbacks and all(HOST_ONLY[name] in f["reason"] for f in fallbacks), fallbacks
    else:
        assert not fallbacks, fallbacks


# ---------------------------------------------------------------------------- memory-format copies

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 4, 4), (1, 129, 1, 2)])  # on / off the 128-partition tile
def test_channels_last_copies_run_in_kernels(dtype, shape):
    """`clone(memory_format=channels_last)` (what nearest upsampling inserts, and `.contiguous(channels_last)`)
    is the same values in another layout: a copy kernel, no host fallback, eager's values."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)

    def fn(t):
        up = F.interpolate(t, scale_factor=2, mode="nearest")
        return up.contiguous(memory_format=torch.channels_last) * 2 + 1, up

    want = fn(x)
    with config.patch(fallback="error"):
        got = torch.compile(fn, backend="neuron", fullgraph=True)(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # copies and one exact multiply-add
    ops = {op for k in neuron_inductor.report().kernels for op in k["ops"]}
    assert "aten.clone.default" in ops or "aten._to_copy.default" in ops, ops


def test_pointwise_fallback_reason_names_the_cause():
    """A pointwise op the kernels refuse says why (the dtype, or the argument), not a generic message."""
    x = torch.randn(4, 8)
    with config.patch(fallback="allow"):
        torch.compile(lambda t: (t.double() * 2).float(), backend="neuron")(x)
        torch.compile(lambda t: torch.pow(-2.0, t), backend="neuron")(x)
    reasons = {f["op"]: f["reason"] for f in neuron_inductor.report().fallbacks}
    assert "dtype float64 has no on-chip type" in reasons["aten.mul.Tensor"], reasons
    assert "a base that is not a positive number" in reasons["aten.pow.Scalar"], reasons


# ---------------------------------------------------------------------------- the models

@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(diffusers_tiny.MODELS))
def test_model_inference_and_training_step_match_eager(name):
    model, inputs = diffusers_tiny.build(name)
    want = diffusers_tiny.inference(model, inputs, "eager")
    want_loss, want_grads = diffusers_tiny.training_step(model, inputs, "eager")
    with config.patch(fallback=_fallback_mode(name)):
        got = diffusers_tiny.inference(model, inputs, "neuron")
        loss, grads = diffusers_tiny.training_step(model, inputs, "neuron")
    torch.testing.assert_close(got, want, **OUTPUT_TOL)
    torch.testing.assert_close(loss, want_loss, **OUTPUT_TOL)
    assert grads.keys() == want_grads.keys() and grads
    for key in want_grads:
        torch.testing.assert_close(grads[key], want_grads[key], **GRAD_TOL, msg=lambda m, k=key: f"{k}: {m}")
    _assert_only_expected_fallbacks(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dit", "sd3"])
def test_transformer_bf16_inference_matches_eager(name):
    """bf16 weights and inputs: kernels round at other points than eager's bf16 ops; compared with eager
    bf16 within 3% of the output scale (observed: one bf16 ulp, 0.016 on outputs up to 1.9)."""
    model, inputs = diffusers_tiny.build(name)
    model = model.to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs.items()}
    want = diffusers_tiny.inference(model, inputs, "eager")
    with config.patch(fallback="error"):
        got = diffusers_tiny.inference(model, inputs, "neuron")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * want.float().abs().max().item())


@pytest.mark.slow
def test_ddpm_pipeline_with_compiled_unet_gives_eager_images():
    pipeline = diffusers_tiny.tiny_ddpm_pipeline()
    want = diffusers_tiny.generate(pipeline, steps=3)
    pipeline.unet.compile(backend="neuron", fullgraph=True)
    with config.patch(fallback="error"):
        got = diffusers_tiny.generate(pipeline, steps=3)
    assert got.shape == (2, 8, 8, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # images in [0, 1]; observed 2.5e-6
    _assert_only_expected_fallbacks("ddpm")
