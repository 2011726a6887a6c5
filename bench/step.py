"""A realistic training step through the backend, timed by the cost model: one Llama-style layer in bf16,
forward and backward, at the sizes users train.

    python bench/step.py                     # d2048: d=2048, S=2048, vocab 32000, 16/8 heads, SwiGLU 5632
    python bench/step.py --config llama3-8b-layer [--seq 2048]   # one Llama-3-8B decoder layer, no vocabulary
    python bench/step.py --config quick      # small, for tests
    python bench/step.py --lnc 1             # kernels for one physical core (default: trn2's LNC=2)
    python bench/step.py --perfetto step.json --json step_report.json

It compiles `model(ids, labels).backward()` (or a decoder layer's `mean(out^2).backward()`) with
backend="neuron", runs it once in the NKI interpreter (the compile checks every kernel there and
records its estimate; see SimulatorToolchain.check) and reports, from the compiled programs:

- the estimated step time: the sum over kernel launches of each launch's estimate (cost_model.py:
  busiest engine + serial term, or the dependency chain, + a fixed launch cost; nothing overlaps
  across kernels), and host fallbacks (which have no device estimate and are listed);
- MFU: useful FLOPs / (step time x the logical NeuronCore's dense BF16 peak): lnc x 79 TF/s, i.e.
  158 TF/s at trn2's default LNC=2 (the step occupies both physical cores, whether or not a kernel
  splits its work over them) and 79 TF/s with --lnc 1;
- a table per kernel family: launches, estimated ms, share of the step, TensorE GFLOP;
- TensorE FLOPs (every nc_matmul / TensorE transpose the kernels executed) against the useful FLOPs:
  FlopCounterMode's count of the eager step (run on the meta device), less the causal-masked half of
  attention's (the model's only bmm), which a flash kernel rightly skips.

The interpreter runs every instruction on the CPU: d2048 takes many minutes of CPU, the 8B layer
more (run them with `nice`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from neuron_inductor.observe import perfetto, session
from neuron_inductor.sim import get_target
from neuron_inductor.testing import Block, TinyLlama, TinyLlamaConfig, rotary_tables

aten = torch.ops.aten
TARGET = "trn2"


@dataclass(frozen=True)
class StepConfig:
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    seq: int
    vocab_size: int | None  # None: one decoder layer on hidden states, no embedding or LM head
    batch: int = 1


CONFIGS = {
    "d2048": StepConfig(dim=2048, ffn_dim=5632, n_heads=16, n_kv_heads=8, seq=2048, vocab_size=32000),
    "llama3-8b-layer": StepConfig(dim=4096, ffn_dim=14336, n_heads=32, n_kv_heads=8, seq=4096, vocab_size=None),
    "quick": StepConfig(dim=256, ffn_dim=704, n_heads=4, n_kv_heads=2, seq=256, vocab_size=1000),
}


class LayerStep(nn.Module):
    """One decoder layer on hidden states: `model(x)` -> mean(layer(x)^2), a loss with a dense gradient."""

    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.block = Block(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = (t.to(x.dtype) for t in rotary_tables(x.shape[1], self.cfg.head_dim, self.cfg.rope_theta,
                                                         x.device))
        return self.block(x, cos, sin).float().square().mean()


def _model_config(config: StepConfig) -> TinyLlamaConfig:
    return TinyLlamaConfig(vocab_size=config.vocab_size or 2, dim=config.dim, n_layers=1, n_heads=config.n_heads,
                           n_kv_heads=config.n_kv_heads, ffn_dim=config.ffn_dim)


def build(config: StepConfig, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    cfg = _model_config(config)
    with torch.device(device):
        if config.vocab_size is None:
            model = LayerStep(cfg).to(torch.bfloat16)
            x = torch.randn(config.batch, config.seq, config.dim, dtype=torch.bfloat16) if device != "meta" else \
                torch.empty(config.batch, config.seq, config.dim, dtype=torch.bfloat16)
            return model, (x,)
        model = TinyLlama(cfg).to(torch.bfloat16)
        ids = torch.randint(0, config.vocab_size, (config.batch, config.seq),
                            generator=torch.Generator().manual_seed(0)) if device != "meta" else \
            torch.zeros(config.batch, config.seq, dtype=torch.long)
        return model, (ids, ids)


def useful_flops(config: StepConfig) -> float:
    """Matmul FLOPs of the eager step (counted on the meta device) less the causal half of attention's."""
    model, args = build(config, "meta")
    with FlopCounterMode(display=False) as counter:
        model(*args).backward()
    by_op = counter.get_flop_counts()["Global"]
    attention = by_op.get(aten.bmm, 0)  # the model's only bmm: SDPA's math path on meta
    return counter.get_total_flops() - attention / 2


def run_step(config: StepConfig, lnc: int) -> list:
    """Compile (for a logical core of `lnc` physical cores) and run one step; -> the compiled programs
    (session.CompiledBucket: forward, backward) in run order."""
    torch._dynamo.reset()
    model, args = build(config)
    compiled = torch.compile(model, backend="neuron", options={"lnc": str(lnc)})
    first = len(session.BUCKETS)
    compiled(*args).backward()
    return session.BUCKETS[first:]


