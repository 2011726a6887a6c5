"""Lower a static ATen graph to an ordered list of kernel and host steps.

Walks the graph in order. Pointwise nodes of one output shape gather into an open fusion group
that stays open across unrelated nodes and is emitted (as one kernel) as soon as something outside
it needs one of its values. Every other node becomes a kernel through its registered lowering, a
host view, a communication step (functional collectives, run through their process group), or —
when no lowering takes it — an explicit fallback with the reason.

Kernels write contiguous outputs, while eager ops may return other layouts (CPU SDPA returns a
permuted one), so a `view` that was legal in eager can be illegal on our tensors. The walk tracks
the strides our values really have and puts a contiguous copy (a `clone` kernel) in front of such
a view.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..tile_program import constant_scalar
from . import matmul, pointwise
from .context import LoweringContext
from .ir import HostStep, KernelSpec, KernelStep, Step, Unsupported
from .registry import (ALLOCATIONS, COLLECTIVES, FALLBACKS, LOWERINGS, RNG_WRAPPERS, SIZE_OPS, VIEW_OPS,
                       load_lowerings)
from .unit_views import same_up_to_units, unit_view_source


class FallbackError(RuntimeError):
    """Raised in fallback='error' mode: lists every op of the graph that has no kernel."""


@dataclass
class LoweredGraph:
    steps: list[Step]
    fallbacks: list[HostStep] = field(default_factory=list)

    @property
    def kernels(self) -> list[KernelSpec]:
        return [step.spec for step in self.steps if isinstance(step, KernelStep)]

    def int32_values(self) -> set[fx.Node]:
        """int64 graph values that exist as int32 tensors at run time: NKI has no 64-bit integers, so
        kernels write int64 results as int32 (and views of those stay int32)."""
        narrowed: set[fx.Node] = set()
        for step in self.steps:
            if isinstance(step, KernelStep):
                spec = step.spec
                narrowed.update(out for pos, out in enumerate(spec.outputs)
                                if pos not in spec.inplace and isinstance(out, fx.Node)
                                and out.meta["val"].dtype == torch.int64)
            elif step.kind == "view" and any(inp in narrowed for inp in step.node.all_input_nodes):
                narrowed.add(step.node)
        return narrowed


def op_name(node: fx.Node) -> str:
    target = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _holds_tensors(node: fx.Node) -> bool:
    """A tensor, or a tuple with one (getitem of a wrapper's (result, ...) tuple is a view, not size math)."""
    val = node.meta.get("val")
    return any(isinstance(v, torch.Tensor) for v in (val if isinstance(val, (tuple, list)) else [val]))


def _has_data_dependent_size(node: fx.Node) -> bool:
    """Whether the node reads or makes a tensor whose size depends on tensor values (an unbacked
    SymInt, from nonzero / masked_select / boolean indexing): no static kernel can be planned for it."""
    values = [node.meta.get("val")] + [n.meta.get("val") for n in node.all_input_nodes]
    flat = [v for value in values for v in (value if isinstance(value, (tuple, list)) else [value])]
    return any(isinstance(v, torch.Tensor) and free_unbacked_symbols((*v.shape, *v.stride()))
               for v in flat)


_RESHAPING_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


class _Layouts:
    """Meta tensors with the strides our runtime values will have, to check views against."""

    def __init__(self) -> None:
        self.metas: dict[fx.Node, object] = {}

    @staticmethod
    def _meta_like(val: torch.Tensor, contiguous: bool) -> torch.Tensor:
        if contiguous:
            return torch.empty(val.shape, dtype=val.dtype, device="meta")
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")

    def set_from_value(self, node: fx.Node, contiguous: bool) -> None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            self.metas[node] = self._meta_like(val, contiguous)
        elif isinstance(val, (tuple, list)):
            self.metas[node] = tuple(self._meta_like(v, contiguous) if isinstance(v, torch.Tensor) else v
                                     for v in val)

    def run(self, node: fx.Node) -> bool:
        """Compute the node's layout by running it on meta tensors; False if that is not possible."""
        # Only ops on tensors run (on meta tensors): a factory op would run for real on its device
        # and draw from the RNG (randn) or allocate memory.
        inputs = node.all_input_nodes
        if not inputs or any(inp not in self.metas for inp in inputs):
            return False
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self.metas[n])
        try:
            if node.target in RNG_WRAPPERS:  # the wrapped op decides the layout
                position = RNG_WRAPPERS[node.target]
                result = args[position](*args[position + 1:], **kwargs)
                if node.target is torch.ops.higher_order.run_and_save_rng_state:  # and the saved state: flat bytes
                    result = (torch.empty(torch.get_rng_state().shape, dtype=torch.uint8, device="meta"), result)
                self.metas[node] = result
            else:
                self.metas[node] = node.target(*args, **kwargs)
        except Exception:
            return False
        return True


