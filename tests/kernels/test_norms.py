"""Layer norm and RMS norm kernels (forward and backward), run in the NKI interpreter against eager.

Each case builds an ATen graph (make_fx with the Neuron decomposition table; `_fused_rms_norm`,
which make_fx always decomposes on CPU, is put into a graph by hand), lowers the node under test,
renders and loads its kernel, feeds it the graph's eager values and compares every output.
Tolerances: fp32 rtol 1e-5 (atol 1e-5 scaled to the output's magnitude); bf16 outputs 2e-2
relative to the magnitude (about two bf16 ulps), against eager bf16 (which computes in fp32).
"""

from __future__ import annotations

import pytest
import torch

from .harness import (DTYPES, ROW_SHAPES, aten_graph, assert_all_close, check_node, graph_values, last_node,
                      op_graph, run_node)

aten = torch.ops.aten


def eager_error(gm: torch.fx.GraphModule, args, target) -> list[float]:
    """Per output of the last `target` node: how far eager fp32 is from eager fp64 on the same
    graph. Ill-conditioned cases (layer norm backward over one column: rstd^3 ~ 3e7 amplifies
    rounding) need this as their tolerance floor."""
    node = last_node(gm, target)
    fp32 = graph_values(gm, args)[node]
    fp64 = graph_values(gm, [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args])[node]
    return [(a.double() - b).abs().max().item() for a, b in zip(fp32, fp64) if a is not None]


# --- layer norm --------------------------------------------------------------------------------

def layer_norm_both(normalized_ndim, eps, output_mask):
    def fn(x, w, b, dy):
        normalized = list(x.shape[x.dim() - normalized_ndim:])
        _, mean, rstd = aten.native_layer_norm(x, normalized, w, b, eps)
        return aten.native_layer_norm_backward(dy, x, normalized, mean, rstd, w, b, output_mask)
    return fn


def layer_norm_case(shape, dtype, has_weight, has_bias, normalized_ndim=1, eps=1e-5, output_mask=None):
    torch.manual_seed(0)
    output_mask = output_mask or (True, has_weight, has_bias)
    x = torch.randn(shape, dtype=dtype) * 3 + 1
    normalized = shape[len(shape) - normalized_ndim:]
    w = torch.randn(normalized, dtype=dtype) if has_weight else None
    b = torch.randn(normalized, dtype=dtype) if has_bias else None
    dy = torch.randn(shape, dtype=dtype)
    args = [x, w, b, dy]
    gm = aten_graph(layer_norm_both(normalized_ndim, eps, list(output_mask)), *args)
    return gm, args


# Every shape and dtype with weight and bias; the optional-argument variants on two of them.
LAYER_NORM_CASES = [(shape, dtype, True, True) for shape in ROW_SHAPES for dtype in DTYPES] + [
    (shape, dtype, has_weight, has_bias)
    for shape, dtype in [((3, 7), torch.bfloat16), ((200, 1000), torch.float32)]
    for has_weight, has_bias in [(False, False), (True, False), (False, True)]]


@pytest.mark.parametrize("shape,dtype,has_weight,has_bias", LAYER_NORM_CASES)
def test_layer_norm_forward(shape, dtype, has_weight, has_bias):
    gm, args = layer_norm_case(shape, dtype, has_weight, has_bias)
    check_node(gm, args, aten.native_layer_norm.default)


@pytest.mark.parametrize("shape,dtype,has_weight,has_bias", LAYER_NORM_CASES)
def test_layer_norm_backward(shape, dtype, has_weight, has_bias):
    gm, args = layer_norm_case(shape, dtype, has_weight, has_bias)
    actual, expected, _ = run_node(gm, args, aten.native_layer_norm_backward.default)
    assert len(actual) == 1 + has_weight + has_bias
    floors = eager_error(gm, args, aten.native_layer_norm_backward.default) if dtype == torch.float32 else None
    assert_all_close(actual, expected, floors)


@pytest.mark.parametrize("eps", [1e-12, 1e-5, 0.5])
def test_layer_norm_eps(eps):
    gm, args = layer_norm_case((64, 48), torch.float32, True, True, eps=eps)
    check_node(gm, args, aten.native_layer_norm.default)
    check_node(gm, args, aten.native_layer_norm_backward.default)


@pytest.mark.parametrize("output_mask", [(True, False, False), (False, True, True), (False, False, True)])
def test_layer_norm_backward_output_mask(output_mask):
    gm, args = layer_norm_case((130, 96), torch.float32, True, True, output_mask=output_mask)
    actual, expected, _ = run_node(gm, args, aten.native_layer_norm_backward.default)
    assert len(actual) == sum(output_mask)
    assert_all_close(actual, expected)


def test_layer_norm_over_two_dims():
    """normalized_shape [6, 40] on [2, 5, 6, 40]: statistics keep two size-1 dims, weight is 2-D."""
    gm, args = layer_norm_case((2, 5, 6, 40), torch.float32, True, True, normalized_ndim=2)
    check_node(gm, args, aten.native_layer_norm.default)
    check_node(gm, args, aten.native_layer_norm_backward.default)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_long_rows_take_two_passes(dtype):
    """20000 columns exceed one SBUF chunk: statistics pass, then normalise pass."""
    gm, args = layer_norm_case((3, 20000), dtype, True, True)
    seen = []
    check_node(gm, args, aten.native_layer_norm.default, seen.append)
    check_node(gm, args, aten.native_layer_norm_backward.default, seen.append)
    assert all(source.count("in0[0:3, 0:") >= 2 for source in seen)  # x read twice per chunk


def test_layer_norm_strided_input():
    """A transposed view reaches the kernel as a strided HBM tensor."""
    def fn(x, w, b):
        return aten.native_layer_norm(x.t(), [96], w, b, 1e-5)[0]
    args = [torch.randn(96, 130), torch.randn(96), torch.randn(96)]
    gm = aten_graph(fn, *args)
    check_node(gm, args, aten.native_layer_norm.default)


# --- RMS norm ----------------------------------------------------------------------------------

RMS_NORM_CASES = [(shape, dtype, True) for shape in ROW_SHAPES + [(3, 20000)] for dtype in DTYPES] + [
    ((200, 1000), torch.float32, False), ((2, 65, 300), torch.bfloat16, False)]


@pytest.mark.parametrize("shape,dtype,has_weight", RMS_NORM_CASES)
def test_rms_norm(shape, dtype, has_weight):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 2
    w = torch.randn(shape[-1:], dtype=dtype) if has_weight else None
    gm, args = op_graph(aten._fused_rms_norm.default, x, [shape[-1]], w, 1e-6)
    actual, expected, _ = run_node(gm, args, aten._fused_rms_norm.default)
    assert actual[1].dtype == torch.float32  # rstd stays fp32 for bf16 inputs
    assert_all_close(actual, expected)


@pytest.mark.parametrize("eps,dtype", [(None, torch.float32), (None, torch.bfloat16), (0.25, torch.float32)])
def test_rms_norm_eps(eps, dtype):
    """eps None is fp32's epsilon (ATen computes in fp32), not bf16's; tiny inputs show the difference."""
    x = torch.randn(70, 33, dtype=dtype) * 1e-3
    gm, args = op_graph(aten._fused_rms_norm.default, x, [33], torch.randn(33, dtype=dtype), eps)
    check_node(gm, args, aten._fused_rms_norm.default)


def test_rms_norm_over_two_dims():
    x = torch.randn(4, 3, 5, 16)
    gm, args = op_graph(aten._fused_rms_norm.default, x, [5, 16], torch.randn(5, 16), 1e-5)
    check_node(gm, args, aten._fused_rms_norm.default)
