"""Row ops and last-dim gathers / scatters by indirect DMA (gather_indirect) at vocabulary sizes 1000 and
128256, the one-hot / indirect choice of lowering/row_path.py, and a tiny Llama training step that
takes the indirect path.

Tolerances: gathers are exact (DMAs copy bits). Scatter-adds sum in fp32 and round once per token
tile (dma_compute adds in fp32 and casts to the output dtype), so fp32 results match an fp32
reference within rtol 1e-5, and bf16 ones the fp32-accumulated reference within 2e-2 relative to
its magnitude; eager bf16 itself rounds after every add.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from neuron_inductor import config, sim
from neuron_inductor.observe import session
from neuron_inductor.lowering import row_path

from .harness import CTX, DTYPES, aten_graph, assert_close, call_kernel, graph_values, kernel_for, lower, run_lowered

aten = torch.ops.aten
F = torch.nn.functional

VOCABS = [1000, 128256]
# (ids shape, width): token tiles of exactly 128 and a ragged one; widths on and off 128 / 512
SHAPES = [((2, 128), 128), ((3, 70), 600)]


def ids_with_padding_and_duplicates(vocab, shape, padding_idx, generator):
    ids = torch.randint(0, vocab, shape, generator=generator)
    flat = ids.view(-1)
    flat[:6] = vocab - 1               # the last row, six times in one tile
    flat[6:9] = padding_idx            # padding tokens
    flat[-3:] = 7                      # and a row repeated in the last tile
    return ids


def paths_for(vocab):
    # the one-hot kernel at 128256 rows costs minutes in the interpreter; the cost model never picks it
    return row_path.PATHS if vocab < 10000 else ("indirect",)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_shape,width", SHAPES, ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
def test_embedding_forward_and_backward(vocab, ids_shape, width, dtype):
    generator = torch.Generator().manual_seed(vocab + width)
    weight = torch.randn(vocab, width, generator=generator).to(dtype)
    padding_idx = 5
    ids = ids_with_padding_and_duplicates(vocab, ids_shape, padding_idx, generator)
    grad = torch.randn(*ids_shape, width, generator=generator).to(dtype)
    backward = lambda g, i: aten.embedding_dense_backward(g, i, vocab, padding_idx, False)  # noqa: E731
    reference = aten.embedding_dense_backward(grad.float(), ids, vocab, padding_idx, False).to(dtype)
    for path in paths_for(vocab):
        with row_path.forced(path):
            (out,), (ref,), _ = run_lowered(lambda w, i: F.embedding(i, w, padding_idx), [weight, ids],
                                            aten.embedding.default)
            assert torch.equal(out, ref), path
            (grad_weight,), _, _ = run_lowered(backward, [grad, ids], aten.embedding_dense_backward.default)
        assert_close(grad_weight, reference)
        assert not grad_weight[padding_idx].any()
        assert torch.count_nonzero(grad_weight.float().abs().sum(-1)) == torch.unique(ids[ids != padding_idx]).numel()


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_select_and_index_of_a_128256_row_table(dtype):
    table = torch.randn(128256, 8).to(dtype)
    ids = torch.tensor([128255, 0, -1, 77, 128255, -128256])
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.index_select(t, 0, i), [table, ids.abs().clamp(max=128255)],
                                    aten.index_select.default)
    assert torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i: t[i], [table, ids], aten.index.Tensor)
    assert torch.equal(out, ref)


def _fails_bounds_check(gm, target, good, bad):
    """The kernel of `target` in `gm` runs with the graph arguments `good` and fails with `bad`, which
    differ in index placeholders only (the bounds check's DMA addresses outside the index:
    NkiIndexError)."""
    _, spec, kernel = kernel_for(gm, target)
    assert spec.index_bounds is not None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = graph_values(gm, good)  # (eager raises on `bad`)
    call_kernel(kernel, spec, [values[n] for n in spec.inputs])
    with pytest.raises(sim.NkiIndexError, match="out of bounds"):
        call_kernel(kernel, spec, [bad[placeholders.index(n)] if n in placeholders else values[n] for n in spec.inputs])


@pytest.mark.parametrize("path", row_path.PATHS)
def test_out_of_range_ids_fail_the_kernel(path):
    """Eager raises for an id outside [-V, V) (x[i], index_put), outside [0, V) (embedding,
    index_select) or outside [0, C) (gather, scatter); every kernel family, on both paths, fails
    its bounds check there: one bad id among good ones, in any token tile, with one or several
    index tensors."""
    vocab, width = 300, 16
    weight, grad, values = torch.randn(vocab, width), torch.randn(140, width), torch.randn(4, width)
    good = torch.randint(0, vocab, (140,))
    with row_path.forced(path):
        gm = aten_graph(lambda w, i: F.embedding(i, w), weight, good)
        for bad_id in (300, -1, 10**12):
            bad = good.clone()
            bad[133] = bad_id  # in the second token tile
            _fails_bounds_check(gm, aten.embedding.default, [weight, good], [weight, bad])
        gm = aten_graph(lambda w, i: w[i], weight, good)
        bad = good - 300
        bad[133] = -301
        _fails_bounds_check(gm, aten.index.Tensor, [weight, good - 300], [weight, bad])
        rows = torch.tensor([3, 299, -300, 7])
        gm = aten_graph(lambda w, i, v: aten.index_put(w, [i], v, True), weight, rows, values)
        _fails_bounds_check(gm, aten.index_put.default, [weight, rows, values],
                            [weight, torch.tensor([3, 300, 0, 7]), values])
        gm = aten_graph(lambda w, i, v: aten.index_put(w, [i], v), weight, rows, values)
        _fails_bounds_check(gm, aten.index_put.default, [weight, rows, values],
                            [weight, torch.tensor([3, 0, -301, 7]), values])
        # two indices: an id outside its own dim fails, even where the flattened number names a row
        table, i, j = torch.randn(4, 5, 3), torch.tensor([1, 0, 3, -1]), torch.tensor([2, 4, 0, -5])
        gm = aten_graph(lambda t, a, b: t[a, b], table, i, j)
        _fails_bounds_check(gm, aten.index.Tensor, [table, i, j], [table, i, torch.tensor([2, 5, 0, 1])])
        logits = torch.randn(6, vocab)
        labels = torch.randint(0, vocab, (6, 2))
        for fn, target in ((lambda t, k: torch.gather(t, -1, k), aten.gather.default),
                           (lambda t, k: torch.scatter(t, -1, k, 2.0), aten.scatter.value),
                           (lambda t, k: torch.scatter_add(t, -1, k, t[:, :2]), aten.scatter_add.default)):
            gm = aten_graph(fn, logits, labels)
            for bad_id in (vocab, -1):
                bad = labels.clone()
                bad[4, 1] = bad_id
                _fails_bounds_check(gm, target, [logits, labels], [logits, bad])
    # embedding's backward is not checked (eager's is not): an id outside [-V, V) drops its token
    gm = aten_graph(lambda g, i: aten.embedding_dense_backward(g, i, vocab, -1, False), grad, good)
    with row_path.forced(path):
        node, spec, kernel = kernel_for(gm, aten.embedding_dense_backward.default)
    assert spec.index_bounds is None
    bad = good.clone()
    bad[5] = vocab
    keep = torch.arange(140) != 5
    (grad_weight,) = call_kernel(kernel, spec, [grad, bad])
    assert_close(grad_weight, aten.embedding_dense_backward(grad[keep], good[keep], vocab, -1, False))


@pytest.mark.parametrize("shape,dim", [((130, 7, 3), 1), ((9, 4), 0)], ids=str)
def test_out_of_range_ids_fail_column_gathers_and_scatters(shape, dim):
    x = torch.randn(shape)
    index = torch.randint(0, shape[dim], shape)
    bad = index.clone()
    bad.view(-1)[-2] = shape[dim]
    for fn, target in ((lambda t, k: torch.gather(t, dim, k), aten.gather.default),
                       (lambda t, k: torch.scatter(t, dim, k, t), aten.scatter.src),
                       (lambda t, k: torch.scatter_add(t, dim, k, t), aten.scatter_add.default)):
        gm = aten_graph(fn, x, index)
        _fails_bounds_check(gm, target, [x, index], [x, bad])
        _fails_bounds_check(gm, target, [x, index], [x, bad.clamp(0) - 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k", [(128, 1), (130, 3)])
@pytest.mark.parametrize("vocab", VOCABS)
def test_gather_along_the_vocabulary(vocab, rows, k, dtype):
    """gather(log_probs, -1, labels[..., None]) (cross-entropy, TRL's per-token log-probs): exact,
    -0.0 and non-finite values included, on both paths at vocab 1000 and indirect at 128256."""
    generator = torch.Generator().manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, generator=generator).to(dtype)
    x[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0]).to(dtype)
    index = torch.randint(0, vocab, (rows, k), generator=generator)
    index[0, 0], index[1, 0], index[2, 0] = 1, 2, vocab - 1
    for path in paths_for(vocab):
        with row_path.forced(path):
            (out,), (ref,), _ = run_lowered(lambda t, i: torch.gather(t, -1, i), [x, index], aten.gather.default)
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
        if path == "indirect":  # (the lane masks' sum of bits turns -0.0 into +0.0)
            assert torch.equal(out.signbit(), ref.signbit())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [130, 8000])
def test_one_dimensional_gather_and_scatters_are_row_ops(size, dtype):
    """gather / scatter.src / scatter_add of a 1-D tensor (sort's backward is `zeros.scatter(0, perm, grad)`
    over 8000 elements: one element per instruction timed out) take the row-op kernels; duplicates in the
    index: scatter.src keeps the last, as eager on the CPU, and scatter_add adds them all."""
    generator = torch.Generator().manual_seed(size)
    x = torch.randn(size, generator=generator).to(dtype)
    index = torch.randint(0, size, (size,), generator=generator)
    index[:4] = 3
    src = torch.randn(size, generator=generator).to(dtype)
    for path in row_path.PATHS if size < 1000 else ("indirect",):
        with row_path.forced(path):
            (out,), (ref,), _ = run_lowered(lambda t, i: torch.gather(t, 0, i), [x, index], aten.gather.default)
            assert torch.equal(out, ref), path
            (out,), (ref,), _ = run_lowered(lambda t, i, v: t.scatter(0, i, v), [x, index, src], aten.scatter.src)
            assert torch.equal(out, ref), path
            (out,), _, _ = run_lowered(lambda t, i, v: t.scatter_add(0, i, v), [x, index, src],
                                       aten.scatter_add.default)
        assert_close(out, x.float().scatter_add(0, index, src.float()).to(dtype))
    _, spec, _ = kernel_for(aten_graph(lambda t, i: torch.gather(t, 0, i), x, index), aten.gather.default)
    assert spec.family in ("gather_rows", "gather_indirect")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_scatter_along_the_vocabulary(vocab, dtype):
    """Cross-entropy's backward `zeros.scatter(1, target, -1)`, scatter.src and scatter_add (a
    repeated index adds up) over a vocabulary row: 130 rows, one ragged tile."""
    generator = torch.Generator().manual_seed(vocab)
    x = torch.randn(130, vocab, generator=generator).to(dtype)
    index = torch.randint(0, vocab, (130, 3), generator=generator)
    index[:, 2] = index[:, 0]  # a repeated index: src's later column wins, scatter_add adds both
    src = torch.randn(130, 3, generator=generator).to(dtype)
    for path in paths_for(vocab):
        with row_path.forced(path):
            (out,), (ref,), _ = run_lowered(lambda t, i: torch.zeros_like(t).scatter(1, i, -1.0), [x, index[:, :1]],
                                            aten.scatter.value)
            assert torch.equal(out, ref), path
            (out,), _, _ = run_lowered(lambda t, i, v: t.scatter(1, i, v), [x, index, src], aten.scatter.src)
            expected = x.clone()
            for k in range(3):
                expected.scatter_(1, index[:, k:k + 1], src[:, k:k + 1])
            assert torch.equal(out, expected), path
            (out,), _, _ = run_lowered(lambda t, i, v: t.scatter_add(1, i, v), [x, index, src], aten.scatter_add.default)
        assert_close(out, x.float().scatter_add(1, index, src.float()).to(dtype))


def test_the_cost_model_picks_one_hot_only_for_tiny_tables(caplog):
    def family(vocab, tokens, width):
        gm = aten_graph(lambda w, i: F.embedding(i, w), torch.randn(vocab, width), torch.randint(0, vocab, (tokens,)))
        node = next(n for n in gm.graph.nodes if n.target is aten.embedding.default)
        return lower(node).family

    with caplog.at_level(logging.INFO, logger=row_path.__name__):
        assert family(8, 3, 4) == "gather_rows"
        assert family(1000, 256, 64) == "gather_indirect"
        assert family(128256, 256, 64) == "gather_indirect"
        with row_path.forced("onehot"):
            assert family(1000, 256, 64) == "gather_rows"
    lines = [r.getMessage() for r in caplog.records]
    assert "row_gather of 3 ids x [1, 8, 4]: onehot (cost model; one-hot" in lines[0]
    assert "indirect (cost model" in lines[1] and "onehot (forced" in lines[3]
    with pytest.raises(ValueError, match="not one of"):
        with row_path.forced("sorted"):
            pass


@pytest.mark.parametrize("path", row_path.PATHS)
@pytest.mark.parametrize("mode,vocab,ids_shape,width,dtype", [
    ("row_gather", 1000, (256,), 64, torch.bfloat16), ("row_gather", 300, (130,), 600, torch.float32),
    ("row_scatter", 1000, (256,), 64, torch.bfloat16), ("row_scatter", 260, (2, 130), 520, torch.float32),
    ("lane_gather", 9000, (130, 2), 1, torch.bfloat16), ("lane_gather", 1000, (256, 1), 1, torch.float32),
    ("lane_scatter", 9000, (130, 2), 1, torch.bfloat16), ("lane_scatter", 1000, (256, 1), 1, torch.float32),
], ids=str)
def test_estimates_track_the_traced_kernels(mode, vocab, ids_shape, width, dtype, path):
    """row_path prices each template's instruction mix; it must stay within 35% of the cost model's
    estimate of the kernel's real trace, so that the choice follows the kernels."""
    ids = torch.randint(0, vocab, ids_shape)
    if mode == "row_gather":
        fn, args, op = (lambda w, i: F.embedding(i, w)), [torch.randn(vocab, width).to(dtype), ids], aten.embedding.default
    elif mode == "lane_gather":
        fn, op = (lambda t, i: torch.gather(t, -1, i)), aten.gather.default
        args = [torch.randn(ids_shape[0], vocab).to(dtype), ids]
    elif mode == "lane_scatter":
        fn, op = (lambda t, i, v: t.scatter_add(-1, i, v)), aten.scatter_add.default
        args = [torch.randn(ids_shape[0], vocab).to(dtype), ids, torch.randn(ids_shape).to(dtype)]
    else:
        fn = lambda g, i: aten.embedding_dense_backward(g, i, vocab, -1, False)  # noqa: E731
        args, op = [torch.randn(*ids_shape, width).to(dtype), ids], aten.embedding_dense_backward.default
    with row_path.forced(path):
        gm = aten_graph(fn, *args)
        _, spec, kernel = kernel_for(gm, op)
    with sim.trace() as recorded:
        call_kernel(kernel, spec, args)
    traced = recorded.estimate("trn2").total_seconds
    if mode.startswith("lane"):
        geometry = row_path.RowOp(mode, ids_shape[0], vocab, 1, ids_shape[1], dtype.itemsize, "", CTX.tile)
    else:
        geometry = row_path.RowOp(mode, spec.params["outer"], vocab, width, ids.numel(), dtype.itemsize,
                                  spec.params["table_kind"], CTX.tile, programs=spec.grid,
                                  merge=spec.params.get("merge", "tile"))
    predicted = row_path.estimate(path, geometry)
    assert abs(predicted - traced) <= 0.35 * traced, (predicted, traced)


