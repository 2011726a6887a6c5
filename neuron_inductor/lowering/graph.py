"""Lower a static ATen graph to an ordered list of kernel and host steps.

Walks the graph in order. Pointwise nodes of one output shape gather into an open fusion group
that stays open across unrelated nodes and is emitted (as one kernel) as soon as something outside
it needs one of its values. Every other node becomes a kernel through its registered lowering, a
host view, or — when no lowering takes it — an explicit fallback with the reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import pointwise
from .ir import HostStep, KernelSpec, KernelStep, Step, Unsupported
from .registry import FALLBACKS, LOWERINGS, VIEW_OPS, load_lowerings


class FallbackError(RuntimeError):
    """Raised in fallback='error' mode: lists every op of the graph that has no kernel."""


@dataclass
class LoweredGraph:
    steps: list[Step]
    fallbacks: list[HostStep] = field(default_factory=list)

    @property
    def kernels(self) -> list[KernelSpec]:
        return [step.spec for step in self.steps if isinstance(step, KernelStep)]


def op_name(node: fx.Node) -> str:
    target = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class _PointwiseGroup:
    def __init__(self) -> None:
        self.nodes: list[fx.Node] = []
        self.members: set[fx.Node] = set()
        self.shape: torch.Size | None = None

    def accepts(self, node: fx.Node) -> bool:
        return not self.nodes or node.meta["val"].shape == self.shape

    def add(self, node: fx.Node) -> None:
        self.shape = node.meta["val"].shape
        self.nodes.append(node)
        self.members.add(node)

    def outputs(self) -> list[fx.Node]:
        return [n for n in self.nodes if any(user not in self.members for user in n.users)]


def lower_graph(gm: fx.GraphModule, fallback_mode: str = "warn",
                force_fallback: dict[fx.Node, str] | None = None) -> LoweredGraph:
    """`force_fallback` names nodes to run on the host regardless of lowerings, with the reason
    (used when a generated kernel broke a hardware rule)."""
    load_lowerings()
    force_fallback = force_fallback or {}
    steps: list[Step] = []
    fallbacks: list[HostStep] = []
    group = _PointwiseGroup()
    produced_by_kernel: set[fx.Node] = set()

    def flush() -> None:
        nonlocal group
        if group.nodes:
            steps.append(KernelStep(pointwise.lower_pointwise_group(group.nodes, group.outputs())))
            produced_by_kernel.update(group.nodes)
        group = _PointwiseGroup()

    def needs_group(node: fx.Node) -> bool:
        return any(inp in group.members for inp in node.all_input_nodes)

    def fall_back(node: fx.Node, reason: str) -> None:
        step = HostStep(node, "fallback", reason)
        steps.append(step)
        fallbacks.append(step)

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            if node.op == "output":
                flush()
            continue
        if node in produced_by_kernel:
            continue  # a getitem bound to a multi-output kernel
        if node.op == "get_attr":
            steps.append(HostStep(node, "constant"))
            continue
        if node.op != "call_function":
            raise NotImplementedError(f"unexpected FX node {node.format_node()} in an ATen graph")
        if node in force_fallback:
            if needs_group(node):
                flush()
            fall_back(node, force_fallback[node])
            continue
        if _is_tensor(node) and pointwise.is_pointwise(node):
            if not group.accepts(node):
                flush()
            group.add(node)
            continue
        if needs_group(node):
            flush()
        if node.target is operator.getitem or node.target in VIEW_OPS:
            steps.append(HostStep(node, "view"))
            continue
        if node.target in FALLBACKS:
            fall_back(node, FALLBACKS[node.target])
            continue
        lowering = LOWERINGS.get(node.target)
        if lowering is None:
            fall_back(node, f"no lowering for {op_name(node)}")
            continue
        try:
            spec = lowering(node)
        except Unsupported as exc:
            fall_back(node, f"{op_name(node)}: {exc}")
            continue
        steps.append(KernelStep(spec))
        produced_by_kernel.update(out for out in spec.outputs if isinstance(out, fx.Node))
    flush()

    if fallbacks and fallback_mode == "error":
        listing = "\n".join(f"  - {op_name(s.node)}: {s.reason}" for s in fallbacks)
        raise FallbackError(
            f"{len(fallbacks)} op(s) of this graph have no NKI kernel (NEURON_INDUCTOR_FALLBACK=error):\n{listing}\n"
            "Set NEURON_INDUCTOR_FALLBACK=warn to run them eagerly on the host instead.")
    return LoweredGraph(steps, fallbacks)
