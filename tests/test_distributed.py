"""torchrun on CPU (gloo, loopback): DDP, FSDP2, DTensor tensor-parallel (with and without sequence
parallelism) and 2-D TP x FSDP2 training of the tiny Llama under backend="neuron".

Each run launches tests/distributed_worker.py in fresh processes. The ranks' losses and trained
parameters must match one process training on the whole global batch, and the ranks, sharing one
empty cache folder, must compile every cache key exactly once between them. Tensor parallelism traces
functional collectives into the compiled graphs: they must run as communication steps of the
compiled program (through the process group), not as host fallbacks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import distributed_worker
from tests.process_groups import destroy_process_groups

REPO = Path(__file__).resolve().parents[1]

# Per-rank partial losses and gradients averaged by a collective sum the same fp32 values in another
# order than one process does: a few ulps, carried through three SGD steps (measured: <= 1e-7
# relative). A wrongly scaled gradient (sum instead of mean) moves the step-2 loss by ~7%.
RTOL, ATOL = 1e-5, 1e-5


def _run_worker(launcher: list[str], mode: str, work: Path) -> tuple[list[dict], Path]:
    """Run the worker under `launcher` with an empty cache folder; returns every rank's result."""
    out_dir, cache_dir = work / "out", work / "cache"
    out_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "NEURON_INDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    result = subprocess.run([*launcher, distributed_worker.__file__, mode, str(out_dir)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"worker failed:\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))], cache_dir


def _torchrun(nproc: int) -> list[str]:
    # --standalone: a rendezvous on localhost with a free port chosen by torchrun itself.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> dict:
    """The reference: one process, the whole global batch, backend="neuron"."""
    (result,), _ = _run_worker([sys.executable], "single", tmp_path_factory.mktemp("single"))
    return result


@pytest.mark.slow
def test_single_process_run_matches_eager(single_process):
    torch._dynamo.reset()
    try:
        eager = distributed_worker.train("single", backend="eager")
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(single_process["losses"], eager["losses"], rtol=1e-4, atol=1e-5)
    assert single_process["losses"][-1] < single_process["losses"][0] - 0.5  # it really trains
    torch.testing.assert_close(single_process["param_norms"], eager["param_norms"], rtol=1e-4, atol=1e-5)


def _assert_matches_single_process_and_compiles_each_key_once(ranks: list[dict], cache_dir: Path,
                                                            single_process: dict, nproc: int,
                                                            same_graphs: bool = True) -> None:
    """`same_graphs`: every rank traces the same graphs (False when they bake in rank-dependent
    constants, as the vocabulary-parallel embedding's slice offset)."""
    assert [r["rank"] for r in ranks] == list(range(nproc)) and all(r["world"] == nproc for r in ranks)
    for result in ranks:
        torch.testing.assert_close(result["losses"], single_process["losses"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(result["param_norms"], single_process["param_norms"], rtol=RTOL, atol=ATOL)
    stats = [r["cache"] for r in ranks]
    entries = len(list(cache_dir.glob("*/*.nicache")))
    # Every rank needs every key once (same graphs, same shapes); the shared disk cache and its
    # per-key lock make exactly one rank compile each key and the others load it from disk.
    assert entries > 0 and sum(s["compiles"] for s in stats) == entries, stats
    if same_graphs:
        assert all(s["compiles"] + s["disk_hits"] == entries for s in stats), stats
    assert all(s["corrupt"] == 0 and s["disk_errors"] == 0 for s in stats), stats


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_training_matches_single_process_and_compiles_each_key_once(single_process, mode, nproc,
                                                                            tmp_path):
    ranks, cache_dir = _run_worker(_torchrun(nproc), mode, tmp_path)
    _assert_matches_single_process_and_compiles_each_key_once(ranks, cache_dir, single_process, nproc)
    if mode == "ddp":  # the 1 MB gradient buckets make Dynamo's DDPOptimizer split the forward graph
        assert all(r["forward_graphs"] >= 2 for r in ranks), [r["forward_graphs"] for r in ranks]


# Collectives each tensor-parallel plan must put into the compiled programs: row-parallel outputs are
# all-reduced (tp) or reduce-scattered to sequence shards, which column-parallel inputs all-gather (tp_sp).
TP_COLLECTIVES = {"tp": {"all_reduce"}, "tp_sp": {"all_gather_into_tensor", "reduce_scatter_tensor"},
                  "tp_fsdp2": {"all_reduce"}}
# Ranks whose graphs differ: tp_sp's vocabulary-parallel embedding offsets the ids by the rank's slice
# of the vocabulary; on tp_fsdp2's 2-D mesh each row's collectives name its own process group.
RANK_DEPENDENT_GRAPHS = {"tp_sp", "tp_fsdp2"}


@pytest.mark.slow
@pytest.mark.parametrize("mode,nproc", [("tp", 2), ("tp_sp", 2), ("tp_fsdp2", 4)])
def test_tensor_parallel_training_matches_single_process_with_collectives_in_the_program(single_process, mode,
                                                                                        nproc, tmp_path):
    ranks, cache_dir = _run_worker(_torchrun(nproc), mode, tmp_path)
    _assert_matches_single_process_and_compiles_each_key_once(ranks, cache_dir, single_process, nproc,
                                                              same_graphs=mode not in RANK_DEPENDENT_GRAPHS)
    for result in ranks:
        ran = {op.split(".")[1] for op in result["collectives"]}
        assert TP_COLLECTIVES[mode] <= ran and "wait_tensor" in ran, result["collectives"]
        assert not result["fallbacks"], result["fallbacks"]


def test_functional_collectives_are_communication_steps_not_fallbacks(tmp_path, monkeypatch):
    """One gloo rank in this process: all_reduce / all_gather / reduce_scatter and their waits compile
    to communication lines of the host wrapper, are reported as such, and give eager's values."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import neuron_inductor
    from neuron_inductor import config
    from neuron_inductor.observe import session

    monkeypatch.setenv("NEURON_INDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD

        def fn(x):
            summed = funcol.all_reduce(x * 2, "sum", group)
            gathered = funcol.all_gather_single(summed + 1, 0, group)
            return funcol.reduce_scatter_single(gathered, "sum", 0, group).relu()

        x = torch.randn(4, 6)
        want = fn(x)
        torch._dynamo.reset()
        session.clear()
        with config.patch(fallback="error"):
            got = torch.compile(fn, backend="neuron", fullgraph=True)(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        report = neuron_inductor.report()
        assert not report.fallbacks
        ran = {op.split(".")[1] for op in report.collectives}
        assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"} <= ran, ran
        assert "communication step(s)" in str(report)
        assert "# communication: through the process group" in session.BUCKETS[-1].artifact.wrapper_source
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_destroy_process_groups_frees_a_group_a_device_mesh_still_holds():
    """The workers' teardown: destroy_process_group() alone leaves a group alive while any DeviceMesh
    over it lives (with its gloo threads, which then run through interpreter shutdown);
    destroy_process_groups() frees it, and names a group something else still holds."""
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    def gloo_world_with_mesh():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return init_device_mesh("cpu", (1,)), weakref.ref(dist.group.WORLD)

    mesh, group = gloo_world_with_mesh()
    destroy_process_groups()
    assert group() is None and mesh.size() == 1  # freed while the mesh lives on

    mesh, group = gloo_world_with_mesh()
    held = group()
    with pytest.raises(RuntimeError, match=f"{held.group_name}.*still referenced"):
        destroy_process_groups()
    del held
    assert group() is None
