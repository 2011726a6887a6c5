"""gather_indirect's row scatters and gathers at LNC 1 and 2 (lowering/indexing.py, row_path.py):
the output fill in blocks of whole rows (FillPlan), both duplicate merges of a scatter-add ("tile":
per token tile, then dma_compute adds; "all": over every token, each row written once by dma_copy),
the split of a scatter over the output rows (the fill) and columns (the "all" merge, after a
core_barrier), and of a gather over its token tiles.

Tolerances: as test_gather_indirect.py (fp32 within 1e-5 of the fp32 reference; bf16 within 2e-2
of its magnitude: the merges sum in fp32 and round once per tile, or once per row). Gathers and the
fill are exact. Fresh interpreter tensors are NaN, so a row the fill misses shows.
"""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.lowering import row_path
from neuron_inductor.lowering.context import LoweringContext

from .harness import DTYPES, aten_graph, assert_close, call_kernel, kernel_for
from .test_gather_indirect import ids_with_padding_and_duplicates

aten = torch.ops.aten
F = torch.nn.functional
CONTEXTS = {lnc: LoweringContext.for_target("trn2", lnc=lnc) for lnc in (1, 2)}
PADDING_IDX = 5


def run(fn, args, op, lnc, traced_args=None):
    """(result, spec, trace) of fn's `op` node lowered for LNC `lnc` on the indirect path (traced
    on `traced_args` of the same shapes if given: eager raises on an out-of-range id)."""
    with row_path.forced("indirect"):
        gm = aten_graph(fn, *(traced_args or args))
        _, spec, kernel = kernel_for(gm, op, ctx=CONTEXTS[lnc])
    values = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), args))
    with sim.trace() as recorded:
        (out,) = call_kernel(kernel, spec, [values[n] for n in spec.inputs])
    return out, spec, recorded


