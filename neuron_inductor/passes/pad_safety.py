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
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..bucketing import dim_factors, evaluate, size_expr
from ..lowering.registry import PAD_RULES, RNG_WRAPPERS, VIEW_OPS, pad_rule
from .padded_layout import (
    RESHAPES, SAME_AS_FIRST, UNKNOWN, MultiLayout, analyse, cat_dim, cat_parts, input_layout, is_padded_expr, prefix_cat,
    reduced_dims, same_size, tensor_inputs, tensor_val,
)

aten = torch.ops.aten
log = logging.getLogger("neuron_inductor")


class Unsafe(Exception):
    """An op whose padded inputs this pass cannot neutralise."""


@dataclass(frozen=True)
class ExtraInput:
    """An input appended to the rewritten graph, computed by the runtime from the real sizes."""

    # "valid": bool [bucket(expr)], true below real(expr); "extent": int32 0-d, real(expr);
    # "bucket_extent": int32 0-d, expr at the bucket sizes
    kind: str
    expr: sympy.Expr

    def value(self, real: dict, padded: dict) -> torch.Tensor:
        if self.kind in ("extent", "bucket_extent"):
            return torch.tensor(evaluate(self.expr, real if self.kind == "extent" else padded), dtype=torch.int32)
        return torch.arange(evaluate(self.expr, padded)) < evaluate(self.expr, real)

    def example(self, padded: dict) -> torch.Tensor:
        """A value of the right shape for specialising the graph to a bucket."""
        return self.value(padded, padded)


@dataclass
class PadSafetyReport:
    masked: list[str] = field(default_factory=list)  # "op: what was done"
    unsafe: list[str] = field(default_factory=list)  # "op: why it cannot be padded"

    @property
    def safe(self) -> bool:
        return not self.unsafe


def _op(node: fx.Node) -> str:
    target = node.target
    return str(target).removeprefix("aten.") if isinstance(target, torch._ops.OpOverload) else getattr(
        target, "__name__", str(target))


def _neutral(kind: str, dtype: torch.dtype):
    if dtype == torch.bool:
        return kind in ("one", "max")
    if kind in ("zero", "one"):
        return 0 if kind == "zero" else 1
    if dtype.is_floating_point:
        return -math.inf if kind == "min" else math.inf
    # Kernels hold int64 as int32 (saturating): an int64 extreme would not survive the narrowing.
    info = torch.iinfo(torch.int32 if dtype == torch.int64 else dtype)
    return info.min if kind == "min" else info.max


# Ops that never move data across positions of a padded dim (besides pointwise-tagged ops).
ROW_LOCAL = SAME_AS_FIRST | RESHAPES | (VIEW_OPS - {aten.as_strided.default, aten.diagonal.default}) | {
    aten.where.self, aten.copy.default,
    aten.full.default, aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.arange.start_step,
    aten.arange.default, aten.arange.start, aten.scalar_tensor.default, aten.expand.default,
    aten.sym_size.int, aten.scatter.value, aten.scatter.src,
    aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
}

# Row-local ops that combine their operands position by position, like pointwise ops.
ELEMENTWISE_EXTRA = {aten.where.self, aten.copy_.default, aten.copy.default}
# Indexing ops: which argument they index, and along which dims (index values count real positions).
INDEXED_DIMS = {
    aten.embedding.default: lambda node: (0, [0]),
    aten.index_select.default: lambda node: (0, [node.args[1]]),
    aten.gather.default: lambda node: (0, [node.args[1]]),
    aten.index.Tensor: lambda node: (0, [d for d, i in enumerate(node.args[1]) if i is not None]),
}

SUM_LIKE = {aten.sum.default: "zero", aten.sum.dim_IntList: "zero", aten.any.default: "zero",
            aten.any.dim: "zero", aten.any.dims: "zero", aten.prod.default: "one", aten.prod.dim_int: "one",
            aten.all.default: "one", aten.all.dim: "one", aten.amax.default: "min", aten.amin.default: "max",
            aten.argmax.default: "min", aten.argmin.default: "max", aten.logsumexp.default: "min"}
CONTRACTIONS = {  # op -> ((arg index, contracted dim), ...)
    aten.mm.default: ((0, 1), (1, 0)), aten.addmm.default: ((1, 1), (2, 0)),
    aten.bmm.default: ((0, 2), (1, 1)), aten.baddbmm.default: ((1, 2), (2, 1)),
}
CUMULATIVE = {aten.cumsum.default: "zero", aten.cumprod.default: "one", aten.logcumsumexp.default: "min"}
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
NLL_LOSSES = {  # op -> (log-probs arg, target arg, ignore_index arg)
    aten.nll_loss_forward.default: (0, 1, 4), aten.nll_loss2d_forward.default: (0, 1, 4),
    aten.nll_loss_backward.default: (1, 2, 5), aten.nll_loss2d_backward.default: (1, 2, 5),
}
NEVER_PADDED = {  # op -> why padding along its data dims cannot be neutralised here
    aten.flip.default: "reverses a padded dim", aten.roll.default: "rotates a padded dim",
    aten.sort.default: "sorts along a padded dim", aten.topk.default: "selects along a padded dim",
    aten.native_layer_norm.default: "normalises over a padded dim",
    aten.native_layer_norm_backward.default: "normalises over a padded dim",
    aten._fused_rms_norm.default: "normalises over a padded dim",
    aten.native_group_norm.default: "normalises over a padded dim",
    aten.native_batch_norm.default: "normalises over a padded dim",
    aten._native_batch_norm_legit_functional.default: "normalises over a padded dim",
    aten.cummax.default: "returns indices across a merged padded dim",
    aten.cummin.default: "returns indices across a merged padded dim",
}


