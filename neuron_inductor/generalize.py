"""Static graphs of one model mapped to buckets: re-derive the symbolic graph behind them.

With `dynamic=False` (the Hugging Face Trainer's setting for `neuron`) Dynamo hands the backend one
static ATen graph per distinct length, with the length baked into integer literals (view sizes,
arange ends, expand sizes) and input shapes. One graph alone cannot tell the length from
coincidental constants, but two graphs of the same structure can: every integer that differs
between them is fitted as `a*s + b` in one changed input dim `s` (the *base*), and the graph is
re-traced with `s` symbolic (`make_fx` over a ShapeEnv) and each fitted literal computed from it.
The result is an ordinary symbolic graph that the runtime makes pad-safe and specialises per
bucket, exactly like a graph that Dynamo traced with dynamic shapes.

Correctness does not rest on the fit being right in general: a static graph is served by a
symbolic form only if it is an *instance* of it — every literal and input dim equals the form's
expression at the graph's own value of `s` (so the form, evaluated there, is that very graph) and
the trace's shape guards hold. A graph that is no instance of any known form stays static (exact
shapes, correct, one kernel set per length) and may pair with a later graph to derive a new form.

Graphs are related through a process-level registry keyed by their structure with integer literals
abstracted (op sequence, argument structure, other constants, input dtypes and ranks), the graph
kind and a scope (the config and cache folder), so that all forms of one family share programs.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from .bucketing import shape_exprs
from .passes.pad_safety import PadSafeRewrite

log = logging.getLogger("neuron_inductor")

# Samples kept per family while no form explains them (each holds its graph).
MAX_UNMATCHED = 8


@dataclass(frozen=True)
class Affine:
    """An integer as a function of the base size: `slope * s + offset` (slope 0: a constant)."""

    slope: int
    offset: int

    def at(self, size):
        return self.slope * size + self.offset if self.slope else self.offset


# ---------------------------------------------------------------------------------------------
# Samples: one static graph's structure, literals and input dims


# Nodes whose arguments may hold literals (placeholders and get_attr nodes have none).
_WITH_ARGUMENTS = ("call_function", "call_method", "output")


def _leaves(value, visit: Callable[[Any], Any]):
    """`value` (a node's args / kwargs) with every leaf replaced by `visit(leaf)`, in a fixed order."""
    if isinstance(value, list):
        return [_leaves(v, visit) for v in value]
    if isinstance(value, tuple):  # torch.Size included: ATen ops take a plain tuple as well
        return tuple(_leaves(v, visit) for v in value)
    if isinstance(value, dict):
        return {k: _leaves(v, visit) for k, v in value.items()}
    return visit(value)


def _is_literal(value) -> bool:
    return type(value) is int  # bools are flags, not sizes


def _constant_digest(gm: fx.GraphModule, node: fx.Node) -> str:
    value = getattr(gm, node.target)
    if isinstance(value, torch.Tensor):
        with unset_fake_temporarily():  # AOTAutograd calls the compilers under its fake mode
            data = value.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
        return f"{value.dtype}{tuple(value.shape)}:" + hashlib.sha256(data).hexdigest()
    return repr(value)


@dataclass
class Sample:
    """A static graph as its family sees it."""

    gm: fx.GraphModule
    key: str  # structure with integer literals abstracted (+ kind and scope)
    literals: tuple[int, ...]  # every integer literal of every node's arguments, in graph order
    dims: tuple[int, ...]  # every dim of every tensor input, in order
    dim_positions: tuple[tuple[int, int], ...]  # (input index, dim) of each entry of `dims`

    @classmethod
    def of(cls, gm: fx.GraphModule, kind: str, scope: str) -> "Sample":
        digest = hashlib.sha256(f"{kind}|{scope}".encode())
        literals: list[int] = []
        index = {node: i for i, node in enumerate(gm.graph.nodes)}

        def visit(leaf):
            if isinstance(leaf, fx.Node):
                return f"%{index[leaf]}"
            if _is_literal(leaf):
                literals.append(leaf)
                return "#"
            return repr(leaf)

        dims, positions = [], []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                digest.update(f"in{i}:{val.dtype}:{val.dim()}|".encode())
                dims += [int(s) for s in val.shape]
                positions += [(i, d) for d in range(val.dim())]
            else:
                digest.update(f"in{i}:{type(val).__name__}:{val!r}|".encode())
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                digest.update(f"{node.op}:{_constant_digest(gm, node)}|".encode())
            elif node.op in _WITH_ARGUMENTS:
                shape = _leaves((node.args, node.kwargs), visit)
                digest.update(f"{node.op}:{node.target}:{shape}|".encode())
        return cls(gm, digest.hexdigest()[:16], tuple(literals), tuple(dims), tuple(positions))


# ---------------------------------------------------------------------------------------------
# Fitting two samples


@dataclass(frozen=True)
class Fit:
    base: int  # index into `dims` of the base size s
    literals: tuple[Affine, ...]
    dims: tuple[Affine, ...]

    def matches(self, sample: Sample) -> bool:
        size = sample.dims[self.base]
        return (all(f.at(size) == v for f, v in zip(self.literals, sample.literals))
                and all(f.at(size) == v for f, v in zip(self.dims, sample.dims)))


def fit(first: Sample, second: Sample) -> Fit | None:
    """Every integer of two same-structure samples as `a*s + b` (integers a, b) in one changed input
    dim s, or None when they do not vary along one size that way."""
    changed = [i for i, (a, b) in enumerate(zip(first.dims, second.dims)) if a != b]
    if not changed:
        return None
    base = min(changed, key=lambda i: (abs(second.dims[i] - first.dims[i]), i))
    x0, x1 = first.dims[base], second.dims[base]
    if min(x0, x1) < 2:  # sizes 0 and 1 are special cases of broadcasting and guards
        return None

    def affine(v0: int, v1: int) -> Affine | None:
        slope, rest = divmod(v1 - v0, x1 - x0)
        return None if rest else Affine(slope, v0 - slope * x0)

    literals = tuple(affine(a, b) for a, b in zip(first.literals, second.literals))
    dims = tuple(affine(a, b) for a, b in zip(first.dims, second.dims))
    if None in literals or None in dims:
        return None
    return Fit(base, literals, dims)


# ---------------------------------------------------------------------------------------------
# The symbolic form


class _ParameterizedInterpreter(fx.Interpreter):
    """Runs a static graph with each fitted literal computed from the base size."""

    def __init__(self, gm: fx.GraphModule, literal_fits: tuple[Affine, ...], base: tuple[int, int]) -> None:
        super().__init__(gm)
        self.base = base
        self.size = None
        self.patched: dict[fx.Node, tuple] = {}
        fits = iter(literal_fits)
        for node in gm.graph.nodes:
            if node.op in _WITH_ARGUMENTS:
                self.patched[node] = _leaves((node.args, node.kwargs),
                                             lambda leaf: next(fits) if _is_literal(leaf) else leaf)

    def run_node(self, node: fx.Node):
        if node not in self.patched:
            return super().run_node(node)
        args, kwargs = self.map_nodes_to_values(self.patched[node], node)
        args, kwargs = _leaves((args, kwargs), lambda leaf: leaf.at(self.size) if isinstance(leaf, Affine) else leaf)
        return getattr(self, node.op)(node.target, args, kwargs)

    def run(self, *args):
        index, dim = self.base
        self.size = args[index].shape[dim]
        return super().run(*args)


@dataclass
class SymbolicForm:
    """The symbolic graph that a family's static graphs are instances of, and what its runners share."""

    fit: Fit
    gm: fx.GraphModule  # symbolic in `symbol`; placeholders' meta["val"] carry the symbolic shapes
    symbol: sympy.Symbol
    guards: tuple[sympy.Expr, ...]  # shape guards the trace assumed (must hold at real and bucket sizes)
    pad_safety: PadSafeRewrite
    programs: dict = field(default_factory=dict)  # compiled programs by call signature, shared by runners

    def holds_at(self, size: int) -> bool:
        return all(bool(guard.xreplace({self.symbol: sympy.Integer(size)})) for guard in self.guards)

    def serves(self, sample: Sample) -> bool:
        return self.fit.matches(sample) and self.holds_at(sample.dims[self.fit.base])

    def bindings(self, sample: Sample) -> dict[sympy.Symbol, int]:
        return {self.symbol: sample.dims[self.fit.base]}

    @property
    def example_inputs(self) -> list:
        return [n.meta.get("val") for n in self.gm.graph.nodes if n.op == "placeholder"]


def trace_form(sample: Sample, found: Fit, kind: str) -> SymbolicForm:
    """Re-trace `sample`'s graph with its base dim symbolic and each fitted literal computed from it."""
    placeholders = [n.meta.get("val") for n in sample.gm.graph.nodes if n.op == "placeholder"]
    orders = {i: sorted(range(v.dim()), key=lambda d: (-v.stride(d), d))
              for i, v in enumerate(placeholders) if isinstance(v, torch.Tensor)}
    dense = {i: v.permute(orders[i]).is_contiguous() for i, v in enumerate(placeholders) if i in orders}
    env = ShapeEnv()
    hint = sample.dims[found.base]
    symbol = env.create_symbol(hint, source=ConstantSource("length"), dynamic_dim=DimDynamic.DYNAMIC)
    size = env.create_symintnode(symbol, hint=hint)
    dim_fits = iter(found.dims)
    inputs = []
    with FakeTensorMode(shape_env=env):
        for i, val in enumerate(placeholders):
            if not isinstance(val, torch.Tensor):
                inputs.append(val)
                continue
            sizes = [next(dim_fits).at(size) for _ in range(val.dim())]
            order = orders[i] if dense[i] else list(range(val.dim()))  # odd strides: trace a dense tensor
            physical = torch.empty([sizes[d] for d in order], dtype=val.dtype, device=val.device)
            inputs.append(physical.permute([order.index(d) for d in range(val.dim())]))
    interpreter = _ParameterizedInterpreter(sample.gm, found.literals, sample.dim_positions[found.base])
    gm = make_fx(interpreter.run, tracing_mode="symbolic")(*inputs)
    if symbol in env.replacements or not _uses(gm, symbol):
        raise ValueError(f"the trace specialised the length to {env.replacements.get(symbol)}")
    guards = tuple(guard.expr for guard in env.guards)
    return SymbolicForm(found, gm, symbol, guards, PadSafeRewrite(gm, (symbol,), f"{kind} graph (static family)"))


def _uses(gm: fx.GraphModule, symbol: sympy.Symbol) -> bool:
    """Whether some input shape of `gm` still depends on `symbol`."""
    return any(symbol in expr.free_symbols for n in gm.graph.nodes if n.op == "placeholder"
               for expr in (shape_exprs(n.meta.get("val")) or ()))


# ---------------------------------------------------------------------------------------------
# Families


@dataclass
class Family:
    """Static graphs of one structure: the symbolic forms found so far and the samples none explains."""

    forms: list[SymbolicForm] = field(default_factory=list)
    unmatched: list[Sample] = field(default_factory=list)
    warned: bool = False

    def form_for(self, sample: Sample, kind: str) -> SymbolicForm | None:
        for form in self.forms:
            if form.serves(sample):
                return form
        for other in reversed(self.unmatched):
            form = self._derive(other, sample, kind)
            if form is not None:
                self.forms.append(form)
                self.unmatched = [s for s in self.unmatched if not form.serves(s)]
                return form
        if not (self.forms or self.unmatched):
            log.info("neuron_inductor: first %s static graph of structure %s runs at exact shapes; a second "
                     "length will show which sizes vary and map later lengths to buckets", kind, sample.key)
        elif not self.warned:
            self.warned = True
            log.warning("neuron_inductor: a %s static graph of structure %s is no instance of a symbolic form "
                        "fitted on earlier lengths and fits no other length alone; such graphs run at EXACT shapes "
                        "(one kernel set per shape)", kind, sample.key)
        self.unmatched = (self.unmatched + [sample])[-MAX_UNMATCHED:]
        return None

    @staticmethod
    def _derive(first: Sample, second: Sample, kind: str) -> SymbolicForm | None:
        found = fit(first, second)
        if found is None:
            return None
        try:
            form = trace_form(second, found, kind)
        except Exception as exc:  # any failure of the re-trace means: not this fit
            log.info("neuron_inductor: %s static graphs %s: re-tracing with a symbolic length failed (%s: %s)",
                     kind, second.key, type(exc).__name__, exc)
            return None
        if not (form.serves(first) and form.serves(second)):
            log.info("neuron_inductor: %s static graphs %s: the symbolic form's shape guards %s exclude the "
                     "lengths it was fitted on", kind, second.key, form.guards)
            return None
        varying = sum(f.slope != 0 for f in found.literals)
        log.info("neuron_inductor: %s static graphs %s (lengths %d and %d): %d literal(s) fitted as a*%s+b; "
                 "later lengths reuse bucket kernels", kind, second.key, first.dims[found.base],
                 second.dims[found.base], varying, form.symbol)
        return form


_FAMILIES: dict[str, Family] = {}


def form_for(sample: Sample, kind: str) -> SymbolicForm | None:
    """The symbolic form `sample` is an instance of (deriving one from an earlier sample if possible)."""
    return _FAMILIES.setdefault(sample.key, Family()).form_for(sample, kind)


def reset() -> None:
    """Forget every family (tests and benchmarks that start over, as a new process would)."""
    _FAMILIES.clear()
