"""TRL SFTTrainer with `--torch_compile true --torch_compile_backend neuron` (examples/trl_sft.py), with and
without `pad_to_multiple_of=128`: the compiled loss curve matches eager (fp32, |diff| <= 1e-4 at every step),
and the graph break TRL's chunked LM-head loss causes is survived and reported.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from neuron_inductor.integrations.hf import compile_summary, format_compile_summary  # noqa: E402
from tests.test_hf_trainer import _assert_curves_agree  # noqa: E402

import trl_sft  # noqa: E402  (examples/ is on sys.path through test_hf_trainer)

# trl.kernels.ChunkedLogProbFunction calls torch.mm(..., out=<non-contiguous tile>) in a loop.
TRL_GRAPH_BREAK = "Attempted to call op with non-contiguous `out=` tensor"


def _train_both(flags: list[str]) -> tuple[list[float], list[float], dict]:
    example, config = trl_sft.parse(["--torch_compile", "true", "--torch_compile_backend", "neuron",
                                     "--num_hidden_layers", "1", "--per_device_train_batch_size", "2", *flags])
    compiled = trl_sft.train(config, example)
    summary = compile_summary()
    eager = trl_sft.train(trl_sft.eager_twin(config), example)
    return compiled, eager, summary


def test_sft_padded_to_128_matches_eager_and_reports_trl_graph_break(fresh_compile_state, tmp_path):
    compiled, eager, summary = _train_both(["--max_steps", "2", "--pad_to_multiple_of", "128",
                                            "--output_dir", str(tmp_path)])
    _assert_curves_agree(compiled, eager, steps=2)
    assert TRL_GRAPH_BREAK in summary["graph_breaks"]
    assert TRL_GRAPH_BREAK in format_compile_summary(summary)
    # Every batch is padded to 128 tokens: no recompile of the backbone graph.
    assert not any("input_ids" in reason for reason in summary["recompiles"])
    assert summary["kernels"] > 0 and summary["kernel_flop_share"] > 0.99


@pytest.mark.slow
def test_sft_unpadded_recompiles_per_length_and_matches_eager(fresh_compile_state, tmp_path):
    compiled, eager, summary = _train_both(["--max_steps", "3", "--output_dir", str(tmp_path)])
    _assert_curves_agree(compiled, eager, steps=3)
    assert TRL_GRAPH_BREAK in summary["graph_breaks"]
    # dynamic=False: each new batch length is a new backbone graph, and the summary says why.
    assert any("input_ids" in reason and "size mismatch" in reason for reason in summary["recompiles"])


@pytest.mark.slow
def test_sft_with_gradient_checkpointing(fresh_compile_state, tmp_path):
    compiled, eager, _ = _train_both(["--max_steps", "2", "--pad_to_multiple_of", "128",
                                      "--activation_checkpointing", "true", "--output_dir", str(tmp_path)])
    _assert_curves_agree(compiled, eager, steps=2)
