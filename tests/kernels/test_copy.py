"""Data-movement kernels (cat, constant_pad_nd, slice_scatter, copy, copy_, flip, repeat) in the NKI
interpreter.

Copies are exact: results must equal eager bit for bit, for fp32, bf16 and int64 data.
"""

from __future__ import annotations

import math

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, aten_graph, last_node, op_graph, run_lowered, run_node

aten = torch.ops.aten
F = torch.nn.functional

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def make(shape, dtype):
    return torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, shape, dtype=dtype)


def check(fn, args, target):
    results, expected, _ = run_lowered(fn, args, target)
    for out, ref in zip(results, expected):
        assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes,dim", [([(5, 300), (5, 7)], 1), ([(130, 4), (2, 4), (129, 4)], 0),
                                        ([(2, 3, 200), (2, 1, 200)], -2), ([(9000,), (3,)], 0)], ids=str)
def test_cat(shapes, dim, dtype):
    args = [make(s, dtype) for s in shapes]
    check(lambda *ts: torch.cat([t * 1 if t.dtype.is_floating_point else t + 0 for t in ts], dim), args,
          aten.cat.default)


def test_cat_of_views_reads_through_strides():
    x = torch.randn(6, 200)
    check(lambda t: torch.cat([t.t(), t.t()[:, :3]], 1), [x], aten.cat.default)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,pad", [((5, 300), (1, 2)), ((130, 9), (0, 3, 2, 0)), ((2, 3, 4), (1, 1, 1, 1, 1, 1)),
                                       ((4, 9000), (0, 200)),
                                       # negative pads crop: alone, mixed with padding, down to nothing
                                       ((5, 300), (-1, -2)), ((130, 9), (-3, 2, 4, -129)),
                                       ((2, 3, 200), (5, -100, -1, 0, 0, 1)), ((4, 5), (-5, 2)), ((4, 5), (-2, -3))],
                         ids=str)
def test_constant_pad_nd(shape, pad, dtype):
    value = -2.5 if dtype.is_floating_point else 7
    check(lambda t: F.pad(t, pad, value=value), [make(shape, dtype)], aten.constant_pad_nd.default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [-math.inf, math.inf, math.nan], ids=str)
def test_constant_pad_nd_with_a_non_finite_value(value, dtype):
    """Pooling-style padding with -inf: the fill reaches the kernel source as float('-inf')."""
    (out,), (ref,), _ = run_lowered(lambda t: F.pad(t, (1, 2, 0, 3), value=value), [make((130, 9), dtype)],
                                    aten.constant_pad_nd.default)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,start,end,step", [
    ((6, 300), 1, 10, 140, 1), ((300, 5), 0, 0, 129, 1), ((3, 4, 5), 2, 3, 5, 1), ((4, 9), 1, -4, None, 1),
    ((6, 300), 1, 10, 140, 3), ((300, 5), 0, 0, None, 2), ((3, 4, 5), 2, 1, 5, 2), ((4, 9), 1, -4, None, 3),
    ((4, 9), 1, 2, None, 10), ((260, 3), 0, 1, 259, 2), ((2, 9000), 1, 0, None, 7)], ids=str)
def test_slice_scatter(shape, dim, start, end, step, dtype):
    base = make(shape, dtype)
    src_shape = list(shape)
    src_shape[dim] = len(range(shape[dim])[start:end:step])
    src = make(src_shape, dtype)
    check(lambda b, s: torch.slice_scatter(b, s, dim, start, end, step), [base, src], aten.slice_scatter.default)


def test_slice_scatter_with_a_step_reads_a_non_contiguous_source():
    base, src = torch.randn(6, 300), torch.randn(49, 6)  # 49 = len(range(7, 300, 6))
    check(lambda b, s: torch.slice_scatter(b, s.t(), 1, 7, None, 6), [base, src], aten.slice_scatter.default)


def copy_node(dst: torch.Tensor, src: torch.Tensor):
    """A graph calling the functional aten.copy(dst, src) (make_fx would keep it, but no Python API
    makes it alone) and its args."""
    return op_graph(aten.copy.default, dst, src)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dst_shape,src_shape", [
    ((5, 300), (5, 300)), ((130, 200), (130, 1)), ((5, 300), (300,)), ((2, 3, 200), (1, 3, 1)),
    ((2, 3, 7), (7,)), ((129, 1), (1,)), ((4, 1, 9000), (4, 1, 1)), ((0, 5), (5,)), ((3,), ()), ((), ())], ids=str)
def test_copy_broadcasts_the_source(dst_shape, src_shape, dtype):
    gm, tensors = copy_node(make(dst_shape, dtype), make(src_shape, dtype))
    (out,), (ref,), _ = run_node(gm, tensors, aten.copy.default)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.int64, torch.float32),
    (torch.int64, torch.bfloat16), (torch.bool, torch.float32), (torch.float32, torch.bool),
    (torch.bool, torch.int64), (torch.int32, torch.int64)], ids=str)
def test_copy_casts_to_the_destination_dtype(src_dtype, dst_dtype):
    src = make((130, 1), src_dtype) if src_dtype != torch.bool else torch.rand(130, 1) > 0.5
    if src_dtype.is_floating_point:  # exact zeros, NaN, infinities and values that round in bf16
        src[:6, 0] = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1 + 2 ** -10])
    gm, tensors = copy_node(torch.zeros(130, 7, dtype=dst_dtype), src)
    (out,), (ref,), _ = run_node(gm, tensors, aten.copy.default)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def test_copy_reads_a_strided_source():
    src = torch.randn(200, 130)
    check(lambda d, s: aten.copy(d, s.t()), [torch.zeros(130, 200), src], aten.copy.default)


