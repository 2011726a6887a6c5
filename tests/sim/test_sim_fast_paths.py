"""The interpreter's fast paths change nothing but speed: generated kernels give bit-identical
outputs and the same instruction trace (ops, engines, FLOPs, bytes, operands) as the general path.

The fast paths: `tensor._normalize_index`'s shortcut for in-range slices (every tile loop of the
templates indexes that way; the general path is `_checked_index`) and the replay of copy-only
kernels (`sim/replay.py`; the general path runs every kernel)."""

from __future__ import annotations

import random

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import op_replay
from neuron_inductor.sim import replay as sim_replay
from neuron_inductor.sim import tensor as sim_tensor
from neuron_inductor.sim.errors import NkiIndexError
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig


def _general_index(key, shape, on_chip):
    return sim_tensor._checked_index(key if type(key) is tuple else (key,), shape, on_chip)


def _random_key(rng: random.Random, shape) -> tuple:
    """Keys the fast path takes (in-range int slices) and keys at and past its edges."""
    key = []
    for size in shape[:rng.randint(1, len(shape))]:
        if rng.random() < 0.6:
            start = rng.randrange(size)
            key.append(slice(start, rng.randint(start + 1, size)))
            continue
        start = rng.randint(-1, size)
        stop = rng.choice([start + 1, size, size + 1, start, rng.randint(0, size)])
        key.append(rng.choice([slice(start, stop), slice(start, stop), slice(start, stop, rng.choice([None, 1, 2])),
                               slice(None, stop), sim_tensor.ds(max(start, 0), max(stop - start, 1)),
                               min(max(start, 0), size - 1), Ellipsis if Ellipsis not in key else slice(None)]))
    return tuple(key) if len(key) > 1 or rng.random() < 0.5 else key[0]


def _view_or_error(index, data: torch.Tensor, key, on_chip):
    try:
        view = data[index(key, data.shape, on_chip)]
    except NkiIndexError as error:
        return type(error), str(error)
    return tuple(view.shape), view.stride(), view.storage_offset()


@pytest.mark.parametrize("on_chip", [True, False])
def test_fast_index_path_gives_the_general_paths_views_and_errors(on_chip):
    rng = random.Random(16)
    fast_taken = 0
    for shape in [(128, 512), (4, 256, 2, 16), (3, 7, 5), (1, 9)]:
        data = torch.zeros(shape)
        for _ in range(400):
            key = _random_key(rng, shape)
            fast = _view_or_error(sim_tensor._normalize_index, data, key, on_chip)
            assert fast == _view_or_error(_general_index, data, key, on_chip), (shape, key)
            if fast[0] is not NkiIndexError:
                fast_taken += sim_tensor._normalize_index(key, shape, on_chip) is key
    assert fast_taken > 400  # the shortcut really ran, on a good share of the keys


def _block(x, w, g):
    h = torch.softmax(x @ w, dim=-1) * g
    return torch.nn.functional.silu(h).sum(0), h.to(torch.float32).amax(-1)


def _traced(step) -> tuple:
    with sim.trace() as recorded:
        out = step()
    ops = [(i.engine, i.op, i.flops, i.bytes, i.free_size, i.partitions, i.operands, i.kernel)
           for i in recorded.instructions]
    return out, ops


def _same_outputs_and_trace(step, monkeypatch) -> None:
    fast, fast_trace = _traced(step)
    with monkeypatch.context() as general:
        general.setattr(sim_tensor, "_normalize_index", _general_index)
        general.setattr(sim_replay, "signature", lambda *call: None)  # no call is replayed
        reference, reference_trace = _traced(step)
    assert len(fast_trace) > 20 and fast_trace == reference_trace
    for a, b in zip(torch.utils._pytree.tree_leaves(fast), torch.utils._pytree.tree_leaves(reference)):
        assert a.dtype == b.dtype and torch.equal(a, b)  # bit-identical (NaN-free outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generated_kernels_same_outputs_and_trace_on_both_paths(dtype, monkeypatch):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen).to(dtype) for s in [(130, 72), (72, 200), (200,)])
    compiled = torch.compile(_block, backend="neuron")
    compiled(x, w, g)  # compile (and check) first: only the runs are compared
    _same_outputs_and_trace(lambda: compiled(x, w, g), monkeypatch)


