"""One training run of the tiny Llama under `backend="neuron"`, launched by tests/test_distributed.py.

    python tests/distributed_worker.py single OUT_DIR            # one process, the whole global batch
    python -m torch.distributed.run --nproc_per_node N tests/distributed_worker.py {ddp|fsdp2} OUT_DIR

Every run trains the same seeded model with SGD for a few steps on one fixed global batch (so the
loss falls and a wrongly scaled gradient shows in the next step's loss). A distributed rank
trains on its contiguous share of the batch rows; the gradient all-reduce (DDP) or
reduce-scatter (FSDP2) averages the ranks' gradients, which equals the single-process gradient
because every rank holds the same number of tokens. Each rank writes OUT_DIR/rank<R>.json: the
global mean loss per step, the norm of every (full) parameter after training, and its
`neuron_inductor.cache_stats()`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import neuron_inductor
from neuron_inductor.runtime import COMPILED_PROGRAMS
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

# vocab 4096: the LM head alone (1 MB) fills the first 1 MB DDP bucket, so Dynamo's DDPOptimizer
# splits the graph in two (the cap cannot go below 1 MB: DDPOptimizer fixes its first bucket at 1 MB).
CONFIG = TinyLlamaConfig(vocab_size=4096, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
GLOBAL_BATCH, SEQ, STEPS, LR = 4, 32, 3, 1.0
DDP_BUCKET_CAP_MB = 1


def global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000)
    return torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=generator)


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    return model


def full_parameter_norms(model: torch.nn.Module) -> dict[str, float]:
    norms = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2 shards are DTensors
        norms[name.removeprefix("module.")] = full.detach().norm().item()
    return norms


def train(mode: str, backend: str = "neuron") -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if mode != "single" else (0, 1)
    rows = GLOBAL_BATCH // world
    model = wrap(TinyLlama(CONFIG), mode)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    ids = global_batch()[rank * rows:(rank + 1) * rows]
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = compiled(ids, ids)
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        losses.append(mean_loss.item())
    forward_graphs = sum(1 for program in COMPILED_PROGRAMS if program["kind"] == "forward")
    return {"rank": rank, "world": world, "losses": losses, "param_norms": full_parameter_norms(model),
            "forward_graphs": forward_graphs, "cache": neuron_inductor.cache_stats()}


def main() -> None:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    if mode != "single":
        dist.init_process_group("gloo")
    try:
        result = train(mode)
    finally:
        if mode != "single":
            dist.destroy_process_group()
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
