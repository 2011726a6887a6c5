"""The kernel IR: what a lowering hands to code generation.

A lowered graph is a list of steps executed in order by the host wrapper:
- `KernelStep`: one generated NKI kernel (rendered from a template family) computing some graph
  values from others;
- `HostStep`: an ATen call run on the host: a *view* (metadata only: view, permute, expand,
  slice, ...; no data moves, kernels read through the strides), an *alloc* (an uninitialised
  buffer), a *scalar* (arithmetic and checks on sizes), a *constant*, or a *fallback* (an op
  without a lowering, run eagerly and reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


class Unsupported(Exception):
    """Raised by a lowering for arguments it does not handle; the node falls back with this reason."""


@dataclass
class KernelSpec:
    """One kernel to generate.

    family:  template file stem, `codegen_templates/<family>.py.j2`.
    params:  the template context besides the argument descriptions: plain, deterministic data
             (ints, floats, strings, bools, lists, tuples, dicts) that fully determines the source.
    inputs:  graph values passed to the kernel as HBM tensors, in order.
    outputs: graph values the kernel returns, in order; an output nobody uses may be given as its
             value metadata (a FakeTensor, e.g. `node.meta["val"][i]` of a multi-output op).
    inplace: for kernels that write into an input instead of returning (copy_ into a graph input):
             maps an output position to the input position it aliases.
    flops:   analytic FLOPs of the math this kernel does (TensorE FLOPs for matmul-like kernels).
    grid:    programs of its SPMD launch: the context's lnc when the kernel splits its work over
             nl.program_id(0) (lowering/lnc.py), else 1.
    index_bounds: for an indexing kernel with a bounds check, what its failure tells the user
             (index_errors.py: op, dims, sizes, whether negative ids count from the end, exception).
    """

    family: str
    params: dict[str, Any]
    inputs: list[fx.Node]
    outputs: list[fx.Node | torch.Tensor]
    flops: int = 0
    inplace: dict[int, int] = field(default_factory=dict)
    grid: int = 1
    index_bounds: dict[str, Any] | None = None
    name: str = ""  # assigned by code generation: k<index>_<family>

    @property
    def output_argument(self) -> bool:
        """A kernel without inputs takes its first output as an argument (allocated by the host):
        nki.jit detects the framework from the kernel's tensor arguments."""
        return not self.inputs and bool(self.outputs)

    @property
    def written_arguments(self) -> list[int]:
        """Positions of the arguments the kernel writes into."""
        return [0] if self.output_argument else sorted(set(self.inplace.values()))


@dataclass
class KernelStep:
    spec: KernelSpec


@dataclass
class HostStep:
    node: fx.Node
    kind: str  # "view" | "alloc" | "fallback" | "constant" | "collective" | "scalar" (Python arithmetic on sizes)
    reason: str = ""


Step = KernelStep | HostStep
