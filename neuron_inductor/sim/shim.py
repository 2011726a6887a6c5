"""Run kernel files written for real NKI: `import nki` resolves to the interpreter inside `as_nki()`.

Inside the block, `nki`, `nki.language`, `nki.isa`, `nki.isa.constants`, `nki.collectives`, `nki.dtype`,
`nki.typing` and the legacy `neuronxcc.nki.typing` in sys.modules are this package's
modules; on exit every such entry is put back as it was, so an installed real `nki`
is never shadowed outside the block (kernels defined inside keep the interpreter's
modules they imported).
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import re
import sys
import types


from . import collectives, dtypes, isa, isa_constants, language, nki_api, typing_api
from .launch import Kernel

isa.constants = isa_constants  # `from nki.isa import constants`

# The legacy neuronxcc.nki namespace: some kernels still import its typing module.
_legacy_nki = types.ModuleType("neuronxcc.nki")
_legacy_nki.typing = typing_api
_legacy = types.ModuleType("neuronxcc")
_legacy.nki = _legacy_nki

_FACADE = {"nki": nki_api, "nki.language": language, "nki.isa": isa, "nki.isa.constants": isa_constants,
           "nki.collectives": collectives, "nki.dtype": dtypes, "nki.typing": typing_api,
           "neuronxcc": _legacy, "neuronxcc.nki": _legacy_nki, "neuronxcc.nki.typing": typing_api}
_ROOTS = ("nki", "neuronxcc")


def _nki_entries() -> list[str]:
    return [name for name in sys.modules if name in _ROOTS or name.startswith(("nki.", "neuronxcc."))]


@contextlib.contextmanager
def as_nki():
    # sys.modules holds thousands of names once transformers or diffusers are loaded, and the backend
    # enters this per kernel it loads: it is scanned only where other nki entries may be (a real nki
    # loaded, or modules imported inside), the facade's own names taken out directly otherwise
    present = any(root in sys.modules for root in _ROOTS)
    saved = {name: sys.modules.pop(name) for name in _nki_entries()} if present else {}
    sys.modules.update(_FACADE)
    inside = len(sys.modules)
    try:
        yield nki_api
    finally:
        if len(sys.modules) == inside and all(sys.modules.get(name) is module for name, module in _FACADE.items()):
            for name in _FACADE:
                del sys.modules[name]
        else:
            for name in _nki_entries():
                del sys.modules[name]
        sys.modules.update(saved)


def loaded_module_name(filename: str) -> str:
    return "neuron_inductor.sim.loaded." + (re.sub(r"\W+", "_", filename).strip("_") or "source")


def load_kernels(source: str, filename: str) -> dict[str, Kernel]:
    """Exec NKI source under as_nki() and return its jit kernels by name.

    The source is registered with linecache so tracebacks (and `inspect.getsource`) show the kernel's
    lines, and it runs as a module in sys.modules (one per filename; loading the same filename again
    replaces it): tools that look up a function's module by name (Dynamo, pickle, torch.library)
    find it.
    """
    code = compile(source, filename, "exec")
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(loaded_module_name(filename))
    module.__file__ = filename
    module.__dict__["__builtins__"] = builtins
    sys.modules[module.__name__] = module
    with as_nki():
        exec(code, module.__dict__)
    return {name: value for name, value in vars(module).items() if isinstance(value, Kernel)}
