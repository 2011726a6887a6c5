"""Out-of-range indices through torch.compile: the compiled graph raises the exception eager raises.

Every indexing kernel checks its ids (lowering/indexing.py, codegen_templates/_bounds.py.j2): an id
outside its dim fails the kernel's bounds-check DMA, and index_errors.py turns that into eager's
exception type (IndexError for embedding, index_select, x[i], index_put and cross-entropy targets,
fused with the LM head or not, RuntimeError for gather and scatter). In-range negative ids, padding_idx and ignore_index still
work; nothing is left half-done (the next call, and a fresh process reading the disk cache, run
normally); padded (bucketed) positions never fail the check, and an id past the real extent of a
padded dim does. Results of good calls match eager exactly (indexing moves bits; scatter_add and
index_put with accumulate sum exactly representable values).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuron_inductor import config, index_errors


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path):
    torch._dynamo.reset()
    with config.patch(cache_dir=str(tmp_path / "cache"), fallback="error"):
        yield
    torch._dynamo.reset()


def eager_error(fn, *args) -> BaseException:
    with pytest.raises(Exception) as raised:
        fn(*args)
    return raised.value


def check(fn, good: tuple, bad: tuple, op: str, size: int):
    """Compiled `fn` matches eager on `good`, raises eager's exception type on `bad` (naming the op
    and the dim size), then matches eager on `good` again."""
    compiled = torch.compile(fn, backend="neuron")
    assert torch.equal(compiled(*good), fn(*good))
    expected = eager_error(fn, *bad)
    with pytest.raises(type(expected)) as raised:
        compiled(*bad)
    assert isinstance(raised.value, (index_errors.IndexOutOfRangeError, index_errors.IndexOutOfRangeRuntimeError))
    assert f"{op}: index out of range" in str(raised.value) and f"size {size}" in str(raised.value)
    assert torch.equal(compiled(*good), fn(*good))


def ints(*values) -> torch.Tensor:
    return torch.tensor(values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding(dtype):
    weight = torch.randn(1000, 64, dtype=dtype)
    fn = lambda i: F.embedding(i, weight)  # noqa: E731
    check(fn, (ints([1, 999]),), (ints([1, 1000]),), "embedding", 1000)
    torch._dynamo.reset()
    check(fn, (ints([1, 999]),), (ints([-1, 3]),), "embedding", 1000)  # embedding takes no negative ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_gathers(dtype):
    x = torch.randn(10, 64, dtype=dtype)
    check(lambda t, i: t[i] * 2, (x, ints(0, -1, -10, 9)), (x, ints(0, 12)), "index", 10)
    check(lambda t, i: t.index_select(0, i), (x, ints(3, 9)), (x, ints(3, 10)), "index_select", 10)
    t3 = torch.randn(4, 5, 6, dtype=dtype)
    check(lambda t, i: t[:, i], (t3, ints(-5, 4)), (t3, ints(-6, 4)), "index", 5)
    # several index tensors: each id against its own dim, even where the flattened row exists
    check(lambda t, i, j: t[i, j], (t3, ints(0, 3), ints(4, -5)), (t3, ints(0, 3), ints(5, 0)), "index", 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathers_and_scatters_along_the_last_and_a_middle_dim(dtype):
    x = torch.randn(3, 7, 5, dtype=dtype)
    last, middle = torch.randint(0, 5, (3, 7, 2)), torch.randint(0, 7, (3, 2, 5))
    src_last, src_middle = torch.ones(3, 7, 2, dtype=dtype), torch.ones(3, 2, 5, dtype=dtype)
    bad_last, bad_middle = last.clone(), middle.clone()
    bad_last[2, 6, 1], bad_middle[1, 0, 4] = 5, -1
    check(lambda t, i: torch.gather(t, -1, i), (x, last), (x, bad_last), "gather", 5)
    check(lambda t, i: torch.gather(t, 1, i), (x, middle), (x, bad_middle), "gather", 7)
    check(lambda t, i, s: torch.scatter_add(t, -1, i, s), (x, last, src_last), (x, bad_last, src_last),
          "scatter_add", 5)
    check(lambda t, i, s: torch.scatter(t, 1, i, s), (x, middle[:, :1], src_middle[:, :1]),
          (x, bad_middle[:, :1], src_middle[:, :1]), "scatter", 7)


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put(accumulate):
    x, values = torch.randn(6, 4), torch.ones(3, 4)
    fn = lambda t, i, v: t.index_put((i,), v, accumulate=accumulate)  # noqa: E731
    check(fn, (x, ints(0, -1, 2), values), (x, ints(0, 6, 2), values), "index_put", 6)


@pytest.mark.parametrize("fused", [False, True], ids=["nll_loss", "lm_head_loss"])
def test_cross_entropy_targets(fused):
    """nll_loss's kernel and the fused LM head + cross-entropy (passes/lm_head_loss.py) check targets."""
    hidden, weight = torch.randn(5, 16), torch.randn(10, 16)
    fn = (lambda h, t: F.cross_entropy(h @ weight.t(), t)) if fused else (lambda x, t: F.cross_entropy(x, t))  # noqa: E731
    x = hidden if fused else hidden @ weight.t()
    compiled = torch.compile(fn, backend="neuron")
    good = ints(1, 9, -100, 0, 3)  # ignore_index still ignored
    torch.testing.assert_close(compiled(x, good), fn(x, good))
    op = "cross_entropy" if fused else "nll_loss"
    for bad in (ints(1, 10, -100, 0, 3), ints(1, 9, -1, 0, 3)):
        with pytest.raises(IndexError, match=f"{op}: index out of range.*size 10.*ignore_index -100"):
            compiled(x, bad)
    torch.testing.assert_close(compiled(x, good), fn(x, good))


