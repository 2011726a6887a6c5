"""The LM head + cross-entropy of a training step, unfused against fused (passes/lm_head_loss.py):
estimated Trn2 time from the cost model (neuron_inductor/sim/cost_model.py) of every kernel of
the forward and backward graphs, TensorE FLOPs, HBM bytes the kernels move, and the [N, V]
logits-sized tensors written to HBM.

The step is Hugging Face's loss on the LM head (`F.cross_entropy(F.linear(h, W).float().view(-1, V), y)`,
a quarter of the rows ignored) in bf16, forward and backward through the backend, once with
`fuse_lm_head_loss=False`, once with the default, and once (fused+logits) also returning the logits
as Hugging Face's models do (the fused forward then writes them once, and the backward recomputes
the logits for grad_h too, to add their cotangent). The kernels run in the NKI interpreter (at the
default size this takes some minutes of CPU).

    python bench/lm_head_loss.py [--rows 2048] [--hidden 2048] [--vocab 32000] [--lnc 1|2] [--variants fused,...]

--lnc: physical cores the kernels split over (default: trn2's 2); --variants: which of unfused, fused,
fused+logits to run (default: all three).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import defaultdict

import torch
import torch.nn.functional as F

from neuron_inductor import config
from neuron_inductor.observe import session


def loss_fn(vocab: int, return_logits: bool):
    def step(h, w, y):
        logits = F.linear(h, w)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y)
        return (loss, logits) if return_logits else loss
    return step


def measure(rows: int, hidden: int, vocab: int, fused: bool, return_logits: bool = False, lnc: str = "auto") -> dict:
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator) / hidden ** 0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (rows,), generator=generator)
    y[::4] = -100
    torch._dynamo.reset()
    before = len(session.BUCKETS)
    with tempfile.TemporaryDirectory() as cache, config.patch(fallback="error", cache_dir=cache,
                                                              fuse_lm_head_loss=fused, lnc=lnc):
        out = torch.compile(loss_fn(vocab, return_logits), backend="neuron")(h, w, y)
        (out[0] if return_logits else out).backward()
    torch._dynamo.reset()
    families: dict = defaultdict(lambda: {"kernels": 0, "seconds": 0.0, "engines": defaultdict(float)})
    totals = {"seconds": 0.0, "tensor_flops": 0, "dma_bytes": 0, "logits_bytes": 0, "logits_tensors": 0}
    launches = []
    for program in session.BUCKETS[before:]:
        meta = program.artifact.meta
        for kernel in meta["kernels"]:
            estimate = meta["estimates"][kernel["name"]]
            launches.append((kernel["family"], estimate["seconds"], kernel["grid"]))
            families[kernel["family"]]["kernels"] += 1
            families[kernel["family"]]["seconds"] += estimate["seconds"]
            for engine, seconds in estimate["engine_seconds"].items():
                families[kernel["family"]]["engines"][engine] += seconds
            totals["seconds"] += estimate["seconds"]
            totals["tensor_flops"] += estimate["tensor_flops"]
            totals["dma_bytes"] += estimate["dma_bytes"]
            for shape, dtype in zip(kernel["outputs"], kernel["output_dtypes"]):
                if math.prod(shape) == rows * vocab and shape[-1] == vocab:
                    totals["logits_tensors"] += 1
                    totals["logits_bytes"] += rows * vocab * getattr(torch, dtype.split(".")[-1]).itemsize
    return {"families": dict(families), "launches": launches, **totals}


# name -> measure()'s (fused, return_logits)
VARIANTS = {"unfused": (False, False), "fused": (True, False), "fused+logits": (True, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--lnc", choices=("auto", "1", "2"), default="auto")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    useful = 6 * args.rows * args.hidden * args.vocab  # logits, grad_h, grad_W matmuls
    chosen = args.variants.split(",")
    if set(chosen) - set(VARIANTS):
        parser.error(f"--variants takes a comma-separated subset of {', '.join(VARIANTS)}, not {args.variants!r}")
    results = {name: measure(args.rows, args.hidden, args.vocab, *VARIANTS[name], lnc=args.lnc) for name in chosen}
    print(f"LM head + cross-entropy, forward and backward, bf16, N={args.rows} d={args.hidden} V={args.vocab} "
          f"LNC={args.lnc} (trn2 cost model, sum over kernel launches)")
    print(f"{'':12} {'est. ms':>9} {'TensorE / useful':>17} {'HBM GB moved':>13} {'[N,V] tensors':>14} {'their GB':>9}")
    for name, r in results.items():
        print(f"{name:12} {r['seconds'] * 1e3:9.2f} {r['tensor_flops'] / useful:17.2f} {r['dma_bytes'] / 1e9:13.2f} "
              f"{r['logits_tensors']:14d} {r['logits_bytes'] / 1e9:9.2f}")
    for name, r in results.items():
        print(f"\n{name}: per kernel family")
        for family, f in sorted(r["families"].items(), key=lambda item: -item[1]["seconds"]):
            engines = ", ".join(f"{e} {t * 1e3:.2f}" for e, t in sorted(f["engines"].items(), key=lambda item: -item[1]))
            print(f"  {family:14} {f['kernels']:3d} kernel(s) {f['seconds'] * 1e3:9.2f} ms  (engines busy, ms: {engines})")
        print("  launches: " + ", ".join(f"{family} {seconds * 1e3:.3f} ms x{programs}"
                                         for family, seconds, programs in r["launches"]) + " (x: programs)")
    unfused = results.get("unfused")
    for name in [n for n in ("fused", "fused+logits") if n in results and unfused]:
        r = results[name]
        print(f"\n{name} / unfused estimated time: {r['seconds'] / unfused['seconds']:.2f}; "
              f"[N, V] bytes written to HBM avoided: {(unfused['logits_bytes'] - r['logits_bytes']) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
