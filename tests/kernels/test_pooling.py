"""2-d pooling kernels (max with indices, average, adaptive average; forward and backward), run in
the NKI interpreter against eager.

Each case traces the forward and backward ATen ops into one graph, lowers the node under test,
runs its kernel on the graph's eager values and compares. Tolerances: max pooling's values and
indices are exact (selection, no arithmetic); sums (average pooling, the backwards' overlapping
windows) fp32 rtol 1e-5 scaled to the output's magnitude, bf16 2e-2 (eager bf16 accumulates in
fp32 as the kernels do).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import (CTX, DTYPES, compiled_forward_backward, assert_close, aten_graph, assert_all_close, last_node,
                      run_node)

aten = torch.ops.aten
MAX = aten.max_pool2d_with_indices.default
MAX_BACKWARD = aten.max_pool2d_with_indices_backward.default
AVG = aten.avg_pool2d.default
AVG_BACKWARD = aten.avg_pool2d_backward.default
ADAPTIVE = aten._adaptive_avg_pool2d.default
ADAPTIVE_BACKWARD = aten._adaptive_avg_pool2d_backward.default

# Inputs: planes (N * C) below and above the 128 partitions, odd spatial sizes, a 3-d [C, H, W]
# input, size-1 batch / channel dims, and rows wide enough that max pooling's window-relative
# index leaves bf16's exact integers (carried in fp32 then).
SHAPES = [(2, 3, 7, 9), (2, 70, 10, 12), (5, 16, 17), (1, 1, 4, 4), (1, 130, 6, 5), (1, 2, 5, 150)]
# (kernel, stride, padding): the common cases, overlapping and padded windows among them.
WINDOWS = [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 0), (3, 3, 0)]


def inputs(shape, dtype, strided=False):
    torch.manual_seed(0)
    if strided:  # channels-last memory: the kernel reads through the strides
        return torch.randn(*shape[:-3], shape[-2], shape[-1], shape[-3]).to(dtype).movedim(-1, -3)
    return torch.randn(shape).to(dtype)


def max_pool_graph(x, kernel, stride, padding, ceil_mode=False, dilation=1):
    window = ([kernel] * 2, [stride] * 2, [padding] * 2, [dilation] * 2, ceil_mode)

    def fn(x, dy):
        y, indices = aten.max_pool2d_with_indices(x, *window)
        return y, indices, aten.max_pool2d_with_indices_backward(dy, x, *window, indices)
    dy = torch.randn(aten.max_pool2d_with_indices(x, *window)[0].shape).to(x.dtype)
    return aten_graph(fn, x, dy), [x, dy]


def avg_pool_graph(x, kernel, stride, padding, count_include_pad=True, divisor_override=None, ceil_mode=False):
    window = ([kernel] * 2, [stride] * 2, [padding] * 2, ceil_mode, count_include_pad, divisor_override)

    def fn(x, dy):
        return aten.avg_pool2d(x, *window), aten.avg_pool2d_backward(dy, x, *window)
    dy = torch.randn(aten.avg_pool2d(x, *window).shape).to(x.dtype)
    return aten_graph(fn, x, dy), [x, dy]


def check(gm, args, target):
    actual, expected, _ = run_node(gm, args, target)
    assert len(actual) == len(expected)
    assert_all_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,stride,padding", WINDOWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_max_pool(shape, kernel, stride, padding, dtype):
    gm, args = max_pool_graph(inputs(shape, dtype), kernel, stride, padding)
    actual, expected, _ = run_node(gm, args, MAX)
    assert len(actual) == 2
    assert torch.equal(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1])
    check(gm, args, MAX_BACKWARD)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,stride,padding", WINDOWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_avg_pool(shape, kernel, stride, padding, dtype):
    gm, args = avg_pool_graph(inputs(shape, dtype), kernel, stride, padding)
    check(gm, args, AVG)
    check(gm, args, AVG_BACKWARD)


@pytest.mark.parametrize("count_include_pad,divisor_override", [(False, None), (True, 5), (False, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_pool_divisors(dtype, count_include_pad, divisor_override):
    gm, args = avg_pool_graph(inputs((2, 3, 7, 9), dtype), 3, 2, 1, count_include_pad, divisor_override)
    check(gm, args, AVG)
    check(gm, args, AVG_BACKWARD)


# ceil_mode windows past the padding: (shape, kernel, stride, padding), the last row / column of
# windows partial in each.
CEIL_CASES = [((2, 3, 8, 9), 2, 2, 0), ((2, 3, 7, 10), 3, 2, 1), ((1, 130, 6, 5), 3, 3, 0), ((5, 16, 17), 3, 2, 1)]


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,kernel,stride,padding", CEIL_CASES)
def test_pool_ceil_mode(shape, kernel, stride, padding, dtype, count_include_pad):
    x = inputs(shape, dtype)
    gm, args = max_pool_graph(x, kernel, stride, padding, ceil_mode=True)
    actual, expected, _ = run_node(gm, args, MAX)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    check(gm, args, MAX_BACKWARD)
    gm, args = avg_pool_graph(x, kernel, stride, padding, count_include_pad, ceil_mode=True)
    check(gm, args, AVG)
    check(gm, args, AVG_BACKWARD)


# Dilated max pools: (shape, kernel, stride, padding, dilation, ceil_mode), windows whose first
# input element is a few dilation steps past the padding among them.
DILATED = [((2, 3, 9, 11), 2, 1, 0, 2, False), ((2, 3, 10, 9), 3, 2, 1, 2, False), ((1, 130, 12, 13), 3, 1, 1, 3, True),
           ((5, 16, 17), 2, 3, 1, 3, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,kernel,stride,padding,dilation,ceil_mode", DILATED)
def test_max_pool_dilation(shape, kernel, stride, padding, dilation, ceil_mode, dtype):
    gm, args = max_pool_graph(inputs(shape, dtype), kernel, stride, padding, ceil_mode, dilation)
    actual, expected, _ = run_node(gm, args, MAX)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    check(gm, args, MAX_BACKWARD)


def test_max_pool_dilation_all_minus_inf():
    """Windows of -inf only keep their first input element's index, dilation steps past the padding."""
    x = torch.full((1, 1, 7, 7), float("-inf"))
    gm, args = max_pool_graph(x, 3, 1, 1, dilation=3)
    actual, expected, _ = run_node(gm, args, MAX)
    assert torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_strided_input(dtype):
    x = inputs((2, 6, 8, 7), dtype, strided=True)
    assert not x.is_contiguous()
    gm, args = max_pool_graph(x, 3, 2, 1)
    check(gm, args, MAX)
    gm, args = avg_pool_graph(x, 3, 2, 1)
    check(gm, args, AVG)


