"""Run kernel files written for real NKI: `import nki` resolves to the interpreter inside `as_nki()`.

Inside the block, `nki`, `nki.language` and `nki.isa` in sys.modules are this package's
modules; on exit every `nki*` entry is put back as it was, so an installed real `nki`
is never shadowed outside the block (kernels defined inside keep the interpreter's
modules they imported).
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import sys

from . import isa, language, nki_api
from .launch import Kernel

_FACADE = {"nki": nki_api, "nki.language": language, "nki.isa": isa}


def _nki_entries() -> list[str]:
    return [name for name in sys.modules if name == "nki" or name.startswith("nki.")]


@contextlib.contextmanager
def as_nki():
    saved = {name: sys.modules.pop(name) for name in _nki_entries()}
    sys.modules.update(_FACADE)
    try:
        yield nki_api
    finally:
        for name in _nki_entries():
            del sys.modules[name]
        sys.modules.update(saved)


def load_kernels(source: str, filename: str) -> dict[str, Kernel]:
    """Exec NKI source under as_nki() and return its jit kernels by name.

    The source is registered with linecache so tracebacks show the kernel's lines.
    """
    code = compile(source, filename, "exec")
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": "__nki_kernels__", "__file__": filename, "__builtins__": builtins}
    with as_nki():
        exec(code, namespace)
    return {name: value for name, value in namespace.items() if isinstance(value, Kernel)}
