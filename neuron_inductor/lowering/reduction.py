"""Reductions (family `reduction`) and inclusive scans (family `cumsum`).

sum / mean / amax / amin / prod / any / all / var / var_mean reduce over any set of dims;
max.dim / min.dim / argmax / argmin over one dim (values and/or int64 indices of the first
extremum, PyTorch's rule); linalg_vector_norm of any order over any set of dims; cumsum along
one dim.

Tiling (`plan_dims`). Kernels index their HBM input by its logical shape only (it may be a
strided host view), so dims are never reordered or merged: every tile is a rectangular box of
the input whose row-major order is the row-major order of the [rows, cols] SBUF tile. Runs of
adjacent dims of the same kind (reduced / kept, size-1 dims ignored) form groups. The last group
gives the free axis of the tiles, the group before it the partition axis; every other dim is
walked one index at a time. That yields three layouts:

- "free":      kept rows on partitions, reduced elements on the free axis -> `tensor_reduce`
               (e.g. mean over the last dim for RMSNorm);
- "partition": reduced rows on partitions, kept elements on the free axis (e.g. the bias grad
               `sum(dim=0)` of a [4096, 64] tensor) -> sums are a TensorE matmul with a ones
               vector accumulating over row tiles in PSUM; other ops fold row tiles elementwise
               and finish with one TensorE transpose and a free-axis reduce;
- "full":      everything is reduced: free-axis reduce per tile, fold, transpose, reduce;
- "fold":      kept trailing elements on partitions and the free axis, every reduced dim walked
               one index at a time: each tile is combined elementwise (VectorE `tensor_tensor` on
               full-width tiles) into an SBUF accumulator of the output tile. Chosen over
               "partition" when few reduced rows would sit on the partitions (e.g. the GQA
               `repeat_interleave` backward, a sum over a middle dim of extent 2): there a ones-vector
               matmul lands each output row on one partition, and its PSUM evacuation and store
               run on one partition (`_fold_pays`).

Inside a group, tiles are boxes: the innermost dims whole, one dim cut into chunks, the outer
ones walked by index (`_box`). Arithmetic happens in fp32 (bf16 / integer inputs included);
integer sums are exact below 2**24.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.fx as fx

from .common import arg, result_values, val
from .context import LoweringContext, TileSizes
from .ir import KernelSpec, Unsupported
from .lnc import split_nest
from .registry import register_lowering

aten = torch.ops.aten

FREE_MAX = 8192  # elements per partition of a free-axis tile (32 KiB of fp32)
EXACT_INT_LIMIT = 2**24  # fp32 represents every integer below this; indices must stay below it


@dataclass(frozen=True)
class Dim:
    """How a kernel walks one input dim: in chunks of `chunk` elements on `axis`.

    axis "p" / "f": the dim lies on the partition / free axis of the tiles (chunk > 1);
    axis "loop": walked one index at a time (chunk 1) or of extent 1.
    """

    index: int
    extent: int
    reduced: bool
    axis: str
    chunk: int

    @property
    def walked(self) -> bool:
        """The kernel loops over this dim (it does not fit one tile)."""
        return self.chunk < self.extent

    def as_param(self) -> dict:
        return {**asdict(self), "walked": self.walked}


def _box(dims: list[int], shape, limit: int) -> dict[int, int]:
    """Chunk per dim of a group so that one tile covers at most `limit` elements."""
    chunks = {}
    inner = 1
    position = len(dims) - 1
    while position >= 0 and inner * shape[dims[position]] <= limit:
        chunks[dims[position]] = shape[dims[position]]
        inner *= shape[dims[position]]
        position -= 1
    if position >= 0:
        chunks[dims[position]] = limit // inner
        position -= 1
    for d in dims[: position + 1]:
        chunks[d] = 1
    return chunks


def _groups(shape, reduced: set[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for d, extent in enumerate(shape):
        if extent == 1:
            continue
        if groups and (groups[-1][-1] in reduced) == (d in reduced):
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def plan_dims(tile: TileSizes, shape, reduced: set[int], free_limit, kind: str | None = None) -> tuple[str, list[Dim]]:
    """The layout ("free" / "partition" / "full" / "fold") and how each dim is walked with `tile`'s
    partitions.

    `free_limit(layout)` gives the largest free-axis tile for that layout. `kind` (a reduction
    kind) allows the "fold" layout for kinds that combine elementwise (FOLD_KINDS); None: never.
    """
    shape = [int(s) for s in shape]
    groups = _groups(shape, reduced)
    if not groups or not any(d in reduced for g in groups for d in g):
        layout, p_group, f_group = "free", (groups[-1] if groups else []), []
    elif len(groups) == 1:
        p_group, f_group = _split(groups[0], shape)
        # with nothing on the partitions a single row of tiles is a plain free-axis reduction
        layout = "full" if p_group else "free"
    else:
        f_group, p_group = groups[-1], groups[-2]
        layout = "free" if f_group[0] in reduced else "partition"
    dims = walk_dims(tile, shape, reduced, p_group, f_group, free_limit(layout))
    if layout == "partition" and kind in FOLD_KINDS:
        kept_p, kept_f = _fold_split(groups[-1], shape, tile.partitions, free_limit("fold"))
        folded = walk_dims(tile, shape, reduced, kept_p, kept_f, free_limit("fold"))
        if _fold_pays(kind, dims, folded):
            return "fold", folded
    return layout, dims


# kinds the "fold" layout computes: one elementwise combine per reduced element (arg-reductions
# track indices and variance is two-pass: both keep their layouts)
FOLD_KINDS = frozenset({"sum", "mean", "prod", "max", "min", "any", "all"})


def _fold_split(group: list[int], shape, partitions: int, limit: int) -> tuple[list[int], list[int]]:
    """Split the kept trailing group of a "fold" walk: the longest suffix within `limit` elements
    that leaves at least `partitions` rows before it, else only the last dim on the free axis (the
    partitions are what the fold gains over ones-vector matmuls)."""
    for split in range(1, len(group)):
        if math.prod(shape[d] for d in group[:split]) >= partitions and \
                math.prod(shape[d] for d in group[split:]) <= limit:
            return group[:split], group[split:]
    return group[:-1], group[-1:]


WIDE_FOLD = 512  # a fold tile narrower than this takes part of its row dim onto the free axis


def _widened_fold(tile: TileSizes, shape, reduced: set[int], dims: list[Dim], limit: int):
    """(view shape, its reduced dims) splitting the fold's innermost partition dim [E] into [E / k, k],
    k beside the free dims, when the fold's tiles are narrower than WIDE_FOLD elements and E / k
    still fills the partitions (the GQA backward's [S, D = 128] tiles become [S / k, k * 128]: wider
    DMAs and fewer instructions); (None, None) otherwise. A split is a view of any strided input."""
    free = math.prod(d.chunk for d in dims if d.axis == "f")
    rows = [d for d in dims if d.axis == "p"]
    if free >= WIDE_FOLD or not rows:
        return None, None
    d = rows[-1].index
    ks = [k for k in range(2, limit // free + 1) if shape[d] % k == 0 and shape[d] // k >= tile.partitions]
    if not ks:
        return None, None
    k = max(ks)
    view = tuple(shape[:d]) + (shape[d] // k, k) + tuple(shape[d + 1:])
    return view, {r + 1 if r > d else r for r in reduced}


def _fold_pays(kind: str, partition: list[Dim], fold: list[Dim]) -> bool:
    """Whether the "fold" walk `fold` costs fewer cycles than the "partition" walk `partition` of the
    same reduction, counted as the cost model counts them (VectorE: elements per partition, x2 for
    a two-input op; TensorE: moving columns per matmul). With K kept and R reduced elements:

    - partition, sums: a ones-vector matmul per [rows, cols] tile (TensorE ~ R*K / rows), then every
      output element is evacuated from PSUM on one partition (VectorE ~ K);
    - partition, other kinds: elementwise folds of [rows, cols] tiles (VectorE ~ 2*R*K / rows);
    - fold: elementwise folds of [kept rows, cols] tiles and one store copy (VectorE ~ (2R + 1)*K / kept rows).
    """
    reduced = math.prod(d.extent for d in partition if d.reduced)
    reduced_rows = math.prod(d.chunk for d in partition if d.axis == "p")
    kept_rows = math.prod(d.chunk for d in fold if d.axis == "p")
    fold_cycles = (2 * reduced + 1) / kept_rows
    if kind in ("sum", "mean"):
        return fold_cycles < max(1.0, reduced / reduced_rows)
    return fold_cycles < 2 * reduced / reduced_rows


def plan_copy(tile: TileSizes, shape) -> list[Dim]:
    """How a data-movement kernel walks `shape`: trailing dims on the free axis, leading ones on
    partitions (nothing is reduced)."""
    shape = [int(s) for s in shape]
    p_group, f_group = _split([d for d, s in enumerate(shape) if s > 1], shape)
    return walk_dims(tile, shape, set(), p_group, f_group, FREE_MAX)


def _split(group: list[int], shape) -> tuple[list[int], list[int]]:
    """Split one group of dims: the longest suffix fitting a free-axis tile (at least the last
    dim) for the free axis, the rest for partitions."""
    split = max(len(group) - 1, 0)
    while split > 0 and math.prod(shape[d] for d in group[split - 1:]) <= FREE_MAX:
        split -= 1
    return group[:split], group[split:]


def walk_dims(tile: TileSizes, shape, reduced, p_group, f_group, free_limit: int) -> list[Dim]:
    """Box-tile `p_group` into at most `tile.partitions` partitions and `f_group` into at most
    free_limit elements; every other dim is walked one index at a time."""
    chunks = {d: 1 for d in range(len(shape))}
    chunks.update(_box(p_group, shape, tile.partitions))
    chunks.update(_box(f_group, shape, free_limit))
    dims = []
    for d, extent in enumerate(shape):
        chunk = min(chunks[d], extent)
        axis = ("p" if d in p_group else "f") if chunk > 1 else "loop"
        dims.append(Dim(d, extent, d in reduced, axis, chunk))
    return dims


# ---- dim arguments ------------------------------------------------------------------------------

def normalize_dims(dims, rank: int) -> set[int]:
    """Reduced dims as a set of non-negative ints; None or [] means every dim."""
    if dims is None or rank == 0:
        return set(range(rank))  # (a 0-d tensor has no dim to reduce: dim 0 / -1 name the value itself)
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return set(range(rank))
    return {d % max(rank, 1) for d in dims}


# ---- reductions ---------------------------------------------------------------------------------

# combine op of each reduction kind (tensor_reduce and tensor_tensor take the same ALU op)
COMBINE = {
    "sum": "nl.add", "mean": "nl.add", "var": "nl.add", "prod": "nl.multiply",
    "max": "nl.maximum", "min": "nl.minimum", "any": "nl.maximum", "all": "nl.minimum",
    "argmax": "nl.maximum", "argmin": "nl.minimum",
}


# what each kernel output holds, by (kind, number of outputs); default: the reduced value
RESULTS = {
    ("argmax", 1): ["index"], ("argmin", 1): ["index"],
    ("argmax", 2): ["value", "index"], ("argmin", 2): ["value", "index"],
    ("var", 2): ["value", "mean"],
}


def _free_limit(tile: TileSizes, kind: str):
    def limit(layout: str) -> int:
        if layout == "fold":
            return FREE_MAX // 2  # the fp32 accumulator, the loaded tile and the output tile live together
        if layout != "partition":
            return FREE_MAX
        # sums accumulate one PSUM bank; other ops transpose [rows, cols] tiles on TensorE
        return tile.psum_fmax if kind in ("sum", "mean") else tile.partitions
    return limit


def reduction_spec(ctx: LoweringContext, node: fx.Node, kind: str, reduced: set[int], keepdim: bool, outputs: list,
                   correction: float = 0.0, transform: str | None = None, exponent: float | None = None,
                   root: float | None = None) -> KernelSpec:
    """`transform` (see `_norm_plan`, with `exponent` for "abs_pow") maps every loaded element
    to fp32 before it is combined; `root` raises the reduced value to that power before the store."""
    x = val(node.args[0])
    shape = tuple(int(s) for s in x.shape)
    if x.dtype in (torch.float64, torch.complex64, torch.complex128):
        raise Unsupported(f"dtype {x.dtype} has no on-chip equivalent")
    if x.numel() == 0:
        raise Unsupported("reduction of an empty tensor")
    layout, dims = plan_dims(ctx.tile, shape, reduced, _free_limit(ctx.tile, kind), kind)
    count = math.prod(shape[d] for d in reduced)
    view = out_view = None
    if layout == "fold":
        view, view_reduced = _widened_fold(ctx.tile, shape, reduced, dims, _free_limit(ctx.tile, kind)("fold"))
        if view is not None:
            layout, dims = plan_dims(ctx.tile, view, view_reduced, _free_limit(ctx.tile, kind), kind)
            out_view = tuple(1 if d in view_reduced else s for d, s in enumerate(view) if keepdim or d not in view_reduced)
    if kind in ("argmax", "argmin"):
        nonunit = [d for d in reduced if shape[d] > 1]
        if len(nonunit) > 1:
            raise Unsupported("arg-reductions over several dims of a multi-dim tensor (flattened index)")
        if count >= EXACT_INT_LIMIT:
            raise Unsupported(f"indices up to {count} are not exact in fp32")
    if kind == "var" and layout != "free":
        raise Unsupported("variance is computed two-pass over free-axis tiles; reduced dims must be trailing")
    scale = None
    if kind == "mean":
        scale = 1.0 / count
    elif kind == "var":
        if count - correction <= 0:
            raise Unsupported(f"variance of {count} elements with correction {correction} divides by <= 0")
        scale = 1.0 / (count - correction)
    index_dim = next((d.index for d in dims if d.reduced and d.extent > 1), None)
    # output blocks are independent (each reduces all its reduced elements): deal them out over the LNC
    blocks = [d for d in dims if not d.reduced and d.walked]
    depth = split_nest(ctx, [[-(-d.extent // d.chunk)] for d in blocks])
    split = None if depth is None else blocks[depth].index
    params = {
        "layout": layout,
        "view": view,
        "out_view": out_view,
        "kind": kind,
        "combine": COMBINE[kind],
        "dims": [d.as_param() for d in dims],
        "keepdim": keepdim,
        "scale": scale,
        "mean_scale": 1.0 / count,
        "results": RESULTS.get((kind, len(outputs)), ["value"]),
        "index_dim": index_dim,
        "is_int_input": not x.dtype.is_floating_point,
        "transform": transform,
        "exponent": exponent,
        "root": root,
        "split": split,
    }
    return KernelSpec("reduction", params, [node.args[0]], outputs, flops=x.numel(),
                      grid=1 if split is None else ctx.lnc)


# Overloads without a dim argument: they reduce every dim.
_EVERY_DIM = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.prod.default,
             aten.any.default, aten.all.default}


def _reduced_dims(node: fx.Node) -> tuple[set[int], bool]:
    """(reduced dims, keepdim) of a reduction called as op(self, dim, keepdim), or of an _EVERY_DIM
    overload."""
    rank = val(node.args[0]).dim()
    if node.target in _EVERY_DIM:
        return set(range(rank)), False
    return normalize_dims(arg(node, 1, "dim"), rank), bool(arg(node, 2, "keepdim", False))


@register_lowering(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default)
def lower_sum(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x = val(node.args[0])
    kind = "mean" if node.target in (aten.mean.dim, aten.mean.default) else "sum"
    reduced, keepdim = _reduced_dims(node)
    if x.dtype == torch.float64 or val(node).dtype == torch.float64:
        raise Unsupported("float64")
    return reduction_spec(ctx, node, kind, reduced, keepdim, [node])


@register_lowering(aten.amax.default, aten.amin.default)
def lower_amax(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    kind = "max" if node.target is aten.amax.default else "min"
    return reduction_spec(ctx, node, kind, *_reduced_dims(node), [node])


@register_lowering(aten.max.default, aten.min.default)
def lower_max_all(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    kind = "max" if node.target is aten.max.default else "min"
    return reduction_spec(ctx, node, kind, *_reduced_dims(node), [node])


@register_lowering(aten.prod.dim_int, aten.prod.default)
def lower_prod(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    reduced, keepdim = _reduced_dims(node)
    if not val(node).dtype.is_floating_point:
        raise Unsupported("integer products overflow fp32 exactness")
    return reduction_spec(ctx, node, "prod", reduced, keepdim, [node])


@register_lowering(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.dims, aten.all.default)
def lower_any_all(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x = val(node.args[0])
    kind = "any" if node.target in (aten.any.dim, aten.any.dims, aten.any.default) else "all"
    reduced, keepdim = _reduced_dims(node)
    if x.dtype != torch.bool:
        raise Unsupported("any/all of a non-bool tensor (decompositions compare to zero first)")
    return reduction_spec(ctx, node, kind, reduced, keepdim, [node])


@register_lowering(aten.max.dim, aten.min.dim)
def lower_max_dim(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    kind = "argmax" if node.target is aten.max.dim else "argmin"
    return reduction_spec(ctx, node, kind, *_reduced_dims(node), result_values(node))


@register_lowering(aten.argmax.default, aten.argmin.default)
def lower_argmax(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x = val(node.args[0])
    kind = "argmax" if node.target is aten.argmax.default else "argmin"
    if arg(node, 1, "dim") is None and x.dim() > 1:
        raise Unsupported("argmax/argmin over a flattened multi-dim tensor")
    return reduction_spec(ctx, node, kind, *_reduced_dims(node), [node])


@register_lowering(aten.var.correction, aten.var_mean.correction)
def lower_var(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    x = val(node.args[0])
    if not x.dtype.is_floating_point:
        raise Unsupported("variance of an integer tensor")
    reduced = normalize_dims(arg(node, 1, "dim"), x.dim())
    correction = node.kwargs.get("correction")
    correction = 1.0 if correction is None else float(correction)
    keepdim = bool(node.kwargs.get("keepdim", False))
    outputs = result_values(node) if node.target is aten.var_mean.correction else [node]
    return reduction_spec(ctx, node, "var", reduced, keepdim, outputs, correction)


def _norm_plan(order: float) -> tuple[str, str, float | None]:
    """(transform, reduction kind, root) of a vector norm of `order`: sums of x*x, |x| or |x|**p
    for finite orders, the count of nonzeros for 0, max / min of |x| for +-inf."""
    if order == 2:
        return "square", "sum", 0.5
    if order == 1:
        return "abs", "sum", None
    if order == 0:
        return "nonzero", "sum", None
    if order == math.inf:
        return "abs", "max", None
    if order == -math.inf:
        return "abs", "min", None
    return "abs_pow", "sum", 1.0 / order


@register_lowering(aten.linalg_vector_norm.default)
def lower_vector_norm(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """linalg.vector_norm over any set of dims: each loaded tile is transformed elementwise in fp32
    (x*x, |x|, |x|**p or x != 0), reduced like a sum / amax / amin in every layout, and the reduced
    value raised to 1/p (power on VectorE) before the store. The `dtype` argument only sets the
    output dtype: the arithmetic is fp32 either way."""
    x = val(node.args[0])
    out = val(node)
    if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"vector norm to {out.dtype}")
    order = float(arg(node, 1, "ord", 2))
    if math.isnan(order):
        raise Unsupported("vector norm of order NaN")
    transform, kind, root = _norm_plan(order)
    reduced = normalize_dims(arg(node, 2, "dim"), x.dim())
    keepdim = bool(arg(node, 3, "keepdim", False))
    exponent = order if transform == "abs_pow" else None
    return reduction_spec(ctx, node, kind, reduced, keepdim, [node], transform=transform, exponent=exponent, root=root)


# ---- scans ------------------------------------------------------------------------------------------

@register_lowering(aten.cumsum.default)
def lower_cumsum(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """Inclusive prefix sum along `dim`, in fp32.

    Along the last non-unit dim (scan axis "f"): a Hillis-Steele log-step scan of VectorE adds on
    free-axis tiles (ping-pong between two tiles, log2(cols) steps), carrying the running total
    across column chunks. Along any other dim (scan axis "p"): the scanned dim goes on the
    partitions, the dims after it on the free axis in PSUM-bank chunks, and TensorE multiplies each
    [rows, cols] tile by an upper-triangular ones matrix (column m sums rows 0..m); the running
    totals of earlier row chunks are broadcast to every row by a ones-row matmul accumulated into
    the same PSUM tile. Dims before the scanned one are walked one index at a time. A float input
    is scanned as its finite values (non-finite ones zeroed) beside prefix counts of +inf-or-NaN
    and -inf-or-NaN elements, which the kernel turns back into inf / -inf / NaN: TensorE's 0 * inf
    would otherwise put NaN into rows the non-finite element does not reach.
    """
    x = val(node.args[0])
    out = val(node)
    if not out.dtype.is_floating_point and out.dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"cumsum to {out.dtype}")
    if out.dtype == torch.float64 or x.dtype in (torch.float64, torch.complex64, torch.complex128):
        raise Unsupported(f"cumsum of {x.dtype} to {out.dtype}: no on-chip equivalent")
    rank = x.dim()
    if rank == 0:
        raise Unsupported("cumsum of a 0-d tensor")
    dim = int(arg(node, 1, "dim")) % rank
    shape = [int(s) for s in x.shape]
    if x.numel() == 0:
        raise Unsupported("cumsum of an empty tensor")
    if not out.dtype.is_floating_point and shape[dim] >= EXACT_INT_LIMIT:
        raise Unsupported("integer prefix sums above 2**24 are not exact in fp32")
    trailing = [d for d in range(dim + 1, rank) if shape[d] > 1]
    if not trailing:
        # the scanned dim plays the role of a reduced dim: trailing, so it lands on the free axis
        _, dims = plan_dims(ctx.tile, shape, {dim}, lambda layout: FREE_MAX)
        scan_axis, guard_nonfinite = "f", False  # VectorE adds handle inf and NaN as eager does
    else:
        guard_nonfinite = x.dtype.is_floating_point
        # the finite values and two flag columns share one PSUM bank
        psum_fmax = ctx.tile.psum_fmax
        dims = walk_dims(ctx.tile, shape, {dim}, [dim], trailing, psum_fmax // 3 if guard_nonfinite else psum_fmax)
        scan_axis = "p"
    params = {"dims": [d.as_param() for d in dims], "scan_dim": dim, "scan_axis": scan_axis,
              "guard_nonfinite": guard_nonfinite, "FLT_MAX": float(torch.finfo(torch.float32).max)}
    return KernelSpec("cumsum", params, [node.args[0]], [node], flops=x.numel())
