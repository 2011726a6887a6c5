"""The real toolchain: compile kernel source with the installed `nki` package and run it on device.

Untested without Trainium hardware (no machine of this project has one). It is kept small on
purpose: exec the standalone kernel source with the real `nki` importable and call the `nki.jit`
kernels with device tensors, exactly as the interpreter does on CPU.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable


class ToolchainUnavailable(RuntimeError):
    pass


def real_nki_available() -> bool:
    """True when an installed `nki` package is the real one (PyPI's `nki` 0.0.1 is a placeholder)."""
    if importlib.util.find_spec("nki") is None:
        return False
    try:
        import nki
        import nki.isa  # noqa: F401  (the placeholder has no isa module)
    except ImportError:
        return False
    return hasattr(nki, "jit")


class NeuronToolchain:
    name = "neuron"

    def __init__(self) -> None:
        if not real_nki_available():
            raise ToolchainUnavailable(
                "NEURON_INDUCTOR_TOOLCHAIN=neuron needs the real `nki` package (Neuron SDK >= 2.29) on a "
                "Trainium host; it is not importable here. Use NEURON_INDUCTOR_TOOLCHAIN=simulator.")
        self._adopted: dict[Callable, Callable] = {}

    def build(self, sources: dict[str, str]) -> dict[str, Callable]:
        kernels: dict[str, Callable] = {}
        for name, source in sources.items():
            namespace: dict = {"__name__": f"neuron_inductor_kernel_{name}"}
            exec(compile(source, f"<neuron_inductor kernel {name}>", "exec"), namespace)
            kernels[name] = namespace[name]
        return kernels

    def adopt(self, kernel: Any) -> Callable:
        """The real nki.jit kernel: the kernel itself when the real nki.jit made it, else rebuilt from its
        file's source with the real nki importable."""
        from ..nki_ops.sources import rebuild, uses_real_nki

        func = kernel.func
        if uses_real_nki(func):
            return kernel
        rebuilt = self._adopted.get(func)
        if rebuilt is None:
            rebuilt = self._adopted[func] = rebuild(func, {"__name__": f"neuron_inductor_user_kernel_{func.__name__}"})
        return rebuilt
