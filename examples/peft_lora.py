"""PEFT adapters trained under `torch.compile(backend="neuron")`, offline on CPU: a tiny random-initialised
LlamaForCausalLM (examples/hf_trainer.py) wrapped by `peft.get_peft_model`, a few AdamW steps on blocks
of examples/data/tiny_corpus.txt, then the same steps eagerly, and both loss curves compared.

    python examples/peft_lora.py                    # LoRA on q/k/v/o
    python examples/peft_lora.py --adapter ia3      # IA3 (learned scaling vectors)
    python examples/peft_lora.py --adapter loha     # LoHa (Hadamard product of two low-rank pairs)

Only the adapter's parameters train (PEFT freezes the base model); the script checks that the frozen
weights did not move and that the trained adapter weights match eager's.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from peft import IA3Config, LoHaConfig, LoraConfig, get_peft_model  # noqa: E402

from hf_trainer import byte_tokenizer, compare, corpus_blocks, tiny_llama  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = {
    "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, task_type="CAUSAL_LM"),
    "ia3": lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                             task_type="CAUSAL_LM"),
    # init_weights=False: random adapter weights, so the first step already changes the output.
    "loha": lambda: LoHaConfig(r=4, alpha=8, target_modules=ATTENTION, init_weights=False, task_type="CAUSAL_LM"),
}
BATCH, BLOCK = 2, 32


def adapted_model(adapter: str, seed: int = 0) -> torch.nn.Module:
    """The tiny Llama (1 layer, weights from `seed`) with the named adapter (its weights from `seed` too)."""
    model = tiny_llama(byte_tokenizer(), seed=seed, num_hidden_layers=1)
    torch.manual_seed(seed)
    return get_peft_model(model, ADAPTERS[adapter]())


def batch() -> torch.Tensor:
    return torch.tensor(corpus_blocks(byte_tokenizer(), BLOCK)["input_ids"][:BATCH])


def train(adapter: str, backend: str, steps: int, lr: float = 1e-2) -> tuple[list[float], torch.nn.Module]:
    """`steps` AdamW steps on one fixed batch; the losses and the trained model."""
    model = adapted_model(adapter)
    model.train()
    run = torch.compile(model, backend=backend) if backend != "eager" else model
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    ids = batch()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def max_weight_difference(a: torch.nn.Module, b: torch.nn.Module, trainable: bool) -> float:
    """Largest |a - b| over the (trainable or frozen) parameters of two models of one structure."""
    return max((pa.detach() - pb.detach()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()) if pa.requires_grad == trainable)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", choices=sorted(ADAPTERS), default="lora")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--loss_tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    losses, model = train(args.adapter, "neuron", args.steps)
    eager_losses, eager_model = train(args.adapter, "eager", args.steps)
    model.print_trainable_parameters()
    agree = compare(losses, eager_losses, args.loss_tolerance)
    frozen = max_weight_difference(model, adapted_model(args.adapter), trainable=False)
    adapter = max_weight_difference(model, eager_model, trainable=True)
    print(f"frozen base weights moved by {frozen:.1e}; trained adapter vs eager's: max |diff| {adapter:.1e}")
    return 0 if agree and frozen == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
