"""Hugging Face Trainer with `--torch_compile true --torch_compile_backend neuron` (examples/hf_trainer.py):
accelerate accepts the backend, the Trainer compiles with dynamic=False, and the compiled training loss
curve matches the eager one (fp32, |diff| <= 1e-4 at every step) with the model's math in NKI kernels.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import hf_trainer  # noqa: E402

from neuron_inductor.integrations.hf import compile_summary  # noqa: E402

LOSS_TOLERANCE = 1e-4  # fp32 kernels vs eager over a few AdamW steps: observed <= 4e-6


def test_accelerate_accepts_neuron_and_trainer_disables_dynamic_shapes(tmp_path):
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin
    from transformers import Trainer

    with pytest.raises(ValueError):
        TorchDynamoPlugin(backend="not_a_backend")
    _, args = hf_trainer.parse(["--torch_compile", "true", "--torch_compile_backend", "neuron",
                                "--output_dir", str(tmp_path)])
    tokenizer = hf_trainer.byte_tokenizer()
    trainer = Trainer(model=hf_trainer.tiny_llama(tokenizer), args=args,
                      train_dataset=hf_trainer.corpus_blocks(tokenizer, 32))
    plugin = trainer.accelerator.state.dynamo_plugin
    assert plugin.backend is DynamoBackend.NEURON
    assert plugin.dynamic is False


def _train_both(flags: list[str]) -> tuple[list[float], list[float], dict]:
    example, args = hf_trainer.parse(["--torch_compile", "true", "--torch_compile_backend", "neuron", *flags])
    compiled = hf_trainer.train(args, example)
    summary = compile_summary()
    eager = hf_trainer.train(hf_trainer.eager_twin(args), example)
    return compiled, eager, summary


def _assert_curves_agree(compiled: list[float], eager: list[float], steps: int) -> None:
    assert len(compiled) == len(eager) == steps
    assert compiled[-1] < compiled[0]  # it trains
    for step, (c, e) in enumerate(zip(compiled, eager), start=1):
        assert abs(c - e) <= LOSS_TOLERANCE, f"step {step}: compiled loss {c}, eager {e}"


def test_trainer_loss_curve_matches_eager(fresh_compile_state, tmp_path):
    compiled, eager, summary = _train_both(
        ["--max_steps", "3", "--per_device_train_batch_size", "2", "--block_size", "32",
         "--num_hidden_layers", "1", "--output_dir", str(tmp_path)])
    _assert_curves_agree(compiled, eager, steps=3)
    # One forward and one backward graph: fixed-shape batches, no graph break, no recompile.
    assert summary["graphs"] == 1 and summary["buckets"] == 2
    assert summary["graph_breaks"] == {} and summary["recompiles"] == []
    assert summary["kernels"] > 0 and summary["kernel_flop_share"] > 0.99


@pytest.mark.slow
def test_trainer_example_ten_steps(fresh_compile_state, tmp_path, capsys):
    """The example as documented: 2 layers, 10 steps, --compare_eager."""
    status = hf_trainer.main(["--torch_compile", "true", "--torch_compile_backend", "neuron",
                              "--compare_eager", "true", "--output_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "within the tolerance" in out and "NKI kernel(s)" in out
