"""Transformers' tensor parallelism (`DistributedConfig(tp_size=2)`, the model's own tp_plan) on 2 CPU
ranks (torchrun, gloo) under backend="neuron", from a tiny saved checkpoint: the losses match one
process, the collectives run as communication steps of the compiled graphs (no host fallback), and the
standard checkpoint `save_pretrained` writes reloads with one process's trained weights.

(TRL's SFTTrainer with `DistributedConfig(tp_size=2, fsdp_size=2)` does not start on CPU ranks, even
eagerly: Accelerate enables the FSDP2 its ParallelismConfig needs only for device backends.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tests import hf_distributed_worker  # noqa: E402
from tests.test_distributed import REPO, _torchrun  # noqa: E402

# The ranks' sharded matmuls and all-reduces sum the same fp32 values in another order: a few ulps
# over three SGD steps (observed: losses 5e-7 apart, reloaded weights 6e-8 apart).
RTOL, ATOL = 1e-5, 1e-5


def _run(launcher: list[str], checkpoint: Path, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "NEURON_INDUCTOR_CACHE_DIR": str(out_dir / "cache"), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    result = subprocess.run([*launcher, hf_distributed_worker.__file__, str(checkpoint), str(out_dir)], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"worker failed:\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]


@pytest.mark.slow
def test_transformers_tensor_parallel_training_matches_one_process_and_its_checkpoint_reloads(tmp_path):
    from hf_trainer import byte_tokenizer, tiny_llama
    from transformers import LlamaForCausalLM

    checkpoint = tmp_path / "tiny"
    tiny_llama(byte_tokenizer(), num_hidden_layers=1).save_pretrained(checkpoint)
    (single,) = _run([sys.executable], checkpoint, tmp_path / "single")
    ranks = _run(_torchrun(2), checkpoint, tmp_path / "tp")

    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert single["losses"][-1] < single["losses"][0]  # it trains
    for result in ranks:
        torch.testing.assert_close(result["losses"], single["losses"], rtol=RTOL, atol=ATOL)
        ran = {op.split(".")[1] for op in result["collectives"]}
        assert {"all_reduce", "wait_tensor"} <= ran, result["collectives"]
        assert not result["fallbacks"], result["fallbacks"]
    assert not single["collectives"] and not single["fallbacks"]

    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "tp" / "saved")
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "single" / "saved")
    for (name, got), (_, want) in zip(reloaded.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