def test_max_pool_non_finite():
    """NaN wins its windows (the last NaN's index, as eager); all -inf windows keep the first
    input element's index, padding never chosen."""
    x = torch.randn(1, 2, 6, 6)
    x[0, 0, 1, 1] = x[0, 0, 1, 2] = float("nan")
    x[0, 1] = float("-inf")
    x[0, 1, 4, 4] = float("inf")
    gm, args = max_pool_graph(x, 3, 2, 1)
    actual, expected, _ = run_node(gm, args, MAX)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,output", [
    # dividing sizes: a plain average pool
    ((2, 3, 8, 12), (4, 3)), ((2, 70, 6, 6), (1, 1)), ((5, 9, 10), (9, 10)), ((1, 1, 4, 4), (2, 4)),
    # ATen's overlapping windows of varying lengths, outputs larger than the input among them
    ((2, 3, 8, 8), (5, 7)), ((1, 130, 7, 9), (3, 4)), ((5, 6, 10), (7, 13)), ((2, 3, 13, 11), (1, 3))])
def test_adaptive_avg_pool(shape, output, dtype):
    x = inputs(shape, dtype)
    dy = torch.randn(*shape[:-2], *output).to(dtype)

    def fn(x, dy):
        return aten._adaptive_avg_pool2d(x, list(output)), aten._adaptive_avg_pool2d_backward(dy, x)
    gm = aten_graph(fn, x, dy)
    check(gm, [x, dy], ADAPTIVE)
    check(gm, [x, dy], ADAPTIVE_BACKWARD)


