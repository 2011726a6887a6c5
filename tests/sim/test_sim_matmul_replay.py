"""A matmul writing its PSUM bank directly (`mm(out=bank view)`), and what the replay passes make of it:
the fill analysis and the dead-copy pass see the out= write as an overwrite, and an in-place
accumulation (`addmm_`) as a read of what it writes. Each rule is also run on operations built to
break it."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import op_replay, op_replay_fills
from neuron_inductor.sim import replay as sim_replay
from neuron_inductor.sim.op_replay_bindings import _Dispatched
from neuron_inductor.sim.op_replay_refs import Ref

from .helpers import bits
from .test_sim_replay_forwarding import _copy, _forwarded, _line, _run, _tiles

aten = torch.ops.aten


def _k_tiles(x, w):
    """out[M, N] = x[K, M].T @ w[K, N] over two K tiles (the last ragged) accumulated into the first
    N columns of a wider PSUM bank, evacuated by ScalarE and stored."""
    k, m = x.shape
    n = w.shape[1]
    acc = nl.ndarray((m, 512), nl.float32, buffer=nl.psum)
    for kt in nl.affine_range((k + 127) // 128):
        rows = min(128, k - kt * 128)
        lhs, rhs = nl.ndarray((rows, m), x.dtype), nl.ndarray((rows, n), w.dtype)  # (written whole: a bf16
        nisa.dma_copy(dst=lhs, src=x[kt * 128:kt * 128 + rows, :])                # operand's cast reads it all)
        nisa.dma_copy(dst=rhs, src=w[kt * 128:kt * 128 + rows, :])
        nisa.nc_matmul(dst=acc[:, 0:n], stationary=lhs, moving=rhs, accumulate=(kt > 0))
    res = nl.ndarray((m, n), nl.float32)
    nisa.activation(dst=res, op=nl.copy, data=acc[:, 0:n], scale=1.0)
    out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res)
    return out


@pytest.mark.parametrize("after_autograd", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [100, 200])  # one K tile (no accumulation), two (mm then addmm_)
def test_a_matmul_replays_into_its_psum_bank_with_the_same_bits_and_no_fill(dtype, k, after_autograd):
    """`after_autograd`: the kernel ran before on tensors that require grad, so the tiles it gave
    back to the interpreter's recycling were in an autograd graph; the ones handed out again are not."""
    if after_autograd:
        sim.Kernel(_k_tiles)(torch.randn(k, 96, requires_grad=True).to(dtype), torch.randn(k, 48).to(dtype))
    sim_replay.forget()
    make = lambda call: (torch.randn(k, 96, generator=torch.Generator().manual_seed(call)).to(dtype),
                         torch.randn(k, 48, generator=torch.Generator().manual_seed(99)).to(dtype))
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(_k_tiles, replay=replay)
        found[replay] = []
        for call in range(3):
            with sim.trace() as traced:
                out = kernel(*make(call)).clone()
            found[replay].append((out, [(i.engine, i.op) for i in traced.instructions]))
    for (out, ops), (ref_out, ref_ops) in zip(found[True], found[False]):
        assert ops == ref_ops and torch.equal(out.view(torch.int32), ref_out.view(torch.int32))
    x, w = make(2)
    torch.testing.assert_close(found[True][2][0], x.float().t() @ w.float(), rtol=1e-5, atol=1e-4)
    plan = sim_replay.plans(_k_tiles)[0]
    assert type(plan) is op_replay.Plan
    args = make(0)
    with _Dispatched() as seen:
        plan.run(args)
    assert torch.ops.aten.mm.out in seen.funcs and torch.ops.aten.mm.default not in seen.funcs
    # the bank's NaN fill is read by nothing (the addmm_ reads only what the mm wrote), and the
    # product is not copied into the bank: in fp32 (no operand casts) the loads, the evacuation and
    # the store are the copies
    assert torch.ops.aten.fill_.Scalar not in seen.funcs and torch.ops.aten.full.default not in seen.funcs
    if dtype is torch.float32:
        assert seen.funcs.count(torch.ops.aten.copy_.default) == 2 * ((k + 127) // 128) + 2


def _recorded(step, *args):
    """The live operations and layouts of `step(*args)` recorded on fresh tiles (no caller storage)."""
    recorder = op_replay.Recorder(args)
    with recorder:
        step(*args)
    return recorder.ops, recorder.layouts


def _tile():
    return torch.full((8, 16), float("nan"))


def _written_then_accumulated(x):
    t = _tile()
    t[:, 0:8].copy_(x)
    t[:, 0:8].add_(1.0)          # reads only what the copy wrote
    return t[:, 0:8].clone()


def _accumulated_past_what_was_written(x):
    t = _tile()
    t[:, 0:8].copy_(x)
    t[:, 0:9].add_(1.0)          # reads column 8: still the fill
    return t[:, 0:8].clone()


def _mm_out_then_read(x):
    t = _tile()
    torch.mm(x, x[0:8, :], out=t[:, 0:8])   # writes the view whole without reading it
    return t[:, 0:8].clone()


def _mm_out_then_read_wider(x):
    t = _tile()
    torch.mm(x, x[0:8, :], out=t[:, 0:8])
    return t[:, 0:10].clone()    # reads columns 8, 9: the fill


def _mm_out_reading_its_own_out(x):
    t = _tile()
    t[:, 8:16].copy_(x)
    torch.mm(t[:, 0:8], x[0:8, :], out=t[:, 0:8])  # an input is the (still filled) out view
    return t[:, 0:8].clone()


@pytest.mark.parametrize("step, skipped", [
    (_written_then_accumulated, True), (_accumulated_past_what_was_written, False),
    (_mm_out_then_read, True), (_mm_out_then_read_wider, False), (_mm_out_reading_its_own_out, False)])
def test_the_fill_analysis_follows_in_place_and_out_writes(step, skipped):
    ops, layouts = _recorded(step, torch.randn(8, 8))
    fills = [i for i, op in enumerate(ops) if op.func is torch.ops.aten.full.default]
    assert len(fills) == 1
    assert (fills[0] in op_replay_fills.skippable(ops, layouts, set())) is skipped


# -- the dead-copy pass (sim/op_replay_forwarding.py) past a recorded out= line --------------------------

def _mm_into(dst, a, b):
    """A recorded out= line: the interpreter's matmul writing its PSUM bank."""
    return op_replay._Call(aten.mm.out, (Ref(a), Ref(b)), {"out": Ref(dst)}, None, ())


_OUT_CASES = {  # name: (lines, whether the copy is dropped)
    "a copy the matmul's out= overwrites": (
        [_copy("pD", "pS"), _mm_into("pD", "pS2", "pQ"), _line(aten.exp.default, "pD", out="v1")], True),
    "a copy the matmul reads, then overwrites": (
        [_copy("pD", "pS"), _mm_into("pD", "pD", "pQ"), _line(aten.exp.default, "pD", out="v1")], False),
    "a copy the matmul's out= overwrites, an input overlapping it": (
        [_copy("pT1", "pS"), _mm_into("pT1", "pT0", "pQ"), _line(aten.exp.default, "pT1", out="v1")], False),
    "a copy into a view the out= covers only in part": (
        [_copy("pT0", "pS"), _mm_into("pT1", "pS2", "pQ"), _line(aten.exp.default, "pT0", out="v1")], False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_OUT_CASES))
def test_a_recorded_out_write_ends_a_copy_only_where_it_overwrites_unread(case, dtype):
    lines, dropped = _OUT_CASES[case]
    tiles = {**_tiles(dtype), "pQ": torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to(dtype)}
    out = _forwarded(lines, tiles)
    assert len(out) == len(lines) - dropped and aten.mm.out in [line.func for line in out]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a GEMM reading what it writes gives one answer on one thread)
    try:
        before, after = _run(lines, tiles), _run(out, tiles)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(after["v1"]), bits(before["v1"]))
