"""Indexing kernels (embedding fwd / bwd, index_select, index, index_put, gather, scatter*) in the
NKI interpreter against eager PyTorch.

Row ops (the `path` fixture) run as one-hot matmuls and as indirect DMA. Gathers are exact (a
one-hot matmul picks one fp32 / bf16 value; a DMA copies bits); scatter-adds accumulate in fp32
(PSUM, or dma_compute's fp32 adds), so fp32 results match within rtol 1e-5 and bf16 results within
one bf16 rounding of the fp32-accumulated reference (2e-2 relative). Lane gathers and scatters move bits, so they are exact
with +-inf and NaN anywhere (compared with NaN equal to NaN).
"""

from __future__ import annotations

import math

import pytest
import torch

from neuron_inductor import config
from neuron_inductor.lowering import row_path
from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, DTYPES, aten_graph, assert_close, run_lowered

aten = torch.ops.aten
F = torch.nn.functional


@pytest.fixture(params=row_path.PATHS)
def path(request):
    """Row-op and last-dim gather / scatter tests run on both formulations: one-hot matmuls / lane
    masks (gather_rows, gather_lanes) and indirect DMA (gather_indirect)."""
    with row_path.forced(request.param):
        yield request.param


def ids_with_duplicates(vocab, shape):
    ids = torch.randint(0, vocab, shape)
    ids.view(-1)[: min(5, ids.numel())] = 3  # repeated rows must accumulate
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width,ids_shape", [(50, 8, (2, 3)), (300, 70, (130,)), (129, 600, (3, 50)),
                                                   (128, 1, (4,))], ids=str)
def test_embedding(vocab, width, ids_shape, dtype, path):
    weight = torch.randn(vocab, width, dtype=dtype)
    ids = ids_with_duplicates(vocab, ids_shape)
    (out,), (ref,), _ = run_lowered(lambda w, i: F.embedding(i, w), [weight, ids], aten.embedding.default)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_select_and_index(dtype, path):
    x = torch.randn(200, 33, dtype=dtype)
    ids = torch.tensor([5, 199, 0, 5, 130])
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.index_select(t, 0, i), [x, ids], aten.index_select.default)
    assert torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i: t[i], [x, ids], aten.index.Tensor)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [-1, 0, 3])
@pytest.mark.parametrize("vocab,width,ids_shape", [(50, 8, (2, 3)), (260, 520, (2, 130))], ids=str)
def test_embedding_dense_backward(vocab, width, ids_shape, padding_idx, dtype, path):
    grad = torch.randn(*ids_shape, width, dtype=dtype)
    ids = ids_with_duplicates(vocab, ids_shape)
    fn = lambda g, i: aten.embedding_dense_backward(g, i, vocab, padding_idx, False)  # noqa: E731
    (out,), _, _ = run_lowered(fn, [grad, ids], aten.embedding_dense_backward.default)
    reference = aten.embedding_dense_backward(grad.float(), ids, vocab, padding_idx, False).to(dtype)
    assert_close(out, reference)


def test_embedding_backward_of_an_expanded_grad(path):
    """AOTAutograd hands the backward a stride-0 expanded gradient."""
    grad, ids = torch.randn(1, 1, 16), torch.randint(0, 40, (3, 5))
    fn = lambda g, i: aten.embedding_dense_backward(g.expand(3, 5, 16), i, 40, -1, False)  # noqa: E731
    (out,), (ref,), inputs = run_lowered(fn, [grad, ids], aten.embedding_dense_backward.default)
    assert inputs[0].stride()[0] == 0
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [True, False])
def test_index_put(accumulate, dtype, path):
    base = torch.randn(200, 40, dtype=dtype)
    ids = torch.tensor([7, 150, 3, 199, 0]) if not accumulate else ids_with_duplicates(200, (3, 60))
    values = torch.randn(*ids.shape, 40, dtype=dtype)
    fn = lambda b, i, v: b.index_put([i], v, accumulate=accumulate)  # noqa: E731
    (out,), _, _ = run_lowered(fn, [base, ids, values], aten.index_put.default)
    reference = base.float().index_put([ids], values.float(), accumulate=accumulate).to(dtype)
    assert_close(out, reference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((130, 50), 1), ((4, 3, 9000), 2), ((7, 1), 1)], ids=str)
