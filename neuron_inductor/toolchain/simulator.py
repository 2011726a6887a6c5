"""The default toolchain: kernels run in the built-in NKI interpreter on CPU tensors."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import sim
from ..codegen.render import unnamed
from ..sim import replay as sim_replay
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


# (source up to its name, grid) -> the func of the first such kernel built and still alive: a kernel
# built again (a repeated layer, in this graph or another) shares its recorded plans
_FIRST_BUILT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


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
            # generated kernels read no values (no registers): their runs replay (sim/replay.py)
            grid = (grids or {}).get(name, 1)
            twin = _FIRST_BUILT.setdefault((unnamed(source, name), grid), kernel.func)
            if twin is not kernel.func:
                sim_replay.share_plans(kernel.func, twin)
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
        return self.verdict_of(recorded)

    def checked_at_first_use(self, kernels: dict[str, Callable], sources: dict[str, str], verdicts,
                             estimates: dict[str, dict], unchecked: list[str]) -> dict[str, Callable]:
        """`kernels` wrapped so that each is checked on its first call, on that call's own arguments:
        the check and the first run are one run (`FirstUseCheck`). `sources`: each kernel's source up
        to its name (its verdict's key, with its arguments' shapes and dtypes); each verdict goes into
        `estimates` by kernel name, and a kernel that passed leaves `unchecked`."""
        return {name: FirstUseCheck(self, name, kernel, sources[name], verdicts, estimates, unchecked)
                for name, kernel in kernels.items()}

    def verdict_of(self, recorded) -> dict:
        """A passing kernel's verdict: the cost estimate of its recorded run for this target."""
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


class FirstUseCheck:
    """A kernel whose rule check is its first run: that run goes through the interpreter's checks on
    the real arguments, and a broken rule raises `KernelRuleViolation` before the kernel returns, so
    no output of a kernel that breaks a rule is ever used. Checking on zeros at compile time and then
    running on the data ran every new kernel twice; the rules depend on shapes and dtypes only, so
    one run is enough. A kernel with a stored passing verdict (`verdicts`) runs straight away. Only
    graphs whose kernels write into no argument the caller sees are checked this way (see
    compiler.py): a kernel that breaks a rule leaves their inputs as they were."""

    def __init__(self, toolchain: SimulatorToolchain, name: str, kernel: Callable, source: str, verdicts,
                 estimates: dict[str, dict], unchecked: list[str]) -> None:
        self.toolchain, self.name, self.kernel, self.source = toolchain, name, kernel, source
        self.verdicts, self.estimates, self.unchecked = verdicts, estimates, unchecked
        self.checked = False

    def __call__(self, *args):
        if self.checked:
            return self.kernel.launch(*args)  # inside a program: see Program.__post_init__
        ran = []

        def run_check() -> dict:
            try:
                with sim.trace() as recorded:  # not isolated: this run is the user's work
                    ran.append(self.kernel(*args))
            except sim.NkiError as exc:
                raise KernelRuleViolation(self.name, exc) from exc
            return self.toolchain.verdict_of(recorded)

        target = self.toolchain.target.name
        verdict = run_check() if self.verdicts is None else self.verdicts.verdict(self.source, list(args), target,
                                                                                  run_check)
        result = ran[0] if ran else self.kernel(*args)  # a stored pass: its check did not run it
        self.estimates[self.name] = verdict
        if self.name in self.unchecked:
            self.unchecked.remove(self.name)
        self.checked = True
        return result
