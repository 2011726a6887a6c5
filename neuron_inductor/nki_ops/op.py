"""`nki_op(name, fn=None, mutates_args=...)`: a PyTorch custom op whose implementation calls NKI kernels.

As `torch.library.triton_op` does for Triton: `fn` takes and returns tensors and calls kernels
through `wrap_nki`. The op is a `torch.library.custom_op` (so `op.register_autograd(backward,
setup_context=...)`, `torch.autograd.Function` and `torch.library.opcheck` work), and:
- its real implementation runs `fn`: the kernels run in the NKI interpreter on CPU tensors;
- its fake implementation runs `fn` on fake (or meta) tensors, where every kernel call runs only
  the kernel's shape logic (see wrap.py), so torch.compile and meta tensors need no math;
- under `backend="neuron"` the op's node becomes a kernel step of the compiled program
  (lowering.py), with the kernels' source in the dump.

Both runs check what `fn` did against the declaration: writing into an argument not listed in
`mutates_args`, or returning an argument (custom ops must return fresh tensors), is an error
naming the fix.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.fake_tensor import FakeTensor

from ..lowering import registry
from ..passes.pad_rules import ROW_LOCAL
from . import sources
from .wrap import recording


class NkiOpError(RuntimeError):
    """An nki_op did something its declaration does not allow."""


@dataclass
class UserOp:
    """One registered nki_op: its function, declaration and the kernels it was seen to call."""

    name: str
    fn: Callable
    mutates_args: frozenset[str] | None  # None: "unknown" (torch assumes every argument is mutated)
    pad_safe: bool = False  # declared: padded positions of its inputs only reach padded positions of its outputs
    op: CustomOpDef | None = None
    kernels: dict[Callable, None] = field(default_factory=dict)  # kernel functions, in first-call order

    @property
    def overload(self) -> torch._ops.OpOverload:
        return self.op._opoverload

    def run(self, args: tuple, kwargs: dict) -> Any:
        """Run `fn` (kernels run, or only their shape logic on fake / meta tensors) and check it."""
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        tensors = {name: value for name, value in bound.arguments.items() if isinstance(value, torch.Tensor)}
        versions = {name: t._version for name, t in tensors.items()}
        with recording(keep_symbols=self.pad_safe) as log:
            result = self.fn(*args, **kwargs)
        for call in log.calls:
            self.kernels.setdefault(call.func, None)
        written = {name for name, t in tensors.items()
                   if t._version != versions[name] or any(w is t for w in log.written)}
        self._check_mutations(written)
        self._check_aliasing(result, tensors)
        return result

    def _check_mutations(self, written: set[str]) -> None:
        undeclared = sorted(written - self.mutates_args) if self.mutates_args is not None else []
        if undeclared:
            declared = sorted(self.mutates_args | set(undeclared))
            raise NkiOpError(f"nki_op {self.name!r} wrote into its argument(s) {undeclared}, which are not in "
                             f"mutates_args: declare them, @nki_op({self.name!r}, mutates_args={set(declared)}), or "
                             "have the kernel write a new nl.shared_hbm tensor and return it")

    def _check_aliasing(self, result: Any, tensors: dict[str, torch.Tensor]) -> None:
        for out in pytree.tree_leaves(result):
            if not isinstance(out, torch.Tensor):
                continue
            for name, t in tensors.items():
                if out is t or (not isinstance(t, FakeTensor) and not t.is_meta
                                and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                                and t.untyped_storage().nbytes()):
                    raise NkiOpError(f"nki_op {self.name!r} returned (a view of) its argument {name!r}: a custom "
                                     "op must return new tensors. Return a copy (the kernel allocates its result "
                                     "with nl.ndarray(..., buffer=nl.shared_hbm)), or return nothing and list "
                                     f"{name!r} in mutates_args for an in-place op")

    def source(self) -> str:
        """The kernels' source for the dump (each kernel's file, or its own text when defined inline)."""
        if not self.kernels:
            raise NkiOpError(f"nki_op {self.name!r} called no kernel through wrap_nki(kernel)(...) when it ran on "
                             "fake tensors; call its kernels as wrap_nki(kernel)(...) inside the op's function")
        parts, seen = [], set()
        for func in self.kernels:
            text = sources.kernel_source(func)
            if text not in seen:
                seen.add(text)
                parts.append(f"# ---- NKI kernel {func.__qualname__} ({func.__code__.co_filename})\n{text.rstrip()}\n")
        header = (f"# User NKI kernel(s) of the op {self.name}, registered with neuron_inductor.nki_op and "
                  f"called by its function {self.fn.__qualname__}.\n")
        return header + "\n".join(parts)

    def source_hash(self) -> str:
        return sources.source_hash(list(self.kernels))


# The registered ops by their default overload (the target of their FX nodes).
REGISTRY: dict[torch._ops.OpOverload, UserOp] = {}


def named(name: str) -> UserOp | None:
    return next((user for user in REGISTRY.values() if user.name == name), None)


def user_op_of(node) -> UserOp | None:
    """The nki_op an FX node calls (directly, or through auto_functionalized_v2 when it mutates), if any."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.higher_order.auto_functionalized_v2:
        return REGISTRY.get(node.args[0])
    return REGISTRY.get(node.target) if isinstance(node.target, torch._ops.OpOverload) else None