def test_gather_last_dim(shape, k, dtype, path):
    x = torch.randn(shape, dtype=dtype)
    index = torch.randint(0, shape[-1], (*shape[:-1], k))
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.gather(t, -1, i), [x, index], aten.gather.default)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((130, 50), 1), ((3, 9000), 3)], ids=str)
def test_scatter_value_src_and_add(shape, k, dtype, path):
    x = torch.randn(shape, dtype=dtype)
    index = torch.stack([torch.randperm(shape[-1])[:k] for _ in range(shape[0])])  # distinct per row
    src = torch.randn(shape[0], k, dtype=dtype)
    (out,), (ref,), _ = run_lowered(lambda t, i: t.scatter(-1, i, -1.0), [x, index], aten.scatter.value)
    assert torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i, s: t.scatter(-1, i, s), [x, index, src], aten.scatter.src)
    assert torch.equal(out, ref)
    dup = torch.zeros(shape[0], 4, dtype=torch.long)  # duplicates must accumulate
    src4 = torch.randn(shape[0], 4, dtype=dtype)
    (out,), _, _ = run_lowered(lambda t, i, s: t.scatter_add(-1, i, s), [x, dup, src4], aten.scatter_add.default)
    assert_close(out, x.float().scatter_add(-1, dup, src4.float()).to(dtype))


NON_FINITE = [-math.inf, math.inf, math.nan]


def assert_same_values(out, ref):
    """Bit-for-bit equal values (-0.0 == 0.0), NaN where eager has NaN."""
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def with_non_finite_lanes(shape, dtype):
    """randn with +inf, -inf and NaN in the first lanes of row 0 and the last lanes of the last row."""
    x = torch.randn(shape)
    x[0, :3] = torch.tensor(NON_FINITE)
    x[-1, -3:] = torch.tensor(NON_FINITE)
    return x.to(dtype)


def distinct_lanes(shape, k):
    """k distinct lanes per row; row 0 hits its first two lanes (holding -inf and inf)."""
    index = torch.stack([torch.randperm(shape[-1])[:k] for _ in range(shape[0])])
    index[0, :2] = torch.tensor([0, 1])
    return index


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("shape,k", [((130, 50), 2), ((3, 9000), 3)], ids=str)
def test_scatter_of_a_non_finite_value(shape, k, value, dtype, path):
    """MoE routers mask the experts they picked with scatter(-1, idx, -inf): the value lands on the
    indexed lanes only, over finite and non-finite values alike, and the other lanes keep theirs."""
    x = with_non_finite_lanes(shape, dtype)
    index = distinct_lanes(shape, k)
    (out,), (ref,), _ = run_lowered(lambda t, i: t.scatter(-1, i, value), [x, index], aten.scatter.value)
    assert_same_values(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((130, 50), 2), ((3, 9000), 3)], ids=str)
def test_lane_ops_move_non_finite_values_exactly(shape, k, dtype, path):
    """Gathered and scattered +-inf / NaN stay on their lanes: no 0 * inf turns a row into NaN."""
    x = with_non_finite_lanes(shape, dtype)
    index = distinct_lanes(shape, k)
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.gather(t, -1, i), [x, index], aten.gather.default)
    assert_same_values(out, ref)
    src = torch.randn(shape[0], k).to(dtype)
    src[1, 0], src[2, -1] = math.inf, math.nan
    (out,), (ref,), _ = run_lowered(lambda t, i, s: t.scatter(-1, i, s), [x, index, src], aten.scatter.src)
    assert_same_values(out, ref)
    (out,), _, _ = run_lowered(lambda t, i, s: t.scatter_add(-1, i, s), [x, index, src], aten.scatter_add.default)
    reference = x.float().scatter_add(-1, index, src.float()).to(dtype)
    assert_close(out, reference)
    assert torch.equal(out.isnan(), reference.isnan()) and torch.equal(out.isinf(), reference.isinf())


