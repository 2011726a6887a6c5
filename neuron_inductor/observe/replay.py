"""Re-run one dumped kernel in the interpreter and show its trace estimate.

A dumped kernel is `kernels/kN_family.py` (its NKI source plus a `__main__` block calling
`run_kernel_file`) with `kN_family.json` (argument specs) and, when they were small enough,
`kN_family.inputs.pt` / `.outputs.pt` (the first run's tensors). Replays use the saved inputs
(and check the result against the saved outputs, bit for bit: the interpreter is deterministic),
or random inputs of the recorded shapes, strides and dtypes. A kernel file run under the real
`nki.jit` (no interpreter, so no instruction trace) still runs and checks its result.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .. import sim
from .verify import difference


class ReplayError(RuntimeError):
    """The kernel path or its files are not a dumped kernel."""


@dataclass
class Replay:
    kernel: str
    inputs_source: str  # "saved" | "random"
    outputs: list[torch.Tensor]
    estimate: Any  # sim.Estimate; None when the kernel ran under the real nki.jit
    instructions: int
    saved_outputs: list[torch.Tensor] | None

    @property
    def mismatch(self) -> str | None:
        """How the outputs differ from the saved ones (None when they agree or nothing was saved).

        The interpreter is deterministic, so an interpreted replay must match bit for bit; on real
        hardware (no estimate) the outputs need only agree within verify's tolerances."""
        if self.saved_outputs is None or self.inputs_source != "saved":
            return None
        if len(self.outputs) != len(self.saved_outputs):
            return f"{len(self.outputs)} outputs, {len(self.saved_outputs)} saved"
        for position, (got, want) in enumerate(zip(self.outputs, self.saved_outputs)):
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"output {position} is {got.dtype}{list(got.shape)}, saved {want.dtype}{list(want.shape)}"
            if self.estimate is None:
                problem = difference(got.cpu(), want)
                if problem:
                    return f"output {position} differs from the saved output: {problem}"
            elif not _identical(got, want):
                error = (got.double() - want.double()).abs().nan_to_num(0.0).max().item()
                return f"output {position} differs from the saved output by up to {error:.3g}"
        return None

    def summary(self) -> str:
        lines = [f"kernel {self.kernel} on {self.inputs_source} inputs: "
                 + ", ".join(f"out{i} {str(o.dtype).removeprefix('torch.')}{list(o.shape)}"
                             for i, o in enumerate(self.outputs))]
        estimate = self.estimate
        if estimate is not None:
            engines = ", ".join(f"{e} {s * 1e6:.2f} us" for e, s in estimate.engine_seconds.items() if s)
            lines.append(f"estimated {estimate.target} time {estimate.total_seconds * 1e6:.2f} us "
                         f"({estimate.bound}-bound); {self.instructions} instructions; engines: {engines}")
        if self.saved_outputs is not None and self.inputs_source == "saved":
            agreement = "exactly" if self.estimate is not None else "within verify's tolerances"
            lines.append(f"result differs from the saved outputs: {self.mismatch}" if self.mismatch
                         else f"result matches the saved outputs of the compiled run {agreement}")
        return "\n".join(lines)


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def find_kernel(path: str | Path) -> Path:
    """The kernel file for `path`: a kernel .py file, the same without '.py', or FOLDER/KERNEL_NAME
    where FOLDER holds exactly one kernels/KERNEL_NAME.py somewhere below it."""
    given = Path(path)
    for candidate in (given, given.with_name(given.name + ".py")):
        if candidate.is_file() and candidate.with_suffix(".json").is_file():
            return candidate
    folder, name = given.parent, given.name.removesuffix(".py")
    matches = sorted(folder.rglob(f"kernels/{name}.py")) if folder.is_dir() else []
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ReplayError(
            f"no dumped kernel at {path}: pass a kernel file (DUMP_DIR/.../kernels/k0_pointwise.py), the same "
            "without '.py', or DUMP_DIR/KERNEL_NAME when one kernel of that name lies below DUMP_DIR")
    listing = "\n  ".join(str(m) for m in matches)
    raise ReplayError(f"{len(matches)} dumped kernels are named {name} under {folder}; pass one of:\n  {listing}")


def random_inputs(specs: list[dict[str, Any]], seed: int) -> list[torch.Tensor]:
    """Inputs with the recorded shapes, strides and dtypes: normal floats, zero integers (valid as indices)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for spec in specs:
        dtype = getattr(torch, spec["dtype"])
        shape, stride = spec["shape"], spec["stride"]
        extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
        if dtype.is_floating_point:
            base = torch.randn(extent, generator=generator).to(dtype)
        else:
            base = torch.zeros(extent, dtype=dtype)
        tensors.append(base.as_strided(shape, stride))
    return tensors


def replay(kernel_file: str | Path, kernel: Callable | None = None, *, random: bool = False, seed: int = 0,
           target: str | None = None) -> Replay:
    """Run the kernel of a dumped kernel file under an instruction trace. `kernel` is the already
    loaded kernel (the file's `__main__` block passes it); otherwise the file is loaded here."""
    path = Path(kernel_file)
    name = path.stem
    spec_file = path.with_suffix(".json")
    if not spec_file.is_file():
        raise ReplayError(f"{path} has no {spec_file.name} beside it: not a kernel from NEURON_INDUCTOR_DUMP_DIR")
    specs = json.loads(spec_file.read_text())
    if kernel is None:
        kernel = sim.load_kernels(path.read_text(), str(path))[name]
    saved_inputs = path.with_name(f"{name}.inputs.pt")
    saved_outputs = path.with_name(f"{name}.outputs.pt")
    use_saved = saved_inputs.is_file() and not random
    args = torch.load(saved_inputs) if use_saved else random_inputs(specs["inputs"], seed)
    with sim.trace() as recorded:
        result = kernel(*args)
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    interpreted = isinstance(kernel, sim.Kernel)
    return Replay(
        kernel=name,
        inputs_source="saved" if use_saved else "random",
        outputs=outputs,
        estimate=recorded.estimate(target) if interpreted else None,
        instructions=len(recorded.instructions),
        saved_outputs=torch.load(saved_outputs) if saved_outputs.is_file() else None,
    )


def run_kernel_file(kernel_file: str, kernel: Callable) -> None:
    """The `__main__` block of a dumped kernel: replay, print, exit 1 if the saved result is not reproduced."""
    result = replay(kernel_file, kernel)
    print(result.summary())
    if result.mismatch:
        sys.exit(1)
