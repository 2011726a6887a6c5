"""What the pipeline hands observers: records the runtime builds once, so that nothing in observe/
calls back into the runner (to re-plan a call or recompute its cache key).

- `GraphRecord`: one AOTAutograd graph (forward / backward / inference) as its `GraphRunner` is
  built: the ATen graph and the options it compiles under.
- `ProgramRecord`: a bucket's program, compiled now or loaded from the compile cache, with the plan
  of the call that asked for it (its bucket sizes), the cache key and how the cache answered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from .. import bucketing
from ..bucketing import Bucket
from ..config import NeuronConfig

if TYPE_CHECKING:
    from ..compiler import Program


@dataclass(frozen=True, eq=False)
class GraphRecord:
    """One AOTAutograd graph. Compared by identity: observers key their per-graph records by it."""

    kind: str  # "forward" | "backward" | "inference"
    graph_hash: str
    gm: fx.GraphModule  # the ATen graph the runner was given (dumps, the eager reference)
    config: NeuronConfig


@dataclass(frozen=True, eq=False)
class ProgramRecord:
    graph: GraphRecord
    signature: tuple  # the call plan's signature: (mode, bucket sizes)
    label: str  # the plan as people read it: "static", "s0=128", "exact s0=100"
    bucket: Bucket | None  # the call's real and padded symbol values (None: a static call)
    # The symbol values padded tensors crossing this call carry: the bucket's, or for an exact-shape
    # call the bucket a padded forward saved its activations at (None: a static call).
    crossing_sizes: dict | None
    input_specs: list  # per input: its symbolic shape, a size expression, or None
    output_specs: list
    key: str  # the compile-cache key
    key_parts: dict[str, Any]
    source: str  # how the cache answered: "compiled" | "memory" | "disk"
    cache: Any  # the cache.CompileCache that answered (a miss is explained against its entries)
    program: Program

    def real_sized(self, values: list, specs: list) -> list:
        """`values` (the call's inputs or outputs) with bucket-padded tensors cut to their real sizes.

        Padded tensors cross graph boundaries: a forward returns the activations it saves for the
        backward still padded, and the backward receives them so. Eager comparisons and padding
        counts need the real sizes.
        """
        if self.bucket is None:
            return values

        def cut(value: Any, spec: Any) -> Any:
            if isinstance(value, torch.Tensor) and isinstance(spec, tuple):
                return bucketing.slice_tensor(value, spec, self.bucket.real, self.crossing_sizes)
            return value

        return [cut(value, spec) for value, spec in zip(values, specs)]

    def real_inputs(self, args: list) -> list:
        return self.real_sized(args, self.input_specs)

    def padding(self, real_args: list) -> dict[str, float] | None:
        """Elements the bucket adds to the inputs that have bucketed dims (None when the call is not padded)."""
        if self.bucket is None:
            return None
        real = padded = 0
        for arg, spec in zip(real_args, self.input_specs):
            if isinstance(arg, torch.Tensor) and isinstance(spec, tuple) and any(
                    getattr(e, "free_symbols", None) for e in spec):
                real += arg.numel()
                padded += math.prod(bucketing.evaluate(e, self.bucket.padded) for e in spec)
        return {"real_elements": real, "padded_elements": padded,
                "fraction": (padded - real) / padded if padded else 0.0}
