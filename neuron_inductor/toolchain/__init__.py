"""Toolchains turn rendered NKI source into callables.

- `simulator`: the built-in NKI interpreter (`neuron_inductor.sim`), the default wherever no
  Neuron device exists;
- `neuron`: the real `nki.jit` (see `neuron.py`; small, isolated, untested without hardware).

`NEURON_INDUCTOR_TOOLCHAIN=simulator|neuron` forces one; `auto` picks `neuron` only when the real
`nki` package imports and a Neuron device is present.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Protocol

log = logging.getLogger("neuron_inductor")


class Toolchain(Protocol):
    name: str

    def build(self, sources: dict[str, str], written: dict[str, list[int]] | None = None,
              grids: dict[str, int] | None = None) -> dict[str, Callable]:
        """Compile each kernel's standalone source; returns the kernels by name. `written`: per kernel,
        the positions of the arguments it writes into (a toolchain that copies arguments copies those back).
        `grids`: per kernel, the programs of its launch when it splits its work over the LNC (1 if absent)."""

    def adopt(self, kernel: Any) -> Callable:
        """A user's `@nki.jit` kernel (made by this toolchain's nki or the other's) as this toolchain runs it."""


def neuron_device_present() -> bool:
    return os.path.exists("/dev/neuron0")


def select_toolchain(choice: str, target: str = "trn2") -> Toolchain:
    """The toolchain for `choice`; the interpreter builds kernels for `target` (the real one for the
    device it runs on)."""
    from .simulator import SimulatorToolchain

    if choice == "simulator":
        return SimulatorToolchain(target)
    from .neuron import NeuronToolchain, real_nki_available

    if choice == "neuron":
        return NeuronToolchain()
    if real_nki_available() and neuron_device_present():
        log.info("neuron_inductor: toolchain 'neuron' (real nki.jit on a Neuron device)")
        return NeuronToolchain()
    log.info("neuron_inductor: toolchain 'simulator' (no Neuron device; kernels run in the NKI interpreter)")
    return SimulatorToolchain(target)