def _insert_contiguous_copy(gm: fx.GraphModule, view: fx.Node) -> fx.Node:
    source = view.args[0]
    with gm.graph.inserting_before(view):
        copy = gm.graph.call_function(torch.ops.aten.clone.default, (source,),
                                      {"memory_format": torch.contiguous_format})
    val = source.meta["val"]
    with val.fake_mode:
        copy.meta["val"] = torch.ops.aten.clone.default(val, memory_format=torch.contiguous_format)
    view.replace_input_with(source, copy)
    return copy


class _PointwiseGroup:
    """An open fusion group: pointwise nodes of one shape (up to size-1 dims), optionally behind a
    matmul (the anchor) whose result they consume as a fused epilogue. Unit views of members
    (lowering/unit_views.py) join as aliases: read through, not materialised; their host view steps
    follow the group's kernels where something outside the group reads them."""

    def __init__(self, ctx: LoweringContext, anchor: fx.Node | None = None,
                 anchor_spec: KernelSpec | None = None) -> None:
        self.ctx = ctx
        self.nodes: list[fx.Node] = []
        self.views: dict[fx.Node, fx.Node] = {}
        self.anchor = anchor
        self.anchor_spec = anchor_spec
        self.members: set[fx.Node] = {anchor} if anchor is not None else set()
        self.shape: torch.Size | None = anchor.meta["val"].shape if anchor is not None else None

    def accepts(self, node: fx.Node) -> bool:
        return self.shape is None or same_up_to_units(node.meta["val"].shape, self.shape)

    def add(self, node: fx.Node) -> None:
        if self.shape is None:
            self.shape = node.meta["val"].shape
        self.nodes.append(node)
        self.members.add(node)

    def absorbs(self, view: fx.Node) -> bool:
        source = unit_view_source(view)
        return source is not None and source in self.members

    def add_view(self, view: fx.Node) -> None:
        self.views[view] = view.args[0]
        self.members.add(view)

    def escapes(self, node: fx.Node) -> bool:
        """Whether a value outside the group reads `node`, directly or through member views."""
        return any(user not in self.members or (user in self.views and self.escapes(user)) for user in node.users)

    def outputs(self) -> list[fx.Node]:
        ordered = ([self.anchor] if self.anchor is not None else []) + self.nodes
        return [n for n in ordered if self.escapes(n)]

    def kernels(self) -> list[KernelSpec]:
        shape = tuple(self.shape) if self.shape is not None else None
        if self.anchor is None:
            return [pointwise.lower_pointwise_group(self.ctx, self.nodes, self.outputs(), shape, self.views)
                    ] if self.nodes else []
        if self.nodes:
            try:
                return [matmul.lower_matmul_with_epilogue(self.ctx, self.anchor, self.nodes, self.outputs(),
                                                          self.views)]
            except Unsupported:
                pass  # the matmul and its consumers run as two kernels
            epilogue_outputs = [n for n in self.outputs() if n is not self.anchor]
            return [self.anchor_spec, pointwise.lower_pointwise_group(self.ctx, self.nodes, epilogue_outputs,
                                                                      shape, self.views)]
        return [self.anchor_spec]


