"""The default toolchain: kernels run in the built-in NKI interpreter on CPU tensors."""

from __future__ import annotations

from typing import Any, Callable

from .. import sim


class SimulatorToolchain:
    """Builds kernels for one hardware target: they run with its rules and capacities (SBUF / PSUM
    sizes, matmul limits), as the Neuron compiler builds a kernel for the chip it targets."""

    name = "simulator"

    def __init__(self, target: str = "trn2") -> None:
        self.target = sim.get_target(target)

    def build(self, sources: dict[str, str], written: dict[str, list[int]] | None = None,
              grids: dict[str, int] | None = None) -> dict[str, Callable]:
        # The interpreter writes through the caller's tensors (views included): `written` needs nothing.
        # A kernel that splits its work runs as `grids[name]` programs; one that does not runs once (on
        # hardware both cores run it whole and write the same values: the cost model charges the same).
        kernels: dict[str, Callable] = {}
        for name, source in sources.items():
            kernel = sim.load_kernels(source, f"<neuron_inductor kernel {name}>")[name]
            # generated kernels read no values (no registers): their copy-only runs replay (sim/replay.py)
            grid = (grids or {}).get(name, 1)
            kernels[name] = sim.Kernel(kernel.func, (grid,) if grid != 1 else kernel.grid,
                                       kernel.platform_target or self.target.name, replay=True)
        return kernels

    def adopt(self, kernel: Any) -> Callable:
        from ..nki_ops.sources import interpreter_kernel

        return interpreter_kernel(kernel)
