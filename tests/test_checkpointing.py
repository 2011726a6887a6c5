"""Activation checkpointing (`torch.utils.checkpoint`, use_reentrant=False) around attention.

The min-cut partitioner wraps the checkpointed region's random ops (SDPA is tagged random for its
dropout argument) in run_and_save_rng_state / run_with_rng_state: the forward saves the generator
state for the backward's recompute. These tests train one step of a small attention block under
every `dynamic` setting, over lengths in two buckets (default policy: multiples of 128), and
compare the loss, the block's output, every gradient and the generator state afterwards with eager
PyTorch from the same seed. Kernels run in the NKI interpreter; the wrapped attention and dropout
run on the host. Tolerance: fp32, rtol 1e-5, atol 1e-5 (gradients are sums over the length).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from neuron_inductor.observe import session

DIM, HEADS = 16, 2
# 24 and 40 share bucket 128 (the second call is the first symbolic / fitted one), 136 is in 256.
LENGTHS = (24, 40, 136)


class CheckpointedAttention(nn.Module):
    """Self-attention whose attention core is recomputed in the backward."""

    def __init__(self, dropout: float, causal: bool = True) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        torch.random.set_rng_state(generator_state)
        self.dropout, self.causal = dropout, causal

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.dropout)
        return y.transpose(1, 2).reshape(batch, length, DIM)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.proj(checkpoint(self.attend, x, use_reentrant=False))
        return (y * weights).sum(), y


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with no compiled frames (its lengths must reach a new graph)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_step(model: nn.Module, step, x: torch.Tensor, weights: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Loss, output, input and parameter gradients, and the generator state after one step from `seed`."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    # dynamic=True would make the batch of 2 dynamic too, padded to 128: 64x the work (280 s of CPU)
    # for programs whose padded dim is still the length, which is what these tests check.
    torch._dynamo.mark_static(x, 0)
    torch.manual_seed(seed)
    loss, y = step(x, weights)
    loss.backward()
    return [loss.detach(), y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()] + [torch.get_rng_state()]


def _compare_over_lengths(model: CheckpointedAttention, dynamic, tmp_path) -> list[str]:
    """Checks every length against eager; returns the signatures of the programs compiled on the way."""
    compiled = torch.compile(model, backend="neuron", dynamic=dynamic, options={"cache_dir": str(tmp_path)})
    before = len(session.BUCKETS)
    for length in LENGTHS:
        generator = torch.Generator().manual_seed(length)
        x, weights = torch.randn(2, length, DIM, generator=generator), torch.rand(2, length, DIM, generator=generator)
        torch._dynamo.mark_static(weights, 0)
        expected = _train_step(model, model, x, weights, seed=length)
        actual = _train_step(model, compiled, x, weights, seed=length)
        names = ["loss", "output", "x.grad"] + [f"{n}.grad" for n, _ in model.named_parameters()] + ["rng state"]
        for name, got, want in zip(names, actual, expected):
            assert got.shape == want.shape, f"length {length}, {name}: shape {got.shape} != {want.shape}"
            if want.dtype == torch.uint8:
                assert torch.equal(got, want), f"length {length}: the generator state differs from eager's"
            else:
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), \
                    f"length {length}, {name}: max error {(got - want).abs().max()}"
    return [p.plan for p in session.BUCKETS[before:]]


@pytest.mark.parametrize("dynamic", [None, True, False])
def test_checkpointed_attention_pads_and_matches_eager(dynamic, tmp_path):
    _assert_two_padded_buckets(_compare_over_lengths(CheckpointedAttention(0.0), dynamic, tmp_path))


def test_checkpointed_non_causal_attention_masks_padded_keys(tmp_path):
    _assert_two_padded_buckets(_compare_over_lengths(CheckpointedAttention(0.0, causal=False), None, tmp_path))


def _assert_two_padded_buckets(signatures: list[str]) -> None:
    # Dynamo's first graph may be static; after it every length runs padded, and each of the two
    # buckets gets one forward and one backward program.
    padded = [s for s in signatures if not s.startswith(("exact", "static"))]
    assert len(padded) == 4 and len(set(padded)) == 2, signatures


@pytest.mark.parametrize("dynamic", [None, True, False])
def test_checkpointed_dropout_follows_eager_rng_stream(dynamic, tmp_path):
    signatures = _compare_over_lengths(CheckpointedAttention(0.25), dynamic, tmp_path)
    # Dropout drawn over a padded length would differ from eager's mask: those graphs run unpadded.
    assert all(s.startswith(("exact", "static")) for s in signatures), signatures
