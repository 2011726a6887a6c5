"""NEURON_INDUCTOR_DUMP_DIR: write what the compiler saw and generated, one folder per graph bucket.

    DUMP_DIR/run-<date>-<time>-pid<PID>/        one per process (run.json: argv, versions, options)
      graph000_<function>/<kind>_bucket<N>/     one per compiled (AOT graph, bucket)
        dynamo_graph.py      the FX graph Dynamo captured
        aten_graph.py        the decomposed ATen graph AOTAutograd produced (symbolic sizes if dynamic)
        lowered_graph.py     the static ATen graph that was lowered (sizes of this bucket)
        bucket.json          bucket signature, real and padded input shapes, padding waste
        wrapper.py           the host wrapper
        cache_key.json       the parts of the compile-cache key
        report.json          kernels, fallbacks, FLOP share, padding, estimated time (see report.py)
        kernels/kN_family.py the NKI source, runnable: `python -m neuron_inductor.sim kernels/k0_pointwise.py`
        kernels/kN_family.json             the first call's argument shapes, strides and dtypes
        kernels/kN_family.inputs.pt / .outputs.pt   that call's tensors (when small enough)

Kernel inputs and outputs are saved on the bucket's first run when they are small enough
(`SAVE_LIMIT_BYTES`); a kernel without saved inputs replays on random ones.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from .. import __version__
from ..config import ConfigError, NeuronConfig
from . import session
from .report import RUN_FILE

# Saved tensors of one kernel call (its inputs' storages, or its outputs) above this are not written.
SAVE_LIMIT_BYTES = 32 * 2**20

RUNNER_BLOCK = '''

if __name__ == "__main__":
    # Standalone run on the inputs saved beside this file (random ones if none were saved):
    #   python -m neuron_inductor.sim {filename}
    from neuron_inductor.observe.replay import run_kernel_file

    run_kernel_file(__file__, {name})
'''

_run_folders: dict[str, Path] = {}


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "graph"


def run_folder(dump_dir: str, config: NeuronConfig) -> Path:
    """This process's folder under `dump_dir`, created (with run.json) on first use."""
    folder = _run_folders.get(dump_dir)
    if folder is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        folder = Path(dump_dir) / f"run-{stamp}-pid{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"NEURON_INDUCTOR_DUMP_DIR={dump_dir!r}: cannot create the dump folder ({exc}); "
                              "accepted: a path to a folder this process can create or write") from None
        write_json(folder / RUN_FILE, {
            "argv": sys.argv, "pid": os.getpid(), "started": stamp, "neuron_inductor": __version__,
            "torch": torch.__version__, "options": config.as_dict(),
        })
        _run_folders[dump_dir] = folder
    return folder


def bucket_folder(bucket: session.CompiledBucket, config: NeuronConfig) -> Path:
    dynamo = bucket.aot.dynamo
    graph = f"graph{dynamo.index:03d}_{_safe(dynamo.function)}" if dynamo else f"graph_{bucket.aot.graph_hash}"
    folder = run_folder(config.dump_dir, config) / graph / f"{bucket.aot.kind}_bucket{bucket.index}"
    (folder / "kernels").mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, default=str)
    # Lists of numbers (shapes, strides) on one line each.
    one_line = lambda match: "[" + ", ".join(re.split(r",\s*", match.group(1).strip())) + "]"  # noqa: E731
    path.write_text(re.sub(r"\[\s+([-\d.e, \n]+?)\s+\]", one_line, text) + "\n")


def graph_source(gm: fx.GraphModule, title: str) -> str:
    body = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    return f"# {title}\n{body}"


def tensor_spec(value: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(value.shape), "stride": list(value.stride()),
            "dtype": str(value.dtype).removeprefix("torch.")}


def kernel_source(name: str, source: str) -> str:
    return source.rstrip("\n") + "\n" + RUNNER_BLOCK.format(filename=f"{name}.py", name=name)


def write_bucket(folder: Path, *, dynamo_code: str | None, aten_gm: fx.GraphModule,
                 lowered_gm: fx.GraphModule | None, artifact: Any, bucket_info: dict[str, Any],
                 cache_key: dict[str, Any]) -> None:
    """Everything known at compile time; the kernels' argument specs and tensors follow on the first
    run (see hooks._KernelSaver), report.json is written now and again after the first run."""
    if dynamo_code is not None:
        (folder / "dynamo_graph.py").write_text(f"# The FX graph Dynamo captured\n{dynamo_code}")
    (folder / "aten_graph.py").write_text(graph_source(aten_gm, "The decomposed ATen graph from AOTAutograd"))
    if lowered_gm is not None:  # absent when the program came from the compile cache
        lowered = graph_source(lowered_gm, "The static ATen graph lowered for this bucket")
        (folder / "lowered_graph.py").write_text(lowered)
    (folder / "wrapper.py").write_text(artifact.wrapper_source)
    write_json(folder / "bucket.json", bucket_info)
    write_json(folder / "cache_key.json", cache_key)
    users = artifact.meta.get("user_kernels", {})
    for name, source in artifact.kernel_sources.items():  # an nki_op's kernels are the user's source as is
        (folder / "kernels" / f"{name}.py").write_text(source if name in users else kernel_source(name, source))


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def small_enough(args: tuple) -> bool:
    """True when a kernel call's arguments are all tensors whose storages fit SAVE_LIMIT_BYTES."""
    return all(isinstance(a, torch.Tensor) for a in args) and storage_bytes(list(args)) <= SAVE_LIMIT_BYTES


def save_call(folder: Path, name: str, inputs: tuple, result: Any) -> None:
    """Save one kernel call's inputs (as they were before the call) and outputs beside its source."""
    torch.save([a.detach() for a in inputs], folder / "kernels" / f"{name}.inputs.pt")
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    if all(isinstance(o, torch.Tensor) for o in outputs) and storage_bytes(outputs) <= SAVE_LIMIT_BYTES:
        torch.save([o.detach() for o in outputs], folder / "kernels" / f"{name}.outputs.pt")


class KernelSaver:
    """Kernel-call observer: writes each kernel's argument specs (shapes, strides, dtypes of the real
    call) and, when small enough, its input and output tensors into the dump. See capture.py."""

    def __init__(self, folder: Path, kernels: list[dict[str, Any]]) -> None:
        self.folder = folder
        self.described = {k["name"]: k for k in kernels}

    def _write_spec(self, name: str, inputs: list, outputs: list | None) -> None:
        kernel = self.described[name]
        write_json(self.folder / "kernels" / f"{name}.json", {
            "name": name, "family": kernel["family"], "flops": kernel["flops"], "ops": kernel["ops"],
            "inputs": [tensor_spec(a) for a in inputs if isinstance(a, torch.Tensor)],
            "outputs": None if outputs is None else [tensor_spec(o) for o in outputs if isinstance(o, torch.Tensor)],
        })

    def before(self, name: str, position: int, count: int, args: tuple) -> tuple[tuple, tuple | None]:
        self._write_spec(name, list(args), None)  # written first, so a kernel that fails still has it
        # Cloned: a kernel may write into an input (in-place outputs); save what it read.
        return args, (tuple(a.clone() for a in args) if small_enough(args) else None)

    def after(self, name: str, state: tuple[tuple, tuple | None], result: Any) -> None:
        args, saved_inputs = state
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        self._write_spec(name, list(args), outputs)
        if saved_inputs is not None:
            save_call(self.folder, name, saved_inputs, result)