def test_moe_router_masks_the_first_expert_with_neg_inf_through_compile(tmp_path):
    """A router in the style of HF PhiMoE's sparsemixer, compiled with every op in a kernel: the
    top expert is masked out with scatter(..., -inf) before the softmax over the others."""
    def router(hidden, weight):
        logits = hidden @ weight.T
        first = logits.argmax(-1, keepdim=True)
        others = logits.scatter(-1, first, float("-inf")).softmax(-1)
        return first, others

    hidden, weight = torch.randn(6, 40, 32), torch.randn(16, 32)
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error", cache_dir=str(tmp_path)):
            first, others = torch.compile(router, backend="neuron")(hidden, weight)
    finally:
        torch._dynamo.reset()
    ref_first, ref_others = router(hidden, weight)
    assert torch.equal(first, ref_first)
    assert torch.equal(others.gather(-1, first), torch.zeros_like(ref_first, dtype=others.dtype))
    assert_close(others, ref_others)


@pytest.mark.parametrize("dtype", DTYPES)
def test_boolean_mask_fill_through_compile_is_a_pointwise_where(dtype, tmp_path):
    """`x[mask] = v` with a mask over the leading dims (DTensor's vocabulary-parallel embedding) runs
    as a `where` kernel (fallback="error"), forward and backward, with eager's values."""
    def fill(x, ids):
        out = x * 2
        out[ids >= 100] = 0.0
        return out

    x, ids = torch.randn(3, 130, 7, dtype=dtype, requires_grad=True), torch.randint(0, 200, (3, 130))
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error", cache_dir=str(tmp_path)):
            got = torch.compile(fill, backend="neuron")(x, ids)
            got.sum().backward()
    finally:
        torch._dynamo.reset()
    grad, x.grad = x.grad, None
    want = fill(x, ids)
    want.sum().backward()
    assert torch.equal(got, want) and torch.equal(grad, x.grad)


def test_cross_entropy_backward_scatter_of_a_constant_into_zeros(path):
    logits, target = torch.randn(6, 30), torch.randint(0, 30, (6,))
    fn = lambda t, y: torch.zeros_like(t).scatter(1, y.unsqueeze(1), -1.0)  # noqa: E731
    (out,), (ref,), _ = run_lowered(fn, [logits, target], aten.scatter.value)
    assert torch.equal(out, ref)


def test_unsupported_cases_raise():
    """An index narrower than the input in a dim other than `dim` (legal for gather) falls back."""
    gm = aten_graph(lambda t, i: torch.gather(t, 0, i), torch.randn(4, 5), torch.zeros(2, 3, dtype=torch.long))
    node = next(n for n in gm.graph.nodes if n.target is aten.gather.default)
    with pytest.raises(Unsupported, match="other dims"):
        LOWERINGS[node.target](CTX, node)


# ---- row ops on any dim of any rank: the table viewed as [outer, rows, inner] ----------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape,dim,positions", [
    ((1, 4, 200, 64), 2, [0, 1, 2]),        # a static KV cache [B, H, S, D] written at 3 positions
    ((2, 3, 130, 600), 2, [129, 5]),        # ragged row tiles, inner walked in 512-column chunks
    ((2, 1, 7, 1), 2, [6]),                 # size-1 dims, one-element rows
    ((5, 260), 1, [259, 0, 128, 3]),        # the last dim: rows of one element
    ((3, 150, 2, 5), 1, list(range(140))),  # more ids than one partition tile
], ids=str)
def test_index_put_on_a_dim_other_than_0(shape, dim, positions, accumulate, dtype, path):
    base = torch.randn(shape, dtype=dtype)
    ids = torch.tensor(positions)
    if accumulate:
        ids[-1] = ids[0]  # a repeated position must add both values
    values = torch.randn(*shape[:dim], len(positions), *shape[dim + 1:], dtype=dtype)
    indices = [None] * dim + [ids]
    fn = lambda b, i, v: aten.index_put(b, [None] * dim + [i], v, accumulate)  # noqa: E731
    (out,), _, _ = run_lowered(fn, [base, ids, values], aten.index_put.default)
    assert_close(out, aten.index_put(base.float(), indices, values.float(), accumulate).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,positions", [((3, 150, 2, 5), 1, [0] + list(range(139)) + [0]),
                                                 ((4, 6), 1, [5, 2, 5, 5])], ids=str)
