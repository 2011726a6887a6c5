"""Layer norm and RMS norm kernels (forward and backward), run in the NKI interpreter against eager.

Each case builds an ATen graph (make_fx with the Neuron decomposition table; `_fused_rms_norm`,
which make_fx always decomposes on CPU, is put into a graph by hand), lowers the node under test,
renders and loads its kernel, feeds it the graph's eager values and compares every output.
Tolerances: fp32 rtol 1e-5 (atol 1e-5 scaled to the output's magnitude); bf16 outputs 2e-2
relative to the magnitude (about two bf16 ulps), against eager bf16 (which computes in fp32).
This module also holds the harness the softmax and cross-entropy tests import.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_inductor import sim
from neuron_inductor.codegen.render import render_kernel
from neuron_inductor.decompositions import neuron_decompositions
from neuron_inductor.lowering.registry import LOWERINGS, load_lowerings

aten = torch.ops.aten
load_lowerings()


# --- harness -----------------------------------------------------------------------------------

def aten_graph(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=neuron_decompositions())(*args)


def op_graph(op, *args, meta=False) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A graph calling `op(*args)` directly (no decomposition), its tensor args as placeholders and
    a multi-output op's outputs read through getitems; and the tensors to run it with.
    meta=True takes the value metadata from meta tensors (for ops eager CPU does not run)."""
    graph = torch.fx.Graph()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    nodes = {}
    for i, t in enumerate(tensors):
        nodes[id(t)] = graph.placeholder(f"arg{i}")
        nodes[id(t)].meta["val"] = t
    call = graph.call_function(op, tuple(nodes.get(id(a), a) for a in args))
    call.meta["val"] = op(*[a.to("meta") if meta and isinstance(a, torch.Tensor) else a for a in args])
    if isinstance(call.meta["val"], torch.Tensor):
        graph.output(call)
    else:
        items = []
        for i, value in enumerate(call.meta["val"]):
            items.append(graph.call_function(operator.getitem, (call, i)))
            items[-1].meta["val"] = value
        graph.output(tuple(items))
    return torch.fx.GraphModule({}, graph), tensors


def graph_values(gm: torch.fx.GraphModule, args) -> dict:
    """Every node's eager value: the kernels' inputs and the reference outputs."""
    env: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            env[node] = super().run_node(node)
            return env[node]

    Recorder(gm).run(*args)
    return env


def kernel_for(gm: torch.fx.GraphModule, target, source_check=None):
    """(node, spec, kernel) for the last `target` node of `gm`: lowered, rendered and loaded."""
    node = [n for n in gm.graph.nodes if n.target is target][-1]
    spec = LOWERINGS[target](node)
    spec.name = f"k0_{spec.family}"
    source = render_kernel(spec)
    if source_check is not None:
        source_check(source)
    return node, spec, sim.load_kernels(source, f"<{spec.name}>")[spec.name]


def run_node(gm: torch.fx.GraphModule, args, target, source_check=None):
    """Lower the last `target` node of `gm`, run its kernel on the graph's eager values.

    Returns (kernel outputs, eager outputs) in the spec's output order.
    """
    node, spec, kernel = kernel_for(gm, target, source_check)
    env = graph_values(gm, args)
    returned = kernel(*[env[n] for n in spec.inputs])
    if not isinstance(returned, tuple):
        returned = (returned,)
    value = env[node]
    # Multi-output ops: the spec lists the outputs the op produces, in order.
    expected = [v for v in value if v is not None] if isinstance(value, tuple) else [value]
    return list(returned), expected


def eager_error(gm: torch.fx.GraphModule, args, target) -> list[float]:
    """Per output of the last `target` node: how far eager fp32 is from eager fp64 on the same
    graph. Ill-conditioned cases (layer norm backward over one column: rstd^3 ~ 3e7 amplifies
    rounding) need this as their tolerance floor."""
    node = [n for n in gm.graph.nodes if n.target is target][-1]
    fp32 = graph_values(gm, args)[node]
    fp64 = graph_values(gm, [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args])[node]
    return [(a.double() - b).abs().max().item() for a, b in zip(fp32, fp64) if a is not None]


def assert_close(actual, expected, *, fp32_rtol=1e-5, bf16_rtol=2e-2, atol_floor=0.0):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    finite = expected.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    scale = max(finite.abs().max().item(), 1.0) if expected.numel() else 1.0
    tol = fp32_rtol if expected.dtype == torch.float32 else bf16_rtol
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=max(tol * scale, atol_floor),
                               equal_nan=True)


def assert_all_close(actual: list, expected: list, atol_floors=None, **tols):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, atol_floor=2 * atol_floors[i] if atol_floors else 0.0, **tols)


# --- layer norm --------------------------------------------------------------------------------

SHAPES = [(1, 1), (3, 7), (128, 512), (200, 1000), (2, 65, 300)]
DTYPES = [torch.float32, torch.bfloat16]


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
LAYER_NORM_CASES = [(shape, dtype, True, True) for shape in SHAPES for dtype in DTYPES] + [
    (shape, dtype, has_weight, has_bias)
    for shape, dtype in [((3, 7), torch.bfloat16), ((200, 1000), torch.float32)]
    for has_weight, has_bias in [(False, False), (True, False), (False, True)]]


