"""Compile one static ATen graph: lower -> render kernels and wrapper -> toolchain build.

`compile_static_graph` produces a `CompiledArtifact` (plain text and JSON-able metadata, so the
disk cache can store it); `compile_and_build` adds the toolchain build and the interpreter's check of
the hardware rules before any kernel's output is used: as each kernel's first run where the graph
allows it, else by running every kernel once on zeros (a kernel that breaks a rule is reported by
name and rule; where fallback is allowed the graph is lowered again with that kernel's ops on the
host). `Program` loads an artifact into something callable.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.fx as fx

from . import index_errors, sim
from .codegen.kernel_args import kernel_dtype, kernel_shape
from .codegen.render import render_kernel, template_hash, unnamed
from .codegen.wrapper import render_wrapper
from .lowering.context import LoweringContext
from .lowering.graph import LoweredGraph, lower_graph, op_name
from .lowering.ir import HostStep, KernelSpec
from .nki_ops import lowering as user_kernels
from .observe import progress
from .observe.accounting import node_flops
from .passes import rms_norm_fusion
from .toolchain import Toolchain
from .toolchain.simulator import KernelCheck, KernelRuleViolation, SimulatorToolchain

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

    user = spec.family == user_kernels.FAMILY
    return {
        "name": spec.name,
        "family": spec.family,
        "template_hash": None if user else template_hash(spec.family),
        "flops": int(spec.flops),
        "inputs": [shape(n) for n in spec.inputs],
        "outputs": [shape(o) for o in spec.outputs],
        "output_dtypes": [str((o.meta["val"] if isinstance(o, fx.Node) else o).dtype) for o in spec.outputs],
        "ops": sorted({op_name(o) for o in spec.outputs if isinstance(o, fx.Node)}),
        "written_arguments": spec.written_arguments,
        "grid": spec.grid,
        "index_bounds": spec.index_bounds,
    }


def written_arguments(artifact: CompiledArtifact) -> dict[str, list[int]]:
    """Per kernel, the positions of the arguments it writes into."""
    return {k["name"]: k.get("written_arguments", []) for k in artifact.meta.get("kernels", [])}


def kernel_grids(artifact: CompiledArtifact) -> dict[str, int]:
    """Per kernel, the programs of its launch (more than 1 when it splits its work over the LNC)."""
    return {k["name"]: k.get("grid", 1) for k in artifact.meta.get("kernels", [])}


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


def compile_static_graph(gm: fx.GraphModule, fallback_mode: str, target: str,
                         force_fallback: dict[fx.Node, str] | None = None,
                         lnc: int | None = None) -> tuple[CompiledArtifact, LoweredGraph]:
    """Lower and render `gm` for `target` (the `target` option) and a logical core of `lnc` physical
    cores (None: the target's default): one LoweringContext reaches every lowering and every template."""
    ctx = LoweringContext.for_target(target, lnc)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    rms_norm_fusion.fuse_rms_norms(gm)  # decomposed RMSNorms -> one kernel each
    lowered = lower_graph(gm, ctx, fallback_mode, force_fallback or {})
    timings["lower"] = time.perf_counter() - start

    start = time.perf_counter()
    sources = {}
    for index, spec in enumerate(lowered.kernels):
        spec.name = f"k{index}_{spec.family}"
        progress.kernel_step("render", index, len(lowered.kernels), spec.name)  # a terminal line (observe/)
        user = spec.family == user_kernels.FAMILY
        sources[spec.name] = user_kernels.source(spec) if user else render_kernel(spec, ctx)
    wrapper_source, constants = render_wrapper(gm, lowered)
    timings["render"] = time.perf_counter() - start

    meta = {
        "kernels": [_describe_kernel(spec) for spec in lowered.kernels],
        "fallbacks": [{"op": op_name(s.node), "reason": s.reason, "flops": node_flops(s.node)} for s in lowered.fallbacks],
        "views": sum(1 for s in lowered.steps if getattr(s, "kind", None) == "view"),
        "collectives": [op_name(s.node) for s in lowered.steps if getattr(s, "kind", None) == "collective"],
        "timings": timings,
        # nki_op kernels: built from the registered op, not from their source (see nki_ops/lowering.py)
        "user_kernels": {spec.name: spec.params for spec in lowered.kernels if spec.family == user_kernels.FAMILY},
    }
    return CompiledArtifact(sources, wrapper_source, constants, meta), lowered


def _check_arguments(spec: KernelSpec) -> list[torch.Tensor]:
    """Zero tensors shaped like the kernel's arguments will be at run time (kernel_args), the output
    buffer of a kernel without inputs included."""
    values = list(spec.inputs) + ([spec.outputs[0]] if spec.output_argument else [])
    vals = [v.meta["val"] if isinstance(v, fx.Node) else v for v in values]
    return [torch.zeros(kernel_shape(val.shape), dtype=kernel_dtype(val.dtype)) for val in vals]


def rule_checks(artifact: CompiledArtifact, lowered: LoweredGraph, skip: set[str] = frozenset()) -> list[KernelCheck]:
    """What the rule check on zeros runs for each of the graph's kernels but those in `skip`."""
    # nki_op kernels run the user's Python beyond their source: their verdicts are never stored
    return [KernelCheck(spec.name, unnamed(artifact.kernel_sources[spec.name], spec.name), _check_arguments(spec),
                        storable=spec.family != user_kernels.FAMILY)
            for spec in lowered.kernels if spec.name not in skip]


def build_kernels(toolchain: Toolchain, artifact: CompiledArtifact) -> dict[str, Callable]:
    """The artifact's kernels as `toolchain` builds them: generated ones from their source, nki_op ones
    as steps running the user's kernels (built by the same toolchain)."""
    users = artifact.meta.get("user_kernels", {})
    kernels = toolchain.build({name: s for name, s in artifact.kernel_sources.items() if name not in users},
                              written_arguments(artifact), kernel_grids(artifact))
    kernels.update(user_kernels.build_steps(users, toolchain))
    return kernels


def rerunnable(lowered: LoweredGraph) -> bool:
    """Whether running the graph again from its inputs after a kernel stopped half-way gives what one
    run gives: no kernel writes into an input and no host step mutates, draws random numbers,
    communicates or has effects."""
    if any(spec.inplace for spec in lowered.kernels):
        return False
    for step in lowered.steps:
        if isinstance(step, HostStep) and step.kind == "collective":
            return False  # the other ranks would not run it again
        if isinstance(step, HostStep) and step.kind == "fallback":
            target = step.node.target
            if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable \
                    or torch.Tag.nondeterministic_seeded in target.tags:
                return False
    return True


def checks_at_first_use(toolchain: Toolchain, target: str, lowered: LoweredGraph) -> bool:
    """Whether the graph's rule check can be its kernels' first run (`FirstUseCheck`) instead of a
    run on zeros at compile time: the interpreter that runs the kernels checks them (the simulator for
    the planned target), no kernel is a user's nki_op (it runs the user's Python beyond its source),
    and a violation can be answered by re-lowering and running the graph again (`rerunnable`). Ranks
    of a distributed job check at compile time: a graph checked at first use is stored only after
    that run, so the other ranks, waiting on its cache key, would each miss and compile it again."""
    return (toolchain.name == "simulator" and toolchain.target.name == target and rerunnable(lowered)
            and not any(spec.family == user_kernels.FAMILY for spec in lowered.kernels)
            and not _one_of_several_ranks())


def _one_of_several_ranks() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def fallback_for(violation: KernelRuleViolation, lowered: LoweredGraph) -> dict[fx.Node, str]:
    """The ops of the kernel that broke a rule, with the reason they now run on the host."""
    spec = next(s for s in lowered.kernels if s.name == violation.kernel)
    reason = f"generated kernel {violation.kernel} broke a hardware rule: {violation.error}"
    return {node: reason for node in _kernel_nodes(spec)}


def _checked_at_first_use(toolchain: SimulatorToolchain, artifact: CompiledArtifact, kernels: dict[str, Callable],
                          verdicts) -> dict[str, Callable]:
    """`kernels` with those listed in `meta[UNCHECKED]` checked at their first use."""
    names = artifact.meta[UNCHECKED]
    sources = {name: unnamed(artifact.kernel_sources[name], name) for name in names}
    return {**kernels, **toolchain.checked_at_first_use({name: kernels[name] for name in names}, sources, verdicts,
                                                        artifact.meta["estimates"], names)}


UNCHECKED = "unchecked"  # artifact.meta: kernels checked at first use that have not run yet


def compile_and_build(gm: fx.GraphModule, fallback_mode: str, toolchain: Toolchain, target: str,
                      verdicts=None, lnc: int | None = None, force: dict[fx.Node, str] | None = None
                      ) -> tuple[CompiledArtifact, LoweredGraph, dict[str, Callable]]:
    """Compile a static graph (the ops in `force` on the host) and build its kernels, each checked
    in the interpreter before its output is used.

    Where `checks_at_first_use` allows, the check is each kernel's first run (`FirstUseCheck`):
    compiling runs none of them; `meta["estimates"]` fills in as they run and `meta[UNCHECKED]`
    lists those that have not run yet (the runtime stores the artifact on disk once it is empty, and
    answers a violation by re-lowering with `fallback_for`). The other kernels, and those whose first
    run can fail on the data (a bounds check on ids: its failure is the user's error, not a broken
    rule), run once on zeros here (kernels with a stored passing verdict in `verdicts` are not run
    again, see `SimulatorToolchain.check`): a kernel that breaks a hardware rule is reported by name
    and rule; where fallback is allowed the graph is lowered again with that kernel's ops on the host
    (and checked again), so no user data ever reaches it. With fallback 'error' the violation is raised.
    """
    force = dict(force or {})
    while True:
        artifact, lowered = compile_static_graph(gm, fallback_mode, target, force, lnc)
        start = time.perf_counter()
        kernels = build_kernels(toolchain, artifact)
        artifact.meta["timings"]["compile"] = time.perf_counter() - start
        first_use = checks_at_first_use(toolchain, target, lowered)
        later = [spec.name for spec in lowered.kernels if first_use and not spec.index_bounds]
        start = time.perf_counter()
        # The interpreter checks the rules before first use whichever toolchain runs the kernels,
        # for the target the kernels were planned for.
        checker = toolchain if toolchain.name == "simulator" and toolchain.target.name == target \
            else SimulatorToolchain(target)
        checked = kernels if checker is toolchain else build_kernels(checker, artifact)
        try:
            artifact.meta["estimates"] = checker.check(checked, rule_checks(artifact, lowered, skip=set(later)),
                                                       verdicts)
        except KernelRuleViolation as violation:
            if fallback_mode == "error":
                raise
            log.error("neuron_inductor: %s; its ops run eagerly on the host instead", violation)
            force.update(fallback_for(violation, lowered))
            continue
        artifact.meta["timings"]["check"] = time.perf_counter() - start
        if later:
            artifact.meta[UNCHECKED] = later
            kernels = _checked_at_first_use(toolchain, artifact, kernels, verdicts)
        return artifact, lowered, kernels


@dataclass(eq=False)
class Program:
    """A loaded artifact: call with the graph's (static-shape) inputs, get its outputs.

    `kernels` holds the artifact's kernels by name: the wrapper calls `kernels.<name>(...)`
    (observers may wrap them for a first call). `static_gm` is the static-shape graph it was
    compiled from and `lowered` its lowering: what observers read; both are None on a cache hit,
    which skips lowering (`static_gm` is kept when the wrapper needs its constants). Build one with
    `Program.load`."""

    artifact: CompiledArtifact
    kernels: SimpleNamespace
    constants: dict[str, torch.Tensor]
    static_gm: fx.GraphModule | None = None
    lowered: LoweredGraph | None = None
    _run: Callable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        namespace: dict[str, Any] = {}
        exec(compile(self.artifact.wrapper_source, "<neuron_inductor wrapper>", "exec"), namespace)
        self._run = namespace["run"]
        # The interpreter's kernels are called past their per-call Dynamo guard (`__call__` calls
        # `launch` under torch._dynamo.disable): the whole program runs under one (`__call__` below).
        kernels = {name: k.launch if isinstance(k, sim.Kernel) else k for name, k in vars(self.kernels).items()}
        # an indexing kernel's failed bounds check reaches the user as eager's exception
        self.kernels = SimpleNamespace(**index_errors.guard_kernels(kernels, self.artifact.meta.get("kernels", [])))

    @classmethod
    def load(cls, artifact: CompiledArtifact, toolchain: Toolchain, constants: dict[str, torch.Tensor],
             kernels: dict[str, Callable] | None = None, static_gm: fx.GraphModule | None = None,
             lowered: LoweredGraph | None = None) -> Program:
        """`kernels` are the artifact's kernels when the caller has just built them (a fresh compile);
        otherwise (a cache hit) `toolchain` builds them from the stored source. `constants` holds at
        least the artifact's constants, by name."""
        if kernels is None:
            kernels = build_kernels(toolchain, artifact)
            if artifact.meta.get(UNCHECKED):  # from memory, before the first run of its compile finished
                kernels = _checked_at_first_use(toolchain, artifact, kernels, None)
        return cls(artifact, SimpleNamespace(**kernels), {name: constants[name] for name in artifact.constants},
                   static_gm, lowered)

    @torch._dynamo.disable(reason="a compiled program runs its kernels and host steps as they are; Dynamo must "
                                  "not trace it (it may run inside a compiled region, as the backward does)")
    def __call__(self, args: list) -> Any:
        return self._run(list(args), self.kernels, self.constants)
