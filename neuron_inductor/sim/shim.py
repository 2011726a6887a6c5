"""Run kernel files written for real NKI: `import nki` resolves to the interpreter inside `as_nki()`.

Inside the block, `nki`, `nki.language`, `nki.isa`, `nki.isa.constants`, `nki.dtype`,
`nki.typing` and the legacy `neuronxcc.nki.typing` in sys.modules are this package's
modules; on exit every such entry is put back as it was, so an installed real `nki`
is never shadowed outside the block (kernels defined inside keep the interpreter's
modules they imported).
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import sys

import types

from . import dtypes, isa, isa_constants, language, nki_api, typing_api
from .launch import Kernel

isa.constants = isa_constants  # `from nki.isa import constants`

# The legacy neuronxcc.nki namespace: some kernels still import its typing module.
_legacy_nki = types.ModuleType("neuronxcc.nki")
_legacy_nki.typing = typing_api
_legacy = types.ModuleType("neuronxcc")
_legacy.nki = _legacy_nki

_FACADE = {"nki": nki_api, "nki.language": language, "nki.isa": isa, "nki.isa.constants": isa_constants,
           "nki.dtype": dtypes, "nki.typing": typing_api,
           "neuronxcc": _legacy, "neuronxcc.nki": _legacy_nki, "neuronxcc.nki.typing": typing_api}
_ROOTS = ("nki", "neuronxcc")


def _nki_entries() -> list[str]:
    return [name for name in sys.modules if name in _ROOTS or name.startswith(("nki.", "neuronxcc."))]


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