@pytest.mark.parametrize("shape,dtype,has_weight,has_bias", LAYER_NORM_CASES)
def test_layer_norm_forward(shape, dtype, has_weight, has_bias):
    gm, args = layer_norm_case(shape, dtype, has_weight, has_bias)
    assert_all_close(*run_node(gm, args, aten.native_layer_norm.default))


@pytest.mark.parametrize("shape,dtype,has_weight,has_bias", LAYER_NORM_CASES)
def test_layer_norm_backward(shape, dtype, has_weight, has_bias):
    gm, args = layer_norm_case(shape, dtype, has_weight, has_bias)
    actual, expected = run_node(gm, args, aten.native_layer_norm_backward.default)
    assert len(actual) == 1 + has_weight + has_bias
    floors = eager_error(gm, args, aten.native_layer_norm_backward.default) if dtype == torch.float32 else None
    assert_all_close(actual, expected, floors)


@pytest.mark.parametrize("eps", [1e-12, 1e-5, 0.5])
def test_layer_norm_eps(eps):
    gm, args = layer_norm_case((64, 48), torch.float32, True, True, eps=eps)
    assert_all_close(*run_node(gm, args, aten.native_layer_norm.default))
    assert_all_close(*run_node(gm, args, aten.native_layer_norm_backward.default))


@pytest.mark.parametrize("output_mask", [(True, False, False), (False, True, True), (False, False, True)])
def test_layer_norm_backward_output_mask(output_mask):
    gm, args = layer_norm_case((130, 96), torch.float32, True, True, output_mask=output_mask)
    actual, expected = run_node(gm, args, aten.native_layer_norm_backward.default)
    assert len(actual) == sum(output_mask)
    assert_all_close(actual, expected)


def test_layer_norm_over_two_dims():
    """normalized_shape [6, 40] on [2, 5, 6, 40]: statistics keep two size-1 dims, weight is 2-D."""
    gm, args = layer_norm_case((2, 5, 6, 40), torch.float32, True, True, normalized_ndim=2)
    assert_all_close(*run_node(gm, args, aten.native_layer_norm.default))
    assert_all_close(*run_node(gm, args, aten.native_layer_norm_backward.default))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_long_rows_take_two_passes(dtype):
    """20000 columns exceed one SBUF chunk: statistics pass, then normalise pass."""
    gm, args = layer_norm_case((3, 20000), dtype, True, True)
    seen = []
    assert_all_close(*run_node(gm, args, aten.native_layer_norm.default, seen.append))
    assert_all_close(*run_node(gm, args, aten.native_layer_norm_backward.default, seen.append))
    assert all(source.count("in0[0:3, 0:") >= 2 for source in seen)  # x read twice per chunk


def test_layer_norm_strided_input():
    """A transposed view reaches the kernel as a strided HBM tensor."""
    def fn(x, w, b):
        return aten.native_layer_norm(x.t(), [96], w, b, 1e-5)[0]
    args = [torch.randn(96, 130), torch.randn(96), torch.randn(96)]
    gm = aten_graph(fn, *args)
    assert_all_close(*run_node(gm, args, aten.native_layer_norm.default))


# --- RMS norm ----------------------------------------------------------------------------------

RMS_NORM_CASES = [(shape, dtype, True) for shape in SHAPES + [(3, 20000)] for dtype in DTYPES] + [
    ((200, 1000), torch.float32, False), ((2, 65, 300), torch.bfloat16, False)]


@pytest.mark.parametrize("shape,dtype,has_weight", RMS_NORM_CASES)
def test_rms_norm(shape, dtype, has_weight):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 2
    w = torch.randn(shape[-1:], dtype=dtype) if has_weight else None
    gm, args = op_graph(aten._fused_rms_norm.default, x, [shape[-1]], w, 1e-6)
    actual, expected = run_node(gm, args, aten._fused_rms_norm.default)
    assert actual[1].dtype == torch.float32  # rstd stays fp32 for bf16 inputs
    assert_all_close(actual, expected)


@pytest.mark.parametrize("eps,dtype", [(None, torch.float32), (None, torch.bfloat16), (0.25, torch.float32)])
def test_rms_norm_eps(eps, dtype):
    """eps None is fp32's epsilon (ATen computes in fp32), not bf16's; tiny inputs show the difference."""
    x = torch.randn(70, 33, dtype=dtype) * 1e-3
    gm, args = op_graph(aten._fused_rms_norm.default, x, [33], torch.randn(33, dtype=dtype), eps)
    assert_all_close(*run_node(gm, args, aten._fused_rms_norm.default))


def test_rms_norm_over_two_dims():
    x = torch.randn(4, 3, 5, 16)
    gm, args = op_graph(aten._fused_rms_norm.default, x, [5, 16], torch.randn(5, 16), 1e-5)
    assert_all_close(*run_node(gm, args, aten._fused_rms_norm.default))
