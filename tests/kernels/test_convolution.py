"""Convolution family: conv1d / conv2d forward and convolution_backward rendered to NKI and run in
the interpreter, against eager ATen on the same inputs.

Tolerances (harness.assert_close, atol scaled by the largest |expected|): fp32 rtol 1e-4 (fp32 PSUM
accumulation in another order than eager over up to C * taps or N * positions terms); bf16 rtol
2e-2 (the result is rounded to bf16 once, eager's own bf16 rounding may differ by an ulp).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, DTYPES, compiled_forward_backward, aten_graph, assert_close, last_node, op_graph, run_node

aten = torch.ops.aten
CONV = aten.convolution.default
CONV_BACKWARD = aten.convolution_backward.default
RTOL = {"fp32_rtol": 1e-4, "bf16_rtol": 2e-2}

# (batch, in channels, spatial size, out channels, kernel, stride, padding, dilation, groups)
CONV2D_CASES = {
    "3x3_pad1": (2, 5, (9, 11), 7, (3, 3), 1, 1, 1, 1),
    "stride2": (2, 5, (9, 11), 7, (3, 3), 2, 1, 1, 1),
    "dilation2": (2, 3, (17, 13), 4, (3, 2), 1, (0, 2), 2, 1),
    "channels_over_128": (1, 130, (7, 13), 200, (3, 3), 2, 1, 1, 1),
    "channels_256": (1, 256, (6, 6), 256, (3, 3), 1, 1, 1, 1),
    "row_blocks": (1, 8, (40, 37), 16, (3, 3), 1, 1, 1, 1),
    "wide_rows": (1, 4, (3, 700), 6, (1, 5), 1, (0, 2), 1, 1),
    "1x1": (3, 20, (5, 5), 9, (1, 1), 1, 0, 1, 1),
    "stride3_1x1": (1, 3, (7, 8), 4, (1, 1), 3, 0, 1, 1),  # grad_input phases no tap reaches
    "stride2_4x4": (2, 5, (10, 9), 6, (4, 4), 2, 1, 1, 1),
    "size_one": (1, 1, (1, 1), 1, (1, 1), 1, 0, 1, 1),
    "pad_beyond_kernel": (1, 3, (4, 4), 2, (3, 3), 1, 3, 1, 1),
    "groups3": (2, 6, (8, 8), 9, (3, 3), 1, 1, 1, 3),
    "depthwise": (2, 8, (10, 9), 8, (3, 3), 2, 1, 1, 8),
}
CONV1D_CASES = {
    "causal_k4": (2, 64, (600,), 48, (4,), 1, 3, 1, 1),  # > 512 output columns
    "stride2_dilation2": (2, 140, (33,), 130, (3,), 2, 1, 2, 1),
    "mamba_depthwise": (2, 16, (50,), 16, (4,), 1, 3, 1, 16),
    "channels_600": (1, 600, (5,), 130, (2,), 1, 0, 1, 1),  # grad_weight: two 512-channel chunks
    # fp32 weight panel of fewer than 128 rows; grad_weight in two blocks of input channels
    "channels_2600_k7": (1, 2600, (9,), 130, (7,), 1, 3, 1, 1),
    "depthwise_200_dilation2": (2, 200, (70,), 200, (4,), 1, 3, 2, 200),
    "depthwise_long": (1, 4, (2100,), 4, (4,), 2, 3, 1, 4),  # grad_weight: over one 2048-output block
    "length_one": (1, 3, (1,), 2, (1,), 1, 0, 1, 1),
}
CASES = {**CONV2D_CASES, **CONV1D_CASES}


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def tensors(case, dtype):
    batch, channels, size, out_channels, kernel, stride, padding, dilation, groups = case
    x = randn(batch, channels, *size, dtype=dtype, seed=1)
    w = randn(out_channels, channels // groups, *kernel, dtype=dtype, seed=2)
    b = randn(out_channels, dtype=dtype, seed=3)
    return x, w, b


def conv(case):
    *_, stride, padding, dilation, groups = case
    fn = F.conv2d if len(case[2]) == 2 else F.conv1d
    return lambda x, w, b=None: fn(x, w, b, stride, padding, dilation, groups)


def check_forward(case, dtype, bias, prepare=lambda x: x):
    x, w, b = tensors(case, dtype)
    args = (prepare(x), w, b) if bias else (prepare(x), w)
    fn = conv(case)
    actual, expected, _ = run_node(aten_graph(lambda *a: fn(*a), *args), args, CONV)
    assert len(actual) == 1
    assert_close(actual[0], expected[0], **RTOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_forward(name, dtype):
    check_forward(CASES[name], dtype, bias=name != "channels_256")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_without_bias(dtype):
    check_forward(CASES["stride2"], dtype, bias=False)


@pytest.mark.parametrize("name", ["3x3_pad1", "causal_k4"])
def test_forward_strided_input(name):
    """A sliced input (every other channel of a wider tensor) is read through its strides."""
    def every_other_channel(x):
        return torch.cat([x, x], 1).reshape(x.shape[0], x.shape[1], 2, *x.shape[2:]).select(2, 0)
    check_forward(CASES[name], torch.float32, bias=True, prepare=every_other_channel)


def backward_graph(case, dtype, mask, meta=False):
    batch, channels, size, out_channels, kernel, stride, padding, dilation, groups = case
    x, w, _ = tensors(case, dtype)
    grad = randn(*conv(case)(x, w).shape, dtype=dtype, seed=4)
    rank = len(size)
    pairs = [[v] * rank if isinstance(v, int) else list(v) for v in (stride, padding, dilation)]
    return op_graph(CONV_BACKWARD, grad, x, w, [out_channels], *pairs, False, [0] * rank, groups, mask,
                    meta=meta)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_backward(name, dtype):
    gm, args = backward_graph(CASES[name], dtype, [True, True, True])
    actual, expected, _ = run_node(gm, args, CONV_BACKWARD)
    assert len(actual) == 3
    for a, e in zip(actual, expected):
        assert_close(a, e, **RTOL)


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, False], [False, False, True],
                                  [False, True, True]], ids=str)
def test_backward_output_mask(mask):
    """Only the results the mask asks for are computed and returned. The graph takes its value
    metadata from meta tensors, as the backend's fake tensors do (eager CPU also returns grad_weight
    when only grad_bias is asked for)."""
    case = CASES["stride2"]
    gm, args = backward_graph(case, torch.float32, mask, meta=True)
    actual, _, _ = run_node(gm, args, CONV_BACKWARD)
    full_gm, _ = backward_graph(case, torch.float32, [True, True, True])
    expected = full_gm(*args)
    assert len(actual) == sum(mask)
    for a, e in zip(actual, [e for e, wanted in zip(expected, mask) if wanted]):
        assert_close(a, e, **RTOL)


@pytest.mark.parametrize("name", ["depthwise", "mamba_depthwise"])
def test_depthwise_pass_selection(name):
    """groups = in = out channels: diagonal-weight matmuls over 128 channels at once, not
    single-partition matmuls per group."""
    x, w, b = tensors(CASES[name], torch.float32)
    spec = lower(conv(CASES[name]), x, w, b)
    assert [p["kind"] for p in spec.params["passes"]] == ["depthwise"]
    gm, _ = backward_graph(CASES[name], torch.float32, [True, True, True])
    spec = LOWERINGS[CONV_BACKWARD](CTX, last_node(gm, CONV_BACKWARD))
    assert [p["kind"] for p in spec.params["passes"]] == ["depthwise_grad_weight", "depthwise", "grad_bias"]


def lower(fn, *args, target=CONV):
    gm = aten_graph(fn, *args)
    return LOWERINGS[target](CTX, last_node(gm, target))


@pytest.mark.parametrize("fn, shapes", [
    (lambda x, w: F.conv_transpose2d(x, w), ((1, 4, 5, 5), (4, 3, 3, 3))),
    (lambda x, w: F.conv3d(x, w), ((1, 2, 4, 4, 4), (3, 2, 2, 2, 2))),
], ids=["transposed", "3d"])
def test_unsupported_convolutions(fn, shapes):
    with pytest.raises(Unsupported):
        lower(fn, *(torch.randn(*s) for s in shapes))


def test_mixed_dtypes_unsupported():
    gm, _ = op_graph(CONV, torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3).bfloat16(), None, [1, 1], [0, 0],
                     [1, 1], False, [0, 0], 1, meta=True)
    with pytest.raises(Unsupported):
        LOWERINGS[CONV](CTX, last_node(gm, CONV))


class CausalDepthwiseConv1d(torch.nn.Module):
    """Mamba's short convolution: depthwise conv1d padded by k - 1, cut back to the input length."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.conv = torch.nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)

    def forward(self, x):
        return torch.nn.functional.silu(self.conv(x)[..., :x.shape[-1]])


BLOCKS = {
    "conv_silu_conv": (lambda: torch.nn.Sequential(torch.nn.Conv2d(6, 10, 3, padding=1), torch.nn.SiLU(),
                                                   torch.nn.Conv2d(10, 4, 3, stride=2, padding=1)), (2, 6, 9, 9)),
    "causal_depthwise_conv1d": (lambda: CausalDepthwiseConv1d(24, 4), (2, 24, 37)),
}


@pytest.mark.parametrize("name", BLOCKS)
def test_compiled_conv_block_forward_backward(name, tmp_path):
    """Blocks through torch.compile, forward and backward in kernels only (fallback="error")."""
    torch.manual_seed(0)
    make_block, shape = BLOCKS[name]
    block = make_block()
    x = torch.randn(*shape)
    eager_x = x.clone().requires_grad_()
    expected = block(eager_x)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    expected_grads = [eager_x.grad] + [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    actual, x_grad = compiled_forward_backward(block, x, grad, tmp_path)
    assert_close(actual, expected.detach(), fp32_rtol=1e-4)
    for a, e in zip([x_grad] + [p.grad for p in block.parameters()], expected_grads):
        assert_close(a, e, fp32_rtol=1e-4)
