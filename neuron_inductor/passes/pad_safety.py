"""Pad safety: rewrite a symbolic ATen graph so that padding its bucketed dims cannot change results.

Padded positions hold arbitrary values (graph inputs are zero-padded, but anything computed from
them may be anything, inf and NaN included). Every op that moves data from padded positions into
real ones is rewritten with ordinary ATen ops, which the kernel families compile like any others:

- reductions over a padded dim (sum, prod, amax/amin, argmax/argmin, logsumexp, any/all, softmax,
  log_softmax and their backwards, cumulative ops across a merged dim): the input goes through
  `where(valid, x, neutral)`; mean / var / std divide by the real count;
- contractions over a padded dim (mm, addmm, bmm, baddbmm): BOTH operands are masked to zero;
- attention over a padded key dim: causal attention is safe for real queries (keys past a real
  query are never visible); every operand is masked to zero so padded rows stay finite, and
  non-causal attention gets a key mask; a padded head dim would change the default softmax scale;
- random ops (and a checkpointed region's `run_and_save_rng_state` / `run_with_rng_state`, which
  wrap one) never draw over a padded dim: eager draws over the real shape only, so the values at
  real positions and the generator's state afterwards would differ; wrapped attention without
  dropout is attention as above;
- scatters whose sources include padded positions (embedding backward, index_put with
  accumulate, scatter_add / scatter_reduce, index_add): the sources are masked to the neutral value;
- losses with ignore_index (nll_loss forward / backward): padded targets become ignore_index, so a
  mean reduction divides by the real count;
- indices that refer to the end of a padded dim (select(-1), slices with a negative or symbolic
  start, SymInt values used as numbers) use the real extent.

The masks and real extents come from extra graph inputs the runtime fills per call (`ExtraInput`):
`valid` (a bool vector over one padded factor, true on its real prefix) and `extent` (a 0-d int32
holding a symbol's real value). An op the pass cannot make safe makes the whole graph run unpadded
(exact shapes), and `PadSafetyReport.unsafe` says which op and why.

The pieces, one module each:
- this module: the visit chain (every node: SymInts used as numbers take their real value, then the
  node's rule), the check of the outputs' layouts, and the entry points `make_pad_safe` and
  `PadSafeRewrite`; `rule_for` / `rule_summary` say which rule an op gets;
- `pad_rewriter`: the `Rewriter` the rules build with (masks, real extents, extra inputs);
- `pad_rules`: rules neutralising padded values, and the row-local / default-deny rule;
- `pad_position_rules`: rules for indices and offsets into padded dims;
- `padded_layout`: where each value's real data sits along its padded dims.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..bucketing import size_expr
from ..lowering.registry import PAD_RULES
from . import pad_position_rules, pad_rules  # noqa: F401 (pad_position_rules: imported for its @pad_rule rules)
from .pad_rewriter import ExtraInput, PadSafetyReport, Rewriter, Unsafe, op_label
from .padded_layout import MultiLayout, input_layout, is_padded_expr, tensor_val

aten = torch.ops.aten
log = logging.getLogger("neuron_inductor")


def rule_for(target):
    """The rule making `target` pad safe: its registered @pad_rule, the random-op rule for ops
    tagged nondeterministic_seeded, else the row-local / default-deny rule."""
    if target in PAD_RULES:
        return PAD_RULES[target].rule
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return pad_rules.random_op
    return pad_rules.row_local_or_deny


def rule_summary(target) -> str:
    """What the pass does with `target` in padded graphs, in a few words (the support table's column)."""
    if target in PAD_RULES:
        return PAD_RULES[target].what
    if rule_for(target) is pad_rules.random_op:
        return "random: refused over a padded dim"
    if pad_rules.row_local_target(target):
        return "row-local (positions never mix)"
    return "no rule: graphs reading padded data through it run unpadded"


def rewrite(rw: Rewriter) -> None:
    """Visit every call in graph order (rules insert before the node they visit), then check the outputs."""
    for node in list(rw.graph.nodes):
        if node.op != "call_function":
            continue
        try:
            with rw.graph.inserting_before(node):
                fix_value_uses(rw, node)
                rule_for(node.target)(rw, node)
        except Unsafe as exc:
            rw.report.unsafe.append(f"{op_label(node)}: {exc}")
    check_outputs(rw)


def fix_value_uses(rw: Rewriter, node: fx.Node) -> None:
    """SymInts used as numbers (x * seq_len, scalar_tensor(seq_len)) take their real value."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return
    value_use = torch.Tag.pointwise in target.tags or target in (aten.scalar_tensor.default, aten.full.default)
    for index, arg in enumerate(node.args):
        if target is aten.full.default and index == 0:
            continue
        if not isinstance(arg, fx.Node) or not isinstance(arg.meta.get("val"), (torch.SymInt, torch.SymFloat)):
            continue
        expr = size_expr(arg.meta["val"])
        if not is_padded_expr(expr, rw.symbols):
            continue
        if not value_use:
            continue
        real = rw.real_scalar(expr)
        if target is aten.scalar_tensor.default:
            dtype = node.kwargs.get("dtype") or torch.get_default_dtype()
            node.replace_all_uses_with(rw.call(aten._to_copy.default, real, dtype=dtype))
            rw.graph.erase_node(node)
            rw.note(node, "uses the real size")
            return
        if target is aten.full.default:
            raise Unsafe("fills with a padded size")
        tensor_overload = getattr(target.overloadpacket, "Tensor", None)
        if tensor_overload is None:
            raise Unsafe("uses a padded size as a number")
        node.target = tensor_overload
        node.update_arg(index, real)
        for other, (schema, value) in enumerate(zip(tensor_overload._schema.arguments, node.args)):
            # The Tensor overload takes its other number arguments (clamp's other bound) as tensors.
            if other != index and type(value) in (int, float) and "Tensor" in str(schema.type):
                node.update_arg(other, rw.prologue(("number", value), aten.scalar_tensor.default, value,
                                                   dtype=torch.int32 if type(value) is int else torch.float32))
        rw.note(node, "uses the real size")


def check_outputs(rw: Rewriter) -> None:
    """The runtime slices every output as if it were a graph input of its shape (each padded dim a
    real prefix, or `c`-major for `c*e`): an output whose real data sits elsewhere cannot be padded."""
    output = next(n for n in reversed(rw.graph.nodes) if n.op == "output")
    for value in _flat_nodes(output.args[0]):
        layout, val = rw.layouts.get(value), tensor_val(value)
        if val is None or layout is None or isinstance(layout, MultiLayout):
            continue
        for dim, (actual, expected) in enumerate(zip(layout, input_layout(val.shape, rw.symbols))):
            if actual != expected:
                rw.report.unsafe.append(
                    f"{op_label(value)}: returns a tensor whose padded dim {dim} holds its real data as {actual}, "
                    f"not as {expected}, the layout the caller slices")


def _flat_nodes(value) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _flat_nodes(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _flat_nodes(item)]
    return []


def make_pad_safe(gm: fx.GraphModule, symbols) -> tuple[fx.GraphModule, list[ExtraInput], PadSafetyReport]:
    """A rewritten copy of symbolic `gm` whose padded execution equals the unpadded one.

    Returns the graph (with the `ExtraInput`s appended as placeholders, in order), the extra
    inputs, and the report. When the report is not `safe` the graph must run unpadded.
    """
    graph = fx.Graph()
    outputs = graph.graph_copy(gm.graph, {})
    graph.output(outputs)
    copy = fx.GraphModule(gm, graph)
    rewriter = Rewriter(copy, frozenset(symbols))
    rewrite(rewriter)
    copy.graph.lint()
    copy.recompile()
    return copy, list(rewriter.extra), rewriter.report


class PadSafeRewrite:
    """`make_pad_safe` of one symbolic graph, done on first use and logged once: `graph()` gives the
    rewritten graph and its extra inputs, or None when some op cannot be padded (the graph then runs
    at exact shapes)."""

    def __init__(self, gm: fx.GraphModule, symbols, label: str) -> None:
        self.gm, self.symbols, self.label = gm, tuple(symbols), label
        self.report: PadSafetyReport | None = None
        self._result: tuple[fx.GraphModule, list[ExtraInput]] | None = None

    def graph(self) -> tuple[fx.GraphModule, list[ExtraInput]] | None:
        if self.report is None:
            graph, extra, self.report = make_pad_safe(self.gm, self.symbols)
            if self.report.safe:
                self._result = (graph, extra)
                log.info("neuron_inductor: %s: pad-safety rewrote %d op(s): %s", self.label, len(self.report.masked),
                         "; ".join(self.report.masked) or "none needed")
            else:
                log.warning("neuron_inductor: %s runs UNPADDED (one kernel set per exact shape) because padding it "
                            "could change results: %s", self.label, "; ".join(self.report.unsafe))
        return self._result
