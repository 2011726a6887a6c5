"""The pad-safety rewriter's building blocks: the graph being rewritten, the padding layout of
every value, the extra inputs the runtime fills per call, and the masks, real extents and
replacements the rules (pad_rules.py, pad_position_rules.py) are written with.

The masks and real extents come from extra graph inputs (`ExtraInput`): `valid` (a bool vector over
one padded factor, true on its real prefix), `extent` (a 0-d int32 holding a symbol's real value)
and `bucket_extent` (its value at the bucket). A rule raises `Unsafe` for what it cannot neutralise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..bucketing import evaluate, size_expr
from .padded_layout import UNKNOWN, MultiLayout, analyse, is_padded_expr, same_size, tensor_val

aten = torch.ops.aten


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


def op_label(node: fx.Node) -> str:
    target = node.target
    return str(target).removeprefix("aten.") if isinstance(target, torch._ops.OpOverload) else getattr(
        target, "__name__", str(target))


def neutral(kind: str, dtype: torch.dtype):
    if dtype == torch.bool:
        return kind in ("one", "max")
    if kind in ("zero", "one"):
        return 0 if kind == "zero" else 1
    if dtype.is_floating_point:
        return -math.inf if kind == "min" else math.inf
    # Kernels hold int64 as int32 (saturating): an int64 extreme would not survive the narrowing.
    info = torch.iinfo(torch.int32 if dtype == torch.int64 else dtype)
    return info.min if kind == "min" else info.max


class Rewriter:
    """One graph being made pad safe: rules (`rule(rw, node)`) build their replacements with these
    methods, inserted before the node being visited."""

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

    def extra_input(self, kind: str, expr: sympy.Expr) -> fx.Node:
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

    def prologue(self, key: tuple, target, *args, **kwargs) -> fx.Node:
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
            return self.extra_input("extent", expr)
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            combine = aten.add.Tensor if isinstance(expr, sympy.Add) else aten.mul.Tensor
            terms = sorted(expr.args, key=lambda a: (not a.free_symbols, str(a)))
            result = self.real_scalar(terms[0])
            for term in terms[1:]:
                result = self.prologue(("scalar", combine, result, term), combine, result, self.real_scalar(term))
            return result
        if type(expr).__name__ == "FloorDiv":
            return self.prologue(("floordiv", expr), aten.div.Tensor_mode, self.real_scalar(expr.args[0]),
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
                    mask = self.prologue(("expand", mask, factor), aten.expand.default,
                                         self.prologue(("unsq", mask), aten.unsqueeze.default, mask, -1),
                                         [-1] * rank + [int(factor)])
                    rank += 1
                continue
            vector = self.extra_input("valid", factor)
            if mask is None:
                mask, rank = vector, 1
                if leading > 1:
                    mask = self.prologue(("expand", vector, leading), aten.expand.default,
                                         self.prologue(("unsq0", vector), aten.unsqueeze.default, vector, 0),
                                         [leading, -1])
                    rank = 2
            else:
                mask = self.prologue(("and", mask, vector), aten.logical_and.default,
                                     self.prologue(("unsq", mask), aten.unsqueeze.default, mask, -1), vector)
                rank += 1
        if rank > 1:
            mask = self.prologue(("flat", mask), aten.reshape.default, mask, [-1])
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
            part = self.prologue(("dimmask", layout, tuple(shape)), aten.view.default, self._valid(layout), shape)
            mask = part if mask is None else self.call(aten.logical_and.default, mask, part)
        return mask

    def call(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def masked(self, node: fx.Node, dims, kind: str) -> fx.Node:
        """`where(real, node, neutral)` over the padded dims among `dims` (node itself if none)."""
        mask = self.mask_for(node, dims)
        if mask is None:
            return node
        val = tensor_val(node)
        fill = self.call(aten.scalar_tensor.default, neutral(kind, val.dtype), dtype=val.dtype)
        return self.call(aten.where.self, mask, node, fill)

    def padded_dims(self, node: fx.Node, dims=None) -> list[int]:
        val = tensor_val(node)
        if val is None or not val.dim():
            return []
        dims = range(val.dim()) if dims is None else {d % val.dim() for d in dims}
        return [d for d in dims if is_padded_expr(size_expr(val.shape[d]), self.symbols)]

    def note(self, node: fx.Node, what: str) -> None:
        self.report.masked.append(f"{op_label(node)}: {what}")

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

    def count(self, node: fx.Node, dims):
        val = tensor_val(node)
        dims = range(val.dim()) if dims is None else {d % val.dim() for d in dims}
        return self.real_scalar(sympy.Mul(*[size_expr(val.shape[d]) for d in dims]))
