"""Cold compile time of a 2-layer Llama-style model, forward and backward: neuron vs inductor.

Each backend runs in a fresh subprocess with empty caches (its own temporary cache folders; the
FX graph and AOTAutograd caches of Inductor are switched off). Compile time = the first training
step (trace + compile + run) minus the mean of the next steps (run only), so the number is what a
user waits for before training starts, less the step itself.

    python bench/compile_time.py [--seq 128] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, sys, time, torch
    import torch._inductor.config as inductor_config
    from neuron_inductor.testing import TinyLlama, TinyLlamaConfig
    backend, seq, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    torch._functorch.config.enable_autograd_cache = False
    model = TinyLlama(TinyLlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176))
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        compiled(ids, ids).backward()
        times.append(time.perf_counter() - start)
    run = sum(times[1:]) / steps
    print(json.dumps({"first_step": times[0], "step": run, "compile": times[0] - run}))
""")


def measure(backend: str, seq: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
               "NEURON_INDUCTOR_CACHE_DIR": os.path.join(cache, "neuron"),
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        result = subprocess.run([sys.executable, "-c", CHILD, backend, str(seq), str(steps)],
                                env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = {backend: measure(backend, args.seq, args.steps) for backend in ("neuron", "inductor")}
    print(f"{'backend':<10} {'cold compile s':>15} {'first step s':>13} {'step s':>8}")
    for backend, r in results.items():
        print(f"{backend:<10} {r['compile']:>15.2f} {r['first_step']:>13.2f} {r['step']:>8.3f}")
    ratio = results["neuron"]["compile"] / results["inductor"]["compile"]
    print(f"neuron / inductor cold compile time: {ratio:.3f} (goal <= 0.1)")


if __name__ == "__main__":
    main()
