"""A one-line progress display for long compiles ("kernel i of n", stage), only on a terminal.

When stderr is not a terminal (CI, pipes, log files) nothing is printed. On a terminal the line
appears only once a compile has taken longer than `DELAY_SECONDS`, so quick compiles stay quiet,
and it is erased when the compile finishes. Two places feed it: the compiler's render and check
loops (`kernel_step`, the line of the compile in progress) and a bucket's first run
(`KernelProgress`, each kernel's first call).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

DELAY_SECONDS = 0.5


class ProgressLine:
    def __init__(self, label: str, stream: TextIO | None = None, delay: float | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream)
        self.started = time.perf_counter()
        self.delay = DELAY_SECONDS if delay is None else delay
        self.width = 0  # characters currently shown

    def update(self, text: str) -> None:
        if not self.enabled or time.perf_counter() - self.started < self.delay:
            return
        line = f"neuron_inductor: {self.label}: {text}"
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)

    def close(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


_compiling: ProgressLine | None = None


def kernel_step(stage: str, position: int, count: int, name: str) -> None:
    """Progress of the compile under way (called by the compiler per kernel of a stage)."""
    global _compiling
    if _compiling is None:
        _compiling = ProgressLine("compiling")
    _compiling.update(f"{stage}, kernel {position + 1}/{count} ({name})")


def compile_finished() -> None:
    global _compiling
    if _compiling is not None:
        _compiling.close()
        _compiling = None


class KernelProgress:
    """Kernel-call observer (see capture.py): 'first run, kernel 3/12 (k2_matmul)'."""

    def __init__(self, line: ProgressLine) -> None:
        self.line = line

    def before(self, name: str, position: int, count: int, args: tuple) -> Any:
        self.line.update(f"first run, kernel {position + 1}/{count} ({name})")

    def after(self, name: str, state: Any, result: Any) -> None:
        pass
