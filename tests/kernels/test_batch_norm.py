"""Batch norm forward kernels (training with functional running-stat updates, and eval), run in
the NKI interpreter against eager.

Each case traces the ATen op into a graph, lowers it, runs its kernel on the graph's eager values
and compares every output. Tolerances: fp32 rtol 1e-5 scaled to each output's magnitude (the
harness default), bf16 2e-2 (about two ulps; eager bf16 computes in fp32 as the kernel does).
The backward needs no kernel of its own: native_batch_norm_backward arrives decomposed into
reductions and pointwise ops, checked by the compiled test below.
"""

from __future__ import annotations

import pytest
import torch

import neuron_inductor  # noqa: F401  (registers the "neuron" backend)
from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, DTYPES, aten_graph, assert_all_close, check_node, last_node, run_node

aten = torch.ops.aten
TRAIN = aten._native_batch_norm_legit_functional.default
EVAL = aten._native_batch_norm_legit_no_training.default

# [N, C, ...]: channels below, at and above the 128 partitions; spatial runs of one element
# (BatchNorm1d on [N, C]), of a 512-column stats group, and one over a column chunk (two passes).
# At most 64 channels split the samples into blocks on more partitions (by 2, 4 and 3 here; one
# sample cannot split).
SHAPES = [(2, 3, 4, 5), (4, 130, 7, 7), (2, 128, 16, 16), (8, 20), (1, 4, 3), (3, 5, 100, 100)]


def batch_norm_args(shape, dtype, stats_dtype, has_weight=True, has_bias=True, strided=False):
    torch.manual_seed(0)
    channels = shape[1]
    if strided:  # channels-last memory: the kernel reads through the strides
        x = (torch.randn(shape[0], *shape[2:], channels) * 3 + 1).to(dtype).movedim(-1, 1)
    else:
        x = (torch.randn(shape) * 3 + 1).to(dtype)
    w = torch.randn(channels, dtype=stats_dtype) if has_weight else None
    b = torch.randn(channels, dtype=stats_dtype) if has_bias else None
    running_mean = torch.randn(channels, dtype=stats_dtype)
    running_var = torch.rand(channels, dtype=stats_dtype) + 0.5
    return [x, w, b, running_mean, running_var]


def train_graph(args, momentum=0.1, eps=1e-5):
    return aten_graph(lambda x, w, b, rm, rv: TRAIN(x, w, b, rm, rv, True, momentum, eps), *args)


def eval_graph(args, eps=1e-5):
    gm = aten_graph(lambda x, w, b, rm, rv: EVAL(x, w, b, rm, rv, 0.1, eps)[0], *args)
    # As the backend gets it: without the unread getitems of the empty saved statistics.
    gm.graph.eliminate_dead_code()
    return gm


def check_eval(args, eps=1e-5):
    """The eval kernel's one output against eager's (whose saved statistics are empty)."""
    actual, expected, _ = run_node(eval_graph(args, eps), args, EVAL)
    assert [e.numel() for e in expected[1:]] == [0, 0]
    assert_all_close(actual, expected[:1])


# (input dtype, weight / running-stat dtype): a bf16 module, and bf16 activations of an fp32 one.
DTYPE_PAIRS = [(dtype, dtype) for dtype in DTYPES] + [(torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype,stats_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_training(shape, dtype, stats_dtype):
    args = batch_norm_args(shape, dtype, stats_dtype)
    actual, expected, _ = run_node(train_graph(args), args, TRAIN)
    assert len(actual) == 5
    assert_all_close(actual, expected)


@pytest.mark.parametrize("dtype,stats_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_eval(shape, dtype, stats_dtype):
    args = batch_norm_args(shape, dtype, stats_dtype)
    check_eval(args)


@pytest.mark.parametrize("has_weight,has_bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_optional_affine(dtype, has_weight, has_bias):
    args = batch_norm_args((4, 130, 3, 3), dtype, dtype, has_weight, has_bias)
    check_node(train_graph(args), args, TRAIN)
    check_eval(args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_strided_input(dtype):
    args = batch_norm_args((2, 6, 5, 7), dtype, dtype, strided=True)
    assert not args[0].is_contiguous()
    check_node(train_graph(args), args, TRAIN)
    check_eval(args)


@pytest.mark.parametrize("momentum,eps", [(0.0, 1e-3), (1.0, 0.5), (0.3, 1e-12)])
def test_batch_norm_momentum_eps(momentum, eps):
    args = batch_norm_args((3, 10, 6), torch.float32, torch.float32)
    check_node(train_graph(args, momentum, eps), args, TRAIN)
    check_eval(args, eps)


def test_batch_norm_unsupported():
    # One value per channel: eager's unbiased running variance divides by zero.
    args = batch_norm_args((1, 4), torch.float32, torch.float32)
    with pytest.raises(Unsupported, match="one value per channel"):
        LOWERINGS[TRAIN](CTX, last_node(train_graph(args), TRAIN))
    args = batch_norm_args((2, 4, 3), torch.float64, torch.float64)
    with pytest.raises(Unsupported, match="dtype"):
        LOWERINGS[EVAL](CTX, last_node(eval_graph(args), EVAL))
    # An [N, C] input walks one DMA per sample and channel tile: too many for a kernel.
    args = batch_norm_args((20000, 4), torch.float32, torch.float32)
    with pytest.raises(Unsupported, match="DMAs"):
        LOWERINGS[EVAL](CTX, last_node(eval_graph(args), EVAL))