def test_index_put_of_a_repeated_position_keeps_the_last_write(shape, dim, positions, dtype, path):
    """Eager leaves repeated positions unspecified (its CPU kernel may take any of the writes); the
    kernel keeps the last one, within a token tile and across tiles."""
    base, ids = torch.randn(shape, dtype=dtype), torch.tensor(positions)
    values = torch.randn(*shape[:dim], len(positions), *shape[dim + 1:], dtype=dtype)
    fn = lambda b, i, v: aten.index_put(b, [None] * dim + [i], v)  # noqa: E731
    (out,), _, _ = run_lowered(fn, [base, ids, values], aten.index_put.default)
    reference = base.clone()
    for t, position in enumerate(positions):
        reference.select(dim, position).copy_(values.select(dim, t))
    assert torch.equal(out, reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_cache_index_copy_of_transposed_states(dtype, path):
    """HF StaticCache: `k_out.index_copy_(2, cache_position, key_states)` with key_states a
    [B, T, H, D] projection transposed to [B, H, T, D] (not contiguous)."""
    cache, states = torch.zeros(2, 4, 16, 8, dtype=dtype), torch.randn(2, 3, 4, 8, dtype=dtype)
    position = torch.tensor([5, 6, 7])
    fn = lambda c, p, s: c.index_copy(2, p, s.transpose(1, 2))  # noqa: E731
    (out,), (ref,), inputs = run_lowered(fn, [cache, position, states], aten.index_put.default)
    assert not inputs[0].is_contiguous()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,ids_shape", [
    ((4, 200, 3), 1, (5,)), ((6, 300), -1, (130,)), ((200,), 0, (7,)), ((2, 3, 70, 520), 2, (2, 4)),
    ((3, 1, 5), 1, (2,)),
], ids=str)
def test_index_select_and_index_on_any_dim(shape, dim, ids_shape, dtype, path):
    x = torch.randn(shape, dtype=dtype)
    ids = torch.randint(0, shape[dim], ids_shape)
    ids.view(-1)[0] = shape[dim] - 1
    if len(ids_shape) == 1:
        (out,), (ref,), _ = run_lowered(lambda t, i: torch.index_select(t, dim, i), [x, ids], aten.index_select.default)
        assert torch.equal(out, ref)
    leading = (slice(None),) * (dim % len(shape))
    (out,), (ref,), _ = run_lowered(lambda t, i: t[leading + (i,)], [x, ids], aten.index.Tensor)
    assert torch.equal(out, ref)


