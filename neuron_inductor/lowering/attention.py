"""Scaled-dot-product attention -> flash-style kernels (`attention_fwd`, `attention_bwd`).

On CPU, SDPA reaches the backend as `_scaled_dot_product_flash_attention_for_cpu` (a boolean
mask already turned into an additive float mask by SDPA itself, GQA with fewer key/value heads
than query heads when `enable_gqa=True`) and its `_backward`. The kernels never write the
[Sq, Sk] score matrix to HBM: the forward keeps a running max / sum per query row (online
softmax) and returns the natural-log logsumexp; the backward recomputes the probabilities
from it. Causal attention is top-left aligned (query i sees keys 0..i) and skips the key
tiles above the diagonal.

Supported: q/k/v [B, H, S, D] in fp32 / bf16 / fp16, D <= 128, Hq a multiple of Hkv (GQA),
any Sq / Sk (remainder tiles), a float mask broadcastable to [B, Hq, Sq, Sk] (not broadcast
along the key dim), `scale`, `is_causal`. Not supported (eager fallback with the reason):
dropout, D > 128, key/value heads resident in SBUF beyond the budget below.

Not registered: `_scaled_dot_product_efficient_attention` / `_scaled_dot_product_flash_attention`
(and backwards) appear only when tracing on CUDA, never for this CPU-traced backend, and return
values with no NKI counterpart (int64 philox seed / offset scalars; uint64 rng_state and SymInt
max_q / max_k) that their backwards read. They fall back as ops without a lowering.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .common import bind_arguments, result_values, val
from .context import KIB, LoweringContext
from .ir import KernelSpec, Unsupported
from .lnc import plan_split
from .registry import register_lowering

aten = torch.ops.aten

# Tile sizes (from the context): query rows per tile = the partitions (the partition dim of the
# score tile); keys per transposed P / dS chunk = the partitions (the contraction dim of P@V, dS@K);
# keys per backward score tile = one PSUM bank of fp32 per partition.
# PSUM banks of keys per forward softmax block (one max / rescale each): 4 banks of fp32 scores
# when P and P^T are 2-byte (P^T then takes 2 banks), 2 banks for fp32 inputs (P^T as large as the
# scores).
KV_BLOCK_BANKS = {2: 4, 4: 2}
# The tensors a kernel keeps per head get the usable SBUF minus this reserve, the per-tile working
# set (forward with a mask: ~24 KiB of score / P / P^T tiles, live twice while a loop iteration
# allocates the next ones): 144 KiB of trn2's 208 KiB.
SBUF_RESERVE = 64 * KIB
# Query tiles (key chunks) whose rows a kernel stages and moves together (one DMA / instruction each
# instead of one per tile): up to 8, within 4 KiB per partition of staging tiles.
GROUP_TILES = 8
GROUP_BYTES = 4 * KIB
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _shape_params(ctx: LoweringContext, query, key, value, dropout_p, scale) -> dict:
    """Kernel params shared by forward and backward; raises Unsupported for what they do not handle."""
    if dropout_p:
        raise Unsupported("dropout > 0 in attention runs eagerly so the RNG stream matches")
    q, k, v = val(query), val(key), val(value)
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise Unsupported(f"attention kernels take [B, H, S, D] tensors, got ranks {q.dim()}, {k.dim()}, {v.dim()}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise Unsupported(f"attention kernels take one of fp32 / bf16 / fp16 for q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, q_heads, q_len, head_dim = (int(s) for s in q.shape)
    kv_heads, kv_len = int(k.shape[1]), int(k.shape[2])
    if tuple(k.shape) != tuple(v.shape) or int(k.shape[0]) != batch or int(k.shape[3]) != head_dim:
        raise Unsupported(f"key {tuple(k.shape)} / value {tuple(v.shape)} do not match query {tuple(q.shape)}")
    partitions = ctx.tile.partitions
    if head_dim > partitions:
        raise Unsupported(f"head dim {head_dim} > {partitions} does not fit the partition dim of the QK^T contraction")
    if q_heads % kv_heads:
        raise Unsupported(f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    return dict(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
        group=q_heads // kv_heads,
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
        q_tile=partitions, kv_chunk=partitions, kv_tile=ctx.tile.psum_fmax,
    )


def _mask_params(mask, shapes: dict) -> dict | None:
    """How the kernel indexes the additive mask: per leading dim "b", "h" or "0" (broadcast)."""
    if mask is None:
        return None
    m = val(mask)
    if m.dtype not in DTYPES:
        raise Unsupported(f"attention mask of dtype {m.dtype} (the kernels add float masks)")
    full = (shapes["batch"], shapes["q_heads"], shapes["q_len"], shapes["kv_len"])
    if m.dim() < 2 or m.dim() > 4:
        raise Unsupported(f"attention mask of rank {m.dim()}")
    shape = (1,) * (4 - m.dim()) + tuple(int(s) for s in m.shape)
    if any(s not in (1, f) for s, f in zip(shape, full)):
        raise Unsupported(f"attention mask {tuple(m.shape)} does not broadcast to {full}")
    if shape[3] != full[3]:
        raise Unsupported("attention mask broadcast along the key dim")
    lead = [axis if size > 1 else "0" for axis, size in zip(("b", "h"), shape[:2])][4 - m.dim():]
    return dict(lead=lead, broadcast_rows=shape[2] == 1 and full[2] > 1)


def _node_params(ctx: LoweringContext, node: fx.Node) -> tuple[dict, dict, dict | None, bool]:
    """What forward and backward read alike: the node's arguments by name, the shape params, the
    mask params and whether attention is causal."""
    args = bind_arguments(node)
    shapes = _shape_params(ctx, args["query"], args["key"], args["value"], args["dropout_p"], args["scale"])
    return args, shapes, _mask_params(args["attn_mask"], shapes), bool(args["is_causal"])


def kv_extent(shapes: dict, causal: bool, q_tile_index: int) -> int:
    """Keys a query tile attends to: all of them, or (causal) up to the end of its diagonal chunk."""
    if not causal:
        return shapes["kv_len"]
    return min(shapes["kv_len"], (q_tile_index + 1) * shapes["q_tile"])


def _score_flops(shapes: dict, causal: bool) -> int:
    """2 * D multiply-adds for every (query, key) score the kernels compute, summed over heads."""
    pairs = 0
    q_tile = shapes["q_tile"]
    for index, start in enumerate(range(0, shapes["q_len"], q_tile)):
        pairs += min(q_tile, shapes["q_len"] - start) * kv_extent(shapes, causal, index)
    return 2 * shapes["head_dim"] * pairs * shapes["batch"] * shapes["q_heads"]


def _check_sbuf(ctx: LoweringContext, what: str, nbytes: int) -> None:
    budget = ctx.sbuf_budget(SBUF_RESERVE)
    if nbytes > budget:
        raise Unsupported(f"{what} needs {nbytes // KIB} KiB per partition resident in SBUF "
                          f"(budget {budget // KIB} KiB on {ctx.target.name}); sequence too long for this kernel")


def _group(tiles: int, bytes_per_tile: int) -> int:
    """Tiles per group: at most GROUP_TILES, `tiles` and GROUP_BYTES of staging per partition, at least 1."""
    return max(1, min(GROUP_TILES, tiles, GROUP_BYTES // bytes_per_tile))


def _out_tiles(shapes: dict, itemsize: int, split: dict | None) -> int:
    """Query tiles per output group of the forward (out rows, l, bias, lse, valid columns): one when the
    query tiles are dealt out over LNC programs (a program's tiles are not adjacent)."""
    if split is not None and split["loop"] == "q_tiles":
        return 1
    return _group(-(-shapes["q_len"] // shapes["q_tile"]), shapes["head_dim"] * itemsize + 4 * 4)


def _forward_sbuf_bytes(shapes: dict, itemsize: int, mask: dict | None, out_tiles: int) -> int:
    """K^T [D, Sk], V as [P, Sk/P, D], Q^T [D, Sq]; a row-broadcast mask as [P, Sk] fp32; an output
    group's rows [P, out_tiles, D] and its fp32 columns (l, bias, lse, valid)."""
    kv_len, chunks = shapes["kv_len"], -(-shapes["kv_len"] // shapes["kv_chunk"])
    resident = (kv_len + shapes["q_len"]) * itemsize + chunks * shapes["head_dim"] * itemsize
    resident += out_tiles * (shapes["head_dim"] * itemsize + 4 * 4)
    if mask and mask["broadcast_rows"]:
        resident += kv_len * 4
    return resident


def _row_tiles(shapes: dict, itemsize: int) -> tuple[int, int]:
    """Whole query tiles whose Q / dO / O rows, lse and dQ the backward moves together (staging O, fp32
    dO * O, lse, dQ), and whole key chunks whose dK / dV it writes together (staging dK, dV); a partial
    last tile moves alone."""
    d = shapes["head_dim"]
    return (_group(shapes["q_len"] // shapes["q_tile"], d * (2 * itemsize + 4) + 4),
            _group(shapes["kv_len"] // shapes["kv_chunk"], 2 * d * itemsize))


def _backward_sbuf_bytes(shapes: dict, itemsize: int, mask: dict | None) -> int:
    """Per kv head: K^T, V^T, K and fp32 dK / dV sums, a chunk group's dK / dV staging; per query head:
    Q^T, dO^T, Q, dO, fp32 dQ sums, a row group's O rows, fp32 dO * O, lse and dQ staging."""
    d = shapes["head_dim"]
    q_len, kv_len = shapes["q_len"], shapes["kv_len"]
    q_chunks, kv_chunks = -(-q_len // shapes["q_tile"]), -(-kv_len // shapes["kv_chunk"])
    per_kv_head = 2 * kv_len * itemsize + kv_chunks * d * (itemsize + 8)
    per_q_head = 2 * q_len * itemsize + q_chunks * d * (2 * itemsize + 4) + q_chunks * 8
    row_tiles, kv_row_tiles = _row_tiles(shapes, itemsize)
    per_q_head += row_tiles * (d * (2 * itemsize + 4) + 4)
    per_kv_head += kv_row_tiles * d * 2 * itemsize
    if mask and mask["broadcast_rows"]:
        per_kv_head += kv_len * 4
    return per_kv_head + per_q_head


@register_lowering(aten._scaled_dot_product_flash_attention_for_cpu.default)
def lower_sdpa_forward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args, shapes, mask, causal = _node_params(ctx, node)
    itemsize = val(args["query"]).element_size()
    inputs = [args["query"], args["key"], args["value"]] + ([args["attn_mask"]] if mask else [])
    # out and lse rows of one (batch, head, query tile) are written by that iteration alone
    split = plan_split(ctx, {"batch": shapes["batch"], "kv_heads": shapes["kv_heads"], "group": shapes["group"],
                             "q_tiles": math.ceil(shapes["q_len"] / shapes["q_tile"])})
    out_tiles = _out_tiles(shapes, itemsize, split)
    _check_sbuf(ctx, "attention forward", _forward_sbuf_bytes(shapes, itemsize, mask, out_tiles))
    return KernelSpec(
        family="attention_fwd",
        params=dict(shapes, causal=causal, mask=mask, kv_block=KV_BLOCK_BANKS[min(itemsize, 4)] * ctx.tile.psum_fmax,
                    split=split, out_tiles=out_tiles),
        inputs=inputs,
        outputs=result_values(node),
        flops=2 * _score_flops(shapes, causal),  # QK^T and PV
        grid=ctx.lnc if split else 1,
    )


@register_lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def lower_sdpa_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    args, shapes, mask, causal = _node_params(ctx, node)
    q = val(args["query"])
    if val(args["grad_out"]).dtype != q.dtype or val(args["out"]).dtype != q.dtype:
        raise Unsupported(f"attention backward with grad_out {val(args['grad_out']).dtype} / out "
                          f"{val(args['out']).dtype} for {q.dtype} inputs")
    if val(args["logsumexp"]).dtype != torch.float32:
        raise Unsupported(f"attention backward with a {val(args['logsumexp']).dtype} logsumexp (expects fp32)")
    itemsize = q.element_size()
    _check_sbuf(ctx, "attention backward", _backward_sbuf_bytes(shapes, itemsize, mask))
    inputs = [args["grad_out"], args["query"], args["key"], args["value"], args["out"], args["logsumexp"]]
    if mask:
        inputs.append(args["attn_mask"])
    # dK / dV of a kv head sum over its query heads and every query tile: only whole kv heads split
    split = plan_split(ctx, {"batch": shapes["batch"], "kv_heads": shapes["kv_heads"]})
    return KernelSpec(
        family="attention_bwd",
        params=dict(shapes, causal=causal, mask=mask, split=split,
                    **dict(zip(("row_tiles", "kv_row_tiles"), _row_tiles(shapes, itemsize)))),
        inputs=inputs,
        outputs=result_values(node),
        flops=5 * _score_flops(shapes, causal),  # QK^T, dO V^T, P^T dO, dS^T Q, dS K
        grid=ctx.lnc if split else 1,
    )
