"""A user kernel's source text, and the kernel rebuilt from it for another `nki`.

A kernel function is written against one `nki`: the interpreter's (imported under
`sim.as_nki()` or loaded with `sim.load_kernels`) or the real one. Shape runs always use the
interpreter; a Neuron host's compiled program runs the real nki.jit. When the function's `nki` is
not the one needed, the kernel is rebuilt from its module's source under the other.
"""

from __future__ import annotations

import hashlib
import inspect
import linecache
import textwrap
import types
from typing import Any, Callable

from .. import sim


class KernelSourceError(RuntimeError):
    """A kernel's source cannot be found (to dump it, or to rebuild it for another nki)."""


def _nki_modules(func: Callable) -> list[types.ModuleType]:
    return [value for value in func.__globals__.values() if isinstance(value, types.ModuleType)
            and (value.__name__ == "nki" or value.__name__.startswith("nki."))]


def uses_real_nki(func: Callable) -> bool:
    """True when the function's module imported the real `nki` (the interpreter's modules are named
    neuron_inductor.sim.*)."""
    return bool(_nki_modules(func))


def is_top_level(func: Callable) -> bool:
    return func.__qualname__ == func.__name__


def module_source(func: Callable) -> str:
    """The source of the file (or `load_kernels` text) defining a top-level kernel."""
    lines = linecache.getlines(func.__code__.co_filename, func.__globals__)
    if not lines:
        raise KernelSourceError(f"no source for NKI kernel {func.__name__} ({func.__code__.co_filename}): define it "
                                "in a file, with neuron_inductor.sim.load_kernels(source, filename), or inline in one")
    return "".join(lines)


def kernel_source(func: Callable) -> str:
    """What the dump shows for a kernel: its whole file when it is top-level, else its own definition."""
    if is_top_level(func):
        return module_source(func)
    try:
        return textwrap.dedent(inspect.getsource(func))
    except OSError as exc:
        raise KernelSourceError(f"no source for NKI kernel {func.__qualname__}: {exc}") from None


def source_hash(funcs: list[Callable]) -> str:
    digest = hashlib.sha256()
    for func in funcs:
        digest.update(func.__qualname__.encode())
        digest.update(kernel_source(func).encode())
    return digest.hexdigest()[:16]


def rebuild(func: Callable, namespace: dict[str, Any]) -> Any:
    """Exec a top-level kernel's module source in `namespace` (imports resolve as the caller arranged)
    and return the kernel defined under the function's name."""
    if not is_top_level(func):
        raise KernelSourceError(f"NKI kernel {func.__qualname__} is defined inside a function, so it cannot be "
                                "rebuilt for another nki; define it at the top level of a file")
    exec(compile(module_source(func), func.__code__.co_filename, "exec"), namespace)
    return namespace[func.__name__]


_interpreted: dict[Callable, sim.Kernel] = {}


def interpreter_kernel(kernel: Any) -> sim.Kernel:
    """A user's `@nki.jit` kernel as the interpreter runs it: itself when made by the interpreter's
    nki.jit, else rebuilt from its file's source under `sim.as_nki()`."""
    if isinstance(kernel, sim.Kernel):
        return kernel
    func = kernel.func
    rebuilt = _interpreted.get(func)
    if rebuilt is None:
        with sim.as_nki():
            rebuilt = _interpreted[func] = rebuild(func, {"__name__": f"neuron_inductor_interpreted_{func.__name__}"})
    return rebuilt