def test_tiny_llama_step_takes_the_indirect_path_and_matches_eager(tmp_path):
    """A training step (forward and backward) compiled with fallback="error": the embedding and its
    backward run as gather_indirect kernels (vocab 1000), loss and gradients match eager."""
    from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

    llama = TinyLlamaConfig(vocab_size=1000, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96)
    torch.manual_seed(0)
    eager = TinyLlama(llama)
    model = copy.deepcopy(eager)
    ids = torch.randint(0, llama.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    ids[0, :4] = 17  # repeated tokens accumulate in the embedding's gradient
    first = len(session.BUCKETS)
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error", cache_dir=str(tmp_path)):
            loss = torch.compile(model, backend="neuron")(ids, ids)
            loss.backward()
    finally:
        torch._dynamo.reset()
    reference = eager(ids, ids)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-4, atol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        scale = q.grad.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(p.grad / scale, q.grad / scale, rtol=1e-4, atol=1e-5, msg=name)
    kernels = [k for p in session.BUCKETS[first:] for k in p.artifact.meta["kernels"]]
    families = {op: k["name"].split("_", 1)[1] for k in kernels for op in k["ops"]}
    assert families["aten.embedding.default"] == "gather_indirect"
    assert families["aten.embedding_dense_backward.default"] == "gather_indirect"
