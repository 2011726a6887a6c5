"""Run one AOTAutograd graph: pick the bucket, find or compile its program, run it.

A `GraphRunner` is what the forward, backward or inference compiler returns to AOTAutograd. On
each call it binds the graph's symbols to the real sizes, maps them to a bucket, looks the program
up (in this runner, then in the compile cache's memory and disk tiers), compiles it on a miss, pads
the inputs, runs the program and slices the outputs back to the real sizes.

A symbolic graph is first made pad-safe (`passes.pad_safety`); if that is impossible it runs at
exact shapes instead, and the warning names the op. Activations a forward graph saves for the
backward stay padded (the backward graph runs at the same bucket and recognises them by shape, or
cuts them back to the real sizes when it runs at exact shapes); SymInts handed to the backward
carry the real sizes.

A static graph (`dynamic=False`, or Dynamo's first graph of a frame) runs as it is until
`generalize` finds the symbolic form it is an instance of (from an earlier static graph of the
same structure at another length); then it runs padded to its bucket through that form, sharing
the form's programs with every other length of the family. Such a forward returns its saved
activations at their real sizes, because its backward may be a graph that still runs static.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import bucketing, generalize, nki_ops, observe
from .bucketing import Bucket, BucketPolicy, evaluate, shape_exprs, size_expr
from .cache import base_key_parts, get_cache, key_of
from .compiler import UNCHECKED, CompiledArtifact, Program, compile_and_build, fallback_for
from .config import NeuronConfig
from .lowering.graph import LoweredGraph
from .lowering.registry import VIEW_OPS
from .passes.pad_safety import PadSafeRewrite
from .toolchain import select_toolchain
from .toolchain.simulator import KernelRuleViolation

log = logging.getLogger("neuron_inductor")


def graph_structure_hash(gm: fx.GraphModule, example_inputs: list) -> str:
    """Hash of the graph's code and its inputs' dtypes and (possibly symbolic) shapes."""
    digest = hashlib.sha256(gm.code.encode())
    digest.update(nki_ops.kernels_hash(gm).encode())  # users' kernels: their source, not only their op's name
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype}{tuple(map(str, value.shape))}".encode())
        else:
            digest.update(f"{type(value).__name__}".encode())
    return digest.hexdigest()[:16]


def _value_spec(value) -> Any:
    """What the runtime needs to know about a graph input or output: its symbolic shape or value."""
    if isinstance(value, torch.Tensor):
        return shape_exprs(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return size_expr(value)
    return None


def _output_specs(gm: fx.GraphModule) -> list:
    outputs = _flat_outputs(gm)
    return [_value_spec(o.meta.get("val")) if isinstance(o, fx.Node) else None for o in outputs]


def _flat_outputs(gm: fx.GraphModule) -> list:
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    return list(output_node.args[0]) if isinstance(output_node.args[0], (list, tuple)) else [output_node.args[0]]


def _input_views(gm: fx.GraphModule) -> dict[int, fx.GraphModule]:
    """Outputs that are views of a graph input (through view ops and size arithmetic alone), each as
    a graph that makes it from the inputs.

    AOTAutograd rebuilds an output that aliases an input from the returned tensor's sizes, strides
    and offset, applied to the caller's input. A padded run returns such an output computed at the
    bucket (or gathered by the pad-safety pass), whose strides and offset are not eager's; the view
    made of the real-size input is."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = _flat_outputs(gm)

    def view_chain(node: fx.Node, chain: dict) -> bool:
        if node.op == "placeholder" or node in chain:
            return True
        is_size = isinstance(node.meta.get("val"), (int, torch.SymInt))
        if node.op != "call_function" or not (is_size or node.target in VIEW_OPS or node.target is operator.getitem):
            return False
        if not all(view_chain(arg, chain) for arg in node.all_input_nodes):
            return False
        chain[node] = None
        return True

    views = {}
    for index, node in enumerate(outputs):
        chain: dict[fx.Node, None] = {}
        if isinstance(node, fx.Node) and node.op == "call_function" and view_chain(node, chain):
            graph, env = fx.Graph(), {}
            for placeholder in placeholders:
                env[placeholder] = graph.node_copy(placeholder)
            for needed in chain:  # in dependency order: each node after its inputs
                env[needed] = graph.node_copy(needed, lambda n: env[n])
            graph.output(env[node])
            views[index] = fx.GraphModule(gm, graph)
    return views


