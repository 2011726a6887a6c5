"""Pad-safety rules that neutralise padded values: an op reading padded data gets them as its
neutral element (reductions, scans, softmax, contractions, attention, scatters, losses), or is
refused when no neutral value exists (random draws, norms and sorts along a padded dim). Ops
without a rule are row-local or refused (`row_local_or_deny`, default-deny). Each rule is
`rule(rw, node)` on a `pad_rewriter.Rewriter`, registered for its ops with `@pad_rule`.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..bucketing import size_expr
from ..lowering.registry import RNG_WRAPPERS, VIEW_OPS, pad_rule
from .pad_position_rules import bound_index
from .pad_rewriter import Rewriter, Unsafe
from .padded_layout import RESHAPES, SAME_AS_FIRST, UNKNOWN, is_padded_expr, reduced_dims, tensor_inputs, tensor_val

aten = torch.ops.aten

# Ops that never move data across positions of a padded dim (besides pointwise-tagged ops).
ROW_LOCAL = SAME_AS_FIRST | RESHAPES | (VIEW_OPS - {aten.as_strided.default, aten.diagonal.default}) | {
    aten.where.self, aten.copy.default,
    aten.full.default, aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.arange.start_step,
    aten.arange.default, aten.arange.start, aten.scalar_tensor.default, aten.expand.default,
    aten.sym_size.int, aten.scatter.value, aten.scatter.src,
    aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
}

# Row-local ops that combine their operands position by position, like pointwise ops.
ELEMENTWISE_EXTRA = {aten.where.self, aten.copy_.default, aten.copy.default}
SUM_LIKE = {aten.sum.default: "zero", aten.sum.dim_IntList: "zero", aten.any.default: "zero",
            aten.any.dim: "zero", aten.any.dims: "zero", aten.prod.default: "one", aten.prod.dim_int: "one",
            aten.all.default: "one", aten.all.dim: "one", aten.amax.default: "min", aten.amin.default: "max",
            aten.argmax.default: "min", aten.argmin.default: "max", aten.logsumexp.default: "min"}
CONTRACTIONS = {  # op -> ((arg index, contracted dim), ...)
    aten.mm.default: ((0, 1), (1, 0)), aten.addmm.default: ((1, 1), (2, 0)),
    aten.bmm.default: ((0, 2), (1, 1)), aten.baddbmm.default: ((1, 2), (2, 1)),
}
CUMULATIVE = {aten.cumsum.default: "zero", aten.cumprod.default: "one", aten.logcumsumexp.default: "min"}
ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
NLL_LOSSES = {  # op -> (log-probs arg, target arg, ignore_index arg)
    aten.nll_loss_forward.default: (0, 1, 4), aten.nll_loss2d_forward.default: (0, 1, 4),
    aten.nll_loss_backward.default: (1, 2, 5), aten.nll_loss2d_backward.default: (1, 2, 5),
}
NEVER_PADDED = {  # op -> why padding along its data dims cannot be neutralised here
    aten.flip.default: "reverses a padded dim", aten.roll.default: "rotates a padded dim",
    aten.sort.default: "sorts along a padded dim", aten.topk.default: "selects along a padded dim",
    aten.native_layer_norm.default: "normalises over a padded dim",
    aten.native_layer_norm_backward.default: "normalises over a padded dim",
    aten._fused_rms_norm.default: "normalises over a padded dim",
    aten.native_group_norm.default: "normalises over a padded dim",
    aten.native_batch_norm.default: "normalises over a padded dim",
    aten._native_batch_norm_legit_functional.default: "normalises over a padded dim",
    aten.cummax.default: "returns indices across a merged padded dim",
    aten.cummin.default: "returns indices across a merged padded dim",
}


def row_local_target(target) -> bool:
    """Whether the op never moves data across positions of a padded dim."""
    if not isinstance(target, torch._ops.OpOverload):
        return True  # getitem and SymInt arithmetic
    return target in ROW_LOCAL or torch.Tag.pointwise in target.tags


@pad_rule(*SUM_LIKE, what="reduction: padded elements -> the reduction's neutral value")
def sum_like(rw: Rewriter, node: fx.Node) -> None:
    return reduction(rw, node, SUM_LIKE[node.target])


@pad_rule(aten.linalg_vector_norm.default,
          what="norm: padded elements -> 0 (ord >= 0) or the largest value (ord < 0)")
def vector_norm(rw: Rewriter, node: fx.Node) -> None:
    # sum |x|**p: zeros are neutral for p >= 0; for p < 0 (and min |x|, p = -inf) |0|**p is
    # inf, while the largest value adds ~0 (or never wins the min).
    order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
    if isinstance(order, fx.Node):
        if rw.padded_dims(node.args[0], reduced_dims(node)[0]):
            raise Unsafe("a vector norm over a padded dim whose order is a graph value")
        return None
    return reduction(rw, node, "max" if order < 0 else "zero")


@pad_rule(aten._softmax.default, aten._log_softmax.default, what="padded logits -> -inf")
def softmax(rw: Rewriter, node: fx.Node) -> None:
    return rw.mask_args(node, [(0, [node.args[1]], "min")], "padded logits -> -inf")


@pad_rule(aten._softmax_backward_data.default, what="padded grad and output -> 0")
def softmax_backward(rw: Rewriter, node: fx.Node) -> None:
    return rw.mask_args(node, [(0, [node.args[2]], "zero"), (1, [node.args[2]], "zero")], "grad, out -> 0")


@pad_rule(aten._log_softmax_backward_data.default, what="padded grad -> 0")
def log_softmax_backward(rw: Rewriter, node: fx.Node) -> None:
    return rw.mask_args(node, [(0, [node.args[2]], "zero")], "grad -> 0")


@pad_rule(*CUMULATIVE, what="scan: a merged padded dim is masked to the neutral value")
def cumulative(rw: Rewriter, node: fx.Node) -> None:
    dim = node.args[1]
    layout = rw.dim_layout(node.args[0], dim)
    if layout is not None and (layout == UNKNOWN or len(layout) > 1):
        return rw.mask_args(node, [(0, [dim], CUMULATIVE[node.target])], "merged dim masked")
    return None


@pad_rule(ATTENTION, ATTENTION_BACKWARD, what="attention: padded rows -> 0, padded keys masked (non-causal)")
def plain_attention(rw: Rewriter, node: fx.Node) -> None:
    return attention(rw, node, node.target)


@pad_rule(aten.embedding_dense_backward.default, what="grad of padded ids -> 0")
def embedding_backward(rw: Rewriter, node: fx.Node) -> None:
    grad = node.args[0]
    return rw.mask_args(node, [(0, range(tensor_val(grad).dim() - 1), "zero")], "grad of padded ids -> 0")


@pad_rule(aten.scatter_add.default, aten.scatter_reduce.two,
          what="scatter-reduce: padded sources -> the reduction's neutral value")
def scatter_reducing(rw: Rewriter, node: fx.Node) -> None:
    rw.real_positions(rw.dim_layout(node.args[0], node.args[1]))
    bound_index(rw, node, 2, node.args[0], node.args[1])
    return scatter_reduce(rw, node)


@pad_rule(aten.scatter.src, aten.scatter.value, what="scatter: refused along a padded index dim")
def scatter_overwriting(rw: Rewriter, node: fx.Node) -> None:
    rw.real_positions(rw.dim_layout(node.args[0], node.args[1]))
    if node.args[1] in rw.padded_dims(node.args[2]) or rw.padded_dims(node.args[2], [node.args[1]]):
        raise Unsafe("overwrites along a padded index dim")
    bound_index(rw, node, 2, node.args[0], node.args[1])
    return None


@pad_rule(aten.index_add.default, what="padded source rows -> 0")
def index_add(rw: Rewriter, node: fx.Node) -> None:
    rw.real_positions(rw.dim_layout(node.args[0], node.args[1]))
    return rw.mask_args(node, [(3, [node.args[1]], "zero")], "padded source rows -> 0")


@pad_rule(aten.as_strided.default, aten.diagonal.default,
          what="refused on padded data (its strides count padded positions)")
def strided_view(rw: Rewriter, node: fx.Node) -> None:
    if rw.padded_dims(node.args[0]):
        raise Unsafe("takes a strided view of padded data, whose strides count padded positions")
    return None


@pad_rule(aten.repeat.default, what="refused when it tiles a padded dim")
def repeat(rw: Rewriter, node: fx.Node) -> None:
    repeats = list(node.args[1])
    tiled = [d for d, r in enumerate(repeats[len(repeats) - tensor_val(node.args[0]).dim():]) if r != 1]
    if rw.padded_dims(node.args[0], tiled):
        raise Unsafe("tiles a padded dim")
    return None


@pad_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, what="refused along a padded dim")
def split(rw: Rewriter, node: fx.Node) -> None:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if node.target is aten.unbind.int:
        dim = node.args[1] if len(node.args) > 1 else 0
    if rw.padded_dims(node.args[0], [dim]):
        raise Unsafe("splits along a padded dim")
    return None


@pad_rule(*NEVER_PADDED, what="refused along its data dims when they are padded")
def check_untouched(rw: Rewriter, node: fx.Node) -> None:
    target = node.target
    data_dims = {
        aten.flip.default: lambda: node.args[1], aten.roll.default: lambda: node.args[2] if len(node.args) > 2 else None,
        aten.sort.default: lambda: [node.args[1] if len(node.args) > 1 else -1],
        aten.topk.default: lambda: [node.args[2] if len(node.args) > 2 else -1],
        aten.native_layer_norm.default: lambda: range(-len(node.args[1]), 0),
        aten.native_layer_norm_backward.default: lambda: range(-len(node.args[2]), 0),
        aten._fused_rms_norm.default: lambda: range(-len(node.args[1]), 0),
        aten.cummax.default: lambda: [node.args[1]], aten.cummin.default: lambda: [node.args[1]],
    }.get(target, lambda: None)()
    arg = node.args[1] if target is aten.native_layer_norm_backward.default else node.args[0]
    dims = rw.padded_dims(arg, data_dims)
    if target in (aten.cummax.default, aten.cummin.default):
        dims = [d for d in dims if len(rw.dim_layout(arg, d) or ()) != 1]
    if dims:
        raise Unsafe(NEVER_PADDED[target])


def reduction(rw: Rewriter, node: fx.Node, kind: str) -> None:
    dims, _ = reduced_dims(node)
    if node.target in (aten.argmax.default, aten.argmin.default) and dims is None and rw.padded_dims(node.args[0]):
        raise Unsafe("flattened argmax / argmin over a padded tensor")
    rw.mask_args(node, [(0, dims, kind)], f"padded elements -> {kind} neutral")


def _padded_reduction(rw: Rewriter, node: fx.Node):
    """(source, reduced dims, keepdim, reduced dims as a list) of a reduction over a padded dim; None
    when no reduced dim is padded."""
    source = node.args[0]
    dims, keepdim = reduced_dims(node)
    if not rw.padded_dims(source, dims):
        return None
    return source, dims, keepdim, list(dims) if dims is not None else list(range(tensor_val(source).dim()))


@pad_rule(aten.mean.dim, aten.mean.default, what="sum of real elements / real count")
def mean(rw: Rewriter, node: fx.Node) -> None:
    padded = _padded_reduction(rw, node)
    if padded is None:
        return
    source, dims, keepdim, dims_list = padded
    total = rw.call(aten.sum.dim_IntList, rw.masked(source, dims, "zero"), dims_list, keepdim,
                    dtype=node.kwargs.get("dtype"))
    result = rw.call(aten.div.Tensor, total, rw.count(source, dims))
    rw.replace(node, result, "sum of real elements / real count")


@pad_rule(aten.var.correction, aten.std.correction, what="centred on the real mean, divided by the real count")
def variance(rw: Rewriter, node: fx.Node) -> None:
    padded = _padded_reduction(rw, node)
    if padded is None:
        return
    source, dims, keepdim, dims_list = padded
    correction = node.kwargs.get("correction")
    correction = 1 if correction is None else correction
    count = rw.count(source, dims)
    mask = rw.mask_for(source, dims)
    zero = rw.call(aten.scalar_tensor.default, 0.0, dtype=tensor_val(source).dtype)
    total = rw.call(aten.sum.dim_IntList, rw.call(aten.where.self, mask, source, zero), dims_list, True)
    centered = rw.call(aten.sub.Tensor, source, rw.call(aten.div.Tensor, total, count))
    centered = rw.call(aten.where.self, mask, centered, zero)
    squares = rw.call(aten.sum.dim_IntList, rw.call(aten.mul.Tensor, centered, centered), dims_list, keepdim)
    result = rw.call(aten.div.Tensor, squares, rw.call(aten.sub.Tensor, count, correction))
    if node.target is aten.std.correction:
        result = rw.call(aten.sqrt.default, result)
    rw.replace(node, result, "centred on the real mean, divided by the real count")


@pad_rule(*CONTRACTIONS, what="both operands zeroed along a padded contraction dim")
def contraction(rw: Rewriter, node: fx.Node) -> None:
    specs = CONTRACTIONS[node.target]
    (a_index, a_dim), (b_index, b_dim) = specs
    a, b = node.args[a_index], node.args[b_index]
    if not rw.padded_dims(a, [a_dim]):
        return
    layout_a, layout_b = rw.dim_layout(a, a_dim), rw.dim_layout(b, b_dim)
    if UNKNOWN in (layout_a, layout_b) or layout_a != layout_b:
        raise Unsafe("contracts a padded dim whose real positions differ between the operands (or are not known)")
    rw.mask_args(node, [(a_index, [a_dim], "zero"), (b_index, [b_dim], "zero")],
                 "both operands zeroed along the padded contraction dim")


def attention(rw: Rewriter, node: fx.Node, op, first: int = 0) -> None:
    """`op` (SDPA or its backward) with its args from `node.args[first]` on (a wrapper's come later)."""
    forward = op is ATTENTION
    tensors = (0, 1, 2) if forward else (0, 1, 2, 3, 4)  # q, k, v (| grad_out, q, k, v, out)
    args = node.args[first:]
    query, key = (args[0], args[1]) if forward else (args[1], args[2])
    causal_index = 4 if forward else 7
    causal = len(args) > causal_index and bool(args[causal_index])
    if rw.padded_dims(query, [-1]) and node.kwargs.get("scale") is None:
        raise Unsafe("the head dim is padded, and the default softmax scale is 1/sqrt(its padded size)")
    key_layout, query_layout = rw.dim_layout(key, -2), rw.dim_layout(query, -2)
    if key_layout is None and query_layout is None:
        return
    if causal and query_layout != key_layout:
        raise Unsafe("causal attention whose query and key lengths are padded differently")
    if UNKNOWN in (key_layout, query_layout):
        raise Unsafe("attention over a sequence dim whose padding layout is not known")
    if causal and key_layout is not None and len(key_layout) > 1:
        # the causal mask hides padded keys only when they come after every real query
        raise Unsafe("causal attention over a merged padded sequence dim, whose padded keys precede real queries")
    dtype = tensor_val(query).dtype  # read before mask_args replaces the operands with unannotated nodes
    specs = [(first + i, [-2], "zero") for i in tensors]
    if not forward:
        specs.append((first + 5, [-1], "zero"))  # logsumexp rows of padded queries
    rw.mask_args(node, specs, "padded rows -> 0" + ("" if causal else ", padded keys masked"))
    if not causal and key_layout is not None:
        key_mask(rw, node, key, dtype)


@pad_rule(*RNG_WRAPPERS, what="attention without dropout as attention; other random ops as random ops")
def rng_wrapped(rw: Rewriter, node: fx.Node) -> None:
    """A checkpointed region's random op: attention without dropout is plain attention (SDPA is
    tagged random for its dropout argument); any other is a random op."""
    position = RNG_WRAPPERS[node.target]
    op, args = node.args[position], node.args[position + 1:]
    if op is ATTENTION and not node.kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0):
        return attention(rw, node, op, position + 1)
    return random_op(rw, node)


