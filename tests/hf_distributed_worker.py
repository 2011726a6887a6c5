"""Transformers' own tensor parallelism under `backend="neuron"`, launched by tests/test_hf_distributed.py.

    python tests/hf_distributed_worker.py CHECKPOINT OUT_DIR                    # one process
    python -m torch.distributed.run --nproc_per_node 2 tests/hf_distributed_worker.py CHECKPOINT OUT_DIR

Loads a saved LlamaForCausalLM with `from_pretrained(..., distributed_config=DistributedConfig(tp_size=WORLD))`
when launched on several ranks (the model's own tp_plan: column / row-parallel projections, a
vocabulary-parallel embedding, a gathered LM head), trains it for a few SGD steps on one fixed batch
under torch.compile, and saves it with `save_pretrained` to OUT_DIR/saved (a standard checkpoint).
Each rank writes OUT_DIR/rank<R>.json: its losses and the collectives and fallbacks of its compiled graphs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import neuron_inductor  # noqa: E402
from tests.process_groups import destroy_process_groups

BATCH, SEQ, STEPS, LR = 2, 32, 3, 0.5


def train(checkpoint: str, out_dir: Path) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {"distributed_config": DistributedConfig(tp_size=world)} if world > 1 else {}
    model = LlamaForCausalLM.from_pretrained(checkpoint, **extra)  # (initialises the process group itself)
    compiled = torch.compile(model, backend="neuron")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.save_pretrained(out_dir / "saved")
    report = neuron_inductor.report()
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "world": world, "losses": losses,
            "collectives": report.collectives, "fallbacks": [f["op"] for f in report.fallbacks]}


def main() -> None:
    checkpoint, out_dir = sys.argv[1], Path(sys.argv[2])
    result = train(checkpoint, out_dir)
    if dist.is_initialized():
        dist.barrier()  # every rank's part of the checkpoint is written
        destroy_process_groups()  # (their threads joined before the interpreter shuts down)
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
