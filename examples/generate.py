"""Greedy generation with a static KV cache, the decoding step compiled by the neuron backend, offline on CPU:

    python examples/generate.py [--max_new_tokens 16] [--batch 2] [--prompt "A compiler is"] [--train_steps 40]

`model.generate(..., cache_implementation="static", compile_config=...)` runs the prefill eagerly and
compiles the one-token decoding step (fixed shapes: the static cache is allocated at its full length, so
every step has the same graph). The script decodes eagerly too and checks the tokens are identical.

The tiny LlamaForCausalLM is random-initialised; --train_steps (default 40) eager AdamW steps on
examples/data/tiny_corpus.txt first give the greedy continuation some of the corpus' words.

The KV-cache update is an input mutation of the cache buffers (`index_copy_` at the cache position along
the sequence dim). In the compiled step it is an `index_put` over dim 2, which runs in a row-op kernel
(an indirect-DMA scatter, or one-hot matmuls where the cost model finds them cheaper), then an
in-place `copy_` back into the cache buffer, which runs in a copy kernel. The summary at the end lists
every host fallback (none are expected: the whole decoding step runs in NKI kernels).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_trainer import byte_tokenizer, corpus_blocks, tiny_llama  # noqa: E402
from neuron_inductor.integrations.hf import compile_summary, format_compile_summary, generation_compile_config  # noqa: E402


def warm_up(model, tokenizer, steps: int) -> None:
    """A few eager AdamW steps on the corpus, so greedy decoding has something to continue."""
    blocks = torch.tensor(corpus_blocks(tokenizer, 64)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = blocks[(step * 8) % len(blocks):][:8]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def encode_prompts(tokenizer, prompts: list[str]) -> dict:
    """Left-padded batch (input_ids, attention_mask), as generate() expects for decoder-only models."""
    tokenizer.padding_side = "left"
    return tokenizer(prompts, return_tensors="pt", padding=True)


def generate(model, encoded: dict, max_new_tokens: int, compiled: bool) -> torch.Tensor:
    """Greedy tokens (prompt included) with a static cache; the decoding step compiled or eager."""
    kwargs = {"compile_config": generation_compile_config()} if compiled else {"disable_compile": True}
    with torch.no_grad():
        return model.generate(**encoded, do_sample=False, max_new_tokens=max_new_tokens,
                              cache_implementation="static", **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="A compiler is")
    parser.add_argument("--batch", type=int, default=2, help="copies of the prompt (one with its first byte cut)")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--train_steps", type=int, default=40)
    args = parser.parse_args(argv)

    tokenizer = byte_tokenizer()
    model = tiny_llama(tokenizer).eval()
    warm_up(model, tokenizer, args.train_steps)
    encoded = encode_prompts(tokenizer, [args.prompt[i % 2:] for i in range(args.batch)])

    eager = generate(model, encoded, args.max_new_tokens, compiled=False)
    compiled = generate(model, encoded, args.max_new_tokens, compiled=True)
    for row in range(args.batch):
        print(f"[{row}] {tokenizer.decode(compiled[row], skip_special_tokens=True)!r}")
    identical = torch.equal(eager, compiled)
    new_tokens = compiled.shape[1] - encoded["input_ids"].shape[1]
    print(f"compiled tokens {'==' if identical else '!='} eager greedy tokens "
          f"({new_tokens} new tokens x {args.batch} sequences)")
    print(format_compile_summary(compile_summary()))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