def test_llama_training_step_same_loss_grads_and_trace_on_both_paths(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLlama(TinyLlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64))
    compiled = torch.compile(model, backend="neuron")
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad()
        loss = compiled(ids, ids)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    step()
    _same_outputs_and_trace(step, monkeypatch)


# -- replay of copy-only kernels (sim/replay.py) ------------------------------------------------------

def _tiled_copy(x):
    """A copy through one SBUF tile per row block, as the copy / pointwise templates emit."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(x.shape[0] // 2):
        t = nl.ndarray((2, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[2 * i:2 * i + 2, :])
        nisa.dma_copy(dst=out[2 * i:2 * i + 2, :], src=t)
    return out


def _half_tile(x):
    """Reads a tile of which only the first row was written: the NaNs of fresh memory come out."""
    out = nl.ndarray((2, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((2, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:1, :], src=x[0:1, :])
    nisa.dma_copy(dst=out, src=t)
    return out


def _in_place_shift(x):
    """Writes into its argument what it read from it: each later read sees the earlier write."""
    for i in nl.sequential_range(x.shape[0] - 1):
        t = nl.ndarray((1, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i:i + 1, :])
        nisa.dma_copy(dst=x[i + 1:i + 2, :], src=t)
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: NaNs compare equal when their bits do."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _runs(kernel_func, make_input, calls=3):
    """[(output, trace)] of `calls` calls, each on a fresh input, with replay on and off."""
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(kernel_func, replay=replay)
        found[replay] = []
        for call in range(calls):
            x = make_input(call)
            out, ops = _traced(lambda: kernel(x))
            found[replay].append((out.clone(), x.clone(), ops))
    return found


@pytest.mark.parametrize("func, make_input", [
    (_tiled_copy, lambda call: torch.randn(10, 24, generator=torch.Generator().manual_seed(call))),
    (_tiled_copy, lambda call: torch.randn(6, 40, generator=torch.Generator().manual_seed(call)).to(torch.bfloat16)),
    (_tiled_copy, lambda call: torch.randn(24, 10, generator=torch.Generator().manual_seed(call)).t()),  # strided
    (_half_tile, lambda call: torch.randn(3, 8, generator=torch.Generator().manual_seed(call))),
    (_in_place_shift, lambda call: torch.randn(5, 8, generator=torch.Generator().manual_seed(call))),
])
def test_replayed_copy_kernels_give_the_same_bits_and_trace(func, make_input):
    runs = _runs(func, make_input)
    for (out, arg, ops), (ref_out, ref_arg, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and len(ops) >= 2
        assert torch.equal(_bits(out), _bits(ref_out)) and torch.equal(_bits(arg), _bits(ref_arg))


def test_a_replayed_kernel_returns_its_argument_itself():
    kernel = sim.Kernel(_in_place_shift, replay=True)
    for _ in range(2):  # recorded, then replayed
        x = torch.randn(5, 8)
        assert kernel(x) is x


def test_copy_kernels_with_whole_tiles_replay_copies_and_others_operations():
    replayed = {}
    for func, x in [(_tiled_copy, torch.randn(10, 24)), (_half_tile, torch.randn(3, 8)),
                    (_in_place_shift, torch.randn(5, 8))]:
        kernel = sim.Kernel(func, replay=True)
        kernel(x.clone())
        replayed[func.__name__] = {type(p) for (f, _), p in sim_replay._PLANS.items() if f is func}
    # _in_place_shift's tiles are fused: each read's source (the row before) was not written after its load;
    # _half_tile reads a tile written in part, so its copies cannot skip the tile: its operations are replayed
    assert replayed == {"_tiled_copy": {sim_replay.Plan}, "_half_tile": {op_replay.Plan},
                        "_in_place_shift": {sim_replay.Plan}}


# -- replay of compute kernels as their recorded operations (sim/op_replay.py) -------------------------

def _many_kernels(x, w, table, ids, q, k, v):
    """Pointwise, reductions, matmul, attention, norms and gathers: one kernel family or more each."""
    h = torch.nn.functional.silu(x) * 1.5 - x.exp() / (1 + x * x)
    norms = torch.nn.functional.layer_norm(h, h.shape[-1:]) + torch.nn.functional.rms_norm(x, x.shape[-1:], eps=1e-5)
    reduced = h.sum(-1), x.amax(0), torch.log_softmax(x, dim=-1).mean(-1)
    attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return norms @ w, reduced, attention, torch.nn.functional.embedding(ids, table), table.index_select(0, ids)


def _op_plans() -> int:
    return sum(type(p) is op_replay.Plan for p in sim_replay._PLANS.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 130])  # on and off the partition tile
def test_replayed_compute_kernels_give_the_same_bits_and_trace(dtype, rows, monkeypatch):
    torch._dynamo.reset()
    sim_replay._PLANS.clear()
    gen = torch.Generator().manual_seed(rows)
    x, w, table = (torch.randn(*s, generator=gen).to(dtype) for s in [(rows, 72), (72, 40), (50, 24)])
    ids = torch.randint(0, 50, (rows,), generator=gen)
    q, k, v = (torch.randn(1, 2, rows, 16, generator=gen).to(dtype) for _ in range(3))
    compiled = torch.compile(_many_kernels, backend="neuron")
    compiled(x, w, table, ids, q, k, v)  # compile, check and record
    assert _op_plans() >= 6  # the compute kernels are replayed, not only the copy kernels
    _same_outputs_and_trace(lambda: compiled(x, w, table, ids, q, k, v), monkeypatch)
    x2 = torch.randn(rows, 72, generator=gen).to(dtype)  # new values, same signature: replayed again
    _same_outputs_and_trace(lambda: compiled(x2, w, table, ids, q, k, v), monkeypatch)


def _log_kernel(x):
    """ScalarE log: its range check reads the data (a guard), its PSUM-free bookkeeping does not."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.activation(dst=t, op=nl.log, data=t)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_a_value_dependent_read_that_differs_runs_the_slow_path():
    x = torch.rand(4, 8) + 0.5
    runs = _runs(_log_kernel, lambda call: x if call < 2 else -x)  # the last call's inputs are out of range
    for (out, _, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(_bits(out), _bits(ref_out))
    assert torch.isnan(runs[True][-1][0]).all()  # the hardware's invalid output, as the slow path gives
    plans = [p for (f, _), p in sim_replay._PLANS.items() if f is _log_kernel]
    assert [type(p) for p in plans] == [op_replay.Plan] and plans[0].counts["guards"] >= 1


def _scale_in_place(x):
    """Writes its argument: the replay writes the caller's tensor too."""
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
    nisa.dma_copy(dst=x, src=t)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replayed_kernel_writing_its_argument_writes_the_same_bits(dtype):
    runs = _runs(_scale_in_place, lambda call: torch.randn(6, 130, generator=torch.Generator().manual_seed(call)).to(dtype))
    for (out, arg, ops), (ref_out, ref_arg, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(_bits(arg), _bits(ref_arg)) and torch.equal(_bits(out), _bits(arg))
    kernel = sim.Kernel(_scale_in_place, replay=True)
    x = torch.randn(6, 130).to(dtype)
    assert kernel(x) is x


@pytest.mark.parametrize("spent", [0, op_replay.PERSISTENT_TOTAL_BYTES])
def test_kept_tiles_stay_within_the_process_budget(spent, monkeypatch):
    """Plans keep their on-chip tiles between calls only while the process-wide budget lasts; past it a plan
    allocates them per call and gives the same bits."""
    sim_replay.forget()
    monkeypatch.setattr(op_replay, "_persistent_total", spent)
    runs = _runs(_log_kernel, lambda call: torch.rand(4, 8, generator=torch.Generator().manual_seed(call)) + 0.5)
    for (out, _, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(_bits(out), _bits(ref_out))
    kept = op_replay._persistent_total - spent
    assert (kept > 0) if spent == 0 else (kept == 0)
    sim_replay.forget()
    assert op_replay._persistent_total == 0