def launches(programs: list) -> list[dict]:
    """Every kernel launch of the step, in program order, with its estimate."""
    out = []
    for program in programs:
        meta = program.artifact.meta
        for kernel in meta["kernels"]:
            estimate = meta["estimates"][kernel["name"]]
            out.append({"program": program.aot.kind, "name": kernel["name"], "family": kernel["family"],
                        "ops": kernel["ops"], "seconds": estimate["seconds"],
                        "engine_seconds": estimate["engine_seconds"], "tensor_flops": estimate["tensor_flops"]})
    return out


EMBEDDING_OPS = ("aten.embedding.default", "aten.embedding_dense_backward.default")
# Issue 15's goals for the d2048 step: MFU, embedding share of the step, TensorE over useful FLOPs.
GOALS = {"mfu": 0.60, "embedding_share": 0.02, "tensor_over_useful": 1.05}


def summarize(config: StepConfig, programs: list, useful: float, wall: float, lnc: int) -> dict:
    step = launches(programs)
    seconds = sum(k["seconds"] for k in step)
    embedding = sum(k["seconds"] for k in step if any(op in EMBEDDING_OPS for op in k["ops"]))
    tensor_flops = sum(k["tensor_flops"] for k in step)
    families: dict[str, dict] = defaultdict(lambda: {"launches": 0, "seconds": 0.0, "tensor_flops": 0})
    for k in step:
        family = families[k["family"]]
        family["launches"] += 1
        family["seconds"] += k["seconds"]
        family["tensor_flops"] += k["tensor_flops"]
    peak = lnc * get_target(TARGET).bf16_flops  # the logical core's: every physical core it has
    return {
        "config": asdict(config), "target": TARGET, "lnc": lnc, "peak_flops": peak,
        "launches": len(step), "step_seconds": seconds,
        "useful_flops": useful, "tensor_flops": tensor_flops, "tensor_over_useful": tensor_flops / useful,
        "mfu": useful / (seconds * peak), "physical_bound_seconds": useful / peak,
        "embedding_share": embedding / seconds,
        "families": dict(sorted(families.items(), key=lambda item: -item[1]["seconds"])),
        "fallbacks": sorted({f["op"] for p in programs for f in p.artifact.meta["fallbacks"]}),
        "interpreter_wall_seconds": wall, "kernels": step,
    }


def format_summary(name: str, s: dict) -> str:
    c = s["config"]
    shape = (f"d={c['dim']} S={c['seq']} batch {c['batch']} heads {c['n_heads']}/{c['n_kv_heads']} "
             f"ffn {c['ffn_dim']} " + (f"vocab {c['vocab_size']}" if c["vocab_size"] else "one layer, no vocabulary"))
    lines = [
        f"{name}: {shape}, bf16 training step (forward + backward)",
        f"  estimated {s['target']} step {s['step_seconds'] * 1e3:.2f} ms over {s['launches']} kernel launches; "
        f"physical bound {s['physical_bound_seconds'] * 1e3:.2f} ms (useful FLOPs at {s['peak_flops'] / 1e12:.0f} TF/s, "
        f"LNC={s['lnc']}): MFU {s['mfu']:.1%}",
        f"  TensorE {s['tensor_flops'] / 1e9:.1f} GFLOP vs useful {s['useful_flops'] / 1e9:.1f} GFLOP: "
        f"{s['tensor_over_useful']:.2f}x",
        f"  embedding kernels (forward and backward) {s['embedding_share']:.1%} of the step",
        f"  issue 15 goals (set for d2048): " + "; ".join(
            f"{key} {s[key]:.3g} {'>=' if key == 'mfu' else '<='} {goal} "
            f"{'met' if (s[key] >= goal if key == 'mfu' else s[key] <= goal) else 'NOT met'}"
            for key, goal in GOALS.items()),
        f"  host fallbacks: {', '.join(s['fallbacks']) or 'none'}; interpreter wall {s['interpreter_wall_seconds']:.0f} s",
        f"  {'family':<22} {'launches':>8} {'est. ms':>9} {'share':>7} {'TensorE GFLOP':>14}",
    ]
    for family, f in s["families"].items():
        lines.append(f"  {family:<22} {f['launches']:>8} {f['seconds'] * 1e3:>9.3f} "
                     f"{f['seconds'] / s['step_seconds']:>7.1%} {f['tensor_flops'] / 1e9:>14.2f}")
    return "\n".join(lines)


def perfetto_trace(s: dict) -> dict:
    return perfetto.trace_events(
        [perfetto.Launch(k["name"], k["seconds"], k["engine_seconds"],
                         {"family": k["family"], "program": k["program"], "ops": k["ops"]}) for k in s["kernels"]],
        TARGET)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="d2048")
    parser.add_argument("--seq", type=int, help="override the config's sequence length")
    parser.add_argument("--perfetto", metavar="FILE", help="write the step's kernel launches as a Perfetto trace")
    parser.add_argument("--json", metavar="FILE", help="write the summary (every launch included) as JSON")
    parser.add_argument("--lnc", type=int, choices=(1, 2), default=get_target(TARGET).default_lnc,
                        help="physical cores per logical core the kernels split over; the MFU peak is lnc x 79 TF/s")
    args = parser.parse_args(argv)
    config = CONFIGS[args.config]
    if args.seq:
        config = StepConfig(**{**asdict(config), "seq": args.seq})
    start = time.perf_counter()
    programs = run_step(config, args.lnc)
    summary = summarize(config, programs, useful_flops(config), time.perf_counter() - start, args.lnc)
    print(format_summary(args.config, summary))
    if args.perfetto:
        perfetto.write(perfetto_trace(summary), args.perfetto)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