def random_op(rw: Rewriter, node: fx.Node) -> None:
    """Random values may be drawn only where no dim is padded."""
    results = _tensor_results(node)
    if any(rw.padded_dims(arg) for arg in tensor_inputs(node)) or any(
            is_padded_expr(size_expr(size), rw.symbols) for val in results for size in val.shape):
        raise Unsafe("draws random numbers over a padded dim, where eager draws over the real shape only")


def key_mask(rw: Rewriter, node: fx.Node, key: fx.Node, dtype: torch.dtype) -> None:
    """Non-causal attention: padded keys get -inf scores through attn_mask."""
    valid = rw.mask_for(key, [-2])  # [..., Lk, 1]
    valid = rw.call(aten.transpose.int, valid, -1, -2)  # [..., 1, Lk]
    existing = node.kwargs.get("attn_mask")
    if existing is None:
        mask = rw.call(aten.where.self, valid, rw.call(aten.scalar_tensor.default, 0.0, dtype=dtype),
                       rw.call(aten.scalar_tensor.default, -math.inf, dtype=dtype))
    elif tensor_val(existing).dtype == torch.bool:
        mask = rw.call(aten.logical_and.default, existing, valid)
    else:
        mask = rw.call(aten.where.self, valid, existing,
                       rw.call(aten.scalar_tensor.default, -math.inf, dtype=tensor_val(existing).dtype))
    node.update_kwarg("attn_mask", mask)


