"""Matmul family: `mm`, `bmm`, `addmm` (and `linear`, which reaches us as `addmm`/`mm` of a
transposed weight view) -> `codegen_templates/matmul.py.j2`.

`baddbmm` is decomposed by the core table into `bmm` + pointwise, which the graph lowering may
fuse back as an epilogue.

Operand layouts. TensorE contracts over the partition dim, so both operands are needed on chip
with K on partitions: A as [K, M] (stationary) and B as [K, N] (moving). A DMA is fast only when
every partition reads a contiguous run of bytes, i.e. when the tile's partition dim is the
slower-varying dim of the HBM tensor. So for each operand the lowering looks through the host
views that produce it (`t` / `permute` / `transpose` / `expand` / batch-only `view`) to the base
tensor those views read, and passes that base as the kernel input together with its layout:
  A: "km" (base rows are K: load [K, M] tiles directly) or "mk" (load [M, K] rows, transpose on chip);
  B: "kn" (load directly) or "nk" (load [N, K] rows, transpose on chip).
Reading the base instead of the view keeps every DMA row contiguous, whatever views the graph
stacked on top. A batched operand also records, per batch dim of its base, how the flat bmm batch
index maps to it ((b // div) % mod; mod 1 = broadcast), so expanded and reshaped batches are read
in place.

Epilogues. `lower_matmul_with_epilogue(ctx, mm_node, epilogue_nodes, outputs)` is the entry point for
the graph lowering when a pointwise group consumes the matmul result: the group's program is
applied to each fp32 PSUM tile on its way to SBUF, so the matmul result never round-trips HBM.
Contract:
  - `mm_node` is an `mm` / `bmm` / `addmm` node this module lowers;
  - `epilogue_nodes` are pointwise nodes (graph order) each of whose inputs is `mm_node`, another
    epilogue node, or a value of the matmul's output shape or broadcastable to it
    (residuals, scales, bias rows);
  - `outputs` are the nodes whose values leave the kernel (`mm_node` itself may be one of them);
  - their shapes may differ from the matmul's by size-1 dims ([N, F] read as [1, N, F]), and
    `aliases` names the unit views (lowering/unit_views.py) they read through: such inputs and
    outputs are reshaped to the matmul's shape in the kernel;
  - raises `Unsupported` when the group cannot be fused; the caller then lowers the matmul and the
    pointwise group separately.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..tile_program import build_program, on_chip_name, resolve_program
from .common import val
from .context import KIB, LoweringContext
from .ir import KernelSpec, Unsupported
from .lnc import plan_split
from .registry import register_lowering
from .unit_views import same_up_to_units

aten = torch.ops.aten

# Tile sizes come from the context (TensorE, nki-reference §2): stationary [K <= partitions,
# M <= stationary_fmax], moving [K <= partitions, N <= moving_fmax].
# The operand panels (streamed ones counted twice: the next panel is allocated while the current
# one is live) get the usable SBUF minus this reserve, which holds the result, bias and epilogue
# tiles whatever the chip's SBUF size (128 KiB of panels on trn2's 208 KiB).
SBUF_RESERVE = 80 * KIB
# Upper bound on the resident A panel's rows: more rows cut B's re-reads, but past ~8 tiles the
# gain is small and the panel crowds out double buffering.
MAX_BLOCK_M = 1024
# PSUM accumulators live at once in "stream" mode (of 8 banks): the rest double-buffer and transpose.
STREAM_PSUM_BANKS = 4
# Row tiles per group ("panel" mode, no bias): a group's PSUM accumulators share one bank ([128,
# group, N], N <= 512 / group fp32) and its rows leave SBUF in one DMA (and, A flipped on TensorE,
# reach it in one: the row-staging tile [128, group, K] is kept within this many bytes per partition).
MAX_GROUP = 8
GROUP_STAGE_BYTES = 16 * KIB

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- Operand views -----------------------------------------------------------------------------


@dataclass
class Operand:
    """A matmul operand as the kernel reads it: `node` (its base) with the last two dims swapped or
    not, and the base's batch index as a function of the flat batch index b."""

    node: fx.Node
    swapped: bool
    batch_index: list[tuple[int, int]]  # per base batch dim: (div, mod) -> (b // div) % mod