def row_local_target(target) -> bool:
    """Whether the op never moves data across positions of a padded dim."""
    if not isinstance(target, torch._ops.OpOverload):
        return True  # getitem and SymInt arithmetic
    return target in ROW_LOCAL or torch.Tag.pointwise in target.tags


def rule_for(target):
    """The rule making `target` pad safe: its registered @pad_rule, the random-op rule for ops
    tagged nondeterministic_seeded, else the row-local / default-deny rule."""
    if target in PAD_RULES:
        return PAD_RULES[target].rule
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return _Rewriter.random
    return _Rewriter.row_local_or_deny


def rule_summary(target) -> str:
    """What the pass does with `target` in padded graphs, in a few words (the support table's column)."""
    if target in PAD_RULES:
        return PAD_RULES[target].what
    if rule_for(target) is _Rewriter.random:
        return "random: refused over a padded dim"
    if row_local_target(target):
        return "row-local (positions never mix)"
    return "no rule: graphs reading padded data through it run unpadded"


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, symbols: frozenset) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.symbols = symbols
        self.layouts = analyse(gm, symbols)
        self.report = PadSafetyReport()
        self.extra: dict[ExtraInput, fx.Node] = {}
        self.memo: dict[tuple, fx.Node] = {}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.last_placeholder = placeholders[-1] if placeholders else None
        self.prologue_end = self.last_placeholder

    # -- building blocks ---------------------------------------------------------------------

    def _extra(self, kind: str, expr: sympy.Expr) -> fx.Node:
        key = ExtraInput(kind, expr)
        if key not in self.extra:
            anchor = self.last_placeholder
            with self.graph.inserting_after(anchor) if anchor else self.graph.inserting_before(None):
                node = self.graph.placeholder(f"pad_{kind}_{len(self.extra)}")
            if self.prologue_end is self.last_placeholder:
                self.prologue_end = node
            self.last_placeholder = node
            self.extra[key] = node
        return self.extra[key]

    def _prologue(self, key: tuple, target, *args, **kwargs) -> fx.Node:
        """A node that only depends on the extra inputs, placed once right after the placeholders."""
        if key not in self.memo:
            with self.graph.inserting_after(self.prologue_end):
                self.memo[key] = self.prologue_end = self.graph.call_function(target, args, kwargs)
        return self.memo[key]

    def real_scalar(self, expr: sympy.Expr):
        """The real value of a size expression: an int, or a 0-d int32 node built from extents."""
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            return self._extra("extent", expr)
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            combine = aten.add.Tensor if isinstance(expr, sympy.Add) else aten.mul.Tensor
            terms = sorted(expr.args, key=lambda a: (not a.free_symbols, str(a)))
            result = self.real_scalar(terms[0])
            for term in terms[1:]:
                result = self._prologue(("scalar", combine, result, term), combine, result, self.real_scalar(term))
            return result
        if type(expr).__name__ == "FloorDiv":
            return self._prologue(("floordiv", expr), aten.div.Tensor_mode, self.real_scalar(expr.args[0]),
                                  self.real_scalar(expr.args[1]), rounding_mode="floor")
        raise Unsafe(f"size expression {expr} has no tensor form")

    def _valid(self, factors: tuple) -> fx.Node:
        """Bool vector over a padded dim with layout `factors`: true at real positions."""
        if ("valid", factors) in self.memo:
            return self.memo[("valid", factors)]
        mask, rank = None, 0
        leading = 1
        for factor in factors:
            if not is_padded_expr(factor, self.symbols):
                if mask is None:
                    leading *= int(factor)
                else:
                    mask = self._prologue(("expand", mask, factor), aten.expand.default,
                                          self._prologue(("unsq", mask), aten.unsqueeze.default, mask, -1),
                                          [-1] * rank + [int(factor)])
                    rank += 1
                continue
            vector = self._extra("valid", factor)
            if mask is None:
                mask, rank = vector, 1
                if leading > 1:
                    mask = self._prologue(("expand", vector, leading), aten.expand.default,
                                          self._prologue(("unsq0", vector), aten.unsqueeze.default, vector, 0),
                                          [leading, -1])
                    rank = 2
            else:
                mask = self._prologue(("and", mask, vector), aten.logical_and.default,
                                      self._prologue(("unsq", mask), aten.unsqueeze.default, mask, -1), vector)
                rank += 1
        if rank > 1:
            mask = self._prologue(("flat", mask), aten.reshape.default, mask, [-1])
        self.memo[("valid", factors)] = mask
        return mask

    def dim_layout(self, node: fx.Node, dim: int):
        layout = self.layouts.get(node)
        val = tensor_val(node)
        if layout is None or isinstance(layout, MultiLayout):
            return None
        return layout[dim % val.dim()] if val.dim() else None

    def mask_for(self, node: fx.Node, dims) -> fx.Node | None:
        """A bool mask broadcastable to `node`, true where every padded dim among `dims` is real."""
        val = tensor_val(node)
        rank = val.dim()
        dims = range(rank) if dims is None else sorted({d % rank for d in dims})
        mask = None
        for dim in dims:
            layout = self.dim_layout(node, dim)
            if layout is None:
                continue
            if layout == UNKNOWN:
                raise Unsafe(f"needs a mask over dim {dim}, whose padding layout is not known")
            shape = [1] * rank
            shape[dim] = -1
            part = self._prologue(("dimmask", layout, tuple(shape)), aten.view.default, self._valid(layout), shape)
            mask = part if mask is None else self._call(aten.logical_and.default, mask, part)
        return mask

    def _call(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def masked(self, node: fx.Node, dims, kind: str) -> fx.Node:
        """`where(real, node, neutral)` over the padded dims among `dims` (node itself if none)."""
        mask = self.mask_for(node, dims)
        if mask is None:
            return node
        val = tensor_val(node)
        fill = self._call(aten.scalar_tensor.default, _neutral(kind, val.dtype), dtype=val.dtype)
        return self._call(aten.where.self, mask, node, fill)

    def padded_dims(self, node: fx.Node, dims=None) -> list[int]:
        val = tensor_val(node)
        if val is None or not val.dim():
            return []
        dims = range(val.dim()) if dims is None else {d % val.dim() for d in dims}
        return [d for d in dims if is_padded_expr(size_expr(val.shape[d]), self.symbols)]

    def note(self, node: fx.Node, what: str) -> None:
        self.report.masked.append(f"{_op(node)}: {what}")

    def replace(self, node: fx.Node, result: fx.Node, what: str, keep: set | None = None) -> None:
        """Route `node`'s users (but the nodes in `keep`) to `result`, which takes its value and
        layout; erase `node` when nothing uses it any more."""
        result.meta["val"] = node.meta.get("val")
        if node in self.layouts:
            self.layouts[result] = self.layouts[node]
        node.replace_all_uses_with(result, delete_user_cb=(lambda user: user not in keep) if keep else lambda _: True)
        if not node.users:
            self.graph.erase_node(node)
        self.note(node, what)

    def real_positions(self, layout) -> None:
        """Refuse an index into a padded dim unless its real positions are a prefix (index values
        count real positions, which a merged or unknown layout moves)."""
        if layout is not None and (layout == UNKNOWN or len(layout) > 1):
            raise Unsafe("indexes a padded dim whose real positions are not a prefix")

    def aligned(self, node: fx.Node, operands, skip_dim: int | None = None) -> None:
        """Operands combined position by position must hold their real data at the same positions
        of every padded dim (aligned from the right, as broadcasting aligns them)."""
        val = tensor_val(node)
        if val is None:
            return
        rank = val.dim()
        for axis in range(rank):
            if axis == skip_dim or not is_padded_expr(size_expr(val.shape[axis]), self.symbols):
                continue
            seen = []
            for operand in operands:
                operand_val, layout = tensor_val(operand), self.layouts.get(operand)
                offset = axis - (rank - operand_val.dim()) if operand_val is not None else -1
                if offset < 0 or isinstance(layout, MultiLayout) or layout is None:
                    continue
                if same_size(operand_val.shape[offset], val.shape[axis]) and layout[offset] is not None:
                    seen.append(layout[offset])
            if len(set(seen)) > 1 or (UNKNOWN in seen and len(seen) > 1):
                raise Unsafe(f"combines operands whose real data sit at different positions of padded dim {axis}")

    # -- rules -------------------------------------------------------------------------------

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op != "call_function":
                continue
            try:
                with self.graph.inserting_before(node):
                    self.visit(node)
            except Unsafe as exc:
                self.report.unsafe.append(f"{_op(node)}: {exc}")
        self.check_outputs()

    def visit(self, node: fx.Node) -> None:
        self.fix_value_uses(node)
        return rule_for(node.target)(self, node)

    # -- rules: registered per op with @pad_rule (lowering/registry.py); rule_for() picks one ----

    @pad_rule(*SUM_LIKE, what="reduction: padded elements -> the reduction's neutral value")
    def sum_like(self, node: fx.Node) -> None:
        return self.reduction(node, SUM_LIKE[node.target])

    @pad_rule(aten.linalg_vector_norm.default,
              what="norm: padded elements -> 0 (ord >= 0) or the largest value (ord < 0)")
    def vector_norm(self, node: fx.Node) -> None:
        # sum |x|**p: zeros are neutral for p >= 0; for p < 0 (and min |x|, p = -inf) |0|**p is
        # inf, while the largest value adds ~0 (or never wins the min).
        order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
        if isinstance(order, fx.Node):
            if self.padded_dims(node.args[0], reduced_dims(node)[0]):
                raise Unsafe("a vector norm over a padded dim whose order is a graph value")
            return None
        return self.reduction(node, "max" if order < 0 else "zero")

    @pad_rule(aten._softmax.default, aten._log_softmax.default, what="padded logits -> -inf")
    def softmax(self, node: fx.Node) -> None:
        return self.mask_args(node, [(0, [node.args[1]], "min")], "padded logits -> -inf")

    @pad_rule(aten._softmax_backward_data.default, what="padded grad and output -> 0")
    def softmax_backward(self, node: fx.Node) -> None:
        return self.mask_args(node, [(0, [node.args[2]], "zero"), (1, [node.args[2]], "zero")], "grad, out -> 0")

    @pad_rule(aten._log_softmax_backward_data.default, what="padded grad -> 0")
    def log_softmax_backward(self, node: fx.Node) -> None:
        return self.mask_args(node, [(0, [node.args[2]], "zero")], "grad -> 0")

    @pad_rule(*CUMULATIVE, what="scan: a merged padded dim is masked to the neutral value")
    def cumulative(self, node: fx.Node) -> None:
        dim = node.args[1]
        layout = self.dim_layout(node.args[0], dim)
        if layout is not None and (layout == UNKNOWN or len(layout) > 1):
            return self.mask_args(node, [(0, [dim], CUMULATIVE[node.target])], "merged dim masked")
        return None

    @pad_rule(ATTENTION, ATTENTION_BACKWARD, what="attention: padded rows -> 0, padded keys masked (non-causal)")
    def plain_attention(self, node: fx.Node) -> None:
        return self.attention(node, node.target)

    @pad_rule(aten.embedding_dense_backward.default, what="grad of padded ids -> 0")
    def embedding_backward(self, node: fx.Node) -> None:
        grad = node.args[0]
        return self.mask_args(node, [(0, range(tensor_val(grad).dim() - 1), "zero")], "grad of padded ids -> 0")

    @pad_rule(aten.scatter_add.default, aten.scatter_reduce.two,
              what="scatter-reduce: padded sources -> the reduction's neutral value")
    def scatter_reducing(self, node: fx.Node) -> None:
        self.real_positions(self.dim_layout(node.args[0], node.args[1]))
        return self.scatter_reduce(node)

    @pad_rule(aten.scatter.src, aten.scatter.value, what="scatter: refused along a padded index dim")
    def scatter_overwriting(self, node: fx.Node) -> None:
        self.real_positions(self.dim_layout(node.args[0], node.args[1]))
        if node.args[1] in self.padded_dims(node.args[2]) or self.padded_dims(node.args[2], [node.args[1]]):
            raise Unsafe("overwrites along a padded index dim")
        return None

    @pad_rule(aten.index_add.default, what="padded source rows -> 0")
    def index_add(self, node: fx.Node) -> None:
        self.real_positions(self.dim_layout(node.args[0], node.args[1]))
        return self.mask_args(node, [(3, [node.args[1]], "zero")], "padded source rows -> 0")

    @pad_rule(aten.as_strided.default, aten.diagonal.default,
              what="refused on padded data (its strides count padded positions)")
    def strided_view(self, node: fx.Node) -> None:
        if self.padded_dims(node.args[0]):
            raise Unsafe("takes a strided view of padded data, whose strides count padded positions")
        return None

    @pad_rule(aten.repeat.default, what="refused when it tiles a padded dim")
    def repeat(self, node: fx.Node) -> None:
        repeats = list(node.args[1])
        tiled = [d for d, r in enumerate(repeats[len(repeats) - tensor_val(node.args[0]).dim():]) if r != 1]
        if self.padded_dims(node.args[0], tiled):
            raise Unsafe("tiles a padded dim")
        return None

    @pad_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, what="refused along a padded dim")
    def split(self, node: fx.Node) -> None:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if node.target is aten.unbind.int:
            dim = node.args[1] if len(node.args) > 1 else 0
        if self.padded_dims(node.args[0], [dim]):
            raise Unsafe("splits along a padded dim")
        return None

    def row_local_or_deny(self, node: fx.Node) -> None:
        """Ops without a rule: a row-local one (positions never mix) is safe once operands combined
        position by position align; any other reading padded data is refused (default-deny)."""
        target = node.target
        if self.is_row_local(node):
            if target in ELEMENTWISE_EXTRA or (isinstance(target, torch._ops.OpOverload)
                                               and torch.Tag.pointwise in target.tags):
                self.aligned(node, tensor_inputs(node))
            return None
        if any(self.padded_dims(arg) for arg in tensor_inputs(node)):
            raise Unsafe("no pad-safety rule for this op and it reads padded data")
        return None

    def is_row_local(self, node: fx.Node) -> bool:
        target = node.target
        if target is torch.ops.higher_order.auto_functionalized_v2:  # a mutating custom op: judge the op itself
            target = node.args[0]
        return row_local_target(target)

    @pad_rule(*NEVER_PADDED, what="refused along its data dims when they are padded")
    def check_untouched(self, node: fx.Node) -> None:
        target = node.target
        data_dims = {
            aten.flip.default: lambda: node.args[1], aten.roll.default: lambda: node.args[2] if len(node.args) > 2 else None,
            aten.sort.default: lambda: [node.args[1] if len(node.args) > 1 else -1],
            aten.topk.default: lambda: [node.args[2] if len(node.args) > 2 else -1],
            aten.native_layer_norm.default: lambda: range(-len(node.args[1]), 0),
            aten.native_layer_norm_backward.default: lambda: range(-len(node.args[2]), 0),
            aten._fused_rms_norm.default: lambda: range(-len(node.args[1]), 0),
            aten.cummax.default: lambda: [node.args[1]], aten.cummin.default: lambda: [node.args[1]],
        }.get(target, lambda: None)()
        arg = node.args[1] if target is aten.native_layer_norm_backward.default else node.args[0]
        dims = self.padded_dims(arg, data_dims)
        if target in (aten.cummax.default, aten.cummin.default):
            dims = [d for d in dims if len(self.dim_layout(arg, d) or ()) != 1]
        if dims:
            raise Unsafe(NEVER_PADDED[target])

    def fix_value_uses(self, node: fx.Node) -> None:
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
            if not is_padded_expr(expr, self.symbols):
                continue
            if not value_use:
                continue
            real = self.real_scalar(expr)
            if target is aten.scalar_tensor.default:
                dtype = node.kwargs.get("dtype") or torch.get_default_dtype()
                node.replace_all_uses_with(self._call(aten._to_copy.default, real, dtype=dtype))
                self.graph.erase_node(node)
                self.note(node, "uses the real size")
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
                    node.update_arg(other, self._prologue(("number", value), aten.scalar_tensor.default, value,
                                                          dtype=torch.int32 if type(value) is int else torch.float32))
            self.note(node, "uses the real size")

    def mask_args(self, node: fx.Node, specs, what: str) -> None:
        changed = False
        for index, dims, kind in specs:
            arg = node.args[index]
            new = self.masked(arg, dims, kind)
            if new is not arg:
                node.update_arg(index, new)
                changed = True
        if changed:
            self.note(node, what)

    def reduction(self, node: fx.Node, kind: str) -> None:
        dims, _ = reduced_dims(node)
        if node.target in (aten.argmax.default, aten.argmin.default) and dims is None and self.padded_dims(node.args[0]):
            raise Unsafe("flattened argmax / argmin over a padded tensor")
        self.mask_args(node, [(0, dims, kind)], f"padded elements -> {kind} neutral")

    def _count(self, node: fx.Node, dims):
        val = tensor_val(node)
        dims = range(val.dim()) if dims is None else {d % val.dim() for d in dims}
        return self.real_scalar(sympy.Mul(*[size_expr(val.shape[d]) for d in dims]))

    @pad_rule(aten.mean.dim, aten.mean.default, what="sum of real elements / real count")
    def mean(self, node: fx.Node) -> None:
        source = node.args[0]
        dims, keepdim = reduced_dims(node)
        if not self.padded_dims(source, dims):
            return
        dims_list = list(dims) if dims is not None else list(range(tensor_val(source).dim()))
        total = self._call(aten.sum.dim_IntList, self.masked(source, dims, "zero"), dims_list, keepdim,
                           dtype=node.kwargs.get("dtype"))
        result = self._call(aten.div.Tensor, total, self._count(source, dims))
        self.replace(node, result, "sum of real elements / real count")

    @pad_rule(aten.var.correction, aten.std.correction, what="centred on the real mean, divided by the real count")
    def variance(self, node: fx.Node) -> None:
        source = node.args[0]
        dims, keepdim = reduced_dims(node)
        if not self.padded_dims(source, dims):
            return
        dims_list = list(dims) if dims is not None else list(range(tensor_val(source).dim()))
        correction = node.kwargs.get("correction")
        correction = 1 if correction is None else correction
        count = self._count(source, dims)
        mask = self.mask_for(source, dims)
        zero = self._call(aten.scalar_tensor.default, 0.0, dtype=tensor_val(source).dtype)
        total = self._call(aten.sum.dim_IntList, self._call(aten.where.self, mask, source, zero), dims_list, True)
        centered = self._call(aten.sub.Tensor, source, self._call(aten.div.Tensor, total, count))
        centered = self._call(aten.where.self, mask, centered, zero)
        squares = self._call(aten.sum.dim_IntList, self._call(aten.mul.Tensor, centered, centered), dims_list, keepdim)
        result = self._call(aten.div.Tensor, squares, self._call(aten.sub.Tensor, count, correction))
        if node.target is aten.std.correction:
            result = self._call(aten.sqrt.default, result)
        self.replace(node, result, "centred on the real mean, divided by the real count")

    @pad_rule(*CONTRACTIONS, what="both operands zeroed along a padded contraction dim")
    def contraction(self, node: fx.Node) -> None:
        specs = CONTRACTIONS[node.target]
        (a_index, a_dim), (b_index, b_dim) = specs
        a, b = node.args[a_index], node.args[b_index]
        if not self.padded_dims(a, [a_dim]):
            return
        layout_a, layout_b = self.dim_layout(a, a_dim), self.dim_layout(b, b_dim)
        if UNKNOWN in (layout_a, layout_b) or layout_a != layout_b:
            raise Unsafe("contracts a padded dim whose real positions differ between the operands (or are not known)")
        self.mask_args(node, [(a_index, [a_dim], "zero"), (b_index, [b_dim], "zero")],
                       "both operands zeroed along the padded contraction dim")

    def attention(self, node: fx.Node, op, first: int = 0) -> None:
        """`op` (SDPA or its backward) with its args from `node.args[first]` on (a wrapper's come later)."""
        forward = op is ATTENTION
        tensors = (0, 1, 2) if forward else (0, 1, 2, 3, 4)  # q, k, v (| grad_out, q, k, v, out)
        args = node.args[first:]
        query, key = (args[0], args[1]) if forward else (args[1], args[2])
        causal_index = 4 if forward else 7
        causal = len(args) > causal_index and bool(args[causal_index])
        if self.padded_dims(query, [-1]) and node.kwargs.get("scale") is None:
            raise Unsafe("the head dim is padded, and the default softmax scale is 1/sqrt(its padded size)")
        key_layout, query_layout = self.dim_layout(key, -2), self.dim_layout(query, -2)
        if key_layout is None and query_layout is None:
            return
        if causal and query_layout != key_layout:
            raise Unsafe("causal attention whose query and key lengths are padded differently")
        if UNKNOWN in (key_layout, query_layout):
            raise Unsafe("attention over a sequence dim whose padding layout is not known")
        dtype = tensor_val(query).dtype  # read before mask_args replaces the operands with unannotated nodes
        specs = [(first + i, [-2], "zero") for i in tensors]
        if not forward:
            specs.append((first + 5, [-1], "zero"))  # logsumexp rows of padded queries
        self.mask_args(node, specs, "padded rows -> 0" + ("" if causal else ", padded keys masked"))
        if not causal and key_layout is not None:
            self.key_mask(node, key, dtype)

    @pad_rule(*RNG_WRAPPERS, what="attention without dropout as attention; other random ops as random ops")
    def rng_wrapped(self, node: fx.Node) -> None:
        """A checkpointed region's random op: attention without dropout is plain attention (SDPA is
        tagged random for its dropout argument); any other is a random op."""
        position = RNG_WRAPPERS[node.target]
        op, args = node.args[position], node.args[position + 1:]
        if op is ATTENTION and not node.kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0):
            return self.attention(node, op, position + 1)
        return self.random(node)

    def random(self, node: fx.Node) -> None:
        """Random values may be drawn only where no dim is padded."""
        results = _tensor_results(node)
        if any(self.padded_dims(arg) for arg in tensor_inputs(node)) or any(
                is_padded_expr(size_expr(size), self.symbols) for val in results for size in val.shape):
            raise Unsafe("draws random numbers over a padded dim, where eager draws over the real shape only")

    def key_mask(self, node: fx.Node, key: fx.Node, dtype: torch.dtype) -> None:
        """Non-causal attention: padded keys get -inf scores through attn_mask."""
        valid = self.mask_for(key, [-2])  # [..., Lk, 1]
        valid = self._call(aten.transpose.int, valid, -1, -2)  # [..., 1, Lk]
        existing = node.kwargs.get("attn_mask")
        if existing is None:
            mask = self._call(aten.where.self, valid, self._call(aten.scalar_tensor.default, 0.0, dtype=dtype),
                              self._call(aten.scalar_tensor.default, -math.inf, dtype=dtype))
        elif tensor_val(existing).dtype == torch.bool:
            mask = self._call(aten.logical_and.default, existing, valid)
        else:
            mask = self._call(aten.where.self, valid, existing,
                              self._call(aten.scalar_tensor.default, -math.inf, dtype=tensor_val(existing).dtype))
        node.update_kwarg("attn_mask", mask)

    @pad_rule(*NLL_LOSSES, what="padded targets -> ignore_index; refused on a padded class dim")
    def nll_loss(self, node: fx.Node) -> None:
        log_probs_position, target_position, ignore_index_position = NLL_LOSSES[node.target]
        log_probs, target = node.args[log_probs_position], node.args[target_position]
        if self.padded_dims(log_probs, [1]) and tensor_val(log_probs).dim() > 1:
            raise Unsafe("the class dim is padded")
        mask = self.mask_for(target, None)
        if mask is None:
            return
        ignore = self._call(aten.scalar_tensor.default, node.args[ignore_index_position], dtype=tensor_val(target).dtype)
        node.update_arg(target_position, self._call(aten.where.self, mask, target, ignore))
        self.note(node, "padded targets -> ignore_index")

    @pad_rule(aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default,
              what="accumulate: padded values -> 0; overwriting at padded indices refused")
    def index_put(self, node: fx.Node) -> None:
        accumulate = len(node.args) > 3 and bool(node.args[3])
        base = node.args[0]
        for dim, index in enumerate(node.args[1]):
            if index is not None:
                self.real_positions(self.dim_layout(base, dim))
        self.count_negative_indices_from_real_end(node, base, node.args[1], 1)
        indices = [i for i in node.args[1] if isinstance(i, fx.Node)]
        if not any(self.padded_dims(i) for i in indices) and not self.padded_dims(node.args[2]):
            return
        if not accumulate:
            raise Unsafe("overwrites at padded index positions")
        self.mask_args(node, [(2, None, "zero")], "padded values -> 0")

    def scatter_reduce(self, node: fx.Node) -> None:
        kind = "zero"
        if node.target is aten.scatter_reduce.two:
            kind = {"sum": "zero", "prod": "one", "amax": "min", "amin": "max"}.get(node.args[4])
            if kind is None and self.padded_dims(node.args[2]):
                raise Unsafe(f"scatter_reduce '{node.args[4]}' over padded sources")
            include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
            if not include_self and self.padded_dims(node.args[2]):
                # A neutral source still counts as a contribution: the target row stops keeping itself.
                raise Unsafe("scatter_reduce without self over padded sources")
        self.mask_args(node, [(3, None, kind)], "padded sources -> neutral")

    @pad_rule(aten.select.int, what="an index from the end counts from the real end")
    def select(self, node: fx.Node) -> None:
        source, dim, index = node.args
        layout = self.dim_layout(source, dim)
        if layout is None:
            return
        index_expr = size_expr(index.meta["val"]) if isinstance(index, fx.Node) else sympy.Integer(index)
        if index_expr.is_Integer and int(index_expr) >= 0:
            return
        if layout == UNKNOWN or len(layout) > 1:
            raise Unsafe("indexes a merged padded dim from its end")
        if index_expr.is_Integer:
            index_expr = size_expr(tensor_val(source).shape[dim]) + index_expr
        position = self.real_scalar(index_expr)
        position = self._call(aten.view.default, position, [1])
        picked = self._call(aten.index_select.default, source, dim, position)
        result = self._call(aten.squeeze.dim, picked, dim)
        self.replace(node, result, "index counted from the real end")

    @pad_rule(aten.slice.Tensor, what="negative / symbolic bounds count from the real end")
    def slice(self, node: fx.Node) -> None:
        source, dim, start, _, step = _with_defaults(node, [None, 0, 0, None, 1])
        layout = self.dim_layout(source, dim)
        if layout is None:
            return
        start_expr = size_expr(start.meta["val"]) if isinstance(start, fx.Node) else sympy.Integer(start or 0)
        if start_expr.is_Integer and int(start_expr) >= 0:
            if int(start_expr) and len(layout) > 1:
                raise Unsafe("slices a merged padded dim at an offset")
            return
        out_size = size_expr(tensor_val(node).shape[dim])
        if _whole_blocks(layout, start_expr, out_size):
            return
        if layout == UNKNOWN or len(layout) > 1:
            raise Unsafe("slices a merged padded dim from its end")
        if start_expr.is_Integer:
            start_expr = size_expr(tensor_val(source).shape[dim]) + start_expr
        keep = set()
        with self.graph.inserting_before(node.next):  # after the slice: its size may be read
            if out_size.is_Integer:
                positions = self._call(aten.arange.start_step, 0, int(out_size) * step, step, dtype=torch.int32)
                positions = self._call(aten.add.Tensor, positions, self.real_scalar(start_expr))
            else:  # a padded length from a real start: positions past the real end stay in bounds
                if step != 1 or len(dim_factors(out_size)) > 1:
                    raise Unsafe("slices a padded length with a step, or into a merged dim")
                keep.add(length := self._call(aten.sym_size.int, node, dim))  # the slice stays, for its size
                positions = self._call(aten.arange.start_step, 0, length, 1, dtype=torch.int32)
                last = self._prologue(("last", source, dim), aten.sub.Tensor,
                                      self._extra("bucket_extent", size_expr(tensor_val(source).shape[dim])), 1)
                positions = self._call(aten.minimum.default, self._call(aten.add.Tensor, positions,
                                                                        self.real_scalar(start_expr)), last)
            result = self._call(aten.index_select.default, source, dim, positions)
        self.replace(node, result, "start counted from the real end", keep=keep)

    @pad_rule(aten.constant_pad_nd.default, what="padded data moved so the fill follows the real data")
    def constant_pad(self, node: fx.Node) -> None:
        """Padding a padded dim puts the fill after the bucket's padding, not after the real data (as
        `F.pad(labels, (0, 1), value=ignore_index)` for shifted labels expects): every position from
        the real end on takes the fill value."""
        source, pads = node.args[0], node.args[1]
        fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
        rank = tensor_val(source).dim()
        ends = []
        for pair in range(len(pads) // 2):
            dim = rank - 1 - pair
            layout = self.dim_layout(source, dim)
            if layout is None:
                continue
            before, after = pads[2 * pair], pads[2 * pair + 1]
            if layout == UNKNOWN or len(layout) > 1 or not (isinstance(before, int) and isinstance(after, int)):
                raise Unsafe("pads a merged padded dim (or by a symbolic amount)")
            if after < 0:
                raise Unsafe("crops the end of a padded dim")
            ends.append((dim, sympy.Integer(before) + size_expr(tensor_val(source).shape[dim])))
        if not ends:
            return
        created: set[fx.Node] = set()
        result = node
        with self.graph.inserting_before(node.next):
            for dim, real_end in ends:
                size = self._call(aten.sym_size.int, node, dim)
                positions = self._call(aten.arange.start_step, 0, size, 1, dtype=torch.int64)
                keep = self._call(aten.lt.Tensor, positions, self.real_scalar(real_end))
                keep = self._call(aten.view.default, keep, [-1] + [1] * (rank - 1 - dim))
                fill_value = self._call(aten.scalar_tensor.default, fill, dtype=tensor_val(node).dtype)
                result = self._call(aten.where.self, keep, result, fill_value)
                created |= {size, positions, keep, fill_value, result}
        self.replace(node, result, "positions past the real end -> fill value", keep=created)

    @pad_rule(aten.slice_scatter.default, aten.select_scatter.default,
              what="positions from the end count from the real end")
    def scatter_into_slice(self, node: fx.Node) -> None:
        base, src, dim = node.args[0], node.args[1], node.args[2]
        layout = self.dim_layout(base, dim)
        if node.target is aten.slice_scatter.default and self.padded_dims(src, [dim]):
            # The padded rows of `src` are written too, and may land on real rows of the base: they
            # write the base's own values there instead.
            if layout is None:
                raise Unsafe("writes a padded source into an unpadded dim")
            bounds = list(node.args[3:6]) + [None, None, 1][len(node.args[3:6]):]
            own = self._call(aten.slice.Tensor, base, dim, *bounds)
            node.update_arg(1, self._call(aten.where.self, self.mask_for(src, [dim]), src, own))
            self.note(node, "padded source rows write the base's own values")
        if layout is None:
            return
        position = node.args[3] if len(node.args) > 3 else 0
        expr = size_expr(position.meta["val"]) if isinstance(position, fx.Node) else sympy.Integer(position or 0)
        if not expr.is_Integer or int(expr) < 0 or (int(expr) and len(layout) > 1):
            raise Unsafe("writes at a position counted from the end of a padded dim")


    @pad_rule(aten.cat.default, what="parts along a padded dim re-packed after each part's real end")
    def cat(self, node: fx.Node) -> None:
        """A cat along a padded dim places each part after the previous part's *padded* end. Equal
        prefix parts give the (k, e) layout the runtime reads a k*e dim in; other prefix parts are
        gathered so that each part's real rows follow the previous part's real rows (positions past
        the real total keep whatever they hold)."""
        parts, dim = cat_parts(node), cat_dim(node)
        self.aligned(node, parts, skip_dim=dim)
        if not self.padded_dims(node, [dim]):
            return
        layouts = [self.dim_layout(part, dim) for part in parts]
        if layouts[0] is not None and layouts[0] != UNKNOWN and len(layouts[0]) == 1 and len(set(layouts)) == 1:
            return
        if not prefix_cat(layouts, self.symbols, tensor_val(node).shape[dim]):
            raise Unsafe("concatenates along a padded dim parts whose real rows are not prefixes")
        created: set[fx.Node] = set()

        def call(target, *args, **kwargs) -> fx.Node:
            created.add(result := self._call(target, *args, **kwargs))
            return result

        with self.graph.inserting_before(node.next):
            positions = call(aten.arange.start_step, 0, call(aten.sym_size.int, node, dim), 1, dtype=torch.int32)
            source, before = positions, sympy.Integer(0)
            for part in parts:
                shift_from = self.real_scalar(before)  # each part's real rows start after the real rows before it
                shift = self._prologue(("cat_shift", before), aten.sub.Tensor, self._extra("bucket_extent", before),
                                       shift_from) if is_padded_expr(before, self.symbols) else None
                if shift is not None:
                    moved = call(aten.add.Tensor, positions, shift)
                    source = call(aten.where.self, call(aten.ge.Tensor, positions, shift_from), moved, source)
                before = before + size_expr(tensor_val(part).shape[dim])
            end = self.real_scalar(before)  # past the real total: any in-bounds position
            source = call(aten.where.self, call(aten.ge.Tensor, positions, end), positions, source)
            result = call(aten.index_select.default, node, dim, source)
        self.replace(node, result, "parts gathered to their real offsets", keep=created)

    @pad_rule(aten.arange.start, aten.arange.start_step,
              what="a start computed from a padded size counts from the real size")
    def arange(self, node: fx.Node) -> None:
        """A range's values come from its start and step; its end only sets its (padded) length. A
        start computed from a padded size (arange(n - 1, -1, -1)) counts from the real size."""
        start, step = node.args[0], node.args[2] if len(node.args) > 2 else 1
        if isinstance(step, fx.Node):
            raise Unsafe("a range whose step is a size")
        if not isinstance(start, fx.Node) or not is_padded_expr(size_expr(start.meta["val"]), self.symbols):
            return
        keep = set()
        real_start = self.real_scalar(size_expr(start.meta["val"]))
        real_length = self.real_scalar(size_expr(tensor_val(node).shape[0]))
        with self.graph.inserting_before(node.next):
            keep.add(length := self._call(aten.sym_size.int, node, 0))
            counts = self._call(aten.arange.start_step, 0, length, 1, **node.kwargs)
            values = self._call(aten.add.Tensor, self._call(aten.mul.Tensor, counts, step), real_start)
            # Past the real length the values would leave the range (and an index built from them its
            # tensor): they repeat the start.
            below = aten.lt.Tensor if isinstance(real_length, fx.Node) else aten.lt.Scalar
            result = self._call(aten.where.self, self._call(below, counts, real_length), values, real_start)
        self.replace(node, result, "starts from the real size", keep=keep)

    @pad_rule(*INDEXED_DIMS, what="index values count real positions; negative indices from the real end")
    def indexing(self, node: fx.Node) -> None:
        index_arg, dims = INDEXED_DIMS[node.target](node)
        source = node.args[index_arg]
        for dim in dims:
            self.real_positions(self.dim_layout(source, dim))
        if node.target is aten.gather.default:
            self.aligned(node, [source, node.args[2]], skip_dim=node.args[1] % tensor_val(node).dim())
        if node.target is aten.index.Tensor:
            self.count_negative_indices_from_real_end(node, source, node.args[1], 1)

    def count_negative_indices_from_real_end(self, node: fx.Node, source: fx.Node, indices, position: int) -> None:
        """Advanced indexing takes negative indices from the end of a dim: the real end."""
        new_indices, changed = list(indices), False
        for dim, index in enumerate(indices):
            if not isinstance(index, fx.Node) or not self.padded_dims(source, [dim]):
                continue
            if tensor_val(index).dtype == torch.bool:
                raise Unsafe("masks a padded dim with a boolean index")
            real = self.real_scalar(size_expr(tensor_val(source).shape[dim]))
            wrapped = self._call(aten.add.Tensor, index, real)
            new_indices[dim] = self._call(aten.where.self, self._call(aten.lt.Scalar, index, 0), wrapped, index)
            changed = True
        if changed:
            node.update_arg(position, new_indices)
            self.note(node, "negative indices counted from the real end")

    def check_outputs(self) -> None:
        """The runtime slices every output as if it were a graph input of its shape (each padded dim a
        real prefix, or `c`-major for `c*e`): an output whose real data sits elsewhere cannot be padded."""
        output = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        for value in _flat_nodes(output.args[0]):
            layout, val = self.layouts.get(value), tensor_val(value)
            if val is None or layout is None or isinstance(layout, MultiLayout):
                continue
            for dim, (actual, expected) in enumerate(zip(layout, input_layout(val.shape, self.symbols))):
                if actual != expected:
                    self.report.unsafe.append(
                        f"{_op(value)}: returns a tensor whose padded dim {dim} holds its real data as {actual}, "
                        f"not as {expected}, the layout the caller slices")


def _with_defaults(node: fx.Node, defaults: list) -> list:
    """`node`'s positional arguments, keyword ones in their schema place, the rest from `defaults`."""
    names = [a.name for a in node.target._schema.arguments][:len(defaults)]
    given = list(node.args) + [node.kwargs.get(name, default) for name, default in
                               zip(names[len(node.args):], defaults[len(node.args):])]
    return [default if value is None else value for value, default in zip(given, defaults)]


def _whole_blocks(layout, start: sympy.Expr, length: sympy.Expr) -> bool:
    """Whether a slice of a dim laid out (k, e) takes whole blocks of e (the parts of a cat of equal
    padded parts): its padded bounds then cut the same blocks."""
    if layout == UNKNOWN or len(layout) != 2 or not layout[0].is_Integer:
        return False
    first, count = sympy.simplify(start / layout[1]), sympy.simplify(length / layout[1])
    return (first.is_Integer and count.is_Integer and 0 <= int(first) and int(count) > 0
            and int(first) + int(count) <= int(layout[0]))


def _flat_nodes(value) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _flat_nodes(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _flat_nodes(item)]
    return []


def _tensor_results(node: fx.Node) -> list[torch.Tensor]:
    """The tensors `node` returns; a wrapper node without a value gives its getitem users' values."""
    val = node.meta.get("val")
    if val is None:
        return [t for user in node.users if user.target is operator.getitem for t in _tensor_results(user)]
    values = val if isinstance(val, (tuple, list)) else [val]
    return [v for v in values if isinstance(v, torch.Tensor)]


def make_pad_safe(gm: fx.GraphModule, symbols) -> tuple[fx.GraphModule, list[ExtraInput], PadSafetyReport]:
    """A rewritten copy of symbolic `gm` whose padded execution equals the unpadded one.

    Returns the graph (with the `ExtraInput`s appended as placeholders, in order), the extra
    inputs, and the report. When the report is not `safe` the graph must run unpadded.
    """
    graph = fx.Graph()
    outputs = graph.graph_copy(gm.graph, {})
    graph.output(outputs)
    copy = fx.GraphModule(gm, graph)
    rewriter = _Rewriter(copy, frozenset(symbols))
    rewriter.run()
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
