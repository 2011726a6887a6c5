"""Compile one static ATen graph: lower -> render kernels and wrapper -> toolchain build.

`compile_static_graph` produces a `CompiledArtifact` (plain text and JSON-able metadata, so the
disk cache can store it), and `Program` loads an artifact into something callable. A kernel that
breaks a hardware rule on its first run is reported by name and rule; where fallback is allowed the
graph is lowered again with that kernel's ops on the host.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from . import sim
from .codegen.render import render_kernel, template_hash
from .codegen.wrapper import render_wrapper
from .lowering.graph import LoweredGraph, lower_graph, op_name
from .lowering.ir import KernelSpec
from .observe import progress
from .observe.accounting import node_flops
from .toolchain import Toolchain

log = logging.getLogger("neuron_inductor")


@dataclass
class CompiledArtifact:
    """Everything needed to run a compiled graph, as text: what the disk cache stores."""

    kernel_sources: dict[str, str]
    wrapper_source: str
    constants: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def _describe_kernel(spec: KernelSpec) -> dict[str, Any]:
    def shape(value) -> list[int]:
        val = value.meta["val"] if isinstance(value, fx.Node) else value
        return [int(s) for s in val.shape]

    return {
        "name": spec.name,
        "family": spec.family,
        "template_hash": template_hash(spec.family),
        "flops": int(spec.flops),
        "inputs": [shape(n) for n in spec.inputs],
        "outputs": [shape(o) for o in spec.outputs],
        "ops": sorted({op_name(o) for o in spec.outputs if isinstance(o, fx.Node)}),
    }


def _kernel_nodes(spec: KernelSpec) -> set[fx.Node]:
    """The graph nodes a kernel computes: everything between its inputs and its outputs."""
    inputs = set(spec.inputs)
    found: set[fx.Node] = set()
    stack = [o for o in spec.outputs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node in found or node in inputs or node.op != "call_function":
            continue
        found.add(node)
        stack.extend(node.all_input_nodes)
    return found


def compile_static_graph(gm: fx.GraphModule, fallback_mode: str,
                         force_fallback: dict[fx.Node, str] | None = None) -> tuple[CompiledArtifact, LoweredGraph]:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    lowered = lower_graph(gm, fallback_mode, force_fallback or {})
    timings["lower"] = time.perf_counter() - start

    start = time.perf_counter()
    sources = {}
    for index, spec in enumerate(lowered.kernels):
        spec.name = f"k{index}_{spec.family}"
        progress.kernel_step("render", index, len(lowered.kernels), spec.name)  # a terminal line (observe/)
        sources[spec.name] = render_kernel(spec)
    wrapper_source, constants = render_wrapper(gm, lowered)
    timings["render"] = time.perf_counter() - start

    meta = {
        "kernels": [_describe_kernel(spec) for spec in lowered.kernels],
        "fallbacks": [{"op": op_name(s.node), "reason": s.reason, "flops": node_flops(s.node)} for s in lowered.fallbacks],
        "views": sum(1 for s in lowered.steps if getattr(s, "kind", None) == "view"),
        "timings": timings,
    }
    return CompiledArtifact(sources, wrapper_source, constants, meta), lowered


class KernelRuleViolation(RuntimeError):
    def __init__(self, kernel: str, error: Exception) -> None:
        super().__init__(f"generated kernel {kernel} breaks a hardware rule: {error}")
        self.kernel = kernel
        self.error = error


class _KernelTable:
    """Kernels by attribute name. A kernel's first call is traced for the cost report and checked
    for rule violations; later calls go straight to the kernel."""

    def __init__(self, kernels: dict[str, Callable], estimates: dict[str, dict], target: str, traced: bool):
        self._estimates = estimates
        self._target = target
        for name, kernel in kernels.items():
            setattr(self, name, self._first_call(name, kernel) if traced and name not in estimates else kernel)

    def _first_call(self, name: str, kernel: Callable) -> Callable:
        def call(*args):
            try:
                with sim.trace() as recorded:
                    result = kernel(*args)
            except sim.NkiError as exc:
                raise KernelRuleViolation(name, exc) from exc
            estimate = recorded.estimate(target=self._target)
            self._estimates[name] = {
                "seconds": estimate.total_seconds,
                "engine_seconds": dict(estimate.engine_seconds),
                "tensor_flops": sum(i.flops for i in recorded.instructions if i.engine == "tensor"),
                "instructions": len(recorded.instructions),
                "dma_bytes": sum(i.bytes for i in recorded.instructions if i.engine == "dma"),
            }
            setattr(self, name, kernel)
            return result

        return call


class Program:
    """A loaded artifact: call with the graph's (static-shape) inputs, get its outputs."""

    def __init__(self, artifact: CompiledArtifact, toolchain: Toolchain, constants: dict[str, torch.Tensor],
                 target: str) -> None:
        self.artifact = artifact
        start = time.perf_counter()  # the 'compile' stage of the compile log (observe/)
        kernels = toolchain.build(artifact.kernel_sources)
        artifact.meta.setdefault("timings", {})["compile"] = time.perf_counter() - start
        estimates = artifact.meta.setdefault("estimates", {})
        self.kernels = _KernelTable(kernels, estimates, target, traced=toolchain.name == "simulator")
        namespace: dict[str, Any] = {}
        exec(compile(artifact.wrapper_source, "<neuron_inductor wrapper>", "exec"), namespace)
        self._run = namespace["run"]
        self._constants = {name: constants[name] for name in artifact.constants}

    @property
    def validated(self) -> bool:
        """True once every kernel has run once without breaking a rule."""
        return set(self.artifact.meta["estimates"]) >= set(self.artifact.kernel_sources)

    def __call__(self, args: list) -> Any:
        return self._run(list(args), self.kernels, self._constants)
