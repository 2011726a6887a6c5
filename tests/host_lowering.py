"""A lowering that puts every op on the host: tests bucketing / pad-safety semantics on their own.

Kernel families are tested elsewhere; here the padded graph runs op by op as eager ATen calls
through the real runtime path (bucket choice, pad-safety rewrite, padding, wrapper, slicing, cache).
"""

from __future__ import annotations

import operator

import pytest

from neuron_inductor import compiler
from neuron_inductor.lowering.graph import LoweredGraph
from neuron_inductor.lowering.ir import HostStep
from neuron_inductor.lowering.registry import VIEW_OPS


def lower_on_host(gm, ctx, fallback_mode="warn", force_fallback=None) -> LoweredGraph:
    steps, fallbacks = [], []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            steps.append(HostStep(node, "constant"))
        elif node.op == "call_function":
            if node.target is operator.getitem or node.target in VIEW_OPS:
                steps.append(HostStep(node, "view"))
            else:
                step = HostStep(node, "fallback", "host-only test lowering")
                steps.append(step)
                fallbacks.append(step)
    return LoweredGraph(steps, fallbacks)


@pytest.fixture
def host_only(monkeypatch):
    monkeypatch.setattr(compiler, "lower_graph", lower_on_host)