def test_index_select_of_a_transposed_table(path):
    x = torch.randn(40, 9)
    ids = torch.tensor([8, 0, 3])
    fn = lambda t, i: torch.index_select(t.t(), 1, i)  # noqa: E731
    (out,), (ref,), inputs = run_lowered(fn, [x, ids], aten.index_select.default)
    assert not inputs[0].is_contiguous()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_shape,first,index_shapes", [
    ((3, 200), 0, [(3, 1), (200,)]),           # mask[b[:, None], s]: broadcast rows and columns
    ((2, 5, 7), 0, [(4,), (4,)]),              # two same-shape indices, an inner dim left
    ((2, 130, 6, 3), 1, [(2, 1, 1), (1, 130)]),  # indices after a sliced dim, ids walked past one tile
    ((4, 9), 0, [(5, 1), (1, 1)]),             # the last ids dim broadcast: one token per tile
], ids=str)
def test_index_with_several_broadcast_indices(table_shape, first, index_shapes, dtype, path):
    x = torch.randn(table_shape, dtype=dtype)
    indices = [torch.randint(0, table_shape[first + k], s) for k, s in enumerate(index_shapes)]

    def fn(t, *idx):
        return t[(slice(None),) * first + idx]

    (out,), (ref,), _ = run_lowered(fn, [x, *indices], aten.index.Tensor)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fn,args,match", [
    (lambda t, i: t[i, :, i], (torch.randn(3, 4, 5), torch.tensor([0, 2])), "consecutive"),
    (lambda t, m: t[m], (torch.randn(3, 4), torch.tensor([True, False, True])), "boolean"),
    (lambda t, i: torch.index_select(t, 1, i), (torch.randn(3, 4), torch.zeros(0, dtype=torch.long)), "empty"),
    (lambda t, i, v: aten.index_put(t, [None, i], v), (torch.randn(3, 4), torch.tensor([1]), torch.randn(1)),
     "broadcast"),
], ids=["apart", "mask", "empty", "broadcast-values"])
def test_unsupported_row_ops_raise(fn, args, match):
    gm = aten_graph(fn, *args)
    row_ops = (aten.index.Tensor, aten.index_select.default, aten.index_put.default)
    node = next(n for n in gm.graph.nodes if n.target in row_ops)
    with pytest.raises(Unsupported, match=match):
        LOWERINGS[node.target](CTX, node)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_of_a_0d_tensor_or_index(dtype, path):
    """index_select / index_copy of a 0-d tensor (its one element is row 0), and 0-d indices."""
    x, ids, value = torch.randn((), dtype=dtype), torch.tensor([0]), torch.randn((), dtype=dtype)
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.index_select(t, 0, i), [x, ids], aten.index_select.default)
    assert torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i, v: t.index_copy(0, i, v), [x, ids, value], aten.index_put.default)
    assert torch.equal(out, ref)
    x, one_id, column = torch.randn(4, 5, dtype=dtype), torch.tensor(3), torch.randn(4, dtype=dtype)
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.index_select(t, 1, i), [x, one_id], aten.index_select.default)
    assert torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i: aten.index(t, [None, i]), [x, one_id], aten.index.Tensor)
    assert torch.equal(out, ref)
    fn = lambda t, i, v: aten.index_put(t, [None, i], v)  # noqa: E731
    (out,), (ref,), _ = run_lowered(fn, [x, one_id, column], aten.index_put.default)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_put_of_values_with_fewer_size_1_dims(dtype, path):
    """values [5] into row [2] of a [5, 5] base (indexed shape [1, 5]): same elements, same order."""
    base, ids, values = torch.randn(5, 5, dtype=dtype), torch.tensor([2]), torch.randn(5, dtype=dtype)
    fn = lambda b, i, v: aten.index_put(b, [i], v)  # noqa: E731
    (out,), (ref,), _ = run_lowered(fn, [base, ids, values], aten.index_put.default)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_indices_count_from_the_end(dtype, path):
    x, ids = torch.randn(3, 140, 4, dtype=dtype), torch.tensor([-1, 0, -140, 5])
    (out,), (ref,), _ = run_lowered(lambda t, i: t[:, i], [x, ids], aten.index.Tensor)
    assert torch.equal(out, ref)
    rows = torch.tensor([[-1], [0], [-3]])
    (out,), (ref,), _ = run_lowered(lambda t, i, j: t[i, j], [x, rows, ids], aten.index.Tensor)
    assert torch.equal(out, ref)
    values = torch.randn(3, 4, 4, dtype=dtype)
    fn = lambda t, i, v: aten.index_put(t, [None, i], v, True)  # noqa: E731
    (out,), _, _ = run_lowered(fn, [x, ids, values], aten.index_put.default)
    assert_close(out, aten.index_put(x.float(), [None, ids], values.float(), True).to(dtype))