def embedding_backward(vocab, ids_shape, width, dtype, merge, lnc, padding_idx=PADDING_IDX):
    generator = torch.Generator().manual_seed(vocab + width)
    ids = ids_with_padding_and_duplicates(vocab, ids_shape, padding_idx, generator)
    grad = torch.randn(*ids_shape, width, generator=generator).to(dtype)
    fn = lambda g, i: aten.embedding_dense_backward(g, i, vocab, padding_idx, False)  # noqa: E731
    with row_path.forced_merge(merge):
        out, spec, recorded = run(fn, [grad, ids], aten.embedding_dense_backward.default, lnc)
    reference = aten.embedding_dense_backward(grad.float(), ids, vocab, padding_idx, False).to(dtype)
    return out, reference, ids, spec, recorded


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("merge", row_path.MERGES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ids_shape,width", [((2, 128), 128), ((3, 70), 600)], ids=str)
def test_embedding_backward_matches_eager(ids_shape, width, dtype, merge, lnc):
    """Token tiles of exactly 128 and a ragged one, widths on and off 128 / 512; duplicates within a
    tile and across tiles, padding_idx tokens; each merge at LNC 1 and 2."""
    out, reference, ids, spec, recorded = embedding_backward(1000, ids_shape, width, dtype, merge, lnc)
    assert spec.params["merge"] == merge
    assert spec.grid == lnc
    assert {i.program_id for i in recorded.instructions} == {(p,) for p in range(lnc)}
    assert_close(out, reference)
    assert not out[PADDING_IDX].any()
    named = torch.unique(ids[ids != PADDING_IDX]).numel()
    assert torch.count_nonzero(out.float().abs().sum(-1)) == named


def hbm_store_bytes(recorded, program) -> int:
    return sum(i.bytes for i in recorded.instructions if i.engine == "dma" and i.program_id == (program,)
               and i.operands[0].buffer == "shared_hbm")


@pytest.mark.parametrize("merge", row_path.MERGES)
def test_the_merges_and_splits_give_the_same_bits(merge):
    """Splitting changes who writes a row, not its sum: LNC 2 equals LNC 1 bit for bit. The "all"
    merge's programs store what one program stores, in two near halves (the fill's blocks are whole
    rows in multiples of 16 here; the tile merge's programs
    each issue every token's writes, masked to their own rows)."""
    one, _, _, _, one_trace = embedding_backward(1000, (3, 70), 600, torch.bfloat16, merge, 1)
    two, _, _, _, two_trace = embedding_backward(1000, (3, 70), 600, torch.bfloat16, merge, 2)
    assert torch.equal(one, two)
    if merge == "all":
        halves = [hbm_store_bytes(two_trace, p) for p in (0, 1)]
        assert sum(halves) == hbm_store_bytes(one_trace, 0)
        assert abs(halves[0] - halves[1]) <= 0.05 * sum(halves), halves


@pytest.mark.parametrize("merge", row_path.MERGES)
def test_embedding_backward_of_a_128256_row_vocabulary_at_lnc2(merge):
    out, reference, _, spec, _ = embedding_backward(128256, (3, 70), 64, torch.bfloat16, merge, 2)
    assert spec.params["merge"] == merge and spec.grid == 2
    assert_close(out, reference)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_index_put_accumulate_with_negative_ids_and_a_base(dtype, lnc):
    """index_put(accumulate=True) on dim 0: the fill copies the base (HBM to HBM) in blocks, negative
    ids count from the end, duplicates (also as -1 and rows - 1) add up; the "all" merge adds each
    row's sum to its base row (dma_compute, every row once)."""
    base = torch.randn(300, 40).to(dtype)
    ids = torch.randint(-300, 300, (200,), generator=torch.Generator().manual_seed(3))
    ids[:4] = -1
    ids[150:152] = 299
    values = torch.randn(200, 40).to(dtype)
    fn = lambda b, i, v: torch.index_put(b, (i,), v, accumulate=True)  # noqa: E731
    with row_path.forced_merge("all"):
        out, spec, _ = run(fn, [base, ids, values], aten.index_put.default, lnc)
    assert spec.params["merge"] == "all" and spec.grid == lnc
    reference = torch.index_put(base.float(), (ids,), values.float(), accumulate=True).to(dtype)
    assert_close(out, reference)


@pytest.mark.parametrize("merge", row_path.MERGES)
def test_an_out_of_range_id_fails_a_split_index_put(merge):
    base, values = torch.zeros(300, 40), torch.randn(200, 40)
    ids = torch.randint(0, 300, (200,))
    bad = ids.clone()
    bad[130] = 300
    fn = lambda b, i, v: torch.index_put(b, (i,), v, accumulate=True)  # noqa: E731
    with row_path.forced_merge(merge), pytest.raises(sim.NkiIndexError):
        run(fn, [base, bad, values], aten.index_put.default, 2, traced_args=[base, ids, values])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ids_shape", [(2, 128), (3, 70), (2, 2, 130), (64,)], ids=str)
def test_embedding_forward_splits_its_token_tiles(ids_shape, dtype):
    weight = torch.randn(1000, 600).to(dtype)
    ids = torch.randint(0, 1000, ids_shape)
    fn = lambda w, i: F.embedding(i, w)  # noqa: E731
    one, spec_one, _ = run(fn, [weight, ids], aten.embedding.default, 1)
    two, spec_two, recorded = run(fn, [weight, ids], aten.embedding.default, 2)
    assert torch.equal(one, F.embedding(ids, weight)) and torch.equal(two, one)
    tiles = 1 if len(ids_shape) == 1 else 2
    assert (spec_one.grid, spec_two.grid) == (1, 2 if tiles > 1 else 1)
    if tiles > 1:
        stores = [sum(1 for i in recorded.instructions if i.program_id == (p,) and i.engine == "dma"
                      and i.operands[0].buffer == "shared_hbm") for p in (0, 1)]
        assert abs(stores[0] - stores[1]) <= 1, stores


@pytest.mark.parametrize("rows,inner,programs", [(32000, 2048, 1), (32000, 2048, 2), (1000, 600, 2), (7, 3, 2),
                                                 (128256, 64, 2), (300, 40, 1), (5, 100000, 2)])
def test_fill_blocks_cover_every_row_once_in_long_runs(rows, inner, programs):
    plan = row_path.fill_plan(rows, inner, 128, 2, programs)
    assert plan.full * plan.block_rows + plan.last_rows == rows and plan.last_rows < plan.block_rows
    assert plan.width * 128 == plan.block_rows * inner  # a block is whole rows on every partition
    assert plan.chunk * 2 <= row_path.FILL_BYTES
    if programs > 1 and rows >= 8 * programs * plan.block_rows:
        assert plan.blocks % programs == 0


@pytest.mark.parametrize("lnc", [1, 2])
def test_the_all_merge_walks_column_groups(lnc):
    """2048 fp32 tokens of width 1100: every token's values fit on chip 1024 columns at a time (a
    full group and a ragged one at LNC 1; at LNC 2 each program's 550 columns are one group)."""
    out, reference, _, spec, _ = embedding_backward(1000, (2048,), 1100, torch.float32, "all", lnc)
    assert spec.params["merge"] == "all" and spec.params["merge_group"] == (1024 if lnc == 1 else 550)
    assert_close(out, reference)


@pytest.mark.parametrize("merge", row_path.MERGES)
def test_a_split_kernel_is_whole_at_one_program(merge):
    """Rendered for LNC 2 but launched with one program (as on an LNC=1 host): the one program owns
    every row and column, and skips the barrier."""
    vocab, ids_shape, width = 1000, (3, 70), 600
    ids = ids_with_padding_and_duplicates(vocab, ids_shape, PADDING_IDX, torch.Generator().manual_seed(4))
    grad = torch.randn(*ids_shape, width)
    fn = lambda g, i: aten.embedding_dense_backward(g, i, vocab, PADDING_IDX, False)  # noqa: E731
    with row_path.forced("indirect"), row_path.forced_merge(merge):
        _, spec, kernel = kernel_for(aten_graph(fn, grad, ids), aten.embedding_dense_backward.default, ctx=CONTEXTS[2])
    assert spec.grid == 2
    (out,) = call_kernel(sim.Kernel(kernel.func, (1,), "trn2"), spec, [grad, ids])
    assert_close(out, aten.embedding_dense_backward(grad, ids, vocab, PADDING_IDX, False))