def kernels_hash(gm) -> str:
    """Hash of the source of the user kernels a graph calls ('' when none): part of its cache key, so
    that editing a kernel recompiles."""
    users = {id(u): u for u in map(user_op_of, gm.graph.nodes) if u is not None}
    return ",".join(sorted(f"{u.name}={u.source_hash()}" for u in users.values()))


def _mutates(mutates_args: str | Iterable[str]) -> frozenset[str] | None:
    if mutates_args == "unknown":
        return None
    if isinstance(mutates_args, str):
        raise TypeError(f"nki_op(mutates_args={mutates_args!r}): pass the names of the arguments the kernels "
                        f"write into as a set, e.g. mutates_args={{{mutates_args!r}}}, or () for none")
    return frozenset(mutates_args)


def nki_op(name: str, fn: Callable | None = None, mutates_args: str | Iterable[str] = (), *,
           schema: str | None = None, pad_safe: bool = False) -> Callable:
    """Register `fn` (type-annotated; it calls kernels with wrap_nki) as the custom op `name`
    ("namespace::op"); usable as a decorator. Returns the torch.library CustomOpDef.

    `pad_safe=True` declares that padded positions of the inputs (rows past the real length of a
    bucketed dim) only reach padded positions of the outputs, so bucketing may pad its inputs: each
    bucket then compiles once for every length in it. Without it the op's sizes specialise and every
    length compiles at its exact shape."""

    mutated = _mutates(mutates_args)

    def register(fn: Callable) -> CustomOpDef:
        user = UserOp(name, fn, mutated, pad_safe=pad_safe)

        @functools.wraps(fn)
        def impl(*args, **kwargs):
            return user.run(args, kwargs)

        if schema is None:
            inferred = torch.library.infer_schema(fn, mutates_args=mutates_args)
        else:
            inferred = schema
        user.op = torch.library.custom_op(name, impl, mutates_args=mutates_args, schema=inferred)
        user.op.register_fake(impl)  # fake / meta tensors: only the kernels' shape logic runs
        REGISTRY[user.overload] = user
        registry.LOWERINGS[user.overload] = _lower
        if pad_safe:
            ROW_LOCAL.add(user.overload)  # the pad-safety pass's set of ops that never mix positions
        return user.op

    return register if fn is None else register(fn)


def _lower(ctx, node):
    from .lowering import lower_user_op  # (lowering.py imports this module)

    return lower_user_op(ctx, node)
