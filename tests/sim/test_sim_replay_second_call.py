"""A signature is recorded on its second call (sim/replay.py `_SEEN`): its first call runs normally and
makes no plan, the second records one, later calls replay it; every call gives the slow path's bits
and trace."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import op_replay
from neuron_inductor.sim import replay as sim_replay

from .helpers import bits


def _scaled_exp(x):
    """A compute kernel (ScalarE exp, VectorE multiply): replayed as its recorded operations."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.activation(dst=t, op=nl.exp, data=t, scale=0.5)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
    res = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=t)
    nisa.dma_copy(dst=out, src=res)
    return out


def _copy_rows(x):
    """A copy-only kernel: replayed as plain copies (replay.Plan)."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t)
    return out


def _counting(monkeypatch) -> dict:
    """How many runs each path made from now on: recorded, replayed."""
    counts = {"recorded": 0, "replayed": 0}
    for owner, name, kind in [(op_replay, "Recorder", "recorded"), (op_replay.Plan, "run", "replayed"),
                              (sim_replay.Plan, "run", "replayed")]:
        original = getattr(owner, name)

        def counted(*args, _original=original, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return counts


@pytest.mark.parametrize("func, plan_type", [(_scaled_exp, op_replay.Plan), (_copy_rows, sim_replay.Plan)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_call_runs_the_second_records_later_ones_replay(func, plan_type, dtype, monkeypatch):
    sim_replay.forget()
    counts = _counting(monkeypatch)
    fast, slow = sim.Kernel(func, replay=True), sim.Kernel(func, replay=False)
    seen = []
    for call in range(4):
        x = torch.randn(100, 40, generator=torch.Generator().manual_seed(call)).to(dtype)
        with sim.trace() as recorded:
            out = fast(x)
        with sim.trace() as reference:
            ref_out = slow(x)
        assert torch.equal(bits(out), bits(ref_out))
        assert [(i.op, i.flops, i.bytes, i.operands) for i in recorded.instructions] == \
               [(i.op, i.flops, i.bytes, i.operands) for i in reference.instructions]
        seen.append((dict(counts), [type(p) for p in sim_replay.plans(func)]))
    assert seen == [({"recorded": 0, "replayed": 0}, []),  # run normally: no plan
                    ({"recorded": 1, "replayed": 0}, [plan_type]),
                    ({"recorded": 1, "replayed": 1}, [plan_type]),
                    ({"recorded": 1, "replayed": 2}, [plan_type])]


def test_past_the_signature_budget_new_signatures_run_normally(monkeypatch):
    sim_replay.forget()
    monkeypatch.setattr(sim_replay, "_MAX_PLANS", 2)
    kernel = sim.Kernel(_scaled_exp, replay=True)
    for rows in (8, 16, 24):
        for _ in range(3):
            out = kernel(torch.ones(rows, 4))
            torch.testing.assert_close(out, torch.full((rows, 4), 3 * torch.tensor(0.5).exp().item()))
    assert len(sim_replay._SEEN) == 2 and len(sim_replay.plans(_scaled_exp)) == 2
    sim_replay.forget()
    assert not sim_replay._SEEN