def lower_graph(gm: fx.GraphModule, ctx: LoweringContext, fallback_mode: str = "warn",
                force_fallback: dict[fx.Node, str] | None = None) -> LoweredGraph:
    """Lower for the target of `ctx` (every lowering gets it). `force_fallback` names nodes to run
    on the host regardless of lowerings, with the reason (used when a generated kernel broke a
    hardware rule)."""
    load_lowerings()
    force_fallback = force_fallback or {}
    steps: list[Step] = []
    fallbacks: list[HostStep] = []
    group = _PointwiseGroup(ctx)
    produced_by_kernel: set[fx.Node] = set()
    layouts = _Layouts()

    def flush(anchor: fx.Node | None = None, anchor_spec: KernelSpec | None = None) -> None:
        nonlocal group
        steps.extend(KernelStep(spec) for spec in group.kernels())
        steps.extend(HostStep(view, "view") for view in group.views if group.escapes(view))
        produced_by_kernel.update(group.nodes)
        group = _PointwiseGroup(ctx, anchor, anchor_spec)

    def add_pointwise(node: fx.Node) -> None:
        if not group.accepts(node):
            flush()
        group.add(node)
        layouts.set_from_value(node, contiguous=True)

    def needs_group(node: fx.Node) -> bool:
        return any(inp in group.members for inp in node.all_input_nodes)

    def foldable_constant(node: fx.Node) -> bool:
        """A 0-d constant whose users all take it as an immediate needs no kernel of its own."""
        return (constant_scalar(node) is not None and bool(node.users)
                and all(user.op == "call_function" and user not in force_fallback and _is_tensor(user)
                        and pointwise.is_pointwise(user) for user in node.users))

    def fall_back(node: fx.Node, reason: str) -> None:
        step = HostStep(node, "fallback", reason)
        steps.append(step)
        fallbacks.append(step)
        if not layouts.run(node):
            layouts.set_from_value(node, contiguous=False)

    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            layouts.set_from_value(node, contiguous=False)
            continue
        if node.op == "output" or node in produced_by_kernel:
            continue  # (or a getitem bound to a multi-output kernel)
        if node.op == "get_attr":
            steps.append(HostStep(node, "constant"))
            layouts.metas[node] = getattr(gm, node.target).to("meta")
            continue
        if node.op != "call_function":
            raise NotImplementedError(f"unexpected FX node {node.format_node()} in an ATen graph")
        if node in force_fallback:
            if needs_group(node):
                flush()
            fall_back(node, force_fallback[node])
            continue
        if (_is_tensor(node) and node.target not in VIEW_OPS
                and _has_data_dependent_size(node)):
            if needs_group(node):
                flush()
            fall_back(node, f"{op_name(node)}: its size depends on tensor values (an unbacked SymInt); "
                            "kernels are planned for static shapes")
            continue
        if foldable_constant(node):
            continue
        if _is_tensor(node) and pointwise.is_pointwise(node):
            add_pointwise(node)
            continue
        if group.absorbs(node):
            group.add_view(node)
            layouts.run(node) or layouts.set_from_value(node, contiguous=False)
            continue
        if node.target in _RESHAPING_VIEWS and not layouts.run(node):
            add_pointwise(_insert_contiguous_copy(gm, node))
            layouts.run(node)
        if needs_group(node):
            flush()
        if node.target in SIZE_OPS or (getattr(node.target, "__module__", None) == "_operator"
                                       and not _holds_tensors(node)):
            steps.append(HostStep(node, "scalar"))  # arithmetic / checks on sizes, not tensor math
            continue
        if node.target in ALLOCATIONS:
            steps.append(HostStep(node, "alloc"))
            layouts.set_from_value(node, contiguous=False)
            continue
        if node.target in COLLECTIVES:
            steps.append(HostStep(node, "collective"))
            layouts.run(node) or layouts.set_from_value(node, contiguous=False)
            continue
        if node.target is operator.getitem or node.target in VIEW_OPS:
            steps.append(HostStep(node, "view"))
            layouts.run(node) or layouts.set_from_value(node, contiguous=False)
            continue
        if node.target in FALLBACKS:
            fall_back(node, FALLBACKS[node.target])
            continue
        lowering = LOWERINGS.get(node.target)
        if lowering is None:
            fall_back(node, f"no lowering for {op_name(node)}")
            continue
        try:
            spec = lowering(ctx, node)
        except Unsupported as exc:
            fall_back(node, f"{op_name(node)}: {exc}")
            continue
        if node.target in matmul.EPILOGUE_ANCHORS:
            flush(node, spec)  # held open: pointwise consumers may fuse as its epilogue
        else:
            steps.append(KernelStep(spec))
        produced_by_kernel.update(out for out in spec.outputs if isinstance(out, fx.Node))
        for out in spec.outputs:
            if isinstance(out, fx.Node):
                layouts.set_from_value(out, contiguous=True)
        for position, input_position in spec.inplace.items():
            layouts.metas[spec.outputs[position]] = layouts.metas[spec.inputs[input_position]]
    flush()

    if fallbacks and fallback_mode == "error":
        listing = "\n".join(f"  - {op_name(s.node)}: {s.reason}" for s in fallbacks)
        raise FallbackError(
            f"{len(fallbacks)} op(s) of this graph have no NKI kernel (NEURON_INDUCTOR_FALLBACK=error):\n{listing}\n"
            "Set NEURON_INDUCTOR_FALLBACK=warn to run them eagerly on the host instead.")
    return LoweredGraph(steps, fallbacks)
