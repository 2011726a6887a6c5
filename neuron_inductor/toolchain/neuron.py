"""The real toolchain: compile kernel source with the installed `nki` package and run it on device.

Untested on Trainium hardware (no machine of this project has one); tests/test_neuron_toolchain.py
checks the calling convention against a fake `nki`. The convention, from the nki.jit docstring
(aws-neuron-sdk nki/api/nki/__init__.py) and TorchNeuron's examples:
- nki.jit detects the framework from the kernel's arguments, so every kernel takes at least one
  torch tensor (templates guarantee it: codegen/render.py refuses a kernel without arguments), and
  the tensors are on the `neuron` device and contiguous (arguments elsewhere, or strided views, are
  copied there; arguments the kernel writes into are copied back afterwards; results stay on device);
- the launch LNC (`kernel[lnc](...)`) must match $NEURON_LOGICAL_NC_CONFIG of the Neuron Runtime, 2 by
  default on trn2 / trn3 ("Mismatching the two will cause a runtime error");
- nki parses the kernel's source (inspect.getsource), so the source is registered in linecache
  under a file name unique to it before it is exec'd.
The interpreter still checks every kernel's hardware rules before first use (compiler.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import os
from typing import Any, Callable

import torch

LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
DEFAULT_LNC = 2  # trn2 / trn3 (the only targets: config.py)


class ToolchainUnavailable(RuntimeError):
    pass


def real_nki_available() -> bool:
    """True when an installed `nki` package is the real one (PyPI's `nki` 0.0.1 is a placeholder)."""
    try:
        if importlib.util.find_spec("nki") is None:
            return False
        import nki
        import nki.isa  # noqa: F401  (the placeholder has no isa module)
    except (ImportError, ValueError):
        return False
    return hasattr(nki, "jit")


def logical_nc_config() -> int:
    """The host's LNC: $NEURON_LOGICAL_NC_CONFIG, else the trn2 default."""
    value = os.environ.get(LNC_ENV)
    if value is None:
        return DEFAULT_LNC
    if value.strip() not in ("1", "2"):
        raise ToolchainUnavailable(f"{LNC_ENV}={value!r}: the logical NeuronCore config is 1 or 2")
    return int(value)


def neuron_device() -> torch.device:
    """torch.device('neuron'), which TorchNeuron (torch-neuronx) registers when imported."""
    if importlib.util.find_spec("torch_neuronx") is not None:
        import torch_neuronx  # noqa: F401
    try:
        return torch.device("neuron")
    except RuntimeError as exc:
        raise ToolchainUnavailable(
            "the 'neuron' torch device is not registered (install and import torch-neuronx on a Trainium "
            f"host), so kernels cannot receive device tensors: {exc}") from None


class DeviceKernel:
    """A jit kernel called the way nki.jit expects under TorchNeuron: device-resident contiguous
    tensors, launched with the host's LNC; arguments the kernel writes into are copied back when the
    kernel got a copy."""

    def __init__(self, launch: Callable, device: torch.device, written: list[int]) -> None:
        self.launch = launch
        self.device = device
        self.written = written

    def __call__(self, *args):
        moved = [a.to(self.device).contiguous() if isinstance(a, torch.Tensor) else a for a in args]
        result = self.launch(*moved)
        for position in self.written:
            if moved[position] is not args[position]:
                args[position].copy_(moved[position])
        return result


class NeuronToolchain:
    name = "neuron"

    def __init__(self, nki_module=None, device: torch.device | None = None) -> None:
        """`nki_module` / `device`: the installed `nki` and torch.device('neuron') unless given (tests)."""
        if nki_module is None:
            if not real_nki_available():
                raise ToolchainUnavailable(
                    "NEURON_INDUCTOR_TOOLCHAIN=neuron needs the real `nki` package (Neuron SDK >= 2.29) on a "
                    "Trainium host; it is not importable here. Use NEURON_INDUCTOR_TOOLCHAIN=simulator.")
            import nki as nki_module
        self.nki = nki_module
        self.device = device if device is not None else neuron_device()
        self.lnc = logical_nc_config()
        self._adopted: dict[Callable, Callable] = {}

    def build(self, sources: dict[str, str], written: dict[str, list[int]] | None = None,
              grids: dict[str, int] | None = None) -> dict[str, Callable]:
        # Every kernel launches with the host's LNC (the runtime requires it), whatever `grids` says: a
        # kernel that splits its work reads nl.num_programs(0), so it is whole at any LNC.
        kernels: dict[str, Callable] = {}
        for name, source in sources.items():
            digest = hashlib.sha256(source.encode()).hexdigest()[:16]
            filename = f"<neuron_inductor kernel {name} {digest}>"
            # nki.jit reads the kernel's source back through inspect.getsource, which finds it here.
            linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
            namespace: dict = {"__name__": f"neuron_inductor_kernel_{name}", "__file__": filename}
            exec(compile(source, filename, "exec"), namespace)
            kernel = namespace[name]
            launch = kernel[self.lnc] if self.lnc != 1 else kernel
            kernels[name] = DeviceKernel(launch, self.device, list((written or {}).get(name, [])))
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
