"""A whole training step replayed gives the bits the interpreter's slow path gives.

The replay plans (sim/replay.py, sim/op_replay*.py: forwarding, casts, routed transposes, skipped
fills, folded constants) are each tested on lines and small kernels built to break them; this runs
them together on every kernel of a training step, forward and backward, and compares the loss and
every gradient bit for bit with the same compiled step run with no replay at all. Two models: a
Llama (attention, matmuls, RMSNorm, SiLU, the fused LM-head loss, embedding gathers and scatters)
and a pre-norm encoder layer with a convolution (LayerNorm, GELU, conv1d, softmax, cross-entropy).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from neuron_inductor import sim
from neuron_inductor.sim import launch
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig
from tests.sim.helpers import bits


class EncoderConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, activation="gelu", batch_first=True,
                                                  norm_first=True)
        self.conv = nn.Conv1d(64, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x, labels):
        h = self.conv(self.encoder(x).transpose(1, 2)).transpose(1, 2).softmax(-1)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _llama(dtype):
    model = TinyLlama(TinyLlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176))
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(0))  # 200: off the 128 tiles
    return model.to(dtype), (ids, ids)


def _encoder_conv(dtype):
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = EncoderConv()
    inputs = (torch.randn(2, 200, 64, generator=generator).to(dtype), torch.randint(0, 10, (2, 200), generator=generator))
    return model.to(dtype), inputs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [_llama, _encoder_conv], ids=["llama", "encoder_conv"])
def test_a_replayed_training_step_gives_the_slow_paths_bits(make, dtype, monkeypatch):
    torch._dynamo.reset()
    sim.replay.forget()
    model, inputs = make(dtype)
    compiled = torch.compile(model, backend="neuron")

    def step() -> tuple[list, list]:
        model.zero_grad(set_to_none=True)
        with sim.trace() as recorded:
            loss = compiled(*inputs)
            loss.backward()
        return [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()], recorded.instructions

    step()  # compiles and runs
    step()  # records each kernel's plan
    replayed, replayed_trace = step()
    plans = sum(plan is not None for plan in sim.replay.plans())
    with monkeypatch.context() as patched:
        patched.setattr(launch.replays, "run", lambda func, args, kwargs, grid, target, run_kernel, unwrap:
                        unwrap(run_kernel()))
        slow, slow_trace = step()
    assert plans > 40  # (the step's kernels did replay)
    assert len(replayed) == len(slow)
    for got, expected in zip(replayed, slow):
        assert torch.equal(bits(got), bits(expected))
    assert [(i.kernel, i.op, i.bytes, i.flops) for i in replayed_trace] == \
        [(i.kernel, i.op, i.bytes, i.flops) for i in slow_trace]
