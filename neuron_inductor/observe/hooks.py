"""The calls the pipeline makes into observe/ (one line each in backend.py and runtime.py).

- `on_dynamo_graph(gm, example_inputs, config)`: the backend received a Dynamo graph;
- `on_graph_runner(graph)`: AOTAutograd produced a forward / backward / inference graph (a
  `GraphRecord`);
- `on_program_compiled(record, args)`: a bucket was compiled or loaded (a `ProgramRecord`: the
  plan, the cache key and its parts, the graphs and the program);
- `on_program_dropped(program)`: the runtime dropped a program whose kernel broke a hardware rule at
  its first use (its plan is lowered again);
- `on_run(record, args, execute)`: runs a call; on a program's first call (the runtime hands its
  record with it) it also captures kernel tensors for the dump, shows progress, verifies against
  eager and finishes the bucket's report. Later calls (record None) just run.
Observers read the records they are given and never call back into the runtime (records.py).

Observing never breaks a compile or a run: an unexpected error in here is logged as a warning and
the pipeline goes on. Only the errors that are the point of a feature propagate: a bad flag value
(ConfigError) and a verify mismatch in 'raise' mode (VerifyError).
"""

from __future__ import annotations

import functools
import shutil
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
import torch.fx as fx

from ..config import ConfigError
from . import cache_events, capture, dump, progress, session, verify
from .logs import log, log_stage_timings
from .records import GraphRecord, ProgramRecord
from .report import REPORT_FILE, summarize

if TYPE_CHECKING:
    from ..compiler import Program


Hook = TypeVar("Hook", bound=Callable[..., Any])


