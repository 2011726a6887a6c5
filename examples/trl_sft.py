"""Supervised fine-tuning with TRL's SFTTrainer and `--torch_compile true --torch_compile_backend neuron`,
offline on CPU: a tiny random-initialised LlamaForCausalLM on the lines of examples/data/tiny_corpus.txt.

    python examples/trl_sft.py --torch_compile true --torch_compile_backend neuron --pad_to_multiple_of 128
    python examples/trl_sft.py --torch_compile true --torch_compile_backend neuron            # no padding
    python examples/trl_sft.py ... --compare_eager true     # also train eagerly and compare the loss curves

Every `SFTConfig` flag works. Two of SFTConfig's own defaults are changed here:
- `--bf16 false`: fp32 training, so the loss curve can be compared with eager at a tight tolerance;
- `--activation_checkpointing false` (SFTConfig's `gradient_checkpointing=True`): checkpointing works and
  matches eager (`--activation_checkpointing true`, tested in tests/test_trl.py), but a checkpointed SDPA
  reaches the backend wrapped in `run_and_save_rng_state` / `run_with_rng_state`, which run on the host
  (no kernel for them yet), so the default here keeps the whole backbone in NKI kernels.

Shapes: the Trainer compiles with `dynamic=False` for this backend, so every new padded length is a new
Dynamo graph. `--pad_to_multiple_of 128` (with `--max_length 128`) gives every batch one shape and one
compile; without it each batch length compiles again (Dynamo's recompile limit then caps the damage).

Graph breaks: SFTTrainer computes the loss with its chunked LM head (`trl.kernels.ChunkedLogProbFunction`),
which calls `torch.mm(..., out=<non-contiguous tile>)` in a loop. Dynamo cannot trace that, so the model's
backbone (embedding, decoder layers, final norm) runs as one compiled graph -- NKI kernels -- and the LM-head
projection and its log-softmax fold run eagerly on the host (its per-tile helper is compiled on its own).
The summary at the end lists the graph breaks and their reasons.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from transformers import HfArgumentParser, set_seed  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_trainer import byte_tokenizer, compare, corpus_lines, eager_twin, tiny_llama  # noqa: E402
from neuron_inductor.integrations.hf import NeuronCompileCallback  # noqa: E402


@dataclass
class ExampleArguments:
    num_hidden_layers: int = 2
    compare_eager: bool = False
    loss_tolerance: float = 1e-4  # largest |compiled - eager| training loss allowed at any step (fp32)


DEFAULT_FLAGS = ["--max_steps", "6", "--per_device_train_batch_size", "4", "--max_length", "128",
                 "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--logging_steps", "1",
                 "--report_to", "none", "--save_strategy", "no", "--use_cpu", "true", "--seed", "0",
                 "--disable_tqdm", "true", "--bf16", "false", "--activation_checkpointing", "false",
                 "--dataloader_drop_last", "true"]


def parse(argv: list[str]) -> tuple[ExampleArguments, SFTConfig]:
    flags = [*DEFAULT_FLAGS, *argv]
    if "--output_dir" not in flags:
        flags += ["--output_dir", tempfile.mkdtemp(prefix="trl_sft_")]
    return HfArgumentParser((ExampleArguments, SFTConfig)).parse_args_into_dataclasses(flags)


def train(config: SFTConfig, example: ExampleArguments) -> list[float]:
    """Fine-tune the tiny model with this config; the training loss of every logged step."""
    set_seed(config.seed)
    tokenizer = byte_tokenizer()
    model = tiny_llama(tokenizer, seed=config.seed, num_hidden_layers=example.num_hidden_layers)
    callbacks = [NeuronCompileCallback()] if config.torch_compile_backend == "neuron" else []
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": corpus_lines()}),
                         processing_class=tokenizer, callbacks=callbacks)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv: list[str] | None = None) -> int:
    example, config = parse(sys.argv[1:] if argv is None else argv)
    losses = train(config, example)
    if not example.compare_eager:
        return 0
    eager = train(eager_twin(config), example)
    return 0 if compare(losses, eager, example.loss_tolerance) else 1


if __name__ == "__main__":
    sys.exit(main())
