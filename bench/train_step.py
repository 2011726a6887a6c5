"""One training step of a 2-layer Llama-style model through the backend: where the FLOPs ran and
what the interpreter costs in CPU time.

For fp32 and bf16 it reports:
- host fallbacks in the compiled forward and backward graphs (the hot path should have none);
- TensorE FLOPs executed by the generated kernels (`nc_matmul` instructions in the trace) against
  what `FlopCounterMode` counts for the same eager step, less the causal-masked half of attention
  that a flash kernel rightly skips (goal >= 98%);
- the time of a steady compiled step in the NKI interpreter as a ratio to eager PyTorch on the
  same CPU (goal <= 3x), best of --repeats with the two taking turns, in wall-clock and in CPU
  (process) time: on a loaded machine eager's thread pool waits on descheduled threads, which
  inflates its wall time, so the CPU-time ratio is the steadier one.

    python bench/train_step.py [--seq 256] [--batch 4] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from neuron_inductor import sim
from neuron_inductor.observe import session
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

aten = torch.ops.aten
SDPA_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


def best_times(steps: dict, repeats: int) -> dict:
    """Best wall and CPU seconds of each step, the steps taking turns so that a machine whose load
    changes slows them alike (the ratio is what matters)."""
    best = {name: {"wall": float("inf"), "cpu": float("inf")} for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            best[name]["wall"] = min(best[name]["wall"], time.perf_counter() - wall)
            best[name]["cpu"] = min(best[name]["cpu"], time.process_time() - cpu)
    return best


def measure(dtype: torch.dtype, batch: int, seq: int, repeats: int) -> dict:
    torch._dynamo.reset()
    config = TinyLlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
    eager, model = TinyLlama(config).to(dtype), TinyLlama(config).to(dtype)
    compiled = torch.compile(model, backend="neuron")
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    first_program = len(session.BUCKETS)
    compiled(ids, ids).backward()  # compile
    programs = session.BUCKETS[first_program:]
    fallbacks = sorted({f["op"] for p in programs for f in p.artifact.meta["fallbacks"]})

    with sim.trace() as recorded:
        compiled(ids, ids).backward()
    tensor_flops = sum(i.flops for i in recorded.instructions if i.op == "nc_matmul")
    with FlopCounterMode(display=False) as counter:
        eager(ids, ids).backward()
    by_op = counter.get_flop_counts()["Global"]
    attention = sum(flops for op, flops in by_op.items() if op in SDPA_OPS)
    useful = counter.get_total_flops() - attention / 2  # causal: the masked half is not work

    best = best_times({"compiled": lambda: compiled(ids, ids).backward(), "eager": lambda: eager(ids, ids).backward()},
                      repeats)
    return {"fallbacks": fallbacks, "tensor_flops": tensor_flops, "useful_flops": useful, "best": best,
            "instructions": len(recorded.instructions),
            "trn2_seconds": recorded.estimate(target="trn2").total_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for eager and host ops (0: torch's default); 1 compares "
                             "like with like, the interpreter's kernels run on one thread")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"2-layer tiny Llama (dim 64, vocab 256), batch {args.batch} x seq {args.seq}, one training step")
    print("steady step, best of --repeats, compiled and eager taking turns; wall and CPU (process) time")
    print(f"{'dtype':<9} {'fallbacks':<12} {'TensorE/eager FLOPs':>20} {'NKI instr':>10} {'Trn2 est us':>12} "
          f"{'interp s':>9} {'eager s':>8} {'wall ratio':>11} {'interp cpu':>11} {'eager cpu':>10} {'CPU ratio':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        r = measure(dtype, args.batch, args.seq, args.repeats)
        compiled, eager = r["best"]["compiled"], r["best"]["eager"]
        print(f"{str(dtype).removeprefix('torch.'):<9} {', '.join(r['fallbacks']) or 'none':<12} "
              f"{100 * r['tensor_flops'] / r['useful_flops']:>19.1f}% {r['instructions']:>10} "
              f"{r['trn2_seconds'] * 1e6:>12.0f} {compiled['wall']:>9.3f} {eager['wall']:>8.3f} "
              f"{compiled['wall'] / eager['wall']:>10.2f}x {compiled['cpu']:>11.3f} {eager['cpu']:>10.3f} "
              f"{compiled['cpu'] / eager['cpu']:>9.2f}x")


if __name__ == "__main__":
    main()