def _not_fatal(hook: Hook) -> Hook:
    @functools.wraps(hook)
    def guarded(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except (ConfigError, verify.VerifyError):
            raise
        except Exception:
            log.warning("neuron_inductor: observing the compile failed in %s; compiling and running go on "
                        "without it", hook.__name__, exc_info=True)
            return None

    return guarded  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Dynamo and AOTAutograd graphs


def _dynamo_frame() -> tuple[str, float | None, str | None]:
    """(function name, seconds Dynamo has spent on this frame so far, recompile reason) — best effort:
    these come from Dynamo internals that may change between torch versions."""
    function, trace_seconds, reason = "graph", None, None
    tracing = torch._guards.TracingContext.try_get()
    if tracing is not None and getattr(tracing, "traced_code", None):
        function = tracing.traced_code[0].co_name
    try:
        metrics = torch._dynamo.utils.get_metrics_context()
        if metrics.in_progress():
            trace_seconds = (time.time_ns() - metrics._start_time_ns) / 1e9
            reason = metrics._metrics.get("recompile_reason")
    except (AttributeError, RuntimeError):
        pass
    return function, trace_seconds, reason


@_not_fatal
def on_dynamo_graph(gm: fx.GraphModule, example_inputs: list, config: Any) -> None:
    function, trace_seconds, reason = _dynamo_frame()
    compile_id = torch._guards.CompileContext.current_compile_id()
    graph = session.DynamoGraph(
        index=len(session.DYNAMO_GRAPHS), function=function,
        code=gm.print_readable(print_output=False, include_stride=True) if config.dump_dir else "",
        compile_id=str(compile_id) if compile_id else None, recompile_reason=reason)
    if trace_seconds is not None:
        graph.timings["trace"] = trace_seconds
    session.DYNAMO_GRAPHS.append(graph)
    recompiles = getattr(compile_id, "frame_compile_id", 0) or 0
    # The first recompile of a frame is usually Dynamo switching to dynamic shapes; later ones are
    # the start of a recompile storm (each costs a full compile) and deserve attention.
    if recompiles:
        log.log(30 if recompiles >= 2 else 20, "neuron_inductor: recompiling %s (compile %s; recompile %d of this "
                "frame): %s", function, graph.compile_id, recompiles, reason or "reason unknown")
    log.debug("neuron_inductor: graph %d (%s, compile %s): Dynamo captured %d nodes in %s", graph.index, function,
              graph.compile_id, len(gm.graph.nodes),
              f"{trace_seconds:.3f}s" if trace_seconds is not None else "unknown time")


@_not_fatal
def on_graph_runner(graph: GraphRecord) -> None:
    dynamo = session.current_dynamo_graph()
    # AOTAutograd traces, decomposes and partitions before it calls the first compiler; a backward
    # compiled later (lazily) has no decompose time of its own.
    first = dynamo is not None and not any(aot.dynamo is dynamo for aot in session.AOT_GRAPHS.values())
    seconds = dynamo.seconds_since_last_mark() if first else None
    aot = session.AotGraph(dynamo, graph.kind, graph.graph_hash, seconds)
    session.AOT_GRAPHS[graph] = aot
    if seconds is not None:
        log.debug("neuron_inductor: %s: AOTAutograd traced, decomposed and partitioned it in %.3fs "
                  "(decompose stage)", aot.label, seconds)


def _aot_graph(graph: GraphRecord) -> session.AotGraph:
    aot = session.AOT_GRAPHS.get(graph)
    if aot is None:  # recorded before session.clear(), or a runner built outside the backend (tests, tools)
        aot = session.AOT_GRAPHS[graph] = session.AotGraph(None, graph.kind, graph.graph_hash, None)
    return aot


# ---------------------------------------------------------------------------------------------
# Compiled buckets


# The bucket of each program record whose program has not had its first call yet (weak: a record
# the runtime dropped vanishes).
_PENDING: "weakref.WeakKeyDictionary[ProgramRecord, session.CompiledBucket]" = weakref.WeakKeyDictionary()
# The bucket of each program (for `on_program_dropped`).
_BUCKET_OF: "weakref.WeakKeyDictionary[Program, session.CompiledBucket]" = weakref.WeakKeyDictionary()


@_not_fatal
def on_program_compiled(record: ProgramRecord, args: list) -> None:
    """`args` are the call's real (unpadded) inputs."""
    aot = _aot_graph(record.graph)
    config = record.graph.config
    program, artifact = record.program, record.program.artifact
    real_args = record.real_inputs(args)
    bucket = session.CompiledBucket(aot=aot, index=len(aot.buckets), signature=repr(record.signature),
                                    plan=record.label, source=record.source, artifact=artifact,
                                    padding=record.padding(real_args), target=config.target)
    aot.buckets.append(bucket)
    session.BUCKETS.append(bucket)
    bucket.cache = cache_events.note_lookup(record.cache, bucket.label)
    progress.compile_finished()
    meta = artifact.meta
    log.info("neuron_inductor: %s compiled: %d kernel(s), %d fallback(s), %d view(s) in %.3fs", bucket.label,
             len(meta["kernels"]), len(meta["fallbacks"]), meta.get("views", 0), meta.get("compile_seconds", 0.0))
    # Dynamo's and AOTAutograd's stages count once, with the first bucket compiled from their graph.
    first_of_graph = aot.dynamo is not None and not any(b.aot.dynamo is aot.dynamo for b in session.BUCKETS[:-1])
    graph_timings = {**aot.dynamo.timings, "decompose": aot.decompose_seconds} if first_of_graph else {}
    log_stage_timings(bucket.label, {**{k: v for k, v in graph_timings.items() if v is not None},
                                             **meta.get("timings", {})})
    if config.dump_dir:
        bucket.folder = dump.bucket_folder(bucket, config)
        dump.write_bucket(
            bucket.folder, dynamo_code=aot.dynamo.code if aot.dynamo else None, aten_gm=record.graph.gm,
            lowered_gm=program.static_gm, artifact=artifact,
            bucket_info={"signature": bucket.signature, "real_input_shapes": _shapes(real_args),
                         "compiled_input_shapes": _compiled_shapes(program), "padding": bucket.padding,
                         "bucket_policy": config.buckets},
            cache_key={"key": record.key, "parts": record.key_parts})
        _write_report(bucket)
        log.info("neuron_inductor: %s dumped to %s", bucket.label, bucket.folder)
    _PENDING[record] = bucket
    _BUCKET_OF[program] = bucket


@_not_fatal
def on_program_dropped(program: Program) -> None:
    """The runtime dropped `program`: one of its kernels broke a hardware rule at its first use
    (compiler.FirstUseCheck) and its plan is lowered again. Its bucket (and dump folder) goes, so
    that the session reads as if the plan had been lowered the safe way from the start."""
    bucket = _BUCKET_OF.pop(program, None)
    if bucket is None:
        return
    session.BUCKETS[:] = [b for b in session.BUCKETS if b is not bucket]
    bucket.aot.buckets[:] = [b for b in bucket.aot.buckets if b is not bucket]
    if bucket.folder is not None:
        shutil.rmtree(bucket.folder, ignore_errors=True)


def _shapes(args: list) -> list[list[int] | None]:
    return [list(a.shape) if isinstance(a, torch.Tensor) else None for a in args]


def _compiled_shapes(program: Program) -> list[list[int] | None] | None:
    static_gm = program.static_gm
    if static_gm is None:
        return None
    return _shapes([n.meta.get("val") for n in static_gm.graph.nodes if n.op == "placeholder"])


def _write_report(bucket: session.CompiledBucket) -> None:
    dump.write_json(bucket.folder / REPORT_FILE, summarize(bucket))


# ---------------------------------------------------------------------------------------------
# First run


def on_run(record: ProgramRecord | None, args: list, execute: Callable[[], Any]) -> Any:
    """`execute()` runs the call (pad, program, slice) on the real inputs `args` and returns the outputs.
    `record` is given with the first call of its program (None for later calls)."""
    bucket = _PENDING.pop(record, None) if record is not None else None
    if bucket is None:
        return execute()
    started = _start_first_run(record, bucket, args)
    start = time.perf_counter()
    try:
        outputs = execute()
    finally:
        if started is not None:
            started[0].close()
    _finish_first_run(record, bucket, args, outputs, time.perf_counter() - start, started[1] if started else None)
    return outputs


@_not_fatal
def _start_first_run(record: ProgramRecord, bucket: session.CompiledBucket,
                     args: list) -> tuple[progress.ProgressLine, verify.Reference | None]:
    """Watch the kernels' first calls; compute the eager reference before inputs are mutated."""
    program = record.program
    observers: list[capture.KernelCallObserver] = []
    if bucket.folder is not None:
        observers.append(dump.KernelSaver(bucket.folder, bucket.artifact.meta["kernels"]))
    line = progress.ProgressLine(bucket.label)
    observers.append(progress.KernelProgress(line))
    capture.watch_first_calls(program.kernels, list(program.artifact.kernel_sources), observers)
    reference = None
    if record.graph.config.verify != "off":
        reference = verify.eager_reference(record.graph.gm, record.real_inputs(args))
    return line, reference


@_not_fatal
def _finish_first_run(record: ProgramRecord, bucket: session.CompiledBucket, args: list, outputs: Any,
                      seconds: float, reference: verify.Reference | None) -> None:
    program = record.program
    bucket.artifact.meta.setdefault("timings", {})["first_run"] = seconds
    log.debug("neuron_inductor: %s first run in %.3fs", bucket.label, seconds)
    try:
        if reference is not None:
            listed = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
            listed = record.real_sized(listed, record.output_specs)
            inputs_after = record.real_inputs(args)
            producers = verify.output_producers(program.lowered, program.static_gm)
            checked, mismatch = verify.compare(reference, listed, inputs_after, producers)
            bucket.verify = verify.report(bucket.label, record.graph.config.verify, checked, mismatch)
    finally:
        if bucket.folder is not None:
            _write_report(bucket)
