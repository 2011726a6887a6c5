"""The main job: train a tiny Llama-style model with torch.compile(backend="neuron"), offline.

The model is random-initialised from a config; the data is the byte-level text in
examples/data/tiny_corpus.txt. Every batch has a different sequence length, as in real training:
the backend pads each length to its bucket (multiples of 128 by default), compiles one kernel set
per bucket and reuses it. An eager copy of the model trains in lockstep so you can see the losses
agree. At the end it prints where the FLOPs ran and what was compiled and cached.

    python examples/train_tiny.py [--steps 12] [--batch 4] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import random
import re
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

import neuron_inductor
from neuron_inductor import sim
from neuron_inductor.bucketing import BucketPolicy
from neuron_inductor.config import resolve as resolve_options
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


def batches(text: bytes, steps: int, batch: int, lengths: tuple[int, int], seed: int):
    """Random windows of the corpus with a random length per step (byte ids are the tokens)."""
    rng = random.Random(seed)
    data = torch.tensor(list(text), dtype=torch.long)
    for _ in range(steps):
        length = rng.randint(*lengths)
        starts = [rng.randrange(0, len(data) - length) for _ in range(batch)]
        yield torch.stack([data[s:s + length] for s in starts])


def flops_report(compiled: torch.nn.Module, eager: torch.nn.Module, ids: torch.Tensor) -> str:
    """Run one more step of each model: TensorE FLOPs the kernels executed vs the eager step's FLOPs.

    The kernels do more matmul work than eager counts, for reasons the breakdown by kernel family
    shows: the length is padded to its bucket, the embedding and its backward are one-hot matmuls
    over the vocabulary, on-chip transposes go through TensorE, and the attention backward recomputes
    the scores (causal kernels skip the masked half, which eager counts)."""
    with sim.trace() as recorded:
        compiled(ids, ids).backward()
    with FlopCounterMode(display=False) as counter:
        eager(ids, ids).backward()
    by_family: dict[str, int] = {}
    for instruction in recorded.instructions:
        if instruction.op == "nc_matmul":
            family = re.sub(r"^k\d+_", "", instruction.kernel)
            by_family[family] = by_family.get(family, 0) + instruction.flops
    kernel_flops = sum(by_family.values())
    families = ", ".join(f"{name} {flops / 1e6:.1f}" for name, flops in sorted(by_family.items(), key=lambda kv: -kv[1]))
    estimate = recorded.estimate(target="trn2")
    engines = ", ".join(f"{name} {seconds * 1e6:.0f} us" for name, seconds in estimate.engine_seconds.items())
    padded = BucketPolicy.parse(resolve_options().buckets).bucket(ids.shape[1])
    return (f"one training step at length {ids.shape[1]} (padded to {padded}): {kernel_flops / 1e6:.1f} MFLOP on "
            f"TensorE in NKI kernels vs {counter.get_total_flops() / 1e6:.1f} MFLOP counted in the eager step\n"
            f"  TensorE MFLOP by kernel family: {families}\n"
            f"  {len(recorded.instructions)} NKI instructions; estimated Trn2 one-core time "
            f"{estimate.total_seconds * 1e6:.0f} us ({engines})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    config = TinyLlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176,
                             seed=args.seed)
    eager = TinyLlama(config).to(dtype)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="neuron")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, eager)]

    print(f"training a {sum(p.numel() for p in model.parameters()):,}-parameter tiny Llama ({args.dtype}) "
          f"on {CORPUS.name}, {args.steps} steps, lengths {args.min_len}..{args.max_len}")
    print(f"{'step':>4} {'length':>6} {'loss (neuron)':>14} {'loss (eager)':>13} {'seconds':>8}")
    text = CORPUS.read_bytes()
    for step, ids in enumerate(batches(text, args.steps, args.batch, (args.min_len, args.max_len), args.seed)):
        start = time.perf_counter()
        loss = compiled(ids, ids)
        loss.backward()
        seconds = time.perf_counter() - start
        eager_loss = eager(ids, ids)
        eager_loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        print(f"{step:>4} {ids.shape[1]:>6} {loss.item():>14.5f} {eager_loss.item():>13.5f} {seconds:>8.2f}")

    print()
    print(flops_report(compiled, eager, ids))
    print()
    stats = neuron_inductor.cache_stats()
    print(f"cache: {stats['compiles']} kernel-set compiles ({stats['compile_seconds']:.1f} s), "
          f"{stats['disk_hits']} disk hits, {stats['memory_hits']} memory hits; per bucket: {stats['per_bucket']}")
    report = neuron_inductor.report()
    print(f"compiled {len(report.buckets)} graph bucket(s): {len(report.kernels)} NKI kernels, "
          f"{len(report.fallbacks)} host fallbacks, {100 * (report.kernel_flop_share or 0):.1f}% of FLOPs in kernels, "
          f"padding waste {100 * (report.padding_waste or 0):.1f}% of padded elements")
    print("every kernel with its Trn2 estimate: print(neuron_inductor.report()), or run with "
          "NEURON_INDUCTOR_DUMP_DIR=dump and read dump/")


if __name__ == "__main__":
    main()
