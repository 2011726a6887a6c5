"""A whole training step replayed gives the bits the interpreter's slow path gives.

The replay plans (sim/replay.py, sim/op_replay*.py: forwarding, casts, routed transposes, skipped
fills, folded constants) are each tested on lines and small kernels built to break them; this runs
them together on every kernel of a Llama step (attention, matmuls, norms, the fused LM-head loss,
embedding gathers and scatters), forward and backward, and compares the loss and every gradient bit
for bit with the same compiled step run with no replay at all.
"""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import launch
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

CONFIG = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replayed_training_step_gives_the_slow_paths_bits(dtype, monkeypatch):
    torch._dynamo.reset()
    sim.replay.forget()
    model = TinyLlama(TinyLlamaConfig(**CONFIG)).to(dtype)
    compiled = torch.compile(model, backend="neuron")
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(0))  # 200: off the 128 tiles

    def step() -> list:
        model.zero_grad(set_to_none=True)
        with sim.trace() as recorded:
            loss = compiled(ids, ids)
            loss.backward()
        return [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()], recorded.instructions

    step()  # compiles, and records each kernel's plan
    replayed, replayed_trace = step()
    plans = sum(plan is not None for plan in sim.replay._PLANS.values())
    with monkeypatch.context() as patched:
        patched.setattr(launch.replays, "run", lambda func, args, kwargs, grid, target, run_kernel, unwrap:
                        unwrap(run_kernel()))
        slow, slow_trace = step()
    assert plans > 50  # (the step's kernels did replay)
    assert len(replayed) == len(slow)
    for got, expected in zip(replayed, slow):
        assert torch.equal(_bits(got), _bits(expected))
    assert [(i.kernel, i.op, i.bytes, i.flops) for i in replayed_trace] == \
        [(i.kernel, i.op, i.bytes, i.flops) for i in slow_trace]
