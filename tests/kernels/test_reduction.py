"""Reduction and cumsum kernels, run in the NKI interpreter against eager PyTorch.

Each case traces a function with make_fx and the Neuron decomposition table, lowers the one node
under test, renders and loads its kernel, feeds it the graph's own values (views included, so
strided inputs are exercised) and compares with eager. fp32 tolerances are rtol 1e-5 scaled to the
magnitudes; bf16 results are compared with an fp32-accumulated reference rounded to bf16, within
2e-2 relative (one or two bf16 ulps).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, aten_graph, assert_close, run_lowered

aten = torch.ops.aten


SHAPES = [(300,), (128, 64), (257, 3), (5, 130, 7), (2, 3, 129, 5)]


def dim_sets(rank):
    for r in range(1, rank + 1):
        yield from itertools.combinations(range(rank), r)


SUM_CASES = [(shape, dims, keepdim) for shape in SHAPES for dims in dim_sets(len(shape)) for keepdim in (False, True)]


@pytest.mark.parametrize("shape,dims,keepdim", SUM_CASES, ids=str)
def test_sum_every_dim_set_fp32(shape, dims, keepdim):
    x = torch.randn(shape)
    (out,), (ref,), _ = run_lowered(lambda t: t.sum(dims, keepdim=keepdim), [x], aten.sum.dim_IntList)
    assert_close(out, ref)


@pytest.mark.parametrize("shape,dims", [((300, 70), (0,)), ((4, 130, 9), (1,)), ((4, 130, 9), (0, 2)),
                                        ((3, 9000), (1,)), ((6, 5, 4), (0, 1, 2))], ids=str)
def test_sum_bf16_accumulates_in_fp32(shape, dims):
    x = torch.randn(shape).bfloat16() + 3.0  # a large mean makes bf16 accumulation visibly wrong
    (out,), _, _ = run_lowered(lambda t: t.sum(dims), [x], aten.sum.dim_IntList)
    reference = x.float().sum(dims).bfloat16()
    assert_close(out, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dims,keepdim", [((260, 64), (-1,), True), ((2, 130, 64), (0, 1), False),
                                                ((5, 7, 3), (1,), False), ((1000,), (0,), False)], ids=str)
def test_mean(shape, dims, keepdim, dtype):
    x = torch.randn(shape, dtype=dtype)
    (out,), _, _ = run_lowered(lambda t: t.mean(dims, keepdim=keepdim), [x], aten.mean.dim)
    assert_close(out, x.float().mean(dims, keepdim=keepdim).to(dtype))


def test_sum_of_a_permuted_view_and_of_bools():
    x = torch.randn(6, 200, 5)
    (out,), (ref,), inputs = run_lowered(lambda t: t.permute(2, 0, 1).sum((0, 2)), [x], aten.sum.dim_IntList)
    assert not inputs[0].is_contiguous()
    assert_close(out, ref)
    mask = torch.rand(4, 300) > 0.3
    (count,), (expected,), _ = run_lowered(lambda m: m.sum(), [mask], aten.sum.dim_IntList)
    assert count.dtype == torch.int64 and torch.equal(count, expected)


def test_sum_with_dtype_upcasts_bf16():
    x = torch.randn(130, 40).bfloat16()
    (out,), (ref,), _ = run_lowered(lambda t: t.sum(0, dtype=torch.float32), [x], aten.sum.dim_IntList)
    assert_close(out, ref)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 140), min_size=1, max_size=4).filter(lambda s: torch.Size(s).numel() <= 40000),
       data=st.data(), op=st.sampled_from(["sum", "amax", "amin", "prod", "mean"]),
       keepdim=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_reductions_property(shape, data, op, keepdim, dtype):
    dims = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))))
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label="seed")  # the values are part of the example
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if op == "prod":
        x = (x.float().sign() * (1 + 0.01 * x.float().abs().clamp(max=3))).to(dtype)  # products stay O(1)
    fn = {
        "sum": lambda t: t.sum(dims, keepdim=keepdim), "mean": lambda t: t.mean(dims, keepdim=keepdim),
        "amax": lambda t: t.amax(dims, keepdim=keepdim), "amin": lambda t: t.amin(dims, keepdim=keepdim),
        "prod": lambda t: t.prod(dims[0], keepdim=keepdim),
    }[op]
    target = {"sum": aten.sum.dim_IntList, "mean": aten.mean.dim, "amax": aten.amax.default,
              "amin": aten.amin.default, "prod": aten.prod.dim_int}[op]
    (out,), _, _ = run_lowered(fn, [x], target)
    assert_close(out, fn(x.float()).to(dtype))


@pytest.mark.parametrize("fn,target", [
    (lambda t: t.amax((0, 2)), aten.amax.default), (lambda t: t.amin(-1, keepdim=True), aten.amin.default),
    (lambda t: t.max(), aten.max.default), (lambda t: t.min(), aten.min.default),
])
def test_max_min(fn, target):
    x = torch.randn(3, 140, 70)
    (out,), (ref,), _ = run_lowered(fn, [x], target)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("op", ["any", "all"])
@pytest.mark.parametrize("dims", [(1,), (0,), (0, 1), None])
def test_any_all(op, dims):
    x = torch.rand(130, 70) > 0.02
    x[5] = True
    x[7] = False
    fn = (lambda t: getattr(t, op)()) if dims is None else (lambda t: getattr(t, op)(dims))
    gm = aten_graph(fn, x)
    # all() decomposes to not(any(not x)): find the overload the graph really holds
    target = [n.target for n in gm.graph.nodes if str(n.target).startswith(("aten.any.", "aten.all."))][-1]
    (out,), (ref,), _ = run_lowered(fn, [x], target)
    assert out.dtype == torch.bool and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", [((7, 300), 1), ((300, 7), 0), ((3, 200, 9), 1), ((5, 9000), -1),
                                       ((1000,), 0), ((4, 1, 6), 1)], ids=str)
def test_max_dim_and_argmax_take_the_first_extremum(shape, dim, dtype):
    x = torch.randint(-3, 4, shape).to(dtype)  # many ties: the first index must win
    for target, fn in [(aten.max.dim, lambda t: t.max(dim)), (aten.min.dim, lambda t: t.min(dim, keepdim=True))]:
        (values, indices), (ref_values, ref_indices), _ = run_lowered(fn, [x], target)
        assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)
    for target, fn in [(aten.argmax.default, lambda t: t.argmax(dim)), (aten.argmin.default, lambda t: t.argmin(dim))]:
        (indices,), (ref_indices,), _ = run_lowered(fn, [x], target)
        assert torch.equal(indices, ref_indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dims,correction", [((9, 300), (1,), 1), ((130, 9000), (-1,), 0),
                                                   ((4, 3, 50), (1, 2), 1)], ids=str)
def test_var_and_var_mean(shape, dims, correction, dtype):
    x = (torch.randn(shape) * 2 + 10).to(dtype)  # a mean far from zero: one-pass formulas would lose digits
    (var,), _, _ = run_lowered(lambda t: t.var(dims, correction=correction), [x], aten.var.correction)
    assert_close(var, x.float().var(dims, correction=correction).to(dtype))
    (var, mean), _, _ = run_lowered(lambda t: torch.var_mean(t, dims, correction=correction, keepdim=True), [x],
                                    aten.var_mean.correction)
    ref_var, ref_mean = torch.var_mean(x.float(), dims, correction=correction, keepdim=True)
    assert_close(var, ref_var.to(dtype))
    assert_close(mean, ref_mean.to(dtype))


def test_unsupported_cases_raise():
    gm = aten_graph(lambda t: t.var(0), torch.randn(300, 4))
    node = next(n for n in gm.graph.nodes if n.target is aten.var.correction)
    with pytest.raises(Unsupported, match="trailing"):
        LOWERINGS[node.target](CTX, node)
    gm = aten_graph(lambda t: t.argmax(), torch.randn(3, 4))
    node = next(n for n in gm.graph.nodes if n.target is aten.argmax.default)
    with pytest.raises(Unsupported, match="flattened"):
        LOWERINGS[node.target](CTX, node)


# Along the last non-unit dim (free-axis scan) and along earlier dims (partition scan on TensorE):
# scanned extents that are and are not multiples of 128 partitions, trailing extents that are and
# are not multiples of the free chunks, size-1 scanned dims and leading dims.
CUMSUM_CASES = [((5, 300), 1), ((130, 9000), -1), ((1000,), 0), ((3, 7, 1), 1), ((300, 70), 0), ((256, 171), 0),
                ((5, 130, 7), 1), ((2, 3, 129, 5), 0), ((257, 1000), 0), ((4, 1, 6), 1), ((1, 600), 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape,dim", CUMSUM_CASES, ids=str)
def test_cumsum(shape, dim, dtype):
    if dtype == torch.int64:
        x = (torch.rand(shape) > 0.3).long()  # an attention mask's position ids
    else:
        x = torch.randn(shape, dtype=dtype)
    (out,), (ref,), _ = run_lowered(lambda t: t.cumsum(dim), [x], aten.cumsum.default)
    if dtype == torch.bfloat16:
        ref = x.float().cumsum(dim).bfloat16()
        # a long bf16 prefix sum rounds once per output, against a magnitude of sqrt(n)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    else:
        assert_close(out, ref, fp32_rtol=1e-5 * shape[dim] ** 0.5)


@pytest.mark.parametrize("dim", [0, 1])
def test_cumsum_with_infinities_and_nans(dim):
    """inf, -inf, both, and NaN in different columns (rows for dim 1), before and after the first
    128-row chunk: the prefixes reaching them become inf / -inf / NaN, the others stay finite."""
    x = torch.randn(300, 7)
    x[5, 0] = x[10, 2] = math.inf
    x[200, 1] = x[150, 2] = x[0, 4] = -math.inf
    x[130, 3] = math.nan
    x[7, 5], x[9, 5] = math.nan, math.inf
    if dim == 1:
        x = x.T.contiguous()
    (out,), (ref,), _ = run_lowered(lambda t: t.cumsum(dim), [x], aten.cumsum.default)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isposinf(), ref.isposinf())
    assert torch.equal(out.isneginf(), ref.isneginf())
    assert_close(out, ref, fp32_rtol=1e-5 * x.shape[dim] ** 0.5)


def test_cumsum_of_a_strided_view_along_a_leading_dim():
    x = torch.randn(9, 200, 5)
    (out,), (ref,), inputs = run_lowered(lambda t: t.permute(1, 2, 0).cumsum(0), [x], aten.cumsum.default)
    assert not inputs[0].is_contiguous()
    assert_close(out, ref, fp32_rtol=1e-5 * 200 ** 0.5)


@pytest.mark.parametrize("shape,dim,reason", [((0, 5), 0, "empty"), ((4, 5), 0, "float64")], ids=str)
def test_cumsum_unsupported_cases_raise(shape, dim, reason):
    dtype = torch.float64 if reason == "float64" else torch.float32
    gm = aten_graph(lambda t: t.cumsum(dim), torch.randn(shape, dtype=dtype))
    node = next(n for n in gm.graph.nodes if n.target is aten.cumsum.default)
    with pytest.raises(Unsupported, match=reason):
        LOWERINGS[node.target](CTX, node)


def lines_with_nans(count: int, length: int) -> torch.Tensor:
    """[count, length] fp32 lines with many ties, cycling through NaN patterns: none (with +-inf),
    one NaN at a position that moves from line to line, several NaNs, all NaN, NaN among +-inf,
    and all -inf / all +inf lines (no NaN: the first element is the extremum)."""
    x = torch.randint(-3, 4, (count, length)).float()
    nan, inf = float("nan"), float("inf")
    for line in range(count):
        first = (line * 7919 + 11) % length  # first NaN position, spread over the line (and its chunks)
        pattern = line % 7
        if pattern == 0:
            x[line, first] = inf
            x[line, (first + 1) % length] = -inf
        elif pattern == 1:
            x[line, first] = nan
        elif pattern == 2:
            x[line, first:] = torch.where(torch.arange(length - first) % 3 == 0, nan, x[line, first:])
        elif pattern == 3:
            x[line] = nan
        elif pattern == 4:
            x[line, : first + 1] = torch.where(torch.arange(first + 1) % 2 == 0, inf, -inf)
            x[line, first] = nan
            x[line, first + 1:] = inf
        elif pattern == 5:
            x[line] = -inf
        else:
            x[line] = inf
    return x


# Reduced dim last (free-axis tiles; 9000 and 20000 lanes span several chunks) or not (partition
# layout); extents that are and are not multiples of 128 partitions / 512 columns.
NAN_SHAPES = [((7, 300), 1), ((256, 512), 1), ((130, 9000), -1), ((20000,), 0), ((300, 7), 0), ((256, 128), 0),
              ((3, 200, 9), 1), ((2, 129, 130), 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", NAN_SHAPES, ids=str)
def test_arg_reductions_point_at_the_first_nan(shape, dim, dtype):
    """Eager treats NaN as beyond every number: argmax and argmin of a line holding NaN both give
    its first NaN, and max / min values are NaN there."""
    dim = dim % len(shape)
    lines = [s for d, s in enumerate(shape) if d != dim]
    # from line 2 on: a 1-d input is one line with several NaNs, the first in its second chunk
    x = lines_with_nans(torch.Size(lines).numel() + 2, shape[dim])[2:]
    x = x.reshape(*lines, shape[dim]).movedim(-1, dim).to(dtype)
    assert x.isnan().any()
    for target, fn in [(aten.argmax.default, lambda t: t.argmax(dim)), (aten.argmin.default, lambda t: t.argmin(dim))]:
        (indices,), (ref_indices,), _ = run_lowered(fn, [x], target)
        assert torch.equal(indices, ref_indices), (indices != ref_indices).nonzero()[:5]
    for target, fn in [(aten.max.dim, lambda t: t.max(dim)), (aten.min.dim, lambda t: t.min(dim, keepdim=True))]:
        (values, indices), (ref_values, ref_indices), _ = run_lowered(fn, [x], target)
        assert torch.equal(indices, ref_indices), (indices != ref_indices).nonzero()[:5]
        torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)


# "fold" layout: reduced dims that are not trailing, few reduced rows, many kept trailing elements
# (the GQA repeat_interleave backward sums [B, Hkv, rep, S, D] over rep). Reduced dims first,
# middle and both; kept trailing extents on and off 128 partitions.
FOLD_CASES = [((1, 3, 2, 130, 128), (2,)), ((2, 300, 70), (0,)), ((4, 256, 64), (0,)),
              ((3, 2, 4, 129, 40), (0, 2)), ((2, 128, 128), (0,))]


def _layout_of(fn, x, target):
    gm = aten_graph(fn, x)
    node = [n for n in gm.graph.nodes if n.target is target][-1]
    return LOWERINGS[target](CTX, node).params["layout"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("shape,dims", FOLD_CASES, ids=str)
def test_sum_over_leading_and_middle_dims_folds_tiles(shape, dims, keepdim, dtype):
    x = (torch.randn(shape) + 2.0).to(dtype)  # a mean off zero: bf16 accumulation would show
    fn = lambda t: t.sum(dims, keepdim=keepdim)  # noqa: E731
    assert _layout_of(fn, x, aten.sum.dim_IntList) == "fold"
    (out,), _, _ = run_lowered(fn, [x], aten.sum.dim_IntList)
    assert_close(out, x.float().sum(dims, keepdim=keepdim).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["mean", "amax", "amin", "prod", "norm"])
def test_other_reductions_fold_tiles(op, dtype):
    x = torch.randn(2, 3, 260, 64).to(dtype)
    if op == "prod":
        x = (x.float().sign() * (1 + 0.01 * x.float().abs().clamp(max=3))).to(dtype)
    fn, target = {
        "mean": (lambda t: t.mean(1, keepdim=True), aten.mean.dim),
        "amax": (lambda t: t.amax((0, 1)), aten.amax.default),
        "amin": (lambda t: t.amin(0), aten.amin.default),
        "prod": (lambda t: t.prod(1), aten.prod.dim_int),
        "norm": (lambda t: torch.linalg.vector_norm(t, 2, (0, 1)), aten.linalg_vector_norm.default),
    }[op]
    assert _layout_of(fn, x, target) == "fold"
    (out,), _, _ = run_lowered(fn, [x], target)
    assert_close(out, fn(x.float()).to(dtype))


def test_fold_reads_strided_views_and_bools():
    x = torch.randn(200, 2, 64)
    fn = lambda t: t.permute(1, 0, 2).sum(0)  # noqa: E731
    (out,), (ref,), inputs = run_lowered(fn, [x], aten.sum.dim_IntList)
    assert not inputs[0].is_contiguous()
    assert _layout_of(fn, x, aten.sum.dim_IntList) == "fold"
    assert_close(out, ref)
    mask = torch.rand(3, 130, 64) > 0.5
    any_fn = lambda m: m.any(0)  # noqa: E731
    (hit,), (expected,), _ = run_lowered(any_fn, [mask], aten.any.dim)
    assert _layout_of(any_fn, mask, aten.any.dim) == "fold"
    assert torch.equal(hit, expected)


def test_fold_is_chosen_only_where_it_pays():
    # many reduced rows onto few kept columns (a bias gradient): ones-vector matmuls stay cheaper
    assert _layout_of(lambda t: t.sum(0), torch.randn(4096, 64), aten.sum.dim_IntList) == "partition"
    # argmax keeps its layout (the fold does not track indices)
    assert _layout_of(lambda t: t.argmax(0), torch.randn(2, 300, 70), aten.argmax.default) == "partition"
    # the step's GQA backward: 2 reduced rows, 2048 x 128 kept elements per head
    assert _layout_of(lambda t: t.sum(2), torch.empty(1, 8, 2, 2048, 128, device="meta"),
                      aten.sum.dim_IntList) == "fold"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("shape,dims,permuted", [((2, 512, 64), (0,), False), ((1, 2, 2, 260, 128), (2,), False),
                                                 ((2, 384, 96), (0,), True)], ids=str)
def test_narrow_fold_tiles_widen_through_a_view(shape, dims, permuted, keepdim, dtype):
    # fold tiles of fewer than 512 columns take part of their row dim onto the free axis: the kernel
    # reads the input (strided too) and writes the output through a reshaped view
    x = (torch.randn(shape) + 1.0).to(dtype)
    if permuted:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    fn = lambda t: t.sum(dims, keepdim=keepdim)  # noqa: E731
    gm = aten_graph(fn, x)
    node = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList][-1]
    params = LOWERINGS[aten.sum.dim_IntList](CTX, node).params
    assert params["layout"] == "fold" and params["view"] is not None
    (out,), _, inputs = run_lowered(fn, [x], aten.sum.dim_IntList)
    assert inputs[0].is_contiguous() != permuted
    assert_close(out, x.float().sum(dims, keepdim=keepdim).to(dtype))
