"""A compiled step as a Chrome / Perfetto trace (JSON "Trace Event Format"): open it in
https://ui.perfetto.dev or chrome://tracing.

One process, "NeuronCore (<target> cost model)", with a track for the kernel launches and one per
engine (TensorE, VectorE, ScalarE, GpSimdE, DMA). Launches run one after another, as the cost model
charges them (cost_model.py): each is one slice on the launch track, and on every engine track a
slice of the launch's busy time on that engine, from the launch's start. With instructions (from an
interpreter trace), each engine's instructions are slices inside it, back to back in program order:
their lengths are the model's costs, their positions a packing, not a schedule.

    neuron-inductor report DUMP_DIR --perfetto step.json       # from the compile report
    neuron_inductor.report().write_perfetto("step.json")
    neuron_inductor.observe.perfetto.write(trace, "step.json", target="trn2")   # a sim.Trace
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from ..sim import cost_model
from ..sim.targets import get_target
from ..sim.tracing import ENGINES

ENGINE_NAMES = {"tensor": "TensorE", "vector": "VectorE", "scalar": "ScalarE", "gpsimd": "GpSimdE", "dma": "DMA"}
LAUNCH_TRACK = 0
PID = 1
# Instruction slices make a file grow by ~150 bytes each: past this many, only launch slices are written.
MAX_INSTRUCTION_SLICES = 200_000


class Launch(NamedTuple):
    name: str
    seconds: float
    engine_seconds: dict
    args: dict
    instructions: list | None = None  # sim Instructions of the launch, if known


def _track(engine: str) -> int:
    return 1 + ENGINES.index(engine)


def _us(seconds: float) -> float:
    return seconds * 1e6


def trace_events(launches: Iterable[Launch], target: str) -> dict[str, Any]:
    """The trace JSON object of `launches` run one after another."""
    target = get_target(target)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "args": {"name": f"NeuronCore ({target.name} cost model)"}},
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": LAUNCH_TRACK, "args": {"name": "kernel launches"}},
        {"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": LAUNCH_TRACK, "args": {"sort_index": 0}},
    ]
    for engine in ENGINES:
        events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": _track(engine),
                       "args": {"name": ENGINE_NAMES[engine]}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": _track(engine),
                       "args": {"sort_index": _track(engine)}})
    start = 0.0
    for index, launch in enumerate(launches):
        events.append({"name": launch.name, "cat": "launch", "ph": "X", "pid": PID, "tid": LAUNCH_TRACK,
                       "ts": _us(start), "dur": _us(launch.seconds),
                       "args": {"launch": index, **launch.args}})
        for engine in ENGINES:
            busy = launch.engine_seconds.get(engine, 0.0)
            if busy <= 0:
                continue
            events.append({"name": launch.name, "cat": "engine", "ph": "X", "pid": PID, "tid": _track(engine),
                           "ts": _us(start), "dur": _us(busy), "args": {"busy_us": _us(busy)}})
        if launch.instructions is not None:
            events += _instruction_slices(launch.instructions, start, target)
        start += launch.seconds
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"target": target.name, "total_us": _us(start), "source": "neuron_inductor cost model"}}


def _instruction_slices(instructions, start: float, target) -> list[dict[str, Any]]:
    cursor = dict.fromkeys(ENGINES, start)
    slices = []
    for ins in instructions:
        seconds = cost_model.instruction_seconds(ins, target)
        slices.append({"name": ins.op, "cat": "instruction", "ph": "X", "pid": PID, "tid": _track(ins.engine),
                       "ts": _us(cursor[ins.engine]), "dur": _us(seconds),
                       "args": {"shapes": [list(o.shape) for o in ins.operands],
                                "dtypes": [o.dtype for o in ins.operands], "bytes": ins.bytes}})
        cursor[ins.engine] += seconds
    return slices


def from_trace(trace, target=None, instructions: bool = True) -> dict[str, Any]:
    """The trace JSON object of an interpreter trace (`with neuron_inductor.sim.trace() as t: ...`), one
    slice per kernel launch, with instruction slices unless `instructions` is False or the trace holds
    more than MAX_INSTRUCTION_SLICES of them."""
    target = get_target(target)
    estimate = trace.estimate(target)
    detailed = instructions and len(trace.instructions) <= MAX_INSTRUCTION_SLICES
    launches = [
        Launch(launch.kernel or "(outside kernels)", launch.seconds, launch.engine_seconds,
               {"instructions": launch.stop - launch.start, "chain_us": _us(launch.chain_seconds),
                "serial_us": _us(launch.serial_seconds), "launch_cost_us": _us(launch.launch_seconds)},
               trace.instructions[launch.start:launch.stop] if detailed else None)
        for launch in estimate.launches
    ]
    return trace_events(launches, target)


def from_report(report) -> dict[str, Any]:
    """The trace JSON object of a compile report: each bucket's kernels in program order, buckets in the
    report's order (forward before backward for a training step). Kernels without an estimate (not run
    yet) are left out and counted in otherData."""
    launches, missing = [], 0
    for bucket in report.buckets:
        graph = bucket["graph"]
        for kernel in bucket["kernels"]:
            if kernel.get("estimated_seconds") is None:
                missing += 1
                continue
            launches.append(Launch(kernel["name"], kernel["estimated_seconds"], kernel.get("engine_seconds") or {},
                                   {"family": kernel["family"], "ops": kernel["ops"], "flops": kernel["flops"],
                                    "graph": f"{graph['index']} {graph['kind']}",
                                    "bucket": bucket["bucket"]["label"]}))
    events = trace_events(launches, report.target if report.target in ("trn1", "trn2", "trn3") else None)
    events["otherData"]["kernels_without_estimate"] = missing
    return events


def write(source, path: str | Path, target=None) -> Path:
    """Write `source` (a sim.Trace, a Report, or a trace JSON object) as a Perfetto / Chrome trace file."""
    if isinstance(source, dict):
        events = source
    elif hasattr(source, "buckets"):
        events = from_report(source)
    else:
        events = from_trace(source, target)
    path = Path(path)
    path.write_text(json.dumps(events))
    return path
