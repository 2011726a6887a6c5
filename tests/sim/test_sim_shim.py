"""`sim.as_nki()`: inside it `import nki` resolves to the interpreter; after it sys.modules holds what it
held before (a real nki's modules back, no facade module and nothing imported under nki left)."""

from __future__ import annotations

import sys
import types

from neuron_inductor import sim
from neuron_inductor.sim import nki_api

_NKI_NAMES = ("nki", "nki.language", "nki.isa", "neuronxcc", "neuronxcc.nki", "neuronxcc.nki.typing")


def _nki_modules() -> dict:
    return {name: module for name, module in sys.modules.items() if name in ("nki", "neuronxcc")
            or name.startswith(("nki.", "neuronxcc."))}


def test_the_facade_is_there_inside_and_gone_after():
    before = _nki_modules()
    with sim.as_nki():
        import nki
        import nki.isa as nisa
        import nki.language as nl
        assert nki is nki_api and nl is sim.language and nisa is sim.isa
    assert _nki_modules() == before == {}
    with sim.as_nki():
        sys.modules["nki.extra"] = types.ModuleType("nki.extra")  # as an import under nki would add
    assert _nki_modules() == {}


def test_a_real_nki_is_put_back_and_modules_imported_inside_go():
    real = {name: types.ModuleType(name) for name in ("nki", "nki.language", "nki.kernels")}
    sys.modules.update(real)
    try:
        with sim.as_nki():
            import nki
            assert nki is nki_api and "nki.kernels" not in sys.modules  # the real one's submodules set aside
            sys.modules["nki.extra"] = types.ModuleType("nki.extra")  # as an import under nki would add
        assert _nki_modules() == real
        with sim.as_nki():
            del sys.modules["nki.isa"]  # a facade module replaced inside: the exit scans
            sys.modules["nki.isa"] = types.ModuleType("nki.isa")
        assert _nki_modules() == real
    finally:
        for name in real:
            sys.modules.pop(name, None)
    assert all(name not in sys.modules for name in _NKI_NAMES)
