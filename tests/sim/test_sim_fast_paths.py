"""The interpreter's fast paths change nothing but speed: generated kernels give bit-identical
outputs and the same instruction trace (ops, engines, FLOPs, bytes, operands) as the general path.

The fast path compared here is `tensor._normalize_index`'s shortcut for in-range slices (every tile
loop of the templates indexes that way); the reference is `_checked_index`, the general path it
skips, run on every index."""

from __future__ import annotations

import random

import pytest
import torch

from neuron_inductor import sim
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
