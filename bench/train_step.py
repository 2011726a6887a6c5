"""One training step of a Llama-style model through the backend: where the FLOPs ran, what the
interpreter costs in CPU time, and how long the first step takes against Inductor's.

For the tiny config (2 layers, dim 64) in fp32 and bf16, and for dim 1024 x seq 1024 in bf16
(1 layer, batch 1), it reports:
- host fallbacks in the compiled forward and backward graphs (the hot path should have none);
- TensorE FLOPs executed by the generated kernels (`nc_matmul` instructions in the trace) against
  what `FlopCounterMode` counts for the same eager step, less the causal-masked half of attention
  that a flash kernel rightly skips (goal >= 98%);
- the time of a steady compiled step in the NKI interpreter as a ratio to eager PyTorch on the
  same CPU (goal <= 3x), best of --repeats with the two taking turns, in wall-clock and in CPU
  (process) time: on a loaded machine eager's thread pool waits on descheduled threads, which
  inflates its wall time, so the CPU-time ratio is the steadier one. A bf16 step is also compared
  with eager's fp32 step of the same model ("vs fp32 eager"): on a CPU without native bf16 (AVX2
  only) eager's bf16 kernels are several times slower than its fp32 ones, which would flatter the
  bf16 ratio; the interpreter computes bf16 work in fp32 anyway. "round ratio" is the median over
  the rounds of compiled / eager CPU time: on a machine whose speed swings within minutes (a VM),
  the two bests may come from different minutes, while a round's two steps run seconds apart.
Then the first step (trace + compile + run) of the dim-1024 model, neuron and inductor side by side,
each in a fresh subprocess with empty caches (goal: neuron no slower). Every number is a ratio
taken within one run: the machine may be shared, and absolute times move with its load.

    python bench/train_step.py [--seq 256] [--batch 4] [--repeats 7] [--threads 1] [--no-tiny] [--no-large] [--no-first-step]
                               [--first-step-repeats 3] [--no-steady]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from neuron_inductor import sim
from neuron_inductor.observe import session
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten
SDPA_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


def round_times(steps: dict, repeats: int) -> dict:
    """Wall and CPU seconds of each step in each round, the steps taking turns so that a machine whose
    load changes slows them alike (the ratio is what matters)."""
    rounds = {name: {"wall": [], "cpu": []} for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            rounds[name]["wall"].append(time.perf_counter() - wall)
            rounds[name]["cpu"].append(time.process_time() - cpu)
    return rounds


def median_round_ratio(rounds: dict, clock: str = "cpu") -> float:
    """The median over rounds of compiled / eager: steadier than the ratio of the bests on a machine
    whose speed swings (a round's two steps ran seconds apart; the bests may come from other minutes)."""
    return statistics.median(c / e for c, e in zip(rounds["compiled"][clock], rounds["eager"][clock]))


TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
LARGE = dict(vocab_size=512, dim=1024, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=2816)
LARGE_SHAPE = (1, 1024)  # batch, seq


def measure(config: dict, dtype: torch.dtype, batch: int, seq: int, repeats: int) -> dict:
    torch._dynamo.reset()
    config = TinyLlamaConfig(**config)
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

    steps = {"compiled": lambda: compiled(ids, ids).backward(), "eager": lambda: eager(ids, ids).backward()}
    if dtype is not torch.float32:
        eager_fp32 = TinyLlama(config)
        steps["eager fp32"] = lambda: eager_fp32(ids, ids).backward()
    rounds = round_times(steps, repeats)
    best = {name: {clock: min(times) for clock, times in clocks.items()} for name, clocks in rounds.items()}
    return {"fallbacks": fallbacks, "tensor_flops": tensor_flops, "useful_flops": useful, "best": best,
            "round_ratio": median_round_ratio(rounds),
            "instructions": len(recorded.instructions),
            "trn2_seconds": recorded.estimate(target="trn2").total_seconds}


FIRST_STEP = textwrap.dedent("""
    import json, resource, sys, time, torch
    import torch._inductor.config as inductor_config
    from neuron_inductor.testing import TinyLlama, TinyLlamaConfig
    backend, config, (batch, seq), threads = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    if threads:
        torch.set_num_threads(threads)
    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    torch._functorch.config.enable_autograd_cache = False
    model = TinyLlama(TinyLlamaConfig(**config)).to(torch.bfloat16)
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    def children_cpu():  # the C++ compiler processes Inductor starts and waits for
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime
    wall, cpu, children = time.perf_counter(), time.process_time(), children_cpu()
    compiled(ids, ids).backward()
    print(json.dumps({"wall": time.perf_counter() - wall,
                      "cpu": time.process_time() - cpu + children_cpu() - children}))
""")


def first_step(backend: str, config: dict, shape: tuple, threads: int) -> dict:
    """The first bf16 training step (trace + compile + run) in a fresh process with empty caches;
    Inductor compiles in that process (TORCHINDUCTOR_COMPILE_THREADS=1), and the CPU time counts the
    C++ compiler processes it waits for."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
               "NEURON_INDUCTOR_CACHE_DIR": os.path.join(cache, "neuron"), "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        result = subprocess.run([sys.executable, "-c", FIRST_STEP, backend, json.dumps(config), json.dumps(shape),
                                 str(threads)], env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7,
                        help="rounds of the steady steps (the dim-1024 step: at most 2); on a machine whose speed "
                             "swings, a few rounds may not catch a quiet moment for both sides")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for eager and host ops (0: torch's default); 1 compares "
                             "like with like, the interpreter's kernels run on one thread")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny config's fp32 and bf16 steady steps")
    parser.add_argument("--no-large", action="store_true", help="skip the dim-1024 x seq-1024 bf16 steady step")
    parser.add_argument("--no-first-step", action="store_true", help="skip the first-step comparison with inductor")
    parser.add_argument("--no-steady", action="store_true", help="skip the steady steps (the first-step comparison only)")
    parser.add_argument("--first-step-repeats", type=int, default=3,
                        help="side-by-side first steps (the ratio's median and spread are reported)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [("tiny 2x64", TINY, torch.float32, (args.batch, args.seq)),
            ("tiny 2x64", TINY, torch.bfloat16, (args.batch, args.seq))] if not (args.no_steady or args.no_tiny) else []
    if not args.no_large and not args.no_steady:
        runs.append(("1 layer x 1024", LARGE, torch.bfloat16, LARGE_SHAPE))
    if runs:
        print("steady step, best of --repeats, compiled and eager taking turns; wall and CPU (process) time; "
              "round ratio: the median over the rounds of compiled / eager CPU time")
        print(f"{'model':<28} {'dtype':<9} {'fallbacks':<12} {'TensorE/eager FLOPs':>20} {'NKI instr':>10} "
              f"{'Trn2 est us':>12} {'interp s':>9} {'eager s':>8} {'wall ratio':>11} {'interp cpu':>11} {'eager cpu':>10} "
              f"{'CPU ratio':>10} {'vs fp32 eager':>14} {'round ratio':>12}")
    for name, config, dtype, (batch, seq) in runs:
        r = measure(config, dtype, batch, seq, args.repeats if config is TINY else min(args.repeats, 2))
        compiled, eager = r["best"]["compiled"], r["best"]["eager"]
        print(f"{f'{name}, {batch} x {seq}':<28} {str(dtype).removeprefix('torch.'):<9} "
              f"{', '.join(r['fallbacks']) or 'none':<12} "
              f"{100 * r['tensor_flops'] / r['useful_flops']:>19.1f}% {r['instructions']:>10} "
              f"{r['trn2_seconds'] * 1e6:>12.0f} {compiled['wall']:>9.3f} {eager['wall']:>8.3f} "
              f"{compiled['wall'] / eager['wall']:>10.2f}x {compiled['cpu']:>11.3f} {eager['cpu']:>10.3f} "
              f"{compiled['cpu'] / eager['cpu']:>9.2f}x "
              f"{compiled['cpu'] / r['best'].get('eager fp32', eager)['cpu']:>13.2f}x "
              f"{r['round_ratio']:>11.2f}x", flush=True)
    if not args.no_first_step:
        print(f"first bf16 step (trace + compile + run, empty caches), 1 layer x 1024, "
              f"{LARGE_SHAPE[0]} x {LARGE_SHAPE[1]}, fresh process each, the two taking turns")
        ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
        for _ in range(args.first_step_repeats):
            results = {backend: first_step(backend, LARGE, LARGE_SHAPE, args.threads)
                       for backend in ("neuron", "inductor")}
            for clock, found in ratios.items():
                found.append(results["neuron"][clock] / results["inductor"][clock])
            times = [f"{backend} wall {r['wall']:>6.1f} s cpu {r['cpu']:>6.1f} s" for backend, r in results.items()]
            print("   ".join(times) + f"   ratio wall {ratios['wall'][-1]:.2f} cpu {ratios['cpu'][-1]:.2f}", flush=True)
        for clock, found in ratios.items():
            print(f"neuron / inductor first step, {clock}: median {statistics.median(found):.2f} "
                  f"(min {min(found):.2f}, "
                  f"max {max(found):.2f}, {len(found)} runs; goal <= 1)")


if __name__ == "__main__":
    main()
