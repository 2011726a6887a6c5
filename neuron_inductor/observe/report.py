"""The compile report: kernels, fallbacks, share of FLOPs in kernels, padding waste, estimated time.

One JSON-able summary per compiled graph bucket (`summarize`, also written as the dump's
`report.json`); a `Report` aggregates summaries from this process (`neuron_inductor.report()`) or
from a dump folder (`neuron-inductor report DUMP_DIR`) and prints them as a table.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from . import perfetto, session

REPORT_FILE = "report.json"
REPORT_FORMAT = 1  # bumped when the summary's keys change; dump_report reads only this format


class DumpError(Exception):
    """A folder is not a readable NEURON_INDUCTOR_DUMP_DIR (missing, empty, or another version's)."""


def summarize(bucket: session.CompiledBucket) -> dict[str, Any]:
    meta = bucket.artifact.meta
    estimates = meta.get("estimates", {})
    kernels = []
    for kernel in meta["kernels"]:
        estimate = estimates.get(kernel["name"], {})
        kernels.append({
            "name": kernel["name"], "family": kernel["family"], "ops": kernel["ops"], "flops": kernel["flops"],
            "inputs": kernel["inputs"], "outputs": kernel["outputs"],
            "estimated_seconds": estimate.get("seconds"), "instructions": estimate.get("instructions"),
            "dma_bytes": estimate.get("dma_bytes"), "engine_seconds": estimate.get("engine_seconds"),
        })
    fallbacks = meta["fallbacks"]  # op, reason, flops (compiler.compile_static_graph)
    kernel_flops = sum(k["flops"] for k in kernels)
    fallback_flops = sum(f["flops"] for f in fallbacks)
    ran = [k["estimated_seconds"] for k in kernels if k["estimated_seconds"] is not None]
    dynamo = bucket.aot.dynamo
    return {
        "format": REPORT_FORMAT,
        "graph": {
            "index": dynamo.index if dynamo else None,
            "function": dynamo.function if dynamo else None,
            "compile_id": dynamo.compile_id if dynamo else None,
            "kind": bucket.aot.kind,
            "graph_hash": bucket.aot.graph_hash,
        },
        "bucket": {"index": bucket.index, "signature": bucket.signature, "label": meta.get("bucket", bucket.signature)},
        "kernels": kernels,
        "fallbacks": fallbacks,
        "views": meta.get("views", 0),
        "collectives": meta.get("collectives", []),  # communication steps, by op
        "flops": {"kernels": kernel_flops, "fallbacks": fallback_flops,
                  "kernel_share": _share(kernel_flops, fallback_flops)},
        "padding": bucket.padding,
        # Kernels only: host fallbacks have no device estimate (nor has the real toolchain).
        "target": bucket.target,
        "estimated_seconds": sum(ran) if len(ran) == len(kernels) and kernels else (0.0 if not kernels else None),
        "timings": {**meta.get("timings", {}), "total": meta.get("compile_seconds")},
        "verify": bucket.verify,
        "cache": bucket.cache,
        "folder": str(bucket.folder) if bucket.folder else None,
    }


def _share(part: float, rest: float) -> float | None:
    return part / (part + rest) if part + rest else None


class Report:
    """Summaries of compiled graph buckets; `str(report)` is the table the CLI prints."""

    def __init__(self, buckets: list[dict[str, Any]], source: str) -> None:
        self.buckets = buckets
        self.source = source

    @property
    def kernels(self) -> list[dict[str, Any]]:
        return [k for b in self.buckets for k in b["kernels"]]

    @property
    def fallbacks(self) -> list[dict[str, Any]]:
        return [f for b in self.buckets for f in b["fallbacks"]]

    @property
    def collectives(self) -> list[str]:
        return [op for b in self.buckets for op in b.get("collectives", [])]

    @property
    def kernel_flop_share(self) -> float | None:
        return _share(sum(b["flops"]["kernels"] for b in self.buckets),
                      sum(b["flops"]["fallbacks"] for b in self.buckets))

    @property
    def padding_waste(self) -> float | None:
        padded = [b["padding"] for b in self.buckets if b["padding"]]
        total = sum(p["padded_elements"] for p in padded)
        return sum(p["padded_elements"] - p["real_elements"] for p in padded) / total if total else None

    @property
    def estimated_seconds(self) -> float | None:
        """Summed device estimate of every bucket's kernels, None if some bucket has not run yet."""
        times = [b["estimated_seconds"] for b in self.buckets]
        return None if None in times else sum(times)

    @property
    def target(self) -> str:
        targets = {b["target"] for b in self.buckets}
        return targets.pop() if len(targets) == 1 else "device"

    @property
    def cache_events(self) -> Counter:
        """How often the compile cache answered 'miss', 'memory hit', 'disk hit'."""
        return Counter(b["cache"]["event"] for b in self.buckets if b.get("cache"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "totals": {
                "buckets": len(self.buckets), "kernels": len(self.kernels), "fallbacks": len(self.fallbacks),
                "collectives": len(self.collectives), "kernel_flop_share": self.kernel_flop_share,
                "padding_waste": self.padding_waste,
                "target": self.target, "estimated_seconds": self.estimated_seconds,
                "cache": dict(self.cache_events),
            },
            "buckets": self.buckets,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_perfetto(self) -> dict[str, Any]:
        """The kernels as a Chrome / Perfetto trace: one slice per kernel launch, one track per engine."""
        return perfetto.from_report(self)

    def write_perfetto(self, path: str | Path) -> Path:
        """Write `to_perfetto()` to `path` (open it in ui.perfetto.dev or chrome://tracing)."""
        return perfetto.write(self.to_perfetto(), path)

    def __str__(self) -> str:
        lines = [f"neuron_inductor report ({self.source}): {len(self.buckets)} compiled graph bucket(s)"]
        for bucket in self.buckets:
            lines += [""] + _bucket_lines(bucket)
        fallback_ops = Counter(f["op"] for f in self.fallbacks)
        listed = ", ".join(f"{op} x{n}" for op, n in sorted(fallback_ops.items()))
        lines += [
            "",
            f"total: {len(self.kernels)} kernel(s), {len(self.fallbacks)} fallback(s)"
            f"{f' ({listed})' if listed else ''}; "
            f"{_communication(self.collectives)}"
            f"FLOPs in kernels {_percent(self.kernel_flop_share)}; padding waste {_percent(self.padding_waste)}; "
            f"estimated {self.target} time {_micros(self.estimated_seconds)}",
        ]
        if self.cache_events:
            lines.append("compile cache: " + ", ".join(f"{n} {event}{'es' if event == 'miss' and n > 1 else ''}"
                                                       for event, n in sorted(self.cache_events.items())))
        return "\n".join(lines)

    __repr__ = __str__


def _communication(collectives: list[str]) -> str:
    """'N communication step(s) (op xn, ...); ' or nothing for a graph without collectives."""
    if not collectives:
        return ""
    listed = ", ".join(f"{op} x{n}" for op, n in sorted(Counter(collectives).items()))
    return f"{len(collectives)} communication step(s) ({listed}); "


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _micros(seconds: float | None) -> str:
    return "not run yet" if seconds is None else f"{seconds * 1e6:.1f} us"


def _bucket_lines(bucket: dict[str, Any]) -> list[str]:
    graph = bucket["graph"]
    padding = bucket["padding"]
    lines = [
        f"graph {graph['index']} {graph['kind']} of {graph['function']}() (Dynamo compile {graph['compile_id']}) "
        f"bucket {bucket['bucket']['index']} ({bucket['bucket']['label']})",
        f"  {len(bucket['kernels'])} kernel(s), {len(bucket['fallbacks'])} fallback(s), {bucket['views']} view(s); "
        f"{_communication(bucket.get('collectives', []))}"
        f"FLOPs in kernels {_percent(bucket['flops']['kernel_share'])}; "
        f"padding waste {_percent(padding['fraction'] if padding else None)}; "
        f"estimated {bucket['target']} time {_micros(bucket['estimated_seconds'])}",
    ]
    if bucket["kernels"]:
        width = max(len(k["name"]) for k in bucket["kernels"])
        lines.append(f"    {'kernel':<{width}}  {'MFLOP':>10}  {'est. us':>9}  {'instr':>6}  ops")
        for k in bucket["kernels"]:
            micros = "-" if k["estimated_seconds"] is None else f"{k['estimated_seconds'] * 1e6:.2f}"
            instructions = "-" if k["instructions"] is None else str(k["instructions"])
            lines.append(f"    {k['name']:<{width}}  {k['flops'] / 1e6:>10.3f}  {micros:>9}  {instructions:>6}  "
                         f"{', '.join(k['ops'])}")
    for f in bucket["fallbacks"]:
        lines.append(f"    fallback {f['op']} ({f['flops'] / 1e6:.3f} MFLOP on the host): {f['reason']}")
    if bucket.get("cache"):
        cached = bucket["cache"]
        lines.append(f"    cache: {cached['event']}" + (f" ({cached['message']})" if "message" in cached else ""))
    if bucket.get("verify"):
        lines.append(f"    verify: {bucket['verify']['message']}")
    return lines


def process_report() -> Report:
    """The graphs compiled (or loaded from the cache) in this process so far."""
    return Report([summarize(b) for b in session.BUCKETS], "this process")


RUN_FILE = "run.json"  # marks one process's folder inside a dump folder (see dump.py)


def newest_run(folder: Path) -> Path | None:
    """The newest run folder directly inside a dump folder (run folder names sort by start time)."""
    runs = sorted(p.parent for p in folder.glob(f"*/{RUN_FILE}"))
    return runs[-1] if runs else None


def dump_report(folder: str | Path, all_runs: bool = False) -> Report:
    """The report of a dump folder: its newest run (or every run with `all_runs`), one run's folder,
    or any folder below it (a graph, a bucket)."""
    root = Path(folder)
    if not root.is_dir():
        raise DumpError(f"{root} is not a folder; pass a NEURON_INDUCTOR_DUMP_DIR folder")
    source = str(root)
    if not all_runs and not (root / RUN_FILE).is_file():
        run = newest_run(root)
        if run is not None:
            root, source = run, f"{run}, the newest run in {folder}"
    files = sorted(root.rglob(REPORT_FILE))
    if not files:
        raise DumpError(f"no {REPORT_FILE} under {root}: is it a NEURON_INDUCTOR_DUMP_DIR folder "
                                "of a process that compiled something?")
    summaries = [json.loads(f.read_text()) for f in files]
    stale = [str(f) for f, summary in zip(files, summaries) if summary.get("format") != REPORT_FORMAT]
    if stale:
        raise DumpError(f"{len(stale)} {REPORT_FILE} file(s) under {root} were written by another "
                                f"neuron_inductor version (this one reads report format {REPORT_FORMAT}), e.g. "
                                f"{stale[0]}; dump again or pass a newer run's folder")
    return Report(summaries, source)
