"""Hugging Face Transformers / TRL: what the neuron backend did during training, and generation on CPU.

Training needs nothing from here: `--torch_compile true --torch_compile_backend neuron` passes accelerate's
`DynamoBackend` check (`NEURON` is a member) and the Trainer compiles with `dynamic=False` for it. This
module adds:

- `compile_summary()` / `format_compile_summary()`: kernels, host fallbacks, share of FLOPs in kernels,
  estimated Trn2 time, compile-cache counters and Dynamo's graph breaks and recompiles, in a few lines;
- `NeuronCompileCallback`: a `TrainerCallback` that prints that summary when training ends;
- `generation_compile_config()`: the `CompileConfig` for `model.generate(..., cache_implementation="static")`.
  Transformers compiles the decoding step only on cuda / xpu / neuron / tpu devices unless the config's
  private `_compile_all_devices` flag is set, so on a CPU host (the interpreter) it must be set.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from transformers import CompileConfig, TrainerCallback


def _graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break reasons in this process (first line of each) with their counts."""
    from torch._dynamo.utils import counters

    breaks: Counter[str] = Counter()
    for reason, count in counters["graph_break"].items():
        breaks[reason.strip().splitlines()[0]] += count
    return dict(breaks)


def compile_summary() -> dict[str, Any]:
    """What the neuron backend compiled and ran in this process so far, as plain data."""
    import neuron_inductor
    from neuron_inductor.cache import cache_stats
    from neuron_inductor.observe import session

    report = neuron_inductor.report()
    stats = cache_stats()
    recompiles = [g.recompile_reason for g in session.DYNAMO_GRAPHS if g.recompile_reason]
    return {
        "graphs": len(session.DYNAMO_GRAPHS),
        "buckets": len(report.buckets),
        "kernels": len(report.kernels),
        "fallbacks": dict(Counter(f["op"] for f in report.fallbacks)),
        "kernel_flop_share": report.kernel_flop_share,
        "estimated_seconds": report.estimated_seconds,
        "cache": {name: stats.get(name, 0) for name in ("compiles", "memory_hits", "disk_hits")},
        "graph_breaks": _graph_breaks(),
        "recompiles": recompiles,
    }


def format_compile_summary(summary: dict[str, Any]) -> str:
    share = summary["kernel_flop_share"]
    seconds = summary["estimated_seconds"]
    fallbacks = ", ".join(f"{op} x{n}" for op, n in sorted(summary["fallbacks"].items())) or "none"
    cache = summary["cache"]
    lines = [
        f"neuron_inductor: {summary['graphs']} Dynamo graph(s), {summary['buckets']} compiled graph bucket(s), "
        f"{summary['kernels']} NKI kernel(s)",
        f"  FLOPs in NKI kernels: {'n/a' if share is None else f'{100 * share:.1f}%'} of the compiled graphs' FLOPs; "
        f"host fallbacks: {fallbacks}",
        f"  estimated Trn2 time of one pass over every compiled graph: "
        f"{'not run yet' if seconds is None else f'{seconds * 1e6:.1f} us'}",
        f"  compile cache: {cache['compiles']} compiled, {cache['memory_hits']} memory hit(s), "
        f"{cache['disk_hits']} disk hit(s)",
    ]
    breaks = summary["graph_breaks"]
    lines.append(f"  Dynamo graph breaks: {sum(breaks.values())}" + ("" if not breaks else ":"))
    lines += [f"    {count} x {reason}" for reason, count in sorted(breaks.items())]
    if summary["recompiles"]:
        lines.append(f"  Dynamo recompiles: {len(summary['recompiles'])} (first: {summary['recompiles'][0]})")
    return "\n".join(lines)


class NeuronCompileCallback(TrainerCallback):
    """Print the compile summary when training ends: `Trainer(..., callbacks=[NeuronCompileCallback()])`."""

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(format_compile_summary(compile_summary()))


def generation_compile_config(**kwargs: Any) -> CompileConfig:
    """`CompileConfig(backend="neuron", **kwargs)` that `generate()` honours on every device (see above)."""
    config = CompileConfig(backend="neuron", **kwargs)
    config._compile_all_devices = True
    return config