def test_embedding_training_with_padding_idx(tmp_path):
    """A bad id fails the forward (as eager's); training goes on; padding_idx keeps a zero gradient;
    a fresh process (Dynamo reset) reading the cache the failed call left runs normally."""
    torch.manual_seed(0)
    eager = torch.nn.Embedding(50, 16, padding_idx=0)
    module = torch.nn.Embedding(50, 16, padding_idx=0)
    module.load_state_dict(eager.state_dict())
    compiled = torch.compile(module, backend="neuron")
    good, bad = ints([0, 3, 3, 49, 0]), ints([0, 3, 50, 49, 0])

    def step(m, ids):
        m.zero_grad()
        (m(ids) ** 2).sum().backward()
        return m.weight.grad.clone()

    expected = step(eager, good)
    assert torch.equal(step(compiled, good), expected)
    assert not expected[0].any()
    with pytest.raises(IndexError):
        step(eager, bad)
    with pytest.raises(index_errors.IndexOutOfRangeError, match="embedding.*size 50"):
        step(compiled, bad)
    assert torch.equal(step(compiled, good), expected)
    torch._dynamo.reset()
    assert torch.equal(step(torch.compile(module, backend="neuron"), good), expected)


def test_padded_dynamic_shapes():
    """Bucketed lengths: ids computed at padded positions (here -1) never fail the check; an id past
    the real length of a padded dim fails it (the kernel sees the bucket), as eager fails."""
    weight = torch.randn(50, 8)
    shifted = torch.compile(lambda i: F.embedding(i - 1, weight), backend="neuron", dynamic=True)
    pick = torch.compile(lambda t, i: t[i], backend="neuron", dynamic=True)
    take = torch.compile(lambda t, i: torch.gather(t, 1, i), backend="neuron", dynamic=True)
    for length in (5, 130):
        ids = torch.randint(1, 51, (2, length))
        assert torch.equal(shifted(ids), F.embedding(ids - 1, weight))
        x = torch.randn(length, 8)
        assert torch.equal(pick(x, ints(0, length - 1, -length)), x[ints(0, length - 1, -length)])
        for bad in (length, -length - 1):
            with pytest.raises(IndexError, match="index: index out of range"):
                pick(x, ints(0, bad))
        rows = torch.randn(2, length)
        index = torch.randint(0, length, (2, 3))
        assert torch.equal(take(rows, index), torch.gather(rows, 1, index))
        index[1, 2] = length
        with pytest.raises(RuntimeError, match="gather: index out of range"):
            take(rows, index)
