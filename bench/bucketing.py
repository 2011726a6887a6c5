"""Bucketing benchmark: train a tiny Llama-style model on variable lengths and count compiles.

    python bench/bucketing.py                      # 200 steps, lengths 2..2048, cold cache, then a warm process
    python bench/bucketing.py --cache-dir DIR      # run it again with the same DIR: the warm start

Runs the same seeded training three ways and prints one row each:
- `dynamic`: default `torch.compile(model, backend="neuron")` (Dynamo's first graph is static, then
  automatic dynamic shapes give one symbolic graph that the backend runs per bucket);
- `static`:  `dynamic=False`, as the Hugging Face Trainer passes for `neuron` (Dynamo hands over one
  static graph per distinct length; from the second length on the backend maps each to its bucket
  through the symbolic form it re-derives, see `neuron_inductor.generalize`);
- `exact`:   default compile with `buckets=off`: one kernel set per distinct length, no padding.

Columns: distinct lengths and buckets touched, kernel-set compiles (forward and backward graphs
each count) split into bucket (padded) and exact-shape sets, disk hits, total compile seconds,
padding waste (padded / real tokens), steps that ran eagerly because Dynamo hit its recompile
limit, wall time. With bucketing, padded sets equal 2 x buckets and the exact sets are the first
length's forward and backward (a single static graph cannot show which sizes vary). Lengths start
at 2 (length 1 leaves no next token to predict: its loss is NaN). Unless `--cache-dir` is given, a
second process then runs the same bench on the same (now warm) cache folder: it should compile
nothing. `--host-only` runs every graph op by op on the host instead of through the generated
kernels: it isolates bucketing and caching from kernel execution speed.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from neuron_inductor import cache, compiler, config, generalize
from neuron_inductor.observe import session
from neuron_inductor.bucketing import BucketPolicy
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

BATCH = 2


def lengths_for(steps: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(2, max_len) for _ in range(steps)]


def train(mode: str, lengths: list[int], cache_dir: str, model_cfg: TinyLlamaConfig) -> dict:
    torch._dynamo.reset()
    cache._caches.clear()  # count this run only (a new process would start empty too)
    generalize.reset()
    programs_before = len(session.BUCKETS)
    torch.manual_seed(0)
    model = TinyLlama(model_cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    compile_kwargs = {"dynamic": False} if mode == "static" else {}
    buckets = "off" if mode == "exact" else config.resolve().buckets
    step_fn = torch.compile(model, backend="neuron", **compile_kwargs)
    generator = torch.Generator().manual_seed(1)
    eager_steps = 0
    start = time.perf_counter()
    with config.patch(cache_dir=cache_dir, buckets=buckets, fallback="allow"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in lengths:
            ids = torch.randint(0, model_cfg.vocab_size, (BATCH, length), generator=generator)
            seen = len(caught)
            loss = step_fn(ids, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            eager_steps += any("EAGERLY" in str(w.message) for w in caught[seen:])
    wall = time.perf_counter() - start
    stats = cache.cache_stats()
    compiled = [p for p in session.BUCKETS[programs_before:] if p.source == "compiled"]
    exact = sum(p.plan == "static" or p.plan.startswith("exact") for p in compiled)
    policy = BucketPolicy.parse(buckets)
    return {
        "mode": mode, "lengths": len(set(lengths)), "buckets": len({policy.bucket(n) for n in lengths}),
        "compiles": stats["compiles"], "padded": len(compiled) - exact, "exact": exact, "disk_hits": stats["disk_hits"], "compile_s": stats["compile_seconds"],
        "waste": sum(policy.bucket(n) for n in lengths) / sum(lengths), "eager_steps": eager_steps, "wall_s": wall,
        "final_loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="dynamic,static,exact")
    parser.add_argument("--cache-dir", default=None, help="reuse a cache folder (run twice: warm start)")
    parser.add_argument("--host-only", action="store_true", help="run graphs op by op on the host (no kernels)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-warm", action="store_true", help="skip the warm-start second process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.host_only:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/ is not installed
        from tests.host_lowering import lower_on_host

        compiler.lower_graph = lower_on_host
    base = Path(args.cache_dir or tempfile.mkdtemp(prefix="neuron_inductor_bench_"))
    lengths = lengths_for(args.steps, args.max_len, args.seed)
    model_cfg = TinyLlamaConfig(n_layers=args.layers)
    print(f"{args.steps} steps, batch {BATCH}, lengths 2..{args.max_len} (seed {args.seed}), cache {base}"
          f"{' (host-only)' if args.host_only else ''}")
    header = f"{'mode':8} {'lengths':>7} {'buckets':>7} {'compiles':>8} {'padded':>6} {'exact':>5} {'disk hits':>9} " \
             f"{'compile s':>9} {'waste':>6} {'eager':>5} {'wall s':>7}  final loss"
    print(header)
    for mode in args.modes.split(","):
        row = train(mode, lengths, str(base / mode), model_cfg)
        print(f"{row['mode']:8} {row['lengths']:7d} {row['buckets']:7d} {row['compiles']:8d} {row['padded']:6d} "
              f"{row['exact']:5d} {row['disk_hits']:9d} {row['compile_s']:9.2f} {row['waste']:6.2f} "
              f"{row['eager_steps']:5d} {row['wall_s']:7.1f}  {row['final_loss']:.4f}", flush=True)
    if args.cache_dir is None and not args.no_warm:
        print("warm start: the same bench in a new process on the same cache folder", flush=True)
        subprocess.run([sys.executable, *sys.argv, "--cache-dir", str(base), "--no-warm"], check=True)


if __name__ == "__main__":
    main()