# ---- gathers / scatters along a dim other than the last: column ops ------------------------------

COLUMN_CASES = [((10, 5), 0, 5), ((3, 200, 7), 1, 4), ((130, 600), 0, 2), ((300,), 0, 7), ((1, 5, 1), 1, 3),
                ((2, 129, 3), 0, 2)]


def distinct_rows(shape, dim, k):
    """An index of k distinct positions along `dim` for every other coordinate."""
    moved = list(shape)
    moved[dim] = k
    order = torch.rand(*shape[:dim], *shape[dim + 1:], shape[dim]).argsort(-1)[..., :k]
    return order.movedim(-1, dim).reshape(moved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,k", COLUMN_CASES, ids=str)
def test_gather_and_scatter_along_a_dim_other_than_the_last(shape, dim, k, dtype):
    x = torch.randn(shape, dtype=dtype)
    index = distinct_rows(shape, dim, k)
    src = torch.randn(index.shape, dtype=dtype)
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.gather(t, dim, i), [x, index], aten.gather.default)
    assert torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i: t.scatter(dim, i, 0.5), [x, index], aten.scatter.value)
    assert torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i, s: t.scatter(dim, i, s), [x, index, src], aten.scatter.src)
    assert torch.equal(out, ref)
    repeated = torch.zeros_like(index)  # every source value adds into row 0
    (out,), _, _ = run_lowered(lambda t, i, s: t.scatter_add(dim, i, s), [x, repeated, src], aten.scatter_add.default)
    assert_close(out, x.float().scatter_add(dim, repeated, src.float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_ops_move_non_finite_values_exactly(dtype):
    x = torch.randn(140, 6)
    x[0, :3] = torch.tensor(NON_FINITE)
    x[-1, -3:] = torch.tensor(NON_FINITE)
    x = x.to(dtype)
    index = distinct_rows(x.shape, 0, 3)
    index[:2, 0] = torch.tensor([0, 139])
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.gather(t, 0, i), [x, index], aten.gather.default)
    assert_same_values(out, ref)
    for value in NON_FINITE:
        (out,), (ref,), _ = run_lowered(lambda t, i: t.scatter(0, i, value), [x, index], aten.scatter.value)
        assert_same_values(out, ref)
    src = torch.randn(index.shape).to(dtype)
    src[1, 0], src[2, -1] = math.inf, math.nan
    (out,), (ref,), _ = run_lowered(lambda t, i, s: t.scatter(0, i, s), [x, index, src], aten.scatter.src)
    assert_same_values(out, ref)
    (out,), _, _ = run_lowered(lambda t, i, s: t.scatter_add(0, i, s), [x, index, src], aten.scatter_add.default)
    reference = x.float().scatter_add(0, index, src.float()).to(dtype)
    assert_close(out, reference)
    assert torch.equal(out.isnan(), reference.isnan()) and torch.equal(out.isinf(), reference.isinf())


def test_column_ops_of_a_transposed_input_and_a_0d_tensor():
    x, index = torch.randn(6, 40), torch.randint(0, 40, (6, 3))
    fn = lambda t, i: torch.gather(t.t(), 0, i.t())  # noqa: E731
    (out,), (ref,), inputs = run_lowered(fn, [x, index], aten.gather.default)
    assert not inputs[0].is_contiguous()
    assert torch.equal(out, ref)
    scalar, zero = torch.randn(()), torch.zeros((), dtype=torch.long)
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.gather(t, 0, i), [scalar, zero], aten.gather.default)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_index_of_integer_and_bool_tables(dtype, path):
    """HF mask building: `padding_mask[batch_idx, kv_idx]` of a bool / int64 attention mask; 32-bit
    values (extremes included) come back exact."""
    if dtype == torch.bool:
        table = torch.rand(3, 140) > 0.5
    elif dtype in (torch.int32, torch.int64):
        table = torch.randint(-2**31, 2**31 - 1, (3, 140), dtype=dtype)
        table[0, :4] = torch.tensor([-2**31, 2**31 - 1, -1, 0])
    else:
        info = torch.iinfo(dtype)
        table = torch.randint(info.min, info.max, (3, 140), dtype=dtype)
    batch, kv = torch.tensor([0, 2, 1, 0])[:, None, None, None], torch.arange(140)[None, None, None, :]
    (out,), (ref,), _ = run_lowered(lambda t, b, k: t[b, k], [table, batch, kv], aten.index.Tensor)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.index_select(t, 1, i), [table, kv.flatten()[:7]],
                                    aten.index_select.default)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("table_shape,first,index_shapes", [
    ((3, 200, 4), 0, [(3, 1), (1, 130)]),      # rows x columns of a [3, 200] grid, broadcast, 2 token tiles
    ((2, 5, 7), 1, [(6,), (6,)]),              # pairs on dims 1 and 2 after a sliced dim
], ids=str)
def test_index_put_with_several_broadcast_indices(table_shape, first, index_shapes, accumulate, dtype, path):
    """The backward of `x[i, j]` (accumulate) and `x[i, j] = v`: distinct positions when replacing
    (eager leaves repeated ones unspecified), repeated ones adding up when accumulating."""
    base = torch.randn(table_shape, dtype=dtype)
    sizes = table_shape[first:first + len(index_shapes)]
    if len(index_shapes[0]) == 2:
        indices = [torch.randperm(sizes[0])[:3].reshape(3, 1), torch.randperm(sizes[1])[:130].reshape(1, 130)]
    else:
        flat = torch.randperm(sizes[0] * sizes[1])[:6]
        indices = [flat // sizes[1], flat % sizes[1]]
    if accumulate:
        indices[-1].view(-1)[-1] = indices[-1].view(-1)[0]
        indices[0].view(-1)[-1] = indices[0].view(-1)[0]
    ids_shape = torch.broadcast_shapes(*(i.shape for i in indices))
    values = torch.randn(*table_shape[:first], *ids_shape, *table_shape[first + len(indices):], dtype=dtype)
    fn = lambda b, v, *idx: aten.index_put(b, [None] * first + list(idx), v, accumulate)  # noqa: E731
    (out,), _, _ = run_lowered(fn, [base, values, *indices], aten.index_put.default)
    reference = aten.index_put(base.float(), [None] * first + indices, values.float(), accumulate).to(dtype)
    assert_close(out, reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_move_non_finite_values_exactly(dtype, path):
    """Gathers and replacing index_puts move bits: an inf / NaN / -0.0 in a row no token names
    stays out of the other rows (no 0 * inf in the one-hot matmul), and lands exactly where named."""
    table = torch.randn(150, 6)
    table[0, :3] = torch.tensor(NON_FINITE)
    table[149, 3:] = torch.tensor([-0.0, math.inf, -math.inf])
    table = table.to(dtype)
    ids = torch.tensor([[1, 149, 2], [0, 5, 1]])
    (out,), (ref,), _ = run_lowered(lambda t, i: t[i], [table, ids], aten.index.Tensor)
    assert_same_values(out, ref)
    assert torch.equal(out.signbit(), ref.signbit())  # -0.0 kept
    (out,), (ref,), _ = run_lowered(lambda t, i: torch.index_select(t, 1, i), [table, ids[1]], aten.index_select.default)
    assert_same_values(out, ref)
    values = torch.randn(3, 6).to(dtype)
    values[0, 0], values[2, 5] = math.nan, -math.inf
    positions = torch.tensor([3, 149, 7])
    (out,), (ref,), _ = run_lowered(lambda t, i, v: t.index_put([i], v), [table, positions, values],
                                    aten.index_put.default)
    assert_same_values(out, ref)
