"""Static-cache generation with the decoding step compiled by the neuron backend (examples/generate.py):
greedy tokens identical to eager greedy decoding, and the KV-cache update runs in kernels or in the
documented host fallback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from neuron_inductor.integrations.hf import compile_summary  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import generate  # noqa: E402


def _generate_both(texts: list[str], new_tokens: int):
    tokenizer = generate.byte_tokenizer()
    model = generate.tiny_llama(tokenizer, num_hidden_layers=1).eval()
    encoded = generate.encode_prompts(tokenizer, texts)
    eager = generate.generate(model, encoded, new_tokens, compiled=False)
    compiled = generate.generate(model, encoded, new_tokens, compiled=True)
    return eager, compiled, encoded


def test_static_cache_greedy_tokens_match_eager(fresh_compile_state):
    eager, compiled, encoded = _generate_both(["A compiler is", "The accelerator"], new_tokens=4)
    assert compiled.shape == (2, encoded["input_ids"].shape[1] + 4)
    assert torch.equal(compiled, eager)
    summary = compile_summary()
    # The decoding step compiled once and ran in kernels, the KV-cache writes (index_put on dim 2) too.
    assert summary["graphs"] == 1 and summary["kernels"] > 0
    assert not summary["fallbacks"], summary["fallbacks"]


@pytest.mark.slow
def test_generate_example_after_warm_up(fresh_compile_state, capsys):
    """The example as documented: a briefly trained model, 24 new tokens, three prompts."""
    status = generate.main(["--train_steps", "30", "--max_new_tokens", "24", "--batch", "3"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "compiled tokens == eager greedy tokens (24 new tokens x 3 sequences)" in out


def test_default_dynamic_cache_greedy_tokens_match_eager(fresh_compile_state):
    """`torch.compile(model, backend="neuron")` then `generate()` with Hugging Face's default
    DynamicCache: every decoding step appends to the cache with `cat` along the growing (padded)
    length, which must give eager's tokens (it did not before the cat rewrite: other tokens from the
    4th on)."""
    tokenizer = generate.byte_tokenizer()
    model = generate.tiny_llama(tokenizer, num_hidden_layers=1).eval()
    encoded = generate.encode_prompts(tokenizer, ["A compiler is", "The accelerator"])
    with torch.no_grad():
        eager = model.generate(**encoded, do_sample=False, max_new_tokens=10, disable_compile=True)
        model.forward = torch.compile(model.forward, backend="neuron")
        compiled = model.generate(**encoded, do_sample=False, max_new_tokens=10, disable_compile=True)
    assert torch.equal(compiled, eager), (compiled, eager)
    summary = compile_summary()
    assert summary["kernels"] > 0 and not summary["fallbacks"], summary["fallbacks"]
