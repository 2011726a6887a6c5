"""Bucket policies and the pad / slice plan of a symbolic graph.

Policy specs (config option `buckets`, env NEURON_INDUCTOR_BUCKETS):
- "128" (default), or any "N": the next multiple of N;
- "64,128,512,2048": an explicit sorted list; sizes above the last entry use exact shapes;
- "128:4096": multiples of 128 up to 4096, then powers of two;
- "off": exact shapes (no padding).

"Symbolic in, static out": every symbol that appears in an input tensor's shape is a bucketed
length. A call binds each symbol to its real value, maps it to its bucket, pads the inputs to the
bucket shapes (zeros at the end of each padded dim), runs the kernel set compiled for the bucket
and slices the outputs back to the real shapes.

Layout of a merged padded dim: a dim whose size is `c * e` (e.g. `2*s` after `view(B*S, D)`) is
laid out `c`-major, `e`-minor (batch-major, as flattening `[B, S, ...]` produces). The pad-safety
pass derives layouts of in-graph views exactly; this rule is only used for graph inputs.
"""

from __future__ import annotations

import logging
import operator
import warnings
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, optimization_hint

log = logging.getLogger("neuron_inductor")


@dataclass(frozen=True)
class BucketPolicy:
    spec: str
    multiple: int | None = None
    sizes: tuple[int, ...] = ()
    pow2_after: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "BucketPolicy":
        text = spec.strip().lower().replace(" ", "")
        if text in ("off", "exact", "none"):
            return cls(spec="off")
        try:
            if ":" in text:
                step, limit = (int(part) for part in text.split(":"))
                if step <= 0 or limit < step or limit % step:
                    raise ValueError
                return cls(spec=f"{step}:{limit}", multiple=step, pow2_after=limit)
            if "," in text:
                sizes = tuple(int(part) for part in text.split(",") if part)
                if not sizes or any(s <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
                    raise ValueError
                return cls(spec=",".join(map(str, sizes)), sizes=sizes)
            multiple = int(text)
            if multiple <= 0:
                raise ValueError
            return cls(spec=str(multiple), multiple=multiple)
        except ValueError:
            raise ValueError(
                f"bad bucket policy {spec!r}; accepted: 'N' (next multiple of N, e.g. '128'), "
                "a strictly increasing list '128,256,512', 'STEP:LIMIT' (multiples of STEP up to LIMIT, "
                "then powers of two, e.g. '128:4096'), or 'off'") from None

    @property
    def enabled(self) -> bool:
        return self.spec != "off"

    def bucket(self, size: int) -> int:
        """The static size that a real size `size` (>= 0) is padded to."""
        if size <= 0 or not self.enabled:
            return size
        if self.sizes:
            return next((s for s in self.sizes if s >= size), size)
        assert self.multiple is not None
        if self.pow2_after is not None and size > self.pow2_after:
            return 1 << (size - 1).bit_length()
        return -(-size // self.multiple) * self.multiple

    def count_up_to(self, limit: int) -> int:
        """How many distinct buckets the sizes 1..limit fall into."""
        return len({self.bucket(size) for size in range(1, limit + 1)})


# ---------------------------------------------------------------------------------------------
# Symbolic sizes


def size_expr(size) -> sympy.Expr:
    """A (possibly symbolic) size as a sympy expression."""
    if isinstance(size, (torch.SymInt, torch.SymFloat)):
        return size.node.expr
    if isinstance(size, sympy.Expr):
        return size
    return sympy.Integer(int(size))


def shape_exprs(value) -> tuple[sympy.Expr, ...] | None:
    """The sympy shape of a tensor (None for anything else)."""
    if isinstance(value, torch.Tensor):
        return tuple(size_expr(s) for s in value.shape)
    return None


def evaluate(expr: sympy.Expr, bindings: dict[sympy.Symbol, int]) -> int:
    value = expr.xreplace({s: sympy.Integer(v) for s, v in bindings.items()})
    if not value.is_number:
        raise ValueError(f"size {expr} has unbound symbols {sorted(map(str, value.free_symbols))}")
    return int(value)


def dim_factors(expr: sympy.Expr) -> tuple[sympy.Expr, ...]:
    """Layout of a graph-input dim of size `expr`: `c*e` is `c`-major (see module doc)."""
    coefficient, rest = sympy.factor_terms(expr).as_coeff_Mul()
    if coefficient != 1 and coefficient.is_Integer and rest.free_symbols:
        return (coefficient, rest)
    return (expr,)


def generator_state_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes holding a saved RNG generator state: the states a checkpointed region's forward saves
    (`run_and_save_rng_state(...)[0]`) and the ones its backward restores (`run_with_rng_state`'s
    first argument)."""
    found: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.run_with_rng_state and isinstance(node.args[0], fx.Node):
            found.append(node.args[0])
        elif (node.target is operator.getitem and node.args[1] == 0 and isinstance(node.args[0], fx.Node)
              and node.args[0].target is torch.ops.higher_order.run_and_save_rng_state):
            found.append(node)
    return list(dict.fromkeys(found))


def pin_generator_states(gm: fx.GraphModule, example_inputs: list) -> list:
    """Give generator states their fixed size in `gm` and `example_inputs` (returned as a new list).

    The partitioner fakeifies the sample generator state under the graph's ShapeEnv, so a state's
    byte count arrives as a fresh symbol. It is no length: padding a state to a bucket corrupts it
    (the generator rejects a state of another size) and a symbol in the backward's inputs would keep
    a `dynamic=False` backward out of its static family. The size is pinned to the symbol's hint,
    the generator's real state size."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pinned = list(example_inputs)
    for node in generator_state_nodes(gm):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not any(isinstance(s, torch.SymInt) for s in val.shape):
            continue
        static = val.fake_mode.from_tensor(
            torch.empty([optimization_hint(s) for s in val.shape], dtype=val.dtype), static_shapes=True)
        node.meta["val"] = static
        if node in placeholders and isinstance(pinned[placeholders.index(node)], torch.Tensor):
            pinned[placeholders.index(node)] = static
    return pinned


def has_symbolic_shapes(example_inputs) -> bool:
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            return True
    return False


def bucketed_symbols(example_inputs) -> tuple[sympy.Symbol, ...]:
    """Symbols that size some input tensor: the lengths that get bucketed (sorted by name).

    Data-dependent sizes (unbacked SymInts, e.g. the count of a boolean mask a backward graph
    receives) stay exact: the ops that read them run on the host, which knows nothing of padding."""
    found: set[sympy.Symbol] = set()
    for value in example_inputs:
        for expr in shape_exprs(value) or ():
            found |= expr.free_symbols - free_unbacked_symbols(expr)
    return tuple(sorted(found, key=str))


def bind_symbols(input_specs, args) -> dict[sympy.Symbol, int]:
    """Real values of a graph's symbols for one call.

    `input_specs[i]` is the symbolic shape (a tuple) of tensor input i, the expression of SymInt
    input i, or None. SymInt inputs carry real values. A tensor input may arrive already padded (an
    activation that the forward program saved for the backward), so a symbol seen only in tensor
    dims takes the smallest size observed: real-size inputs give it, padded ones never go below.
    """
    bound: dict[sympy.Symbol, int] = {}
    from_tensors: dict[sympy.Symbol, int] = {}
    for spec, actual in zip(input_specs, args):
        if isinstance(spec, sympy.Symbol):
            bound[spec] = int(actual)
        elif isinstance(spec, tuple):
            for axis, expr in enumerate(spec):
                if isinstance(expr, sympy.Symbol):
                    size = int(actual.shape[axis])
                    from_tensors[expr] = min(size, from_tensors.get(expr, size))
    return {**from_tensors, **bound}


# ---------------------------------------------------------------------------------------------
# Pad inputs / slice outputs


def _factor_shapes(shape: tuple[sympy.Expr, ...], bindings: dict) -> list[int]:
    return [evaluate(f, bindings) for expr in shape for f in dim_factors(expr)]


def pad_tensor(tensor: torch.Tensor, shape: tuple[sympy.Expr, ...], real: dict, bucket: dict) -> torch.Tensor:
    """`tensor` (real sizes, or already padded) as a zero-padded tensor of the bucket shape."""
    target = [evaluate(e, bucket) for e in shape]
    if list(tensor.shape) == target:
        return tensor
    real_factors, bucket_factors = _factor_shapes(shape, real), _factor_shapes(shape, bucket)
    padded = tensor.new_zeros(bucket_factors)
    padded[tuple(slice(0, n) for n in real_factors)] = tensor.reshape(real_factors)
    return padded.view(target)


def slice_tensor(tensor: torch.Tensor, shape: tuple[sympy.Expr, ...], real: dict, bucket: dict) -> torch.Tensor:
    """The real-size part of a bucket-shaped output (a view where the layout allows one)."""
    target = [evaluate(e, real) for e in shape]
    if list(tensor.shape) == target:
        return tensor
    if all(len(dim_factors(e)) == 1 for e in shape):
        return tensor[tuple(slice(0, n) for n in target)]
    real_factors, bucket_factors = _factor_shapes(shape, real), _factor_shapes(shape, bucket)
    return tensor.reshape(bucket_factors)[tuple(slice(0, n) for n in real_factors)].reshape(target)


@dataclass(frozen=True)
class Bucket:
    """One call's sizes: real and bucketed values of every symbol."""

    real: dict
    padded: dict

    @property
    def signature(self) -> tuple[tuple[str, int], ...]:
        return tuple((str(s), v) for s, v in sorted(self.padded.items(), key=lambda kv: str(kv[0])))

    @property
    def is_padded(self) -> bool:
        return self.real != self.padded


def choose_bucket(policy: BucketPolicy, symbols: tuple[sympy.Symbol, ...], real: dict) -> Bucket:
    padded = {s: (policy.bucket(v) if s in symbols else v) for s, v in real.items()}
    return Bucket(real, padded)


def specialize(gm: fx.GraphModule, args: list) -> fx.GraphModule:
    """A static copy of a symbolic ATen graph for the concrete sizes of `args` (tensors or ints).

    Re-tracing the graph on fake tensors of those sizes evaluates every SymInt expression (view
    sizes, sym_size nodes, SymInt inputs) and leaves static shapes in every node's meta["val"].
    """
    return make_fx(fx.Interpreter(gm).run, tracing_mode="fake", pre_dispatch=False)(*args)


# ---------------------------------------------------------------------------------------------
# Dynamo's recompile limit

# Lengths the raised recompile limit covers (one recompile per bucket up to this length).
COVERED_LENGTH = 16384
_DYNAMO_LIMIT_MESSAGE = "torch._dynamo hit config."


def raise_recompile_limit(policy: BucketPolicy) -> None:
    """Let every bucket up to COVERED_LENGTH compile without Dynamo dropping the frame to eager.

    With dynamic shapes Dynamo recompiles a frame about once per specialisation, and static graphs
    (`dynamic=False`) once per distinct length, so the limit covers one recompile per length up to
    COVERED_LENGTH under the policy's bucket count at the least. Opt out with
    NEURON_INDUCTOR_RAISE_RECOMPILE_LIMIT=0.
    """
    config = torch._dynamo.config
    wanted = max(policy.count_up_to(COVERED_LENGTH), 1024)
    if config.recompile_limit < wanted:
        log.info("neuron_inductor: raising torch._dynamo.config.recompile_limit %d -> %d",
                 config.recompile_limit, wanted)
        config.recompile_limit = wanted
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * wanted)


class _RecompileLimitAlarm(logging.Filter):
    """Turns Dynamo's one-line 'hit config.recompile_limit' log into a loud warning naming the fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(_DYNAMO_LIMIT_MESSAGE):
            limit = record.args[0] if record.args else "recompile_limit"
            warnings.warn(
                f"neuron_inductor: Dynamo hit torch._dynamo.config.{limit}; this frame now runs EAGERLY on "
                "the host, not on neuron_inductor kernels. Fix: keep NEURON_INDUCTOR_RAISE_RECOMPILE_LIMIT=1 "
                "(the default) or raise torch._dynamo.config.recompile_limit / accumulated_recompile_limit, "
                "and prefer a coarser NEURON_INDUCTOR_BUCKETS policy or dynamic shapes (dynamic=None) so that "
                "lengths share buckets.", RuntimeWarning, stacklevel=2)
            log.error("neuron_inductor: Dynamo recompile limit hit; a frame fell back to eager (see warning)")
        return True


_ALARM = _RecompileLimitAlarm()


def watch_recompile_limit() -> None:
    """Install the alarm on Dynamo's frame-conversion logger (idempotent)."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _ALARM not in logger.filters:
        logger.addFilter(_ALARM)
