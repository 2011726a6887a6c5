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
from neuron_inductor.sim import copy_batching
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import op_replay, op_replay_bindings, op_replay_casts, op_replay_transposes
from neuron_inductor.sim import replay as sim_replay
from neuron_inductor.sim import tensor as sim_tensor
from neuron_inductor.sim.op_replay_refs import Ref
from neuron_inductor.sim.errors import NkiIndexError
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

from .helpers import bits


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


def _rotary(q, cos, sin):
    half = q.shape[-1] // 2
    rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
    return q * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [256, 130])
def test_rotary_kernels_with_folded_lead_dims_same_outputs_and_trace_on_both_paths(dtype, seq, monkeypatch):
    # q seen through a transpose, [B, H, S, D], times [S, D] tables: pointwise tiles with H on the free axis
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(2, seq, 4, 16, generator=gen).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(seq, 16, generator=gen).to(dtype) for _ in range(2))
    compiled = torch.compile(_rotary, backend="neuron")
    compiled(q, cos, sin)
    _same_outputs_and_trace(lambda: compiled(q, cos, sin), monkeypatch)


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
        assert torch.equal(bits(out), bits(ref_out)) and torch.equal(bits(arg), bits(ref_arg))


def test_a_replayed_kernel_returns_its_argument_itself():
    kernel = sim.Kernel(_in_place_shift, replay=True)
    for _ in range(2):  # recorded, then replayed
        x = torch.randn(5, 8)
        assert kernel(x) is x


def test_copy_kernels_with_whole_tiles_replay_copies_and_others_operations():
    sim_replay.forget()
    replayed = {}
    for func, x in [(_tiled_copy, torch.randn(10, 24)), (_half_tile, torch.randn(3, 8)),
                    (_in_place_shift, torch.randn(5, 8))]:
        kernel = sim.Kernel(func, replay=True)
        for _ in range(2):  # run, then recorded
            kernel(x.clone())
        replayed[func.__name__] = {type(p) for p in sim_replay.plans(func)}
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
    return sum(type(p) is op_replay.Plan for p in sim_replay.plans())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 130])  # on and off the partition tile
def test_replayed_compute_kernels_give_the_same_bits_and_trace(dtype, rows, monkeypatch):
    torch._dynamo.reset()
    sim_replay.forget()
    gen = torch.Generator().manual_seed(rows)
    x, w, table = (torch.randn(*s, generator=gen).to(dtype) for s in [(rows, 72), (72, 40), (50, 24)])
    ids = torch.randint(0, 50, (rows,), generator=gen)
    q, k, v = (torch.randn(1, 2, rows, 16, generator=gen).to(dtype) for _ in range(3))
    compiled = torch.compile(_many_kernels, backend="neuron")
    for _ in range(2):
        compiled(x, w, table, ids, q, k, v)  # compile, check and run; then record
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
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    assert torch.isnan(runs[True][-1][0]).all()  # the hardware's invalid output, as the slow path gives
    plans = sim_replay.plans(_log_kernel)
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
        assert ops == ref_ops and torch.equal(bits(arg), bits(ref_arg)) and torch.equal(bits(out), bits(arg))
    kernel = sim.Kernel(_scale_in_place, replay=True)
    x = torch.randn(6, 130).to(dtype)
    assert kernel(x) is x


@pytest.mark.parametrize("func, plan_type", [(_scale_in_place, op_replay.Plan), (_in_place_shift, sim_replay.Plan),
                                             (_tiled_copy, sim_replay.Plan)])
def test_a_replay_advances_the_version_of_the_arguments_it_writes_as_the_slow_path(func, plan_type):
    """Replays dispatch below the autograd layer, which is what advances version counters: the plan
    advances them itself, so autograd still sees a saved tensor a replayed kernel overwrote."""
    sim_replay.forget()
    kernel = sim.Kernel(func, replay=True)
    versions = []
    for _ in range(2):  # recorded (the slow path), then replayed
        x = torch.randn(5, 8)
        before = x._version
        kernel(x)
        versions.append(x._version > before)
    assert [type(p) for p in sim_replay.plans(func)] == [plan_type]
    assert versions == [func is not _tiled_copy] * 2
    if func is _tiled_copy:
        return
    for _ in range(2):
        leaf = torch.randn(5, 8, requires_grad=True)
        saved = leaf.exp()  # exp's backward reads its result
        with torch.no_grad():
            kernel(saved)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.sum().backward()


def _concat(x, y):
    """out = [x | y] along columns by copies only, as cat([x, x]) passes one tensor twice."""
    out = nl.ndarray((x.shape[0], x.shape[1] + y.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[:, 0:x.shape[1]], src=x)
    nisa.dma_copy(dst=out[:, x.shape[1]:x.shape[1] + y.shape[1]], src=y)
    return out


def _scaled_sum(x, y):
    """out = 3x + y: compute instructions, so replayed as operations."""
    a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    b = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=y)
    nisa.tensor_scalar(dst=a, data=a, op0=nl.multiply, operand0=3.0)
    nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)
    return out


