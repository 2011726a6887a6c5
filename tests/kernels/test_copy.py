"""Data-movement kernels (cat, constant_pad_nd, slice_scatter, copy_) in the NKI interpreter.

Copies are exact: results must equal eager bit for bit, for fp32, bf16 and int64 data.
"""

from __future__ import annotations

import math

import pytest
import torch

from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import aten_graph, run_lowered

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
                                       ((4, 9000), (0, 200))], ids=str)
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
@pytest.mark.parametrize("shape,dim,start,end", [((6, 300), 1, 10, 140), ((300, 5), 0, 0, 129), ((3, 4, 5), 2, 3, 5),
                                                 ((4, 9), 1, -4, None)], ids=str)
def test_slice_scatter(shape, dim, start, end, dtype):
    base = make(shape, dtype)
    src_shape = list(shape)
    src_shape[dim] = len(range(shape[dim])[start:end])
    src = make(src_shape, dtype)
    check(lambda b, s: torch.slice_scatter(b, s, dim, start, end), [base, src], aten.slice_scatter.default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_into_input_is_in_place(dtype):
    """KV-cache style: copy_ writes the kernel's input 0 and returns nothing."""
    cache, update = torch.zeros(4, 300, dtype=dtype), torch.randn(4, 300)
    gm = aten_graph(lambda c, u: c.copy_(u), cache.clone(), update)
    node = next(n for n in gm.graph.nodes if n.target is aten.copy_.default)
    spec = LOWERINGS[node.target](node)
    assert spec.inplace == {0: 0}
    results, _, inputs = run_lowered(lambda c, u: c.copy_(u), [cache.clone(), update], aten.copy_.default)
    assert results == []
    assert torch.equal(inputs[0], update.to(dtype))


def test_unsupported_cases_raise():
    gm = aten_graph(lambda t: F.pad(t, (-1, 2)), torch.randn(4, 5))
    node = next(n for n in gm.graph.nodes if n.target is aten.constant_pad_nd.default)
    with pytest.raises(Unsupported, match="negative"):
        LOWERINGS[node.target](node)
