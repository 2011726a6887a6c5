"""See what neuron_inductor generated and why: dump, verify, report, replay.

A small residual MLP block trains one step on a batch of 100 rows (padded to the 128-row bucket)
with every inspection feature on, then the script shows what a user would look at:

    python examples/inspect_kernels.py [--dump-dir DIR]

The same, for any script, from the environment and the console:

    NEURON_INDUCTOR_DUMP_DIR=DIR NEURON_INDUCTOR_VERIFY=raise TORCH_LOGS="+neuron_inductor" python train.py
    neuron-inductor report DIR                  # kernels, fallbacks, FLOP share, padding, estimated time
    neuron-inductor replay DIR/k0_matmul         # re-run one kernel in the interpreter
    python -m neuron_inductor.sim DIR/.../kernels/k0_matmul.py   # a dumped kernel runs standalone
    neuron-inductor cache explain                # why the last compiles missed the cache
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

import neuron_inductor
from neuron_inductor.observe.replay import replay


class ResidualMLP(nn.Module):
    """x + down(gelu(up(rms_norm(x))))."""

    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return x + self.down(torch.nn.functional.gelu(self.up(normed)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-dir", type=Path, default=None, help="where to dump (default: a temporary folder)")
    args = parser.parse_args()
    dump_dir = args.dump_dir or Path(tempfile.mkdtemp(prefix="neuron_inductor_dump_"))

    torch.manual_seed(0)
    model = torch.compile(ResidualMLP(), backend="neuron", dynamic=True,
                          options={"dump_dir": str(dump_dir), "verify": "raise"})
    x = torch.randn(100, 64)
    model(x).square().mean().backward()  # compiles the forward and backward graphs; verify raises on a mismatch

    report = neuron_inductor.report()
    print(report)

    # The most expensive kernel by the Trn2 estimate, and where its files are.
    bucket, kernel = max(((b, k) for b in report.buckets for k in b["kernels"]),
                         key=lambda pair: pair[1]["estimated_seconds"])
    kernel_file = Path(bucket["folder"]) / "kernels" / f"{kernel['name']}.py"
    print(f"\nDumped to {dump_dir}; one bucket's folder:")
    for path in sorted(Path(bucket["folder"]).iterdir()):
        print(f"  {path.name}{'/' if path.is_dir() else ''}")
    print(f"\nThe slowest kernel, {kernel['name']} ({', '.join(kernel['ops'])}), with the arguments it was called with:")
    print(json.dumps(json.loads(kernel_file.with_suffix('.json').read_text())["inputs"]))

    result = replay(kernel_file)
    print(f"\nReplayed in the interpreter:\n{result.summary()}")
    print(f"\nTry:\n  neuron-inductor report {dump_dir}\n  python -m neuron_inductor.sim {kernel_file}")


if __name__ == "__main__":
    main()
