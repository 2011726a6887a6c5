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
import torch.nn.functional as F
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


def op_graph(op, *args) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A graph calling `op(*args)` directly (no decomposition), its tensor args as placeholders,
    its outputs through getitems; and the tensors to run it with."""
    graph = torch.fx.Graph()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    nodes = {}
    for i, t in enumerate(tensors):
        nodes[id(t)] = graph.placeholder(f"arg{i}")
        nodes[id(t)].meta["val"] = t
    call = graph.call_function(op, tuple(nodes.get(id(a), a) for a in args))
    call.meta["val"] = op(*args)
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


def run_node(gm: torch.fx.GraphModule, args, target, source_check=None):
    """Lower the last `target` node of `gm`, run its kernel on the graph's eager values.

    Returns (kernel outputs, eager outputs) in the spec's output order.
    """
    node = [n for n in gm.graph.nodes if n.target is target][-1]
    spec = LOWERINGS[target](node)
    spec.name = f"k0_{spec.family}"
    source = render_kernel(spec)
    if source_check is not None:
        source_check(source)
    kernel = sim.load_kernels(source, f"<{spec.name}>")[spec.name]
    env = graph_values(gm, args)
    returned = kernel(*[env[n] for n in spec.inputs])
    if not isinstance(returned, tuple):
        returned = (returned,)
    value = env[node]
    # Multi-output ops: the spec lists the outputs the op produces, in order.
    expected = [v for v in value if v is not None] if isinstance(value, tuple) else [value]
    return list(returned), expected


def assert_close(actual, expected, *, fp32_rtol=1e-5, bf16_rtol=2e-2):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    scale = max(expected.float().abs().max().item(), 1.0) if expected.numel() else 1.0
    tol = fp32_rtol if expected.dtype == torch.float32 else bf16_rtol
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale, equal_nan=True)


def assert_all_close(actual: list, expected: list, **tols):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_close(a, e, **tols)