@pad_rule(*NLL_LOSSES, what="padded targets -> ignore_index; refused on a padded class dim")
def nll_loss(rw: Rewriter, node: fx.Node) -> None:
    log_probs_position, target_position, ignore_index_position = NLL_LOSSES[node.target]
    log_probs, target = node.args[log_probs_position], node.args[target_position]
    if rw.padded_dims(log_probs, [1]) and tensor_val(log_probs).dim() > 1:
        raise Unsafe("the class dim is padded")
    mask = rw.mask_for(target, None)
    if mask is None:
        return
    ignore = rw.call(aten.scalar_tensor.default, node.args[ignore_index_position], dtype=tensor_val(target).dtype)
    node.update_arg(target_position, rw.call(aten.where.self, mask, target, ignore))
    rw.note(node, "padded targets -> ignore_index")


def scatter_reduce(rw: Rewriter, node: fx.Node) -> None:
    kind = "zero"
    if node.target is aten.scatter_reduce.two:
        kind = {"sum": "zero", "prod": "one", "amax": "min", "amin": "max"}.get(node.args[4])
        if kind is None and rw.padded_dims(node.args[2]):
            raise Unsafe(f"scatter_reduce '{node.args[4]}' over padded sources")
        include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
        if not include_self and rw.padded_dims(node.args[2]):
            # A neutral source still counts as a contribution: the target row stops keeping itself.
            raise Unsafe("scatter_reduce without self over padded sources")
    rw.mask_args(node, [(3, None, kind)], "padded sources -> neutral")


