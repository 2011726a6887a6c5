"""Verdicts of the interpreter's rule check, cached across graphs and processes.

Checking a generated kernel (its first run, `toolchain.simulator.FirstUseCheck`, or a run on zeros
at compile time, `SimulatorToolchain.check`) is a pure function of its source, its arguments'
shapes and dtypes, the interpreter's own source and the interpreter settings that change what runs
(target, fp32 storage, strict activation ranges). A kernel that passed is not checked again when the
same kernel appears in another graph or process: its verdict (the cost estimate the check recorded)
is read back. Only passes are stored; a kernel that breaks a rule is checked (and reported) every time.

Verdicts live next to the compiled graphs, in the `checks/` subfolder of the cache folder, as
entries of a `CompileCache` of their own: the same trust rules (private or authenticated), atomic
writes and corruption handling, and their own statistics (not counted as graph compiles).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__, sim
from .cache import CompileCache, source_hash
from .compiler import CompiledArtifact
from .sim import dtypes as sim_dtypes
from .sim import rules as sim_rules

SUBFOLDER = "checks"
BUCKET = "kernel check"


class KernelChecks:
    """The verdict store of one cache folder (None: this process's memory only)."""

    def __init__(self, folder: Path | None, secret: str | None = None) -> None:
        self._entries = CompileCache(folder / SUBFOLDER if folder is not None else None, secret)

    @property
    def stats(self) -> dict[str, Any]:
        return self._entries.stats.as_dict()

    def verdict(self, source: str, args: list[torch.Tensor], target: str, run_check: Callable[[], dict]) -> dict:
        """The stored verdict for `source` on `args`' shapes and dtypes with costs estimated for
        `target`, else `run_check()`'s (which raises on a broken rule, storing nothing)."""
        parts = key_parts(source, args, target)
        artifact, _, _ = self._entries.get_or_compile(
            parts, BUCKET, lambda: (CompiledArtifact({}, "", [], {"verdict": run_check()}), None))
        return artifact.meta["verdict"]

    def clear(self) -> None:
        self._entries.clear()


def key_parts(source: str, args: list[torch.Tensor], target: str) -> dict[str, Any]:
    return {
        "kind": "kernel check",
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "args": [[list(a.shape), str(a.dtype)] for a in args],
        "estimate_target": target,
        "running_target": sim.get_target().name,
        "fp32_storage": os.environ.get(sim_dtypes.FP32_STORAGE_ENV, ""),
        "strict": os.environ.get(sim_rules.STRICT_ENV, ""),
        "interpreter": source_hash(("sim",)),
        "neuron_inductor": __version__,
        "torch": torch.__version__,
    }
