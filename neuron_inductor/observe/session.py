"""What this process compiled, in order: the records behind `report()`, the dumps and verify, and
the one list of compiled programs (`BUCKETS`) tests and benchmarks count.

A `DynamoGraph` is one graph Dynamo handed to the backend; each of its AOTAutograd graphs
(forward / backward / inference) is run by one `GraphRunner`, and every bucket that runner compiles
(or loads from the cache) becomes a `CompiledBucket`.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DynamoGraph:
    index: int
    function: str  # name of the compiled Python function, as Dynamo recorded it
    code: str  # the Dynamo FX graph as Python source
    compile_id: str | None  # Dynamo's "frame/compile" id: "0/1" is the first recompile of frame 0
    recompile_reason: str | None
    timings: dict[str, float] = field(default_factory=dict)
    last_mark: float = field(default_factory=time.perf_counter)

    def seconds_since_last_mark(self) -> float:
        now = time.perf_counter()
        elapsed, self.last_mark = now - self.last_mark, now
        return elapsed


@dataclass
class AotGraph:
    """One GraphRunner's graph: what its buckets have in common."""

    dynamo: DynamoGraph | None
    kind: str  # "forward" | "backward" | "inference"
    graph_hash: str
    decompose_seconds: float | None
    buckets: list["CompiledBucket"] = field(default_factory=list)

    @property
    def label(self) -> str:
        index = self.dynamo.index if self.dynamo else "?"
        return f"graph {index} {self.kind}"


@dataclass
class CompiledBucket:
    """A program compiled or loaded from the compile cache, in the order the process asked for them."""

    aot: AotGraph
    index: int  # order of compilation within its AotGraph
    signature: str  # the call plan's signature: (mode, bucket sizes)
    plan: str  # the plan as people read it: "static", "s0=128", "exact s0=100"
    source: str  # how the compile cache answered: "compiled" | "memory" | "disk"
    artifact: Any  # compiler.CompiledArtifact (meta["estimates"]: the kernel check's, filled in at first use)
    padding: dict[str, float] | None
    target: str  # hardware generation the estimates are for (config option `target`)
    folder: Path | None = None
    verify: dict[str, Any] | None = None  # the first run's comparison with eager, when enabled
    cache: dict[str, Any] | None = None  # how the compile cache answered: hit or explained miss

    @property
    def label(self) -> str:
        return f"{self.aot.label} bucket {self.index}"


DYNAMO_GRAPHS: list[DynamoGraph] = []
BUCKETS: list[CompiledBucket] = []
# The AotGraph of each live GraphRunner's GraphRecord (weak: a runner Dynamo dropped must not be kept alive).
AOT_GRAPHS: "weakref.WeakKeyDictionary[Any, AotGraph]" = weakref.WeakKeyDictionary()


def current_dynamo_graph() -> DynamoGraph | None:
    """The graph the backend is compiling now: AOTAutograd builds its runners inside that call."""
    return DYNAMO_GRAPHS[-1] if DYNAMO_GRAPHS else None


def clear() -> None:
    """Forget everything recorded so far (tests; `report()` then covers only later compiles)."""
    DYNAMO_GRAPHS.clear()
    BUCKETS.clear()
    AOT_GRAPHS.clear()
