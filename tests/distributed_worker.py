"""One training run of the tiny Llama under `backend="neuron"`, launched by tests/test_distributed.py.

    python tests/distributed_worker.py single OUT_DIR            # one process, the whole global batch
    python -m torch.distributed.run --nproc_per_node N tests/distributed_worker.py {ddp|fsdp2|tp|tp_sp|tp_fsdp2} OUT_DIR

Every run trains the same seeded model with SGD for a few steps on one fixed global batch (so the
loss falls and a wrongly scaled gradient shows in the next step's loss). A distributed rank
of a data-parallel run (DDP, FSDP2) trains on its contiguous share of the batch rows; the gradient
all-reduce (DDP) or reduce-scatter (FSDP2) averages the ranks' gradients, which equals the
single-process gradient because every rank holds the same number of tokens. A tensor-parallel rank
(tp: DTensor ColwiseParallel / RowwiseParallel over each block's projections; tp_sp: also
SequenceParallel norms, the activations between blocks sharded along the sequence) sees the whole
batch and holds a slice of every projection; its functional collectives are traced into the
compiled graphs. tp_fsdp2 combines both on a 2-D mesh: FSDP2 across rows of TP_SIZE
tensor-parallel ranks, each row training on its share of the batch. Each rank writes OUT_DIR/rank<R>.json: the
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
from neuron_inductor.observe.session import BUCKETS
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig
from tests.process_groups import destroy_process_groups

# vocab 4096: the LM head alone (1 MB) fills the first 1 MB DDP bucket, so Dynamo's DDPOptimizer
# splits the graph in two (the cap cannot go below 1 MB: DDPOptimizer fixes its first bucket at 1 MB).
CONFIG = TinyLlamaConfig(vocab_size=4096, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
GLOBAL_BATCH, SEQ, STEPS, LR = 4, 32, 3, 1.0
DDP_BUCKET_CAP_MB = 1


def global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000)
    return torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=generator)


TP_SIZE = 2  # tensor-parallel ranks per row of tp_fsdp2's mesh


def tensor_parallel_plan(sequence_parallel: bool) -> dict:
    """parallelize_module's plan for one Block: q / k / v and gate / up split by output features,
    o_proj / down by input features (one all-reduce each, or a reduce-scatter to sequence shards)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        heads = ColwiseParallel()  # each rank: its slice of the heads, as plain local tensors
        return {"attn.q_proj": heads, "attn.k_proj": heads, "attn.v_proj": heads, "attn.o_proj": RowwiseParallel(),
                "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    gathered = ColwiseParallel(input_layouts=Shard(1))  # all-gathers the sequence shards first
    return {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attn.q_proj": gathered, "attn.k_proj": gathered, "attn.v_proj": gathered,
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.gate": ColwiseParallel(input_layouts=Shard(1)), "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1))}


def parallelize(model: torch.nn.Module, mesh, sequence_parallel: bool) -> torch.nn.Module:
    """Tensor parallelism over the 1-D `mesh`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    for block in model.blocks:
        parallelize_module(block, mesh, tensor_parallel_plan(sequence_parallel))
    if sequence_parallel:  # the residual stream leaves the embedding as sequence shards, the logits are whole
        parallelize_module(model, mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    return model


def fully_shard_blocks(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
    if mode == "fsdp2":
        return fully_shard_blocks(model)
    if mode in ("tp", "tp_sp"):
        return parallelize(model, init_device_mesh("cpu", (dist.get_world_size(),)), sequence_parallel=mode == "tp_sp")
    if mode == "tp_fsdp2":  # a 2-D mesh: FSDP2 over rows ("dp"), tensor parallelism within each row ("tp")
        mesh = init_device_mesh("cpu", (dist.get_world_size() // TP_SIZE, TP_SIZE), mesh_dim_names=("dp", "tp"))
        return fully_shard_blocks(parallelize(model, mesh["tp"], sequence_parallel=False), mesh["dp"])
    return model


def data_parallel_share(mode: str) -> tuple[int, int]:
    """(index, count): this rank trains on share `index` of `count` equal shares of the batch rows."""
    if mode in ("single", "tp", "tp_sp"):
        return 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "tp_fsdp2":  # init_device_mesh numbers ranks row-major: rank = dp * TP_SIZE + tp
        return rank // TP_SIZE, world // TP_SIZE
    return rank, world


def full_parameter_norms(model: torch.nn.Module) -> dict[str, float]:
    norms = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2 shards are DTensors
        norms[name.removeprefix("module.")] = full.detach().norm().item()
    return norms


def train(mode: str, backend: str = "neuron") -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if mode != "single" else (0, 1)
    share, shares = data_parallel_share(mode)
    rows = GLOBAL_BATCH // shares
    model = wrap(TinyLlama(CONFIG), mode)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    ids = global_batch()[share * rows:(share + 1) * rows]
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = compiled(ids, ids)
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        if shares > 1:  # (tensor-parallel peers hold equal losses: the world's mean is the shares' mean)
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        losses.append(mean_loss.item())
    forward_graphs = sum(1 for program in BUCKETS if program.aot.kind == "forward")
    report = neuron_inductor.report()
    return {"rank": rank, "world": world, "losses": losses, "param_norms": full_parameter_norms(model),
            "forward_graphs": forward_graphs, "cache": neuron_inductor.cache_stats(),
            "collectives": report.collectives, "fallbacks": [f["op"] for f in report.fallbacks]}


def main() -> None:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    if mode != "single":
        dist.init_process_group("gloo")
    try:
        result = train(mode)
    finally:
        if mode != "single":
            destroy_process_groups()  # (their threads joined before the interpreter shuts down)
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