def test_pool_unsupported():
    x = torch.randn(1, 2, 7, 7)
    cases = [
        (lambda x: aten.avg_pool2d(x, [9, 9], [1, 1], [4, 4]), AVG, "offsets"),
    ]
    for fn, target, reason in cases:
        with pytest.raises(Unsupported, match=reason):
            LOWERINGS[target](CTX, last_node(aten_graph(fn, x), target))
    with pytest.raises(Unsupported, match="reduce steps"):
        LOWERINGS[ADAPTIVE](CTX, last_node(aten_graph(lambda x: aten._adaptive_avg_pool2d(x, [1, 1050]),
                                                 torch.randn(1, 1, 2, 1100)), ADAPTIVE))
    big = torch.randn(1, 1, 200, 200)
    with pytest.raises(Unsupported, match="SBUF"):
        LOWERINGS[AVG](CTX, last_node(aten_graph(lambda x: aten.avg_pool2d(x, [2, 2]), big), AVG))
    with pytest.raises(Unsupported, match="dtype"):
        LOWERINGS[MAX](CTX, last_node(aten_graph(lambda x: aten.max_pool2d_with_indices(x, [2, 2]), x.double()), MAX))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_free_block_compiled(dtype, train, tmp_path):
    """BatchNorm2d -> ReLU -> MaxPool2d -> AdaptiveAvgPool2d through the backend with every op in a
    kernel (fallback=error), forward and backward, against the same module run eagerly: output,
    input / weight / bias gradients and (training) the updated running statistics. 130 channels
    straddle two partition tiles; the batch norm backward arrives as reductions and pointwise ops."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.BatchNorm2d(130), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.AdaptiveAvgPool2d((3, 2)))
    with torch.no_grad():
        block[0].weight.normal_()
        block[0].bias.normal_()
        block[0].running_mean.normal_()
        block[0].running_var.uniform_(0.5, 1.5)
    block = block.to(dtype).train(train)
    reference = copy.deepcopy(block)
    x = torch.randn(4, 130, 12, 12).to(dtype)
    grad = torch.randn(4, 130, 3, 2).to(dtype)
    eager_x = x.clone().requires_grad_()
    out, x_grad = compiled_forward_backward(block, x, grad, tmp_path)
    ref = reference(eager_x)
    ref.backward(grad)
    tols = {"fp32_rtol": 1e-4, "bf16_rtol": 3e-2}  # the backward chains several kernels
    assert_close(out, ref.detach(), **tols)
    if dtype == torch.float32:
        assert_close(x_grad, eager_x.grad, **tols)
    else:
        # bf16 batch-norm outputs a rounding apart can swap a max-pool window's winner (ReLU zeros
        # and near-ties), which moves that window's gradient to another element: allow 0.1% of
        # the input gradient to differ, all else within tolerance.
        off = ~torch.isclose(x_grad.float(), eager_x.grad.float(), rtol=tols["bf16_rtol"],
                             atol=tols["bf16_rtol"] * eager_x.grad.float().abs().max().item())
        assert off.sum().item() <= 1e-3 * off.numel(), off.sum().item()
    for compiled, eager in zip(block[0].parameters(), reference[0].parameters()):
        assert_close(compiled.grad, eager.grad, **tols)
    for compiled, eager in zip(block[0].buffers(), reference[0].buffers()):
        assert_close(compiled, eager, **tols)