def _saved_outputs_start(kind: str, num_outputs: int) -> int:
    """Outputs from this index on are saved for the backward (a forward graph's tail), not user-visible."""
    if kind != "forward":
        return num_outputs
    tracing = torch._guards.TracingContext.try_get()
    metadata = getattr(tracing, "fw_metadata", None) if tracing else None
    return metadata.num_forward_returns if metadata is not None else num_outputs


@dataclass(frozen=True)
class CallPlan:
    """How one call runs: padded to a bucket (through the pad-safe graph) or at exact shapes."""

    mode: str  # "static" | "padded" | "exact"
    bucket: Bucket | None

    @property
    def signature(self) -> tuple:
        return (self.mode, self.bucket.signature if self.bucket else ())

    @property
    def label(self) -> str:
        if self.bucket is None:
            return "static"
        sizes = ",".join(f"{name}={value}" for name, value in self.bucket.signature)
        return sizes if self.mode == "padded" else f"exact {sizes}"


class GraphRunner:
    def __init__(self, gm: fx.GraphModule, example_inputs: list, config: NeuronConfig, kind: str) -> None:
        self.gm = gm
        self.config = config
        self.kind = kind
        self.policy = BucketPolicy.parse(config.buckets)
        self.symbolic = bucketing.has_symbolic_shapes(example_inputs)
        self.graph_hash = graph_structure_hash(gm, example_inputs)
        self.toolchain = select_toolchain(config.toolchain, config.target)
        self.programs: dict[tuple, Program] = {}
        # The record of each program compiled or loaded here that has not run yet (observe/ gets it
        # with the program's first call).
        self._first_calls: dict[tuple, observe.ProgramRecord] = {}
        # Per plan whose kernels broke a rule at their first use: the static graph and the ops it now
        # runs on the host (compiler.fallback_for), for its next compile.
        self._relowered: dict[tuple, tuple[fx.GraphModule, dict]] = {}
        self.input_specs = [_value_spec(v) for v in example_inputs]
        self.input_dtypes = [str(v.dtype) for v in example_inputs if isinstance(v, torch.Tensor)]
        self.output_specs = _output_specs(gm)
        self.saved_from = _saved_outputs_start(kind, len(self.output_specs))
        self.input_views = {i: g for i, g in _input_views(gm).items() if i < self.saved_from}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.mutated_inputs = sorted({placeholders.index(n.args[0]) for n in gm.graph.nodes
                                      if n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders})
        self.symbols = bucketing.bucketed_symbols(example_inputs) if self.symbolic and self.policy.enabled else ()
        self.pad_safety = PadSafeRewrite(gm, self.symbols, f"{kind} graph {self.graph_hash}") if self.symbols else None
        # A static graph's place in its family (see `generalize`); its plan never changes once made.
        self.static_sample = (generalize.Sample.of(gm, kind, f"{config.cache_hash()}|{config.cache_dir}")
                              if not self.symbolic and self.policy.enabled else None)
        self._static_plan: CallPlan | None = None
        if config.raise_recompile_limit:
            bucketing.raise_recompile_limit(self.policy)
        bucketing.watch_recompile_limit()
        self.record = observe.GraphRecord(kind, self.graph_hash, gm, config)  # what observers get of this graph
        observe.on_graph_runner(self.record)

    # -- planning ----------------------------------------------------------------------------

    def plan(self, args: list) -> CallPlan:
        if not self.symbolic:
            if self._static_plan is None:
                self._static_plan = self._plan_static()
            return self._static_plan
        real = bucketing.bind_symbols(self.input_specs, args)
        if self.symbols and self.pad_safety.graph() is not None:
            return CallPlan("padded", bucketing.choose_bucket(self.policy, self.symbols, real))
        return CallPlan("exact", Bucket(real, real))

    def _plan_static(self) -> CallPlan:
        """Padded through the family's symbolic form when there is one (and it pads safely), else as is."""
        sample, self.static_sample = self.static_sample, None  # looked up once
        form = generalize.form_for(sample, self.kind) if sample is not None else None
        if form is None or form.pad_safety.graph() is None:
            return CallPlan("static", None)
        real = form.bindings(sample)
        bucket = bucketing.choose_bucket(self.policy, (form.symbol,), real)
        if not form.holds_at(bucket.padded[form.symbol]):
            log.info("neuron_inductor: %s graph %s: the symbolic form's guards exclude bucket %s; runs at exact "
                     "shapes", self.kind, self.graph_hash, bucket.signature)
            return CallPlan("static", None)
        self._adopt(form)
        return CallPlan("padded", bucket)

    def _adopt(self, form: generalize.SymbolicForm) -> None:
        """Run as an instance of `form`: its shapes, cache keys, pad-safe graph and programs."""
        self.symbols = (form.symbol,)
        self.input_specs = [_value_spec(v) for v in form.example_inputs]
        self.output_specs = _output_specs(form.gm)
        self.saved_from = len(self.output_specs)  # everything leaves at real sizes (see the module doc)
        self.graph_hash = graph_structure_hash(form.gm, form.example_inputs)
        self.pad_safety = form.pad_safety
        self.programs = form.programs

    def graph_for(self, plan: CallPlan) -> fx.GraphModule:
        return self.pad_safety.graph()[0] if plan.mode == "padded" else self.gm

    def padded_sizes(self, plan: CallPlan) -> dict:
        """The symbol values that padded tensors crossing this call carry: its bucket's, or, for an
        exact-shape call, the bucket a padded forward saved its activations at."""
        if plan.mode == "exact":
            return bucketing.choose_bucket(self.policy, self.symbols, plan.bucket.real).padded
        return plan.bucket.padded

    def inputs_for(self, plan: CallPlan, args: list) -> list:
        if plan.bucket is None:
            return args
        real, padded = plan.bucket.real, plan.bucket.padded
        # An unpadded backward still gets the activations of a forward that ran padded at its bucket.
        saved_at = self.padded_sizes(plan) if plan.mode == "exact" else None
        inputs = []
        for spec, arg in zip(self.input_specs, args):
            if isinstance(spec, tuple) and isinstance(arg, torch.Tensor):
                if saved_at is not None and list(arg.shape) == [evaluate(e, saved_at) for e in spec]:
                    arg = bucketing.slice_tensor(arg, spec, real, saved_at)
                inputs.append(bucketing.pad_tensor(arg, spec, real, padded))
            elif spec is not None and not isinstance(spec, tuple):
                inputs.append(evaluate(spec, padded))  # SymInt inputs size the padded graph
            else:
                inputs.append(arg)
        if plan.mode == "padded":
            inputs.extend(extra.value(real, padded) for extra in self.pad_safety.graph()[1])
        return inputs

    def finish(self, plan: CallPlan, outputs, args: list, inputs: list) -> list:
        """Slice user-visible outputs to the real sizes; SymInt outputs get the real values."""
        if plan.bucket is None:
            return outputs
        real, padded = plan.bucket.real, plan.bucket.padded
        for index in self.mutated_inputs:
            if inputs[index] is not args[index]:
                args[index].copy_(bucketing.slice_tensor(inputs[index], self.input_specs[index], real, padded))
        finished = list(outputs)
        for index, (spec, value) in enumerate(zip(self.output_specs, finished)):
            if spec is None:
                continue
            if not isinstance(spec, tuple):
                finished[index] = evaluate(spec, real)
            elif index < self.saved_from and isinstance(value, torch.Tensor):
                finished[index] = bucketing.slice_tensor(value, spec, real, padded)
        if plan.mode == "padded":
            for index, view in self.input_views.items():
                finished[index] = view(*args)
        return finished

    # -- compiling ---------------------------------------------------------------------------

    def key_parts(self, plan: CallPlan) -> dict[str, Any]:
        return {**base_key_parts(self.config), "graph": self.graph_hash, "kind": self.kind, "mode": plan.mode,
                "bucket": [list(item) for item in plan.bucket.signature] if plan.bucket else [],
                "dtypes": self.input_dtypes}

    def _static_gm(self, plan: CallPlan, inputs: list) -> fx.GraphModule:
        return bucketing.specialize(self.graph_for(plan), inputs) if plan.bucket is not None else self.gm

    def _load_program(self, artifact: CompiledArtifact, static_gm: fx.GraphModule | None,
                      kernels: dict | None = None, lowered: LoweredGraph | None = None) -> Program:
        constants = {}
        if artifact.constants:
            constants = {name: getattr(static_gm, name) for name in artifact.constants}
        return Program.load(artifact, self.toolchain, constants, kernels, static_gm, lowered)

    def _compile(self, plan: CallPlan, inputs: list) -> Program:
        start = time.perf_counter()
        static_gm, force = self._relowered.get(plan.signature) or (self._static_gm(plan, inputs), {})
        bucket_seconds = time.perf_counter() - start  # the 'bucket' stage of the compile log (observe/)
        verdicts = get_cache(self.config.cache_dir, self.config.cache_secret).checks
        artifact, lowered, kernels = compile_and_build(static_gm, self.config.fallback, self.toolchain,
                                                       self.config.target, verdicts,
                                                       None if self.config.lnc == "auto" else int(self.config.lnc),
                                                       force)
        artifact.meta["timings"]["bucket"] = bucket_seconds
        program = self._load_program(artifact, static_gm, kernels, lowered)
        artifact.meta["compile_seconds"] = time.perf_counter() - start
        artifact.meta["bucket"] = plan.label
        return program

    def program_for(self, plan: CallPlan, inputs: list, args: list) -> Program:
        program = self.programs.get(plan.signature)
        if program is not None:
            return program
        cache = get_cache(self.config.cache_dir, self.config.cache_secret)
        parts = self.key_parts(plan)
        artifact, program, source = cache.get_or_compile(
            parts, plan.label, lambda: (lambda p: (p.artifact, p))(self._compile(plan, inputs)))
        if program is None:
            static_gm = self._static_gm(plan, inputs) if artifact.constants else None
            program = self._load_program(artifact, static_gm)
        self.programs[plan.signature] = program
        self._report_fallbacks(artifact)  # compiled now or loaded from the cache alike
        record = observe.ProgramRecord(
            graph=self.record, signature=plan.signature, label=plan.label, bucket=plan.bucket,
            crossing_sizes=self.padded_sizes(plan) if plan.bucket is not None else None,
            input_specs=list(self.input_specs), output_specs=list(self.output_specs), key=key_of(parts),
            key_parts=parts, source=source, cache=cache, program=program)
        self._first_calls[plan.signature] = record
        observe.on_program_compiled(record, args)
        return program

    def _report_fallbacks(self, artifact: CompiledArtifact) -> None:
        if self.config.fallback == "warn":
            for fallback in artifact.meta["fallbacks"]:
                log.warning("neuron_inductor: %s runs eagerly on the host (%s)", fallback["op"], fallback["reason"])

    # -- calling -----------------------------------------------------------------------------

    def __call__(self, args: list) -> Any:
        args, boxed = list(args), args
        boxed.clear()  # AOTAutograd's boxed convention: the callee frees its inputs
        plan = self.plan(args)
        inputs = self.inputs_for(plan, args)
        while True:
            program = self.program_for(plan, inputs, args)

            def execute() -> list:
                outputs = program(inputs)
                if UNCHECKED in program.artifact.meta and not program.artifact.meta[UNCHECKED]:
                    self._cache().store_checked(self.key_parts(plan), program.artifact)
                return self.finish(plan, outputs, args, inputs)

            try:
                return observe.on_run(self._first_calls.pop(plan.signature, None), args, execute)
            except KernelRuleViolation as violation:
                self._relower(plan, inputs, program, violation)

    def _cache(self):
        return get_cache(self.config.cache_dir, self.config.cache_secret)

    def _relower(self, plan: CallPlan, inputs: list, program: Program, violation: KernelRuleViolation) -> None:
        """A kernel checked at its first use broke a rule (compiler.FirstUseCheck): raise with fallback
        'error', else compile the plan again with that kernel's ops on the host; the caller runs the
        graph again from its inputs, which none of its kernels writes (compiler.rerunnable)."""
        self.programs.pop(plan.signature, None)
        observe.on_program_dropped(program)
        self._cache().discard(self.key_parts(plan))
        if self.config.fallback == "error":
            raise violation
        if program.lowered is None:  # loaded from memory: the next compile lowers it and finds the kernel again
            return
        log.error("neuron_inductor: %s; its ops run eagerly on the host instead", violation)
        static_gm, force = self._relowered.get(plan.signature) or (program.static_gm, {})
        self._relowered[plan.signature] = (static_gm, {**force, **fallback_for(violation, program.lowered)})