def row_local_or_deny(rw: Rewriter, node: fx.Node) -> None:
    """Ops without a rule: a row-local one (positions never mix) is safe once operands combined
    position by position align; any other reading padded data is refused (default-deny)."""
    target = node.target
    if is_row_local(node):
        if target in ELEMENTWISE_EXTRA or (isinstance(target, torch._ops.OpOverload)
                                           and torch.Tag.pointwise in target.tags):
            rw.aligned(node, tensor_inputs(node))
        return None
    if any(rw.padded_dims(arg) for arg in tensor_inputs(node)):
        raise Unsafe("no pad-safety rule for this op and it reads padded data")
    return None


def is_row_local(node: fx.Node) -> bool:
    target = node.target
    if target is torch.ops.higher_order.auto_functionalized_v2:  # a mutating custom op: judge the op itself
        target = node.args[0]
    return row_local_target(target)


def _tensor_results(node: fx.Node) -> list[torch.Tensor]:
    """The tensors `node` returns; a wrapper node without a value gives its getitem users' values."""
    val = node.meta.get("val")
    if val is None:
        return [t for user in node.users if user.target is operator.getitem for t in _tensor_results(user)]
    values = val if isinstance(val, (tuple, list)) else [val]
    return [v for v in values if isinstance(v, torch.Tensor)]
