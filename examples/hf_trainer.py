"""Train a tiny random-initialised LlamaForCausalLM with the Hugging Face Trainer and
`--torch_compile true --torch_compile_backend neuron`, offline on CPU (the NKI kernels run in
neuron_inductor's interpreter).

    python examples/hf_trainer.py --torch_compile true --torch_compile_backend neuron
    python examples/hf_trainer.py --torch_compile true --torch_compile_backend neuron --compare_eager true

Every `TrainingArguments` flag works (--max_steps, --learning_rate, --per_device_train_batch_size, ...).
The text is examples/data/tiny_corpus.txt, one token per byte, cut into blocks of --block_size tokens:
every batch has the same shape, so the Trainer (which compiles with `dynamic=False` for this backend)
compiles one forward and one backward graph. The Trainer prints the loss of every step; at the end the
script prints where the FLOPs ran and the compile / cache summary, and with --compare_eager it trains
the same model eagerly (same seed, same batches) and checks both loss curves agree within
--loss_tolerance.

The tokenizer, corpus and model builders here are shared by trl_sft.py and generate.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments,
    default_data_collator, set_seed)

from neuron_inductor.integrations.hf import NeuronCompileCallback  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in memory (no download): 256 byte tokens, then <eos> and <pad>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def corpus_lines() -> list[str]:
    return [line for line in CORPUS.read_text().splitlines() if line.strip()]


def tiny_llama(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer LlamaForCausalLM (hidden 64, 4 heads, 2 KV heads; `overrides` change config fields),
    random weights from `seed`."""
    fields = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = LlamaConfig(**{**fields, **overrides}, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def corpus_blocks(tokenizer: PreTrainedTokenizerFast, block_size: int) -> Dataset:
    """The corpus as consecutive blocks of `block_size` tokens (the tail that does not fill one is dropped)."""
    ids = tokenizer(CORPUS.read_text())["input_ids"]
    blocks = [ids[i:i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


@dataclass
class ExampleArguments:
    block_size: int = 64
    num_hidden_layers: int = 2
    compare_eager: bool = False
    loss_tolerance: float = 1e-4  # largest |compiled - eager| training loss allowed at any step (fp32)


DEFAULT_FLAGS = ["--max_steps", "10", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
                 "--lr_scheduler_type", "constant", "--logging_steps", "1", "--report_to", "none",
                 "--save_strategy", "no", "--use_cpu", "true", "--seed", "0", "--disable_tqdm", "true",
                 "--dataloader_drop_last", "true"]


def parse(argv: list[str]) -> tuple[ExampleArguments, TrainingArguments]:
    """The command line over DEFAULT_FLAGS (later flags win); output in a temporary folder unless given."""
    flags = [*DEFAULT_FLAGS, *argv]
    if "--output_dir" not in flags:
        flags += ["--output_dir", tempfile.mkdtemp(prefix="hf_trainer_")]
    return HfArgumentParser((ExampleArguments, TrainingArguments)).parse_args_into_dataclasses(flags)


def train(training_args: TrainingArguments, example: ExampleArguments) -> list[float]:
    """Train the tiny model with these arguments; the training loss of every logged step."""
    set_seed(training_args.seed)
    tokenizer = byte_tokenizer()
    model = tiny_llama(tokenizer, seed=training_args.seed, num_hidden_layers=example.num_hidden_layers)
    callbacks = [NeuronCompileCallback()] if training_args.torch_compile_backend == "neuron" else []
    trainer = Trainer(model=model, args=training_args, train_dataset=corpus_blocks(tokenizer, example.block_size),
                      data_collator=default_data_collator, callbacks=callbacks)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def eager_twin(training_args: TrainingArguments) -> TrainingArguments:
    """The same arguments without torch.compile."""
    return dataclasses.replace(training_args, torch_compile=False, torch_compile_backend=None,
                               torch_compile_mode=None)


def compare(compiled: list[float], eager: list[float], tolerance: float) -> bool:
    """Print both loss curves side by side; whether they agree within `tolerance` at every step."""
    print(f"{'step':>4}  {'compiled':>10}  {'eager':>10}  {'|diff|':>9}")
    for step, (c, e) in enumerate(zip(compiled, eager), start=1):
        print(f"{step:>4}  {c:>10.6f}  {e:>10.6f}  {abs(c - e):>9.2e}")
    worst = max(abs(c - e) for c, e in zip(compiled, eager))
    agree = worst <= tolerance and len(compiled) == len(eager)
    print(f"largest loss difference {worst:.2e} over {len(compiled)} step(s): "
          f"{'within' if agree else 'NOT within'} the tolerance {tolerance:g}")
    return agree


def main(argv: list[str] | None = None) -> int:
    example, training_args = parse(sys.argv[1:] if argv is None else argv)
    losses = train(training_args, example)
    if not example.compare_eager:
        return 0
    eager = train(eager_twin(training_args), example)
    return 0 if compare(losses, eager, example.loss_tolerance) else 1


if __name__ == "__main__":
    sys.exit(main())
