"""Run one AOTAutograd graph: pick the bucket, find or compile its program, run it.

A `GraphRunner` is what the forward, backward or inference compiler returns to AOTAutograd. On
each call it maps the real input sizes to a bucket signature, looks the program up (in this
runner, then in the compile cache), compiles it on a miss, and runs it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch
import torch.fx as fx

from . import bucketing, observe
from .compiler import CompiledArtifact, KernelRuleViolation, Program, compile_static_graph, _kernel_nodes
from .config import NeuronConfig
from .toolchain import select_toolchain

log = logging.getLogger("neuron_inductor")

# Every program compiled or loaded in this process, in order: what `neuron_inductor.report()` reads.
COMPILED_PROGRAMS: list[dict[str, Any]] = []


def graph_structure_hash(gm: fx.GraphModule, example_inputs: list) -> str:
    """Hash of the graph's code and its inputs' dtypes and (possibly symbolic) shapes."""
    digest = hashlib.sha256(gm.code.encode())
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype}{tuple(map(str, value.shape))}".encode())
        else:
            digest.update(f"{type(value).__name__}".encode())
    return digest.hexdigest()[:16]


class GraphRunner:
    def __init__(self, gm: fx.GraphModule, example_inputs: list, config: NeuronConfig, kind: str) -> None:
        self.gm = gm
        self.config = config
        self.kind = kind
        self.symbolic = bucketing.has_symbolic_shapes(example_inputs)
        self.graph_hash = graph_structure_hash(gm, example_inputs)
        self.toolchain = select_toolchain(config.toolchain)
        self.programs: dict[tuple, Program] = {}
        observe.on_graph_runner(self)

    def _signature(self, args: list) -> tuple:
        return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)

    def _compile(self, args: list, signature: tuple) -> Program:
        start = time.perf_counter()
        static_gm = bucketing.specialize(self.gm, args) if self.symbolic else self.gm
        constants = {name: getattr(static_gm, name) for name, _ in static_gm.named_buffers()}
        constants.update({name: getattr(static_gm, name) for name, _ in static_gm.named_parameters()})
        for node in static_gm.graph.nodes:
            if node.op == "get_attr":
                constants[node.target] = getattr(static_gm, node.target)
        artifact, lowered = compile_static_graph(static_gm, self.config.fallback)
        program = Program(artifact, self.toolchain, constants, self.config.target)
        program.static_gm = static_gm
        program.lowered = lowered
        artifact.meta["compile_seconds"] = time.perf_counter() - start
        self._report_fallbacks(artifact)
        COMPILED_PROGRAMS.append({"graph": self.graph_hash, "kind": self.kind, "signature": repr(signature),
                                  "artifact": artifact})
        observe.on_program_compiled(self, program, signature, args)
        return program

    def _report_fallbacks(self, artifact: CompiledArtifact) -> None:
        if self.config.fallback == "warn":
            for fallback in artifact.meta["fallbacks"]:
                log.warning("neuron_inductor: %s runs eagerly on the host (%s)", fallback["op"], fallback["reason"])

    def _recompile_without(self, program: Program, violation: KernelRuleViolation, args: list) -> Program:
        """A kernel broke a hardware rule: run its ops on the host instead (or raise in error mode)."""
        if self.config.fallback == "error":
            raise violation
        log.error("neuron_inductor: %s; its ops run eagerly on the host instead", violation)
        spec = next(s for s in program.lowered.kernels if s.name == violation.kernel)
        reason = f"generated kernel {violation.kernel} broke a hardware rule: {violation.error}"
        force = {node: reason for node in _kernel_nodes(spec)}
        artifact, lowered = compile_static_graph(program.static_gm, self.config.fallback, force)
        fixed = Program(artifact, self.toolchain, program._constants, self.config.target)
        fixed.static_gm, fixed.lowered = program.static_gm, lowered
        return fixed

    def __call__(self, args: list) -> Any:
        args, boxed = list(args), args
        boxed.clear()  # AOTAutograd's boxed convention: the callee frees its inputs
        signature = self._signature(args)
        program = self.programs.get(signature)
        if program is None:
            program = self.programs[signature] = self._compile(args, signature)
        while True:
            try:
                return observe.on_run(self, program, args, lambda: program(args))
            except KernelRuleViolation as violation:
                program = self.programs[signature] = self._recompile_without(program, violation)
