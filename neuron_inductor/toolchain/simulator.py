"""The default toolchain: kernels run in the built-in NKI interpreter on CPU tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import sim
from ..observe import progress


class KernelRuleViolation(RuntimeError):
    def __init__(self, kernel: str, error: Exception) -> None:
        super().__init__(f"generated kernel {kernel} breaks a hardware rule: {error}")
        self.kernel = kernel
        self.error = error


@dataclass(frozen=True)
class KernelCheck:
    """One kernel of a graph as the rule check runs it."""

    name: str
    source: str  # its source up to its name: kernels equal in it and in `args` are checked once
    args: list[torch.Tensor]  # zeros shaped like its run-time arguments
    storable: bool = True  # whether its verdict may be stored and read back (kernel_checks.KernelChecks)


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

    def check(self, kernels: dict[str, Callable], checks: list[KernelCheck], verdicts=None) -> dict[str, dict]:
        """Run every kernel once in the interpreter on zeros of its arguments' shapes and dtypes, before
        any real data reaches it, as the Neuron compiler checks a kernel when it builds it.

        The interpreter enforces the hardware rules (tile and partition limits, buffer capacity,
        engine dtypes), which depend on shapes and dtypes, not on values. The recorded instructions
        give each kernel's cost estimate for this toolchain's target, returned by kernel name. Raises
        `KernelRuleViolation` naming the first kernel that breaks a rule. `verdicts` (a
        `kernel_checks.KernelChecks`) holds kernels that passed before, in this graph or another, in
        this process or an earlier one: those are not run again.
        """
        estimates: dict[str, dict] = {}
        checked: dict[tuple, dict] = {}  # a model's repeated layers repeat kernels: each is run once
        for index, check in enumerate(checks):
            progress.kernel_step("check", index, len(checks), check.name)
            same = (check.source, tuple((tuple(a.shape), a.dtype) for a in check.args))
            if same not in checked:
                def run_check(check=check) -> dict:
                    return self._check_kernel(check.name, kernels[check.name], check.args)

                stored = verdicts is not None and check.storable
                checked[same] = verdicts.verdict(check.source, check.args, self.target.name, run_check) \
                    if stored else run_check()
            estimates[check.name] = checked[same]
        return estimates

    def _check_kernel(self, name: str, kernel: Callable, args: list[torch.Tensor]) -> dict:
        try:
            with sim.trace(isolated=True) as recorded:
                kernel(*args)
        except sim.NkiError as exc:
            raise KernelRuleViolation(name, exc) from exc
        estimate = recorded.estimate(target=self.target.name)
        return {
            "seconds": estimate.total_seconds,
            "engine_seconds": dict(estimate.engine_seconds),
            "tensor_flops": sum(i.flops for i in recorded.instructions if i.engine == "tensor"),
            "instructions": len(recorded.instructions),
            "dma_bytes": sum(i.bytes for i in recorded.instructions if i.engine == "dma"),
        }

    def adopt(self, kernel: Any) -> Callable:
        from ..nki_ops.sources import interpreter_kernel

        return interpreter_kernel(kernel)
