"""Tiny Diffusers models and a tiny pipeline under `torch.compile(backend="neuron", fullgraph=True)`,
offline on CPU (random weights from configs, no download; the NKI kernels run in the interpreter).

    python examples/diffusers_tiny.py                 # every model: inference vs eager, then the pipeline
    python examples/diffusers_tiny.py unet vae        # only these models
    python examples/diffusers_tiny.py --train unet    # also one training step of each named model

Models: an SD-style UNet2DConditionModel (cross-attention, timestep embedding), an AutoencoderKL
(encode and decode), a DiT and a PixArt transformer, an SD3 MMDiT (joint attention) and a Flux
transformer (joint attention, RoPE). The pipeline is DDPMPipeline with a tiny UNet2DModel, its UNet
compiled in place, run for a few denoising steps from a seeded generator.

Flux's RoPE tables are computed in float64 on a CPU tensor (diffusers computes them in float32 on a
Neuron device, `maybe_adjust_dtype_for_device`); float64 has no on-chip type, so those few ops run on
the host, and the script lists them. Every other op of every model runs in NKI kernels.

The model builders and the compare helpers are shared with tests/test_diffusers.py.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL, DDPMPipeline, DDPMScheduler, DiTTransformer2DModel, FluxTransformer2DModel,
    PixArtTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel, UNet2DModel)

import neuron_inductor  # noqa: E402

Inputs = dict[str, object]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def tiny_unet() -> tuple[torch.nn.Module, Inputs]:
    """SD-style: a cross-attention down / up block pair around a mid block, timestep embedding."""
    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    return model, {"sample": _randn(2, 4, 8, 8, seed=1), "timestep": torch.tensor([10, 500]),
                   "encoder_hidden_states": _randn(2, 5, 32, seed=2)}


class VaeRoundTrip(torch.nn.Module):
    """AutoencoderKL encode (the latent distribution's mean) then decode, as one module."""

    def __init__(self) -> None:
        super().__init__()
        self.vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(16, 32),
            latent_channels=4, norm_num_groups=8, layers_per_block=1, sample_size=16)

    def forward(self, sample: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        latents = self.vae.encode(sample).latent_dist.mean
        return self.vae.decode(latents).sample, latents


def tiny_vae() -> tuple[torch.nn.Module, Inputs]:
    return VaeRoundTrip(), {"sample": _randn(1, 3, 16, 16, seed=3)}


def tiny_dit() -> tuple[torch.nn.Module, Inputs]:
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                  num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    return model, {"hidden_states": _randn(2, 4, 8, 8, seed=4), "timestep": torch.tensor([1, 5]),
                   "class_labels": torch.tensor([1, 2])}


def tiny_pixart() -> tuple[torch.nn.Module, Inputs]:
    model = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                     num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=16,
                                     caption_channels=16)
    return model, {"hidden_states": _randn(2, 4, 8, 8, seed=5), "timestep": torch.tensor([1, 5]),
                   "encoder_hidden_states": _randn(2, 5, 16, seed=6),
                   "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def tiny_sd3() -> tuple[torch.nn.Module, Inputs]:
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16)
    return model, {"hidden_states": _randn(2, 4, 8, 8, seed=7), "encoder_hidden_states": _randn(2, 5, 16, seed=8),
                   "pooled_projections": _randn(2, 8, seed=9), "timestep": torch.tensor([1.0, 5.0])}


def tiny_flux() -> tuple[torch.nn.Module, Inputs]:
    """One double-stream (joint attention) and one single-stream block; a 4 x 4 latent grid with
    3-axis RoPE ids (frame, row, column) and 5 text tokens."""
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    rows, cols = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return model, {"hidden_states": _randn(1, 16, 16, seed=10), "encoder_hidden_states": _randn(1, 5, 32, seed=11),
                   "pooled_projections": _randn(1, 16, seed=12), "timestep": torch.tensor([0.5]),
                   "img_ids": img_ids, "txt_ids": torch.zeros(5, 3)}


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Inputs]]] = {
    "unet": tiny_unet, "vae": tiny_vae, "dit": tiny_dit, "pixart": tiny_pixart, "sd3": tiny_sd3, "flux": tiny_flux}


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, Inputs]:
    """The named tiny model with weights from `seed`, and its example inputs."""
    torch.manual_seed(seed)
    return MODELS[name]()


def compiled(model: torch.nn.Module) -> Callable:
    return torch.compile(model, backend="neuron", fullgraph=True)


def inference(model: torch.nn.Module, inputs: Inputs, backend: str) -> torch.Tensor:
    """The model's first output (eval mode, no grad), run eagerly or compiled."""
    model.eval()
    run = compiled(model) if backend == "neuron" else model
    with torch.no_grad():
        return run(**inputs, return_dict=False)[0]


def training_step(model: torch.nn.Module, inputs: Inputs, backend: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One denoising-style loss (MSE of the output against a fixed target) and its gradients. The RNG
    is seeded first: DiT drops class labels at random in training (on the host, eager's RNG stream)."""
    torch.manual_seed(1234)
    model.train()
    model.zero_grad(set_to_none=True)
    run = compiled(model) if backend == "neuron" else model
    out = run(**inputs, return_dict=False)[0]
    target = _randn(*out.shape, seed=99)
    loss = torch.nn.functional.mse_loss(out, target)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def tiny_ddpm_pipeline(seed: int = 0) -> DDPMPipeline:
    """DDPMPipeline from a 2-level UNet2DModel (one attention block) and a 1000-step DDPM scheduler."""
    torch.manual_seed(seed)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                       norm_num_groups=8, attention_head_dim=8)
    pipeline = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def generate(pipeline: DDPMPipeline, steps: int, seed: int = 0) -> torch.Tensor:
    """Images (batch 2, channels last, in [0, 1]) after `steps` denoising steps from a seeded generator."""
    images = pipeline(batch_size=2, generator=torch.Generator().manual_seed(seed), num_inference_steps=steps,
                      output_type="np").images
    return torch.from_numpy(images)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help=f"models to run, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--train", action="store_true", help="also run one training step of each model")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps of the pipeline")
    args = parser.parse_args()
    unknown = sorted(set(args.models) - MODELS.keys())
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    for name in args.models or MODELS:
        start = time.perf_counter()
        model, inputs = build(name)
        eager = inference(model, inputs, "eager")
        ours = inference(model, inputs, "neuron")
        line = f"{name:7s} inference max |diff| {max_error(ours, eager):.1e}"
        if args.train:
            eager_loss, eager_grads = training_step(model, inputs, "eager")
            loss, grads = training_step(model, inputs, "neuron")
            grad_error = max(max_error(grads[k], eager_grads[k]) for k in eager_grads)
            line += (f"; training loss {loss.item():.5f} (eager {eager_loss.item():.5f}), "
                     f"grads max |diff| {grad_error:.1e}")
        print(f"{line}  ({time.perf_counter() - start:.1f} s)")
        torch._dynamo.reset()

    pipeline = tiny_ddpm_pipeline()
    eager_images = generate(pipeline, args.steps)
    pipeline.unet.compile(backend="neuron", fullgraph=True)
    images = generate(pipeline, args.steps)
    print(f"DDPMPipeline, {args.steps} steps: images {tuple(images.shape)}, max |diff| vs eager "
          f"{max_error(images, eager_images):.1e}")

    fallbacks = neuron_inductor.report().fallbacks
    print(f"host fallbacks: {len(fallbacks)}")
    for op, reason in sorted({(f["op"], f["reason"]) for f in fallbacks}):
        print(f"  {op}: {reason}")


if __name__ == "__main__":
    main()
