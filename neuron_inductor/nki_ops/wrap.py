"""`wrap_nki(kernel)(*args)` / `wrap_nki(kernel)[grid](*args)`: call an NKI kernel from PyTorch code.

Tensor arguments become the kernel's HBM tensors; every other argument is a constant the kernel
sees as plain Python (as in NKI, where non-tensor arguments are fixed at trace time). Three ways
a call runs:
- real tensors: the kernel runs on a toolchain (`toolchain.adopt`): inside a compiled program
  its toolchain (see `running_on`), elsewhere the configured one (the NKI interpreter on CPU);
- fake or meta tensors: only the kernel's shape logic runs, in the interpreter on meta tensors
  (no data, no math, hidden from traces), giving outputs of the right shapes and dtypes;
- under Dynamo outside an `nki_op`: not traceable, so Dynamo runs the call eagerly (a graph
  break whose reason names the fix).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from .. import sim
from .sources import interpreter_kernel

_state = threading.local()  # .toolchain: the running compiled program's toolchain; .log: a CallLog


@contextlib.contextmanager
def running_on(toolchain) -> Any:
    """Kernels called inside run as `toolchain` builds them (the interpreter's or the real nki.jit's)."""
    previous = getattr(_state, "toolchain", None)
    _state.toolchain = toolchain
    try:
        yield
    finally:
        _state.toolchain = previous


@contextlib.contextmanager
def shape_instructions() -> Any:
    """The instructions the shape runs inside record (hidden from every trace, they are not work done)."""
    previous = getattr(_state, "shape_instructions", None)
    instructions = _state.shape_instructions = []
    try:
        yield instructions
    finally:
        _state.shape_instructions = previous


@dataclass
class CallLog:
    """The kernel calls made inside `recording()`, and the fake / meta tensors their shape runs wrote into
    (real tensors show writes in their version counters)."""

    calls: list[NkiCall] = field(default_factory=list)
    written: list[torch.Tensor] = field(default_factory=list)
    keep_symbols: bool = False  # the op declared padding safe: dynamic sizes stay symbolic (see _output_sizes)


@contextlib.contextmanager
def recording(keep_symbols: bool = False) -> Any:
    previous = getattr(_state, "log", None)
    log = _state.log = CallLog(keep_symbols=keep_symbols)
    try:
        yield log
    finally:
        _state.log = previous


def kernel_function(kernel: Any) -> Callable:
    """The Python function of an `@nki.jit` kernel (the interpreter's or the real nki's), or a TypeError."""
    func = getattr(kernel, "func", None)
    if callable(func) and inspect.isfunction(func):
        return func
    raise TypeError(f"wrap_nki() takes a kernel decorated with @nki.jit, got {kernel!r} of type "
                    f"{type(kernel).__name__}: decorate the kernel function with @nki.jit (import nki inside "
                    f"neuron_inductor.sim.as_nki() on a CPU host, or load it with neuron_inductor.sim.load_kernels)")


def _grid(grid) -> tuple[int, ...]:
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    # (a SymInt, e.g. a grid computed from a dynamic size, is specialised: NKI traces a kernel per shape)
    grid = tuple(int(g) if isinstance(g, torch.SymInt) else g for g in grid)
    if not grid or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in grid):
        raise ValueError(f"wrap_nki(kernel)[{grid!r}]: a grid is one or more positive Python ints, "
                         "e.g. wrap_nki(kernel)[4](x) or wrap_nki(kernel)[2, 2](x)")
    return grid


def _is_shape_only(value: Any) -> bool:
    return isinstance(value, FakeTensor) or (isinstance(value, torch.Tensor) and value.is_meta)


class NkiCall:
    """A kernel with its launch grid; calling it runs the kernel (see the module doc)."""

    def __init__(self, kernel: Any, grid: tuple[int, ...] = (1,)) -> None:
        self.kernel = kernel
        self.func = kernel_function(kernel)
        self.grid = grid
        self.signature = inspect.signature(self.func)

    @property
    def name(self) -> str:
        return self.func.__name__

    def __getitem__(self, grid) -> NkiCall:
        return NkiCall(self.kernel, _grid(grid))

    def bind(self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"wrap_nki({self.name}): {exc}; the kernel's signature is "
                            f"{self.name}{self.signature}") from None
        bound.apply_defaults()
        return bound

    def __call__(self, *args, **kwargs):
        bound = self.bind(args, kwargs)
        log = getattr(_state, "log", None)
        if log is not None:
            log.calls.append(self)
        values = list(bound.arguments.values())
        if any(_is_shape_only(v) for v in values):
            return self._shape_run(bound)
        toolchain = getattr(_state, "toolchain", None) or _eager_toolchain()
        return toolchain.adopt(self.kernel)[self.grid](*bound.args, **bound.kwargs)

    def _shape_run(self, bound: inspect.BoundArguments):
        """The kernel's shape logic on meta tensors: its outputs' shapes and dtypes, no math."""
        originals: dict[int, torch.Tensor] = {}
        device = None
        log = getattr(_state, "log", None)
        symbols = _symbols_by_hint(bound.arguments.values()) if log is not None and log.keep_symbols else None
        # Kernels compute on Python ints: dynamic sizes are specialised (Dynamo guards on them), unless
        # the op declared padding safe; then the kernel runs at the sizes' current values (hints).
        size = int if symbols is None else _hint

        def to_meta(value):
            nonlocal device
            if isinstance(value, torch.SymInt):
                return int(value)
            if not isinstance(value, torch.Tensor):
                return value
            device = device or value.device
            meta = torch.empty_strided([size(s) for s in value.shape], [size(s) for s in value.stride()],
                                       dtype=value.dtype, device="meta")
            originals[id(meta)] = value
            return meta

        with unset_fake_temporarily():
            args = [to_meta(a) for a in bound.args]
            kwargs = {k: to_meta(v) for k, v in bound.kwargs.items()}
            metas = [m for m in (*args, *kwargs.values()) if isinstance(m, torch.Tensor)]
            versions = [m._version for m in metas]
            with sim.shapes_only(), sim.trace(isolated=True) as recorded:
                result = interpreter_kernel(self.kernel)[self.grid](*args, **kwargs)
            counted = getattr(_state, "shape_instructions", None)
            if counted is not None:
                counted.extend(recorded.instructions)
            if log is not None:
                log.written.extend(originals[id(m)] for m, version in zip(metas, versions) if m._version != version)

        def from_meta(value):
            if isinstance(value, (tuple, list)):
                return type(value)(from_meta(v) for v in value)
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) in originals:  # the kernel returned one of its arguments
                return originals[id(value)]
            sizes = list(value.shape) if symbols is None else [symbols.get(s, s) for s in value.shape]
            return torch.empty(sizes, dtype=value.dtype, device=device)  # fake under the fake mode

        return from_meta(result)


_eager_toolchains: dict[str, Any] = {}


def _eager_toolchain():
    """Where kernels called outside a compiled program run: NEURON_INDUCTOR_TOOLCHAIN's choice (by default
    the interpreter, unless the real nki and a Neuron device are present)."""
    from ..config import resolve
    from ..toolchain import select_toolchain

    choice = resolve().toolchain
    if choice not in _eager_toolchains:
        _eager_toolchains[choice] = select_toolchain(choice)
    return _eager_toolchains[choice]


def _hint(size) -> int:
    return size.node.hint if isinstance(size, torch.SymInt) and size.node.hint is not None else int(size)


def _symbols_by_hint(values) -> dict[int, torch.SymInt] | None:
    """The symbolic sizes of the tensor arguments by current value, for giving a pad-safe op's outputs
    symbolic sizes: an output size equal to a symbolic input size is that size. None (specialise
    everything) when two different symbols have the same value, so which one is meant is ambiguous."""
    found: dict[int, torch.SymInt] = {}
    for value in values:
        if not isinstance(value, torch.Tensor):
            continue
        for s in value.shape:
            if isinstance(s, torch.SymInt) and not s.node.is_nested_int():
                hint = _hint(s)
                if hint in found and str(found[hint]) != str(s):
                    return None
                found[hint] = s
    return found


_CALL_OUTSIDE_OP = ("wrap_nki(kernel)(...) called directly in code that torch.compile traces: the kernel runs "
                    "eagerly in a graph break. Put the call inside a function registered with "
                    "@neuron_inductor.nki_op('mylib::name', mutates_args=...) so that it becomes a kernel of the "
                    "compiled program")
NkiCall.__call__ = torch._dynamo.disable(NkiCall.__call__, reason=_CALL_OUTSIDE_OP)


def wrap_nki(kernel: Any) -> NkiCall:
    """`wrap_nki(kernel)(*args)` or `wrap_nki(kernel)[grid](*args)`; see the module doc."""
    return NkiCall(kernel)