def _add_into(x, y):
    """x += y, written through x: when y is x (or overlaps it) a replay would have to see that write."""
    for i in nl.sequential_range(x.shape[0]):
        a = nl.ndarray((1, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        b = nl.ndarray((1, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x[i:i + 1, :])
        nisa.dma_copy(dst=b, src=y[i:i + 1, :])
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
        nisa.dma_copy(dst=x[i:i + 1, :], src=a)
    return x


def _shared(base: torch.Tensor, layout: str) -> tuple:
    """Two arguments on one storage: the tensor twice, or two overlapping views of it."""
    return (base, base) if layout == "same" else (base[0:4], base[2:6])


@pytest.mark.parametrize("layout", ["same", "overlapping"])
@pytest.mark.parametrize("func, plan_type", [(_concat, sim_replay.Plan), (_scaled_sum, op_replay.Plan)])
def test_arguments_sharing_memory_replay_when_the_kernel_only_reads_them(func, plan_type, layout):
    sim_replay.forget()
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(func, replay=replay)
        found[replay] = [_traced(lambda: kernel(*_shared(torch.randn(6, 8, generator=torch.Generator().manual_seed(call)),
                                                         layout))) for call in range(3)]
    for (out, ops), (ref_out, ref_ops) in zip(found[True], found[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    assert [type(p) for p in sim_replay.plans(func)] == [plan_type]
    # the same call on separate tensors is another signature, with a plan of its own
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):  # run, then recorded
        sim.Kernel(func, replay=True)(x, y)
    assert len(sim_replay.plans(func)) == 2


@pytest.mark.parametrize("layout", ["same", "overlapping"])
def test_a_kernel_writing_an_argument_that_shares_memory_runs_the_slow_path(layout):
    """x += x through x and y = x: each row's y read sees the x write before it only on the slow path
    (for overlapping views, rows 2-3 of x are rows 0-1 of y); no plan is kept for that signature."""
    sim_replay.forget()
    kernel = sim.Kernel(_add_into, replay=True)
    for call in range(3):
        base = torch.randn(6, 8, generator=torch.Generator().manual_seed(call))
        expected = base.clone()
        x, y = _shared(expected, layout)
        for i in range(x.shape[0]):
            x[i] += y[i]
        kernel(*_shared(base, layout))
        assert torch.equal(base, expected)
    assert sim_replay.plans(_add_into) == [None]


@pytest.mark.parametrize("spent", [0, op_replay.PERSISTENT_TOTAL_BYTES])
def test_kept_tiles_stay_within_the_process_budget(spent, monkeypatch):
    """Plans keep their on-chip tiles between calls only while the process-wide budget lasts; past it a plan
    allocates them per call and gives the same bits."""
    sim_replay.forget()
    monkeypatch.setattr(op_replay, "_persistent_total", spent)
    runs = _runs(_log_kernel, lambda call: torch.rand(4, 8, generator=torch.Generator().manual_seed(call)) + 0.5)
    for (out, _, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    kept = op_replay._persistent_total - spent
    assert (kept > 0) if spent == 0 else (kept == 0)
    sim_replay.forget()
    assert op_replay._persistent_total == 0


# -- loop batching, SPMD launches, indirect DMA and skipped fills in the replays ----------------------

def _row_tiles(x):
    """A copy through 128-row tiles (the last one ragged), read transposed-strided from the argument."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    rows, cols = x.shape
    for i in nl.affine_range((rows + 127) // 128):
        n = min(128, rows - 128 * i)
        for j in nl.affine_range(cols // 8):
            t = nl.ndarray((n, 8), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x[128 * i:128 * i + n, 8 * j:8 * j + 8])
            nisa.dma_copy(dst=out[128 * i:128 * i + n, 8 * j:8 * j + 8], src=t)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 130])
def test_a_tile_loops_copies_replay_as_few_strided_copies_with_the_same_bits(dtype, rows):
    make = lambda call: torch.randn(32, rows, generator=torch.Generator().manual_seed(call)).to(dtype).t()
    runs = _runs(_row_tiles, make)
    for (out, _, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and len(ops) == 2 * 4 * ((rows + 127) // 128)
        assert torch.equal(bits(out), bits(ref_out))
    plans = sim_replay.plans(_row_tiles)
    assert len(plans[-1].copies) == (rows + 127) // 128  # one copy per row block (the ragged one apart)


def _permuted_plus_row(x):
    """[H, S, D] read as [S, H * D] tiles through permuted and broadcast HBM views (pointwise fold_leads),
    plus its own first head, written back through a permuted view."""
    heads, seq, dim = x.shape
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((seq, heads * dim), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.permute((1, 0, 2)))
    first = nl.ndarray((seq, heads * dim), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=first, src=x[0:1].broadcast(0, heads).permute((1, 0, 2)))
    nisa.tensor_tensor(dst=t, data1=t, data2=first, op=nl.add)
    nisa.dma_copy(dst=out.permute((1, 0, 2)), src=t)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dmas_through_permuted_and_broadcast_views_copy_in_place_with_the_same_bits(dtype):
    make = lambda call: torch.randn(4, 100, 8, generator=torch.Generator().manual_seed(call)).to(dtype)
    runs = _runs(_permuted_plus_row, make)
    for (out, arg, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
        assert torch.equal(out, (arg.float() + arg[0:1].float()).to(dtype))
    plan = sim_replay.plans(_permuted_plus_row)[-1]
    # each DMA is one copy into the tile seen as the source's shape: no compact copy of the source first
    replayed = {getattr(v, "__name__", "") for k, v in plan.function.__globals__.items() if k[0] == "f"}
    assert "copy_" in replayed and not replayed & {"clone", "_unsafe_view", "reshape"}


def _view(sizes, strides, offset, owner=("arg", 0)):
    return owner, sizes, strides, offset, False


def test_copy_runs_merge_only_between_tensors_into_elements_written_once():
    out = ("out", 0)
    run = [(_view((4, 8), (8, 1), 32 * k, out), _view((4, 8), (16, 1), 8 * k)) for k in range(4)]
    assert copy_batching.batched(run) == [(_view((4, 4, 8), (32, 8, 1), 0, out), _view((4, 4, 8), (8, 16, 1), 0))]
    overlapping = [(_view((4, 8), (8, 1), 4 * k, out), _view((4, 8), (8, 1), 32 * k)) for k in range(3)]
    assert copy_batching.batched(overlapping) == overlapping  # later writes win: kept in order
    same_tensor = [(_view((1, 8), (8, 1), 8 * k + 64), _view((1, 8), (8, 1), 8 * k)) for k in range(3)]
    assert copy_batching.batched(same_tensor) == same_tensor  # each may read what the one before wrote
    nested = [(_view((2,), (1,), 2 * i + 16 * j, out), _view((2,), (1,), 2 * i + 8 * j)) for j in range(3) for i in range(4)]
    assert copy_batching.batched(nested) == [(_view((3, 4, 2), (16, 2, 1), 0, out), _view((3, 4, 2), (8, 2, 1), 0))]


def _swap_halves(data):
    """LNC2: each core computes on its half, trades it with the other core and meets it at a barrier."""
    me = nl.program_id(0)
    mine = nl.ndarray(tuple(data.shape[1:]), data.dtype)
    nisa.dma_copy(dst=mine, src=data[me])
    theirs = nl.ndarray(tuple(data.shape[1:]), data.dtype)
    nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=0)
    total = nl.ndarray(tuple(data.shape[1:]), nl.float32)
    nisa.tensor_tensor(total, mine, theirs, nl.subtract)
    shared = nl.ndarray((2, *data.shape[1:]), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=shared[me], src=total)
    nisa.core_barrier(shared, cores=(0, 1))
    check = nl.ndarray(tuple(data.shape[1:]), nl.float32)
    nisa.dma_copy(dst=check, src=shared[1 - me])
    nisa.activation(dst=check, op=nl.exp, data=check)
    sums = nl.ndarray((2, *data.shape[1:]), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=sums[me], src=check)
    return shared, sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 130 - 64])
def test_an_spmd_launch_replays_its_programs_with_the_same_bits_and_trace(dtype, rows):
    sim_replay.forget()
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(_swap_halves, replay=replay)[2]
        found[replay] = []
        for call in range(3):
            x = torch.randn(2, rows, 24, generator=torch.Generator().manual_seed(call)).to(dtype)
            with sim.trace() as recorded:
                out, ops = _traced(lambda: kernel(x))
            found[replay].append(([o.clone() for o in out], ops + [i.program_id for i in recorded.instructions]))
    for (outs, ops), (ref_outs, ref_ops) in zip(found[True], found[False]):
        assert ops == ref_ops and {(0,), (1,)} <= set(ops)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, ref_outs))
    assert [type(p) for p in sim_replay.plans(_swap_halves)] == [op_replay.Plan]


def _gather_scatter(table, ids, grad):
    """Rows of `table` by index (a gather), and `grad` added into a zeroed table at them (a scatter)."""
    p, f = ids.shape[0], table.shape[1]
    idx = nl.ndarray((p, 1), nl.int32)
    nisa.dma_copy(dst=idx, src=ids)
    rows = nl.ndarray((p, f), table.dtype)
    nisa.dma_copy(dst=rows, src=table.ap([[f, p], [1, f]], vector_offset=idx, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip)
    out = nl.ndarray((p, f), table.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows)
    scattered = nl.ndarray(table.shape, table.dtype, buffer=nl.shared_hbm)
    zeros = nl.ndarray(table.shape, table.dtype)
    nisa.memset(zeros, 0.0)
    nisa.dma_copy(dst=scattered, src=zeros)
    values = nl.ndarray((p, f), grad.dtype)
    nisa.dma_copy(dst=values, src=grad)
    nisa.dma_copy(dst=scattered.ap([[f, p], [1, f]], vector_offset=idx, indirect_dim=0), src=values,
                  oob_mode=nisa.oob_mode.skip)
    return out, scattered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indirect_dma_kernels_replay_and_rows_out_of_bounds_run_the_slow_path(dtype):
    sim_replay.forget()
    gen = torch.Generator().manual_seed(5)
    table, grad = torch.randn(100, 16, generator=gen).to(dtype), torch.randn(128, 16, generator=gen).to(dtype)
    unique = [torch.randperm(100, generator=gen)[:64].repeat(2)[:128, None].int() for _ in range(3)]
    calls = unique + [torch.where(unique[0] % 7 == 0, 1000, unique[0]).int()]  # the last: rows out of bounds
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(_gather_scatter, replay=replay)
        found[replay] = [_traced(lambda: [o.clone() for o in kernel(table, ids, grad)]) for ids in calls]
    for (outs, ops), (ref_outs, ref_ops) in zip(found[True], found[False]):
        assert ops == ref_ops and all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, ref_outs))
    assert [type(p) for p in sim_replay.plans(_gather_scatter)] == [op_replay.Plan]
    sim_replay.forget()
    for _ in range(2):  # run, then recorded with rows out of bounds
        sim.Kernel(_gather_scatter, replay=True)(table, calls[-1], grad)
    assert sim_replay.plans(_gather_scatter) == [None]


def _column_blocks(x, w):
    """A PSUM tile written in column blocks by matmuls, then read whole: its NaN fill is never read."""
    k, m = x.shape
    n = w.shape[1]
    lhs, rhs = nl.ndarray((k, m), x.dtype), nl.ndarray((k, n), w.dtype)
    nisa.dma_copy(dst=lhs, src=x)
    nisa.dma_copy(dst=rhs, src=w)
    acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    for j in nl.affine_range(n // 32):
        nisa.nc_matmul(acc[:, 32 * j:32 * j + 32], lhs, rhs[:, 32 * j:32 * j + 32])
    res = nl.ndarray((m, n), nl.float32)
    nisa.tensor_copy(res, acc)
    out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res)
    return out


def test_fills_nothing_reads_are_skipped_with_the_same_bits():
    make = lambda call: torch.randn(64, 128, generator=torch.Generator().manual_seed(call))
    w = torch.randn(64, 96)
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(_column_blocks, replay=replay)
        found[replay] = [_traced(lambda: kernel(make(call), w)) for call in range(3)]
    for (out, ops), (ref_out, ref_ops) in zip(found[True], found[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    plan = sim_replay.plans(_column_blocks)[0]
    with sim.trace(), _Dispatched() as seen:
        plan.run((make(0), w))
    assert torch.ops.aten.fill_.Scalar not in seen.funcs and torch.ops.aten.full.default not in seen.funcs


def _reads_a_tile_before_writing_it(x):
    """Copies out a tile's fill (never written yet), then writes the tile: each call must read the
    fill again, not what the call before wrote."""
    t = nl.ndarray(x.shape, nl.float32)
    before = nl.ndarray(x.shape, nl.float32)
    nisa.tensor_copy(before, t)
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    nisa.tensor_tensor(dst=t, data1=t, data2=before, op=nl.add)
    nisa.dma_copy(dst=out, src=t)
    return out


def _refills(plan, args) -> bool:
    """Whether a plan's call puts a fill back: a kept tile's first value copied back in (its `iv`
    copy), or a fill made anew (a tile whose storage the interpreter recycled is filled by fill_)."""
    with sim.trace(), _Dispatched() as seen:
        plan.run(args)
    fills = {torch.ops.aten.fill_.Scalar, torch.ops.aten.full.default}
    return any(name.startswith("iv") for name in plan.function.__globals__) or bool(fills & seen.funcs)


@pytest.mark.parametrize("recycled", [False, True])
def test_kept_tiles_are_re_filled_per_call_only_where_their_fill_is_read(recycled, monkeypatch):
    """A kept (persistent) tile's NaN fill is put back on each call only when an element of it is
    read before being written: PSUM banks written in column blocks are not re-filled. A fill that is
    read, of a tile nothing else writes, may instead be held once (op_replay_folding): every call
    must read the fill, never what the call before left. `recycled`: the interpreter hands out tiles
    of storage an earlier kernel gave back (their fill is a fill_, not a fresh tile's first value)."""
    sim_replay.forget()
    monkeypatch.setattr(sim_tensor, "_RECYCLED", {((8, 24), torch.float32): [torch.zeros(8, 24) for _ in range(4)]}
                        if recycled else {})
    w = torch.randn(64, 96)
    for func, make, reads_fill in [
            (_column_blocks, lambda call: (torch.randn(64, 128, generator=torch.Generator().manual_seed(call)), w), False),
            (_reads_a_tile_before_writing_it, lambda call: (torch.randn(8, 24, generator=torch.Generator().manual_seed(call)),), True)]:
        found = {}
        for replay in (True, False):
            kernel = sim.Kernel(func, replay=replay)
            found[replay] = [_traced(lambda: kernel(*make(call))) for call in range(3)]
        for (out, ops), (ref_out, ref_ops) in zip(found[True], found[False]):
            assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
            assert bool(torch.isnan(out).all()) is reads_fill  # NaN + x: the fill was read, on every call
        plan = sim_replay.plans(func)[0]
        assert type(plan) is op_replay.Plan, func.__name__
        if not reads_fill:
            assert not _refills(plan, make(0))


@pytest.mark.parametrize("replay", [False, True])
def test_a_dispatch_mode_around_a_kernel_call_sees_none_of_its_operations(replay):
    """A kernel's torch operations are the device's work: a mode around the call (AOTAutograd's
    custom-op aliasing check on a graph's first call, a user's FlopCounterMode) neither sees them
    nor slows them, and the result and the replay are unchanged."""
    sim_replay.forget()
    kernel = sim.Kernel(_column_blocks, replay=replay)
    x, w = torch.randn(32, 16), torch.randn(32, 64)
    for _ in range(2):  # record, then replay
        with _Dispatched() as seen:
            out = kernel(x, w)
        assert seen.funcs == set()
        torch.testing.assert_close(out, x.t() @ w, rtol=1e-5, atol=1e-5)
    with _Dispatched() as seen:
        torch.mm(x.t(), w)  # the mode itself still sees the caller's operations
    assert torch.ops.aten.mm.default in seen.funcs


class _Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.funcs = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.add(func)
        return func(*args, **(kwargs or {}))


def _reshaped_read(x):
    """Reshapes a transposed argument, which torch cannot view: the kernel reads through a copy."""
    flat = x.reshape((x.shape[0] * x.shape[1] // 8, 8))
    t = nl.ndarray(tuple(flat.shape), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=flat)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    out = nl.ndarray(tuple(flat.shape), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_replay_under_inference_mode_with_the_same_bits_and_trace(dtype, monkeypatch):
    """Under inference mode torch hands `reshape` to the recorder undecomposed, declared a view even
    where it copies (the root cause of inference mode once staying on the slow path)."""
    sim_replay.forget()
    with torch.inference_mode():
        runs = _runs(_reshaped_read, lambda call: torch.randn(16, 12, generator=torch.Generator().manual_seed(call))
                     .to(dtype).t())
        for (out, _, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
            assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
        assert [type(p) for p in sim_replay.plans(_reshaped_read)] == [op_replay.Plan]
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(3)
        x, w, table = (torch.randn(*s, generator=gen).to(dtype) for s in [(130, 72), (72, 40), (50, 24)])
        ids = torch.randint(0, 50, (130,), generator=gen)
        q, k, v = (torch.randn(1, 2, 130, 16, generator=gen).to(dtype) for _ in range(3))
        compiled = torch.compile(_many_kernels, backend="neuron")
        for _ in range(2):  # run, then recorded
            compiled(x, w, table, ids, q, k, v)
        assert _op_plans() >= 6
        _same_outputs_and_trace(lambda: compiled(x, w, table, ids, q, k, v), monkeypatch)


# -- making a plan: binding probes on meta, the fill analysis, the kernel's threads -------------------

_SPEC = op_replay_bindings.TensorSpec


def test_a_binding_is_probed_on_meta_per_argument_kind():
    """A binding is used only where it dispatches exactly the recorded overload: `torch.pow` takes
    `pow.Tensor_Scalar` for a Python number but `pow.Tensor_Tensor` for a 0-d tensor, so a verdict
    for one kind must not answer for the other."""
    pow_scalar, x = torch.ops.aten.pow.Tensor_Scalar, _SPEC((128, 64), (64, 1), torch.bfloat16)
    assert op_replay_bindings.dispatches_exactly(pow_scalar, torch.pow, (x, 2.0), {})
    assert not op_replay_bindings.dispatches_exactly(pow_scalar, torch.pow, (x, torch.tensor(2.0)), {})
    assert op_replay_bindings.dispatches_exactly(torch.ops.aten.pow.Tensor_Tensor, torch.pow, (x, torch.tensor(2.0)), {})
    # another overload than the recorded one, and an operation meta cannot run: the operation object is used
    assert not op_replay_bindings.dispatches_exactly(torch.ops.aten.mul.Scalar, torch.mul, (x, 2.0), {})
    assert not op_replay_bindings.dispatches_exactly(torch.ops.aten.is_nonzero.default, torch.is_nonzero,
                                                     (_SPEC((), (), torch.float32),), {})
    # a factory's device becomes meta: a 16 GiB tile is probed without being made
    full = torch.ops.aten.full.default
    assert op_replay_bindings.dispatches_exactly(full, torch.full, ([1 << 16, 1 << 16], 0.0),
                                                 {"dtype": torch.float32, "device": torch.device("cpu")})


def test_making_a_plan_runs_no_math_on_the_data_and_uses_the_kernels_threads(monkeypatch):
    """The binding check probes meta tensors (it used to run the plan on copies of the arguments),
    and the plan is made with the kernel's torch threads, not the caller's (an OpenMP team of the
    caller's size waits on descheduled threads on a busy machine: the fill analysis of a d=1024 step
    took minutes)."""
    sim_replay.forget()
    seen = {"threads": [], "devices": set()}
    skippable, probe = op_replay.op_replay_fills.skippable, op_replay_bindings._probe

    def recording_skippable(*args):
        seen["threads"].append(torch.get_num_threads())
        return skippable(*args)

    def recording_probe(func, binding, args, kwargs):
        seen["devices"].update(a.device.type for a in args if isinstance(a, torch.Tensor) and a.dim())
        return probe(func, binding, args, kwargs)

    monkeypatch.setattr(op_replay.op_replay_fills, "skippable", recording_skippable)
    monkeypatch.setattr(op_replay_bindings, "_probe", recording_probe)
    monkeypatch.setattr(op_replay_bindings, "_VERDICTS", {})
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = _runs(_log_kernel, lambda call: torch.rand(4, 8, generator=torch.Generator().manual_seed(call)) + 0.5)
    finally:
        torch.set_num_threads(previous)
    for (out, _, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    assert seen["threads"] == [1] and seen["devices"] == {"meta"}


@pytest.mark.parametrize("sizes, strides, distinct", [
    ((4, 8), (8, 1), True), ((8, 4), (1, 8), True), ((4, 1, 8), (8, 0, 1), True),  # a size-1 dim's stride is moot
    ((4, 8), (0, 1), False), ((3, 3), (2, 1), False), ((2, 4), (16, 2), True),
])
def test_the_fill_analysis_counts_a_write_through_repeated_elements_on_the_storage(sizes, strides, distinct):
    """fill_ / zero_ write through views that name one element twice (copy_ refuses them): such a
    write's element count would overstate what it overwrote, so it is counted on the storage
    (the test the fill analysis shares with copy_batching's merges)."""
    view = torch.zeros(64).as_strided(sizes, strides)
    assert copy_batching.each_element_once(tuple(view.shape), view.stride()) is distinct


# -- transposing copies between tiles routed through a scratch (sim/op_replay_transposes.py) --------

def _transpose_blocks(x):
    """Transposes 128-column blocks of x on TensorE out of a wide SBUF tile (rows 1024 elements apart:
    each transpose is a copy whose source steps 2 or 4 KiB), through PSUM, back to HBM."""
    rows, cols = x.shape
    out = nl.ndarray((cols, rows), dtype=x.dtype, buffer=nl.shared_hbm)
    wide = nl.ndarray((rows, 1024), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=wide[:, 0:cols], src=x)
    for c in nl.affine_range(cols // 128):
        t_psum = nl.ndarray((128, rows), dtype=x.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=t_psum, data=wide[:, 128 * c:128 * c + 128])
        t = nl.ndarray((128, rows), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t, src=t_psum)
        nisa.dma_copy(dst=out[128 * c:128 * c + 128, :], src=t)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 100])  # on and off the partition tile
def test_routed_transposes_replay_with_the_same_bits_and_trace(dtype, rows):
    make = lambda call: torch.randn(rows, 256, generator=torch.Generator().manual_seed(call)).to(dtype)
    runs = _runs(_transpose_blocks, make)
    for (out, _, ops), (ref_out, _, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    x = make(0)
    assert torch.equal(bits(runs[True][0][0]), bits(x.t().contiguous()))
    plans = sim_replay.plans(_transpose_blocks)
    assert isinstance(plans[-1], op_replay.Plan)
    assert sum(name.endswith("_scratch") for name in plans[-1].function.__globals__) == 2  # one per transpose


def _copy_call(dst: str, src: str):
    return op_replay._Call(torch.ops.aten.copy_.default, (Ref(dst), Ref(src)), {}, None, ())


def _run_calls(calls, namespace):
    for call in calls:
        call.func(*(namespace[a.name] for a in call.args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposing_copies_route_only_between_separate_regions(dtype):
    """Routed: a transpose out of a wide tile, also one that rounds fp32 to bf16 on the way (the
    second step converts, element by element, as the direct copy did). Not routed: a source
    overlapping its destination's storage extent, a copy that does not transpose, a small one."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(128, 1024, generator=gen) * 1e3 + 1 / 3  # values whose bf16 rounding shows
    wide_d = wide.to(dtype)
    nan = lambda shape, t=dtype: torch.full(shape, float("nan"), dtype=t)
    cases = {  # name: (dst, src, routed)
        "transpose": (nan((128, 128)), wide_d[:, 128:256].t(), True),
        "converting": (nan((128, 128), torch.bfloat16), wide[:, 0:128].t(), True),
        "3-d": (nan((2, 128, 128)), wide_d.view(128, 8, 128)[:, 2:4, :].permute(1, 2, 0), True),
        "overlapping": (wide_d[:, 0:128], wide_d[:, 64:192].t(), False),
        "not transposing": (nan((128, 128)), wide_d[:, 0:128], False),
        "small": (nan((16, 16)), wide_d[0:16, 0:16].t(), False),
    }
    for name, (dst, src, routed) in cases.items():
        namespace = {"pdst": dst, "psrc": src}
        expected = dst.clone().copy_(src)
        calls = op_replay_transposes.routed([_copy_call("pdst", "psrc")], namespace, {})
        assert len(calls) == (2 if routed else 1), name
        if name != "overlapping":  # (left to torch's copy_ as recorded)
            _run_calls(calls, namespace)
            assert torch.equal(bits(namespace["pdst"]), bits(expected)), name


def _transposed_load(x):
    """dma_transpose of each 128-column block of an HBM argument into a panel (its rows are as far
    apart as its columns make them), then the panel back to HBM."""
    rows, cols = x.shape
    out = nl.ndarray((cols, rows), dtype=x.dtype, buffer=nl.shared_hbm)
    panel = nl.ndarray((128, cols // 128, rows), dtype=x.dtype, buffer=nl.sbuf)
    for c in nl.affine_range(cols // 128):
        nisa.dma_transpose(dst=panel[:, c, :], src=x[:, 128 * c:128 * c + 128])
    for c in nl.affine_range(cols // 128):
        nisa.dma_copy(dst=out[128 * c:128 * c + 128, :], src=panel[:, c, :])
    return out


@pytest.mark.parametrize("dtype, cols, routed", [
    (torch.bfloat16, 1024, True), (torch.float32, 512, True),  # rows 2 KiB apart
    (torch.bfloat16, 1408, False), (torch.float32, 640, False),  # 2816 and 2560 B apart: copied directly
])
@pytest.mark.parametrize("rows", [128, 100])
def test_transposing_loads_out_of_arguments_replay_with_the_same_bits_and_trace(dtype, cols, routed, rows):
    make = lambda call: torch.randn(rows, cols, generator=torch.Generator().manual_seed(call)).to(dtype)
    runs = _runs(_transposed_load, make)
    for (out, arg, ops), (ref_out, ref_arg, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out)) and torch.equal(bits(arg), bits(ref_arg))
        assert torch.equal(bits(out), bits(arg.t().contiguous()))
    plans = sim_replay.plans(_transposed_load)
    assert isinstance(plans[-1], op_replay.Plan)
    scratches = sum(name.endswith("_scratch") for name in plans[-1].function.__globals__)
    assert scratches == (cols // 128 if routed else 0)


def _run_calls_with_results(calls, namespace):
    for call in calls:
        value = call.func(*(namespace[a.name] if isinstance(a, Ref) else a for a in call.args))
        if call.new:
            namespace[call.outs.name] = value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposing_loads_route_only_argument_views_whose_rows_alias(dtype):
    """A copy into a kept tile out of an argument's view (made by one as_strided of it) is routed when
    the view's step along the tile's rows is a multiple of 2 KiB, also when it converts on the way;
    not a step of 2816 B, a copy that does not transpose, or a view of another dtype than its root."""
    gen = torch.Generator().manual_seed(5)
    elements = 2048 // torch.empty((), dtype=dtype).element_size()  # a row of 2 KiB
    nan = lambda t=dtype: torch.full((128, 128), float("nan"), dtype=t)
    cases = {  # name: (argument, view (sizes, strides, offset), view dtype, dst, routed)
        "transposing": (torch.randn(256, elements, generator=gen).to(dtype), ((128, 128), (1, elements), 128), dtype,
                        nan(), True),
        "converting": (torch.randn(256, elements, generator=gen).to(dtype) * 1e3 + 1 / 3,
                       ((128, 128), (1, elements), 0), dtype, nan(torch.bfloat16 if dtype is torch.float32 else torch.float32),
                       True),
        "2816 B": (torch.randn(256, 2816 // (2048 // elements), generator=gen).to(dtype),
                   ((128, 128), (1, 2816 // (2048 // elements)), 0), dtype, nan(), False),
        "not transposing": (torch.randn(256, elements, generator=gen).to(dtype), ((128, 128), (elements, 1), 0), dtype,
                            nan(), False),
        "dtype view": (torch.randn(256, elements, generator=gen).to(dtype), ((128, 128), (1, elements), 0),
                       torch.int16 if dtype is torch.bfloat16 else torch.int32, nan(), False),
    }
    for name, (arg, (sizes, strides, offset), view_dtype, dst, routed) in cases.items():
        layouts = {"a0": ("a0", tuple(arg.shape), arg.stride(), 0, arg.dtype),
                   "v1": ("a0", sizes, strides, offset, view_dtype)}
        make_view = op_replay._Call(torch.ops.aten.as_strided.default, (Ref("a0"), sizes, strides, offset),
                                    {}, Ref("v1"), ("v1",))
        namespace = {"pdst": dst, "a0": arg}
        calls = op_replay_transposes.routed([make_view, _copy_call("pdst", "v1")], namespace, layouts)
        assert len(calls) == (4 if routed else 2), name  # (the recorded view is left to the unread-view pass)
        if view_dtype is not dtype:
            continue
        expected = dst.clone().copy_(arg.as_strided(sizes, strides, offset))
        _run_calls_with_results(calls, namespace)
        assert torch.equal(bits(namespace["pdst"]), bits(expected)), name


# -- repeated casts of an unchanged tile reused (sim/op_replay_casts.py) -----------------------------

def _stationary_reused(a, b):
    """One stationary tile against three moving ones; before the last it is scaled in place, so
    that matmul must see the new values (its cast of the tile may not be the first one's)."""
    out = nl.ndarray((3, 128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    s = nl.ndarray((128, 128), dtype=a.dtype, buffer=nl.sbuf)
    m = nl.ndarray((128, 256), dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=a)
    nisa.dma_copy(dst=m, src=b)
    for j in range(3):
        if j == 2:
            nisa.tensor_scalar(dst=s, data=s, op0=nl.multiply, operand0=3.0)
        p = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=m[:, 128 * (j % 2):128 * (j % 2) + 128], accumulate=False)
        t = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t, src=p)
        nisa.dma_copy(dst=out[j], src=t)
    return out


def _replayed_and_not(kernel_func, a_cols: int, dtype) -> list:
    """The last call's (out, a, b) of three calls of kernel_func(a [128, a_cols], b [128, 256]) on
    fresh inputs, after checking that replayed calls give the slow path's bits and trace."""
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(kernel_func, replay=replay)
        found[replay] = []
        for call in range(3):
            gen = torch.Generator().manual_seed(call)
            a, b = torch.randn(128, a_cols, generator=gen).to(dtype), torch.randn(128, 256, generator=gen).to(dtype)
            out, ops = _traced(lambda: kernel(a, b))
            found[replay].append((out.clone(), ops, a, b))
    for (out, ops, _, _), (ref_out, ref_ops, _, _) in zip(found[True], found[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    out, _, a, b = found[True][-1]
    return out, a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_casts_replay_with_the_same_bits_and_trace(dtype):
    out, _, _ = _replayed_and_not(_stationary_reused, 128, dtype)
    assert not torch.equal(out[2], out[0])  # the scaled tile was used


def _cast(out: str, src: str):
    return op_replay._Call(torch.ops.aten._to_copy.default, (Ref(src),), {"dtype": Ref("c0")},
                           Ref(out), (out,))


def _read(*names):
    refs = tuple(Ref(n) for n in names)
    return op_replay._Call(torch.ops.aten.add.Tensor, refs, {}, Ref("vsum"), ("vsum",))


def _in_place(name: str):
    return op_replay._Call(torch.ops.aten.mul_.Tensor, (Ref(name), Ref("c1")), {}, None, ())


def test_a_cast_is_reused_only_while_its_tile_and_both_results_are_unchanged():
    tile, other = torch.randn(128, 256).to(torch.bfloat16), torch.randn(128, 256).to(torch.bfloat16)
    namespace = {"c0": torch.float32, "c1": torch.tensor(3.0), "pa": tile[:, 0:128], "pb": tile[:, 0:128],
                 "pc": tile[:, 128:256], "po": other[:, 0:128]}
    reused = lambda calls, results=(): op_replay_casts.reused(calls, namespace, set(results))
    repeat = [_cast("v1", "pa"), _cast("v2", "pb"), _read("v1", "v2")]
    kept = reused(repeat)
    assert len(kept) == 2 and [r.name for r in kept[-1].args] == ["v1", "v1"]  # same view of one tile: reused
    assert len(reused([_cast("v1", "pa"), _cast("v2", "pc"), _read("v1", "v2")])) == 3  # another region
    changed = [_cast("v1", "pa"), _in_place("pb"), _cast("v2", "pa"), _read("v1", "v2")]
    assert len(reused(changed)) == 4  # the tile was written in between
    assert len(reused([_cast("v1", "pa"), _in_place("po"), _cast("v2", "pa"), _read("v1", "v2")])) == 3  # another tile
    assert len(reused([_cast("v1", "pa"), _in_place("v1"), _cast("v2", "pa"), _read("v1", "v2")])) == 4  # result written
    through_view = [_cast("v1", "pa"),
                    op_replay._Call(torch.ops.aten.t.default, (Ref("v2"),), {}, Ref("v3"), ("v3",)),
                    _in_place("v3")]
    assert len(reused([_cast("v1", "pa"), _cast("v2", "pa")] + through_view[1:])) == 4  # written through a view
    assert len(reused(repeat, results=["v2"])) == 3  # returned to the caller


def _order(calls) -> list:
    return [(c.func._schema.name.split("::")[1], c.new[0] if c.new else c.args[0].name) for c in calls]


def test_a_cast_moves_up_to_just_after_the_last_write_that_may_reach_what_it_reads():
    tile, other = torch.randn(128, 2048).to(torch.bfloat16), torch.randn(128, 256).to(torch.bfloat16)  # rows 4 KiB
    namespace = {"c0": torch.float32, "c1": torch.tensor(3.0), "pa": tile[:, 0:128], "pc": tile[:, 128:256],
                 "po": other[:, 0:128]}
    hoisted = lambda calls: _order(op_replay_casts.hoisted(calls, namespace))
    # written, then other tiles and the tile's other half: the cast follows the write of its half
    calls = [_in_place("pa"), _in_place("po"), _in_place("pc"), _read("po", "pc"), _cast("v1", "pa")]
    assert hoisted(calls) == [("mul_", "pa"), ("_to_copy", "v1"), ("mul_", "po"), ("mul_", "pc"), ("add", "vsum")]
    # written again later: it follows the last write
    calls = [_in_place("pa"), _in_place("po"), _in_place("pa"), _in_place("pc"), _cast("v1", "pa")]
    assert hoisted(calls) == [("mul_", "pa"), ("mul_", "po"), ("mul_", "pa"), ("_to_copy", "v1"), ("mul_", "pc")]
    # a write through a view made at run time may reach the whole tile: the cast follows it
    view = op_replay._Call(torch.ops.aten.as_strided.default, (Ref("pc"), (128, 64), (2048, 1), 64), {},
                           Ref("v2"), ("v2",))
    calls = [_in_place("pa"), view, _in_place("v2"), _in_place("po"), _cast("v1", "pa")]
    assert hoisted(calls) == [("mul_", "pa"), ("as_strided", "v2"), ("mul_", "v2"), ("_to_copy", "v1"), ("mul_", "po")]
    # never written in the plan (a value kept from an earlier call): stays where it is
    calls = [_in_place("po"), _in_place("pc"), _cast("v1", "pa")]
    assert hoisted(calls) == _order(calls)
    # rows closer than a page (512 B): converts as fast where it is
    calls = [_in_place("po"), _in_place("pa"), _cast("v1", "po")]
    assert hoisted(calls) == _order(calls)


def _panel_matmuls(a, b):
    """A stationary panel loaded block by block (rows 4 KiB apart in bf16), one block scaled after the
    loads, then one matmul per block: each block's cast moves up to its DMA, the scaled one's to the
    scaling."""
    blocks = a.shape[1] // 128
    out = nl.ndarray((blocks, 128, 256), dtype=nl.float32, buffer=nl.shared_hbm)
    panel = nl.ndarray((128, blocks, 128), dtype=a.dtype, buffer=nl.sbuf)
    m = nl.ndarray((128, 256), dtype=b.dtype, buffer=nl.sbuf)
    for c in nl.affine_range(blocks):
        nisa.dma_copy(dst=panel[:, c, :], src=a[:, 128 * c:128 * c + 128])
    nisa.dma_copy(dst=m, src=b)
    nisa.tensor_scalar(dst=panel[:, 1, :], data=panel[:, 1, :], op0=nl.multiply, operand0=3.0)
    for c in nl.affine_range(blocks):
        p = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=panel[:, c, :], moving=m, accumulate=False)
        t = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t, src=p)
        nisa.dma_copy(dst=out[c], src=t)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hoisted_casts_replay_with_the_same_bits_and_trace(dtype):
    out, a, b = _replayed_and_not(_panel_matmuls, 2048, dtype)
    expected = torch.stack([a[:, 128 * c:128 * c + 128].float().t() @ b.float() for c in range(16)])
    expected[1] = (a[:, 128:256].float() * 3.0).to(dtype).float().t() @ b.float()  # the scaled block, as stored
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