def _fit_batch_index(indices: list[tuple[int, ...]], batch: int) -> list[tuple[int, int]] | None:
    """Express each base batch dim's index as (b // div) % mod over b in range(batch), or None."""
    fitted = []
    for dim in range(len(indices[0])):
        values = [index[dim] for index in indices]
        if not any(values):
            fitted.append((1, 1))
            continue
        div = next(b for b, v in enumerate(values) if v)
        mod = max(values) + 1
        if any(v != (b // div) % mod for b, v in enumerate(values)):
            return None
        fitted.append((div, mod))
    return fitted


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def _ravel(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat


def _permutation(node: fx.Node) -> list[int] | None:
    rank = val(node).dim()
    if node.target is aten.t.default:
        return [1, 0] if rank == 2 else None
    if node.target is aten.transpose.int:
        d0, d1 = (d % rank for d in node.args[1:3])
        dims = list(range(rank))
        dims[d0], dims[d1] = d1, d0
        return dims
    return [d % rank for d in node.args[1]]


_PERMUTES = {aten.t.default, aten.transpose.int, aten.permute.default}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
             aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.alias.default,
             aten.detach.default}
_VIEWS = _PERMUTES | _RESHAPES | {aten.expand.default}


def _step_back(node: fx.Node, indices: list[tuple[int, ...]], swapped: bool):
    """One view back: (input node, its batch indices, swapped) or None if `node` is not a view
    that keeps the matrix dims whole."""
    if (node.op != "call_function" or node.target not in _VIEWS or not node.args
            or not isinstance(node.args[0], fx.Node)):
        return None
    source = node.args[0]
    out_shape, in_shape = tuple(val(node).shape), tuple(val(source).shape)
    rank, in_rank = len(out_shape), len(in_shape)
    if in_rank < 2:
        return None
    if node.target in _PERMUTES:
        dims = _permutation(node)
        if dims is None or sorted(dims[-2:]) != [rank - 2, rank - 1]:
            return None
        moved = [0] * (rank - 2)
        for out_dim, in_dim in enumerate(dims[:-2]):
            moved[in_dim] = out_dim
        return source, [tuple(index[d] for d in moved) for index in indices], swapped ^ (dims[-2] == rank - 1)
    if node.target is aten.expand.default:
        if in_shape[-2:] != out_shape[-2:]:
            return None  # broadcast inside the matrix: read the stride-0 view as it is
        lead = rank - in_rank
        return source, [tuple(0 if in_shape[d] == 1 else index[lead + d] for d in range(in_rank - 2))
                        for index in indices], swapped
    if node.target in _RESHAPES:
        if in_shape[-2:] != out_shape[-2:]:
            return None
        return source, [_unravel(_ravel(index, out_shape[:-2]), in_shape[:-2]) for index in indices], swapped
    return None


def resolve_operand(node: fx.Node, batch: int) -> Operand:
    """Look through the host views producing a matmul operand to the tensor they read."""
    rank = val(node).dim()
    indices = [(b,) if rank == 3 else () for b in range(batch)]
    best = Operand(node, False, _fit_batch_index(indices, batch) if rank == 3 else [])
    swapped = False
    while (step := _step_back(node, indices, swapped)) is not None:
        node, indices, swapped = step
        fitted = _fit_batch_index(indices, batch) if indices[0] else []
        if fitted is None:
            break
        best = Operand(node, swapped, fitted)
    return best


# --- Blocking ----------------------------------------------------------------------------------


def operand_load(k_major: bool, itemsize: int) -> str:
    """How an operand's tiles reach SBUF with K on partitions.

    "direct": the base's rows are K already. Otherwise its rows are read contiguously and flipped:
    "dma_transpose" for 2-byte dtypes (the DMA engine transposes in flight and TensorE stays free
    for matmuls), "pe_transpose" for fp32 (128x128 TensorE transposes through PSUM).
    """
    if k_major:
        return "direct"
    return "dma_transpose" if itemsize == 2 else "pe_transpose"


def plan_blocking(ctx: LoweringContext, m: int, n: int, k: int, itemsize: int, staged: bool,
                  groupable: bool = False, staged_a: bool = False) -> dict:
    """Tile blocking within the target's SBUF budget (`staged`: some operand is flipped on TensorE
    and needs a row-staging tile, `staged_a`: A is; `groupable`: the result leaves PSUM as it is, so
    "panel" mode may group row tiles, see MAX_GROUP). Tiles are [tile_k = partitions, tile_m =
    stationary_fmax] and tile_n = moving_fmax columns.

    "panel": an A^T panel of `block_m` rows over the whole K stays resident while B panels of
    [K, tile_n] stream past it (double-buffered); each B panel is reused by every m-tile of the
    block, and A is read once.
    "stream" (K too long for a resident panel): per [block_m, tile_n] output block, K is walked in
    chunks of `k_chunk` tiles, accumulating into block_m / tile_m PSUM banks.
    """
    tile_k, tile_m, tile_n = ctx.tile.partitions, ctx.tile.stationary_fmax, ctx.tile.moving_fmax
    budget = ctx.sbuf_budget(SBUF_RESERVE)
    k_tiles = math.ceil(k / tile_k)
    m_padded = math.ceil(m / tile_m) * tile_m
    group = 1
    if groupable and tile_m == tile_k:
        group = min(MAX_GROUP, ctx.tile.psum_fmax // n, GROUP_STAGE_BYTES // (k * itemsize) if staged_a else MAX_GROUP)
    stage = max(2 * k_tiles * tile_k, group * k if staged_a else 0) * itemsize if staged else 0
    b_panels = 2 * k_tiles * tile_n * itemsize
    rows_fit = max(0, budget - b_panels - stage) // (k_tiles * itemsize)
    block_m = min(MAX_BLOCK_M, rows_fit // tile_m * tile_m, m_padded)
    if block_m >= tile_m:
        group = min(group, block_m // tile_m)
        return {"mode": "panel", "block_m": block_m, "k_chunk": k_tiles, "group": group if group > 1 else 1}
    block_m = min(STREAM_PSUM_BANKS * tile_m, m_padded)
    per_k_tile = 2 * (block_m + tile_n + (tile_k if staged else 0)) * itemsize
    return {"mode": "stream", "block_m": block_m, "k_chunk": max(1, budget // per_k_tile), "group": 1}


# --- Bias ----------------------------------------------------------------------------------------


def _bias_kind(shape: tuple[int, ...], m: int, n: int) -> str:
    """How an addmm bias broadcasts over the [M, N] result."""
    if math.prod(shape) == 1:
        return "scalar"
    if len(shape) == 1 or shape[0] == 1:
        return "row"
    if shape[1] == 1:
        return "col"
    return "full"


# --- Specs -----------------------------------------------------------------------------------------


def _matmul_spec(ctx: LoweringContext, node: fx.Node, a: fx.Node, b: fx.Node, bias: fx.Node | None = None,
                 beta: float = 1.0, alpha: float = 1.0) -> KernelSpec:
    a_val, b_val, out_val = val(a), val(b), val(node)
    if a_val.dtype not in SUPPORTED_DTYPES or b_val.dtype != a_val.dtype or out_val.dtype != a_val.dtype:
        raise Unsupported(f"matmul of {a_val.dtype} x {b_val.dtype} -> {out_val.dtype} "
                          f"(TensorE takes fp32/bf16/fp16 operands of one dtype)")
    batch = a_val.shape[0] if a_val.dim() == 3 else 1
    m, k = a_val.shape[-2:]
    n = b_val.shape[-1]
    if 0 in (batch, m, n, k):
        raise Unsupported("empty matmul")
    a_op, b_op = resolve_operand(a, batch), resolve_operand(b, batch)
    itemsize = a_val.element_size()
    a_load, b_load = operand_load(a_op.swapped, itemsize), operand_load(not b_op.swapped, itemsize)
    inputs = [a_op.node, b_op.node]
    params = {
        "batch": batch, "m": m, "n": n, "k": k, "alpha": float(alpha),
        "a": {"layout": "km" if a_op.swapped else "mk", "load": a_load, "batch_index": a_op.batch_index},
        "b": {"layout": "nk" if b_op.swapped else "kn", "load": b_load, "batch_index": b_op.batch_index},
        "bias": None,
        "epilogue": None,
        "blocking": plan_blocking(ctx, m, n, k, itemsize, "pe_transpose" in (a_load, b_load),
                                  groupable=bias is None, staged_a=a_load == "pe_transpose"),
    }
    block_m = params["blocking"]["block_m"]
    params["split"] = plan_split(ctx, {"batch": batch, "m": math.ceil(m / block_m),
                                       "n": math.ceil(n / ctx.tile.moving_fmax)})
    if bias is not None:
        bias_val = val(bias)
        if bias_val.dim() == 0:
            raise Unsupported("0-d addmm bias")
        if bias_val.dtype != out_val.dtype:
            raise Unsupported(f"addmm bias of dtype {bias_val.dtype} with {out_val.dtype} operands")
        params["bias"] = {"kind": _bias_kind(tuple(bias_val.shape), m, n), "beta": float(beta)}
        inputs.append(bias)
    return KernelSpec("matmul", params, inputs, [node], flops=2 * batch * m * n * k,
                      grid=ctx.lnc if params["split"] else 1)


@register_lowering(aten.mm.default, aten.bmm.default)
def lower_mm(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    a, b = node.args[:2]
    return _matmul_spec(ctx, node, a, b)


@register_lowering(aten.addmm.default)
def lower_addmm(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    bias, a, b = node.args[:3]
    beta = node.kwargs.get("beta", 1)
    alpha = node.kwargs.get("alpha", 1)
    if beta == 0:
        return _matmul_spec(ctx, node, a, b, alpha=alpha)  # torch ignores the bias (even NaNs) when beta == 0
    return _matmul_spec(ctx, node, a, b, bias, beta=beta, alpha=alpha)


_MATMUL_LOWERINGS = {aten.mm.default: lower_mm, aten.bmm.default: lower_mm, aten.addmm.default: lower_addmm}
# Ops whose pointwise consumers the graph lowering offers to `lower_matmul_with_epilogue`.
EPILOGUE_ANCHORS = frozenset(_MATMUL_LOWERINGS)


def lower_matmul_with_epilogue(ctx: LoweringContext, mm_node: fx.Node, epilogue_nodes: list[fx.Node],
                               outputs: list[fx.Node], aliases: dict[fx.Node, fx.Node] | None = None) -> KernelSpec:
    """One kernel: the matmul, then the pointwise program of `epilogue_nodes` on each output tile
    (see the module docstring for the contract).

    The matmul tile (alpha and bias applied) is evacuated to an fp32 SBUF tile that the program
    reads, so the epilogue computes from the unrounded fp32 accumulator. Other program inputs must
    have the matmul's shape (read tile by tile) or be its rows' columns ([..., M, 1]: an fp32 [P, 1]
    operand); anything else raises Unsupported.
    """
    if mm_node.target not in _MATMUL_LOWERINGS:
        raise Unsupported(f"{mm_node.target} is not a matmul this family lowers")
    spec = _MATMUL_LOWERINGS[mm_node.target](ctx, mm_node)
    spec.params["blocking"]["group"] = 1  # the epilogue works tile by tile
    out_shape = tuple(val(mm_node).shape)
    for node in epilogue_nodes:
        if not same_up_to_units(val(node).shape, out_shape):
            raise Unsupported(f"epilogue node {node.name} of shape {tuple(val(node).shape)} on a {out_shape} matmul")
    program = build_program(epilogue_nodes, outputs, out_shape, aliases)
    kinds, loads, matmul_var = {}, [], None
    for index, inp in enumerate(program.inputs):
        if inp.value is mm_node:
            matmul_var = inp.name
            program.inputs[index] = dataclasses.replace(inp, dtype=torch.float32)  # the fp32 accumulator
            kinds[inp.name] = "tile"
            continue
        if inp.shape == out_shape:
            kinds[inp.name] = "tile"
        elif inp.shape == out_shape[:-1] + (1,):
            kinds[inp.name] = "col"
        else:
            raise Unsupported(f"epilogue input {inp.value.name} of shape {inp.shape} does not tile like the "
                              f"{out_shape} matmul result")
        reshape = inp.shape if tuple(val(inp.value).shape) != inp.shape else None  # a unit-dim reshape
        loads.append({"var": inp.name, "kind": kinds[inp.name], "arg": len(spec.inputs), "dtype": inp.tile_dtype,
                      "reshape": reshape})
        spec.inputs.append(inp.value)
    if matmul_var is None:
        raise Unsupported("the epilogue does not read the matmul result")
    store_dtypes = [on_chip_name(val(node).dtype) for node, _ in program.results]
    resolved = resolve_program(program, kinds, {matmul_var}, store_dtypes)
    store_reshapes = [out_shape if tuple(val(node).shape) != out_shape else None for node, _ in program.results]
    spec.params["epilogue"] = {"matmul_var": matmul_var, "loads": loads, "instrs": resolved.instrs,
                               "stores": resolved.stores, "store_reshapes": store_reshapes, "rank": len(out_shape)}
    spec.outputs = list(outputs)
    return spec