def test_copy_into_input_broadcasts_and_casts():
    cache, update = torch.zeros(3, 4, 300, dtype=torch.bfloat16), torch.randn(4, 1)
    results, _, inputs = run_lowered(lambda c, u: c.copy_(u), [cache.clone(), update], aten.copy_.default)
    assert results == [] and torch.equal(inputs[0], update.to(torch.bfloat16).expand(3, 4, 300))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dims", [((5, 300), (1,)), ((130, 9), (0,)), ((130, 9), (0, 1)),
                                        ((2, 3, 200), (0, 2)), ((2, 1, 129), (-2, -1)), ((7,), (0,)),
                                        ((4, 9000), (0,)), ((3, 4), ()), ((), ())], ids=str)
def test_flip(shape, dims, dtype):
    check(lambda t: torch.flip(t, dims), [make(shape, dtype)], aten.flip.default)


def test_flip_of_a_transposed_input():
    check(lambda t: torch.flip(t.t(), (0,)), [torch.randn(9, 130)], aten.flip.default)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,repeats", [((5, 300), (2, 1)), ((3,), (2, 2, 2)), ((130, 4), (1, 3)),
                                           ((2, 3, 4), (1, 1, 1)), ((2, 1, 65), (2, 3, 2)), ((4, 5), (0, 2)),
                                           ((1, 9000), (3, 1)), ((), ()), ((), (3, 2))], ids=str)
def test_repeat(shape, repeats, dtype):
    check(lambda t: t.repeat(repeats), [make(shape, dtype)], aten.repeat.default)


def test_repeat_of_a_transposed_input():
    check(lambda t: t.t().repeat(2, 3), [torch.randn(7, 130)], aten.repeat.default)


def lowered(fn, *args, target):
    node = next(n for n in aten_graph(fn, *args).graph.nodes if n.target is target)
    return LOWERINGS[target](CTX, node)


def lowered_copy(dst: torch.Tensor, src: torch.Tensor):
    return LOWERINGS[aten.copy.default](CTX, last_node(copy_node(dst, src)[0], aten.copy.default))


def test_unsupported_cases_raise():
    with pytest.raises(Unsupported, match="truncating"):  # float -> int: a DMA would round
        lowered_copy(torch.zeros(4, 5, dtype=torch.int32), torch.randn(4, 5))
    with pytest.raises(Unsupported, match="on-chip"):
        lowered_copy(torch.zeros(4, 5), torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(Unsupported, match="DMAs"):  # every element of a 2-d flip is its own DMA
        lowered(lambda t: torch.flip(t, (0, 1)), torch.randn(300, 300), target=aten.flip.default)


# HBM -> HBM boxes are not cut at the partition count (copy._walk): a slice, a permuted copy or a cat is
# a DMA or two, shared by the LNC programs when large (copy._share_out); rows on and off 128, fp32, bf16
# and int64, bit for bit.
LNC1 = LoweringContext.for_target("trn2", lnc=1)


def _dmas(fn, args, target, ctx) -> list:
    with sim.trace() as trace:
        results, expected, _ = run_lowered(fn, args, target, ctx=ctx)
    for out, ref in zip(results, expected):
        assert out.dtype == ref.dtype and torch.equal(out, ref)
    return [i for i in trace.instructions if i.engine == "dma"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [256, 131])
def test_hbm_copies_move_whole_boxes_shared_by_the_programs(rows, dtype):
    x = make((4, rows, 64), dtype)
    for fn in (lambda t: t[:, 1:].clone(), lambda t: t.transpose(0, 1).contiguous()):
        assert len(_dmas(fn, [x], aten.clone.default, LNC1)) == 1
        shared = _dmas(fn, [x], aten.clone.default, CTX)
        assert len(shared) == 2 and {i.program_id for i in shared} == {(0,), (1,)}
    # a cat of rows - 1 and 1 rows: the large piece is cut in two, the small one is one DMA
    a, b = make((4, rows - 1, 64), dtype), make((4, 1, 64), dtype)
    cat = lambda a, b: torch.cat([t * 1 if t.dtype.is_floating_point else t + 0 for t in (a, b)], 1)  # noqa: E731
    assert len(_dmas(cat, [a, b], aten.cat.default, LNC1)) == 2
    assert len(_dmas(cat, [a, b], aten.cat.default, CTX)) == 3


def test_hbm_boxes_stay_within_an_access_patterns_sizes():
    # 70000 rows: one box of 65535 (uint16 sizes) and the rest
    boxes = _dmas(lambda t: t[1:].clone(), [torch.randn(70001, 2)], aten.clone.default, LNC1)
    assert len(boxes) == 2 and max(max(o.shape) for i in boxes for o in i.operands) == 65535


@pytest.mark.parametrize("rows", [8, 128])
def test_a_box_of_at_most_128_rows_stays_one_programs_dma(rows):
    # as before boxes grew past the partitions: one DMA, one program (copy replay, not operations)
    spec = lowered(lambda t: t[1:].clone(), torch.randn(rows + 1, 2, 64), target=aten.clone.default)
    assert spec.grid == 1
    assert len(_dmas(lambda t: t[1:].clone(), [torch.randn(rows + 1, 2, 64)], aten.clone.default, CTX)) == 1
