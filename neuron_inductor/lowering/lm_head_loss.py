"""The fused LM head + cross-entropy: two custom ops and their lowering to the `lm_head_loss`
kernel family (codegen_templates/lm_head_loss.py.j2).

`passes/lm_head_loss.py` rewrites `cross_entropy(linear(h, W).float(), y)` in Dynamo graphs into
`neuron_inductor::lm_head_loss(h, W, y, ...)`; AOTAutograd then traces its autograd formula, so the
forward graph holds `lm_head_loss` and the backward graph `lm_head_loss_backward`. Neither
materialises the [N, V] logits: the kernels compute them one vocabulary chunk at a time on chip.

- forward: loss, lse (per-row log-sum-exp, fp32), count (rows not ignored, fp32) and
  unscaled_grad_h = softmax @ W - (1 - eps) * W[target] - eps / V * sum(W) (fp32 [N, d]): the
  softmax is applied to W as flash attention applies it to V (an online rescaled sum per vocabulary
  chunk), so grad_h needs no second pass over the logits. The logits are rounded to h's dtype, as
  eager's `linear` output is, before the fp32 loss math.
- backward: grad_h = coef * unscaled_grad_h per row, coef = valid * grad (/ count for mean);
  grad_W = dlogits^T @ h with dlogits = coef * (softmax - (1 - eps) * onehot - eps / V) recomputed
  per chunk from h, W and lse, rounded to h's dtype as eager's cast before its matmuls.
- `lm_head_loss_with_grads` (training, reduction mean or sum; the loss is terminal, as in
  Liger-Kernel's fused linear cross-entropy): one forward kernel makes the loss and its gradients
  for a cotangent of 1, grad_h and grad_W (in h's and W's dtype, each rounded once from fp32
  sums), with three [N, V, d] matmuls in all (logits, dlogits @ W, dlogits^T @ h) and no
  recompute; the backward only scales them by the cotangent (one pass over [V, d] in W's dtype,
  where an fp32 grad_W cost a read of 4 bytes per element and a cast).
  Per row block (as many rows as the SBUF panels hold): a pass over the vocabulary makes the
  logits and the online log-sum-exp, keeping the block's logits in a [block, V] HBM scratch; a
  second pass reads them back as dlogits, whose products with W's chunk (grad_h, accumulated in
  SBUF over the chunks) and with the block's h (grad_W's chunk, accumulated in PSUM over the
  block's rows, then added into an fp32 grad_W over the blocks, the last block's on chip) are
  made at once.
  Under LNC=2 it splits the vocabulary chunks over the programs (`_lnc_split`): each keeps its
  grad_W rows whole, and two small exchanges through shared HBM (each behind a core_barrier)
  combine the per-row log-sum-exp and sum grad_h's partials.
- `lm_head_logits_loss` (the graph also uses the logits) returns the logits instead of
  unscaled_grad_h, written once as they are made; its backward reads them back (a [N, V] read in
  h's dtype is much cheaper than recomputing them), adds their cotangent to dlogits and computes
  grad_h = dlogits @ W in a second pass over them.

The eager implementations below are the reference semantics and the visible host fallback.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.utils.flop_counter import register_flop_formula

from .common import arg, result_values, val
from .context import KIB, LoweringContext
from .ir import KernelSpec, Unsupported
from .lnc import plan_split
from .registry import register_lowering

REDUCTIONS = ("mean", "sum", "none")
GRAD_REDUCTIONS = ("mean", "sum")  # a scalar cotangent: the gradients can be made in the forward
FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (hidden @ weight.t()).float()


def _smoothed_pick(logits, target, ignore_index, label_smoothing):
    """Per row: valid, lse, and lse - (1 - eps) * logit[target] - eps / V * sum(logits)."""
    valid = target != ignore_index
    lse = torch.logsumexp(logits, dim=1)
    picked = logits.gather(1, torch.where(valid, target, 0)[:, None])[:, 0]
    loss = lse - (1.0 - label_smoothing) * picked
    if label_smoothing:
        loss = loss - label_smoothing / logits.shape[1] * logits.sum(dim=1)
    return valid, lse, torch.where(valid, loss, 0.0)


@torch.library.custom_op("neuron_inductor::lm_head_loss", mutates_args=())
def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                 reduction: str, label_smoothing: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cross_entropy(hidden @ weight.T, target) without the logits: (loss, lse, count,
    unscaled_grad_h), fp32."""
    loss, lse, count, logits = _loss(hidden, weight, target, ignore_index, reduction, label_smoothing)
    w = weight.float()
    picked = w[torch.where(target != ignore_index, target, 0)] * (target != ignore_index)[:, None]
    unscaled = torch.softmax(logits, dim=1) @ w - (1.0 - label_smoothing) * picked
    return loss, lse, count, unscaled - label_smoothing / w.shape[0] * w.sum(dim=0)


def _loss(hidden, weight, target, ignore_index, reduction, label_smoothing):
    logits = _logits(hidden, weight)
    valid, lse, per_row = _smoothed_pick(logits, target, ignore_index, label_smoothing)
    count = valid.sum().float()
    loss = per_row if reduction == "none" else per_row.sum() / count if reduction == "mean" else per_row.sum()
    return loss, lse, count, logits


def _dlogits(logits, lse, target, ignore_index, coef, label_smoothing):
    """coef * (softmax - (1 - eps) * onehot(target) - eps / V), fp32 (ignored rows have coef 0)."""
    vocab = logits.shape[1]
    onehot = torch.zeros_like(logits).scatter_(1, torch.where(target != ignore_index, target, 0)[:, None], 1.0)
    return coef[:, None] * (torch.exp(logits - lse[:, None]) - (1.0 - label_smoothing) * onehot
                            - label_smoothing / vocab)


@torch.library.custom_op("neuron_inductor::lm_head_loss_with_grads", mutates_args=())
def lm_head_loss_with_grads(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                            reduction: str, label_smoothing: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lm_head_loss for training, reduction "mean" or "sum": (loss, grad_hidden, grad_weight), the
    gradients for a cotangent of 1, in hidden's and weight's dtypes (fp32 sums rounded once);
    dlogits are rounded to hidden's dtype before their matmuls, as eager's backward rounds them."""
    if reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"lm_head_loss_with_grads takes reduction {GRAD_REDUCTIONS}, not {reduction!r} "
                         "(a per-row cotangent must reach grad_W: use lm_head_loss)")
    loss, lse, count, logits = _loss(hidden, weight, target, ignore_index, reduction, label_smoothing)
    coef = _row_coefficients(torch.tensor(1.0), target, count, ignore_index, reduction)
    dlogits = _dlogits(logits, lse, target, ignore_index, coef, label_smoothing).to(hidden.dtype).float()
    return loss, (dlogits @ weight.float()).to(hidden.dtype), (dlogits.t() @ hidden.float()).to(weight.dtype)


@lm_head_loss_with_grads.register_fake
def _(hidden, weight, target, ignore_index, reduction, label_smoothing):
    return hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden), torch.empty_like(weight)


@torch.library.custom_op("neuron_inductor::lm_head_logits_loss", mutates_args=())
def lm_head_logits_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                        reduction: str, label_smoothing: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """lm_head_loss when the graph also returns or reads the logits: (loss, lse, count, logits), the
    logits in hidden's dtype, written once by the forward kernel as it computes them."""
    return (*_loss(hidden, weight, target, ignore_index, reduction, label_smoothing)[:3], hidden @ weight.t())


def _fake_loss(hidden, reduction):
    rows = hidden.shape[0]
    loss = hidden.new_empty((rows,) if reduction == "none" else (), dtype=torch.float32)
    return loss, hidden.new_empty((rows,), dtype=torch.float32), hidden.new_empty((), dtype=torch.float32)


@lm_head_loss.register_fake
def _(hidden, weight, target, ignore_index, reduction, label_smoothing):
    return (*_fake_loss(hidden, reduction), hidden.new_empty(hidden.shape, dtype=torch.float32))


@lm_head_logits_loss.register_fake
def _(hidden, weight, target, ignore_index, reduction, label_smoothing):
    return (*_fake_loss(hidden, reduction), hidden.new_empty((hidden.shape[0], weight.shape[0])))


def _row_coefficients(grad_loss, target, count, ignore_index, reduction):
    coef = (target != ignore_index).float() * grad_loss.float()
    if reduction == "mean":
        # finite, so that rows of an all-ignored batch get 0 (as eager's nll_loss_backward does)
        coef = coef * torch.clamp(1.0 / count, max=3.0e38)
    return coef


@torch.library.custom_op("neuron_inductor::lm_head_loss_backward", mutates_args=())
def lm_head_loss_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          lse: torch.Tensor, count: torch.Tensor, ignore_index: int, reduction: str,
                          label_smoothing: float, grad_logits: torch.Tensor | None = None,
                          unscaled_grad_h: torch.Tensor | None = None, logits: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight) of the loss for the cotangent grad_loss: of lm_head_loss given its
    unscaled_grad_h, or of lm_head_logits_loss given its logits and their own cotangent grad_logits."""
    if (grad_logits is None) == (unscaled_grad_h is None) or (grad_logits is None) != (logits is None):
        raise ValueError("lm_head_loss_backward takes grad_logits and logits (lm_head_logits_loss) or "
                         "unscaled_grad_h (lm_head_loss)")
    logits = _logits(hidden, weight) if logits is None else logits.float()
    coef = _row_coefficients(grad_loss, target, count, ignore_index, reduction)
    dlogits = _dlogits(logits, lse, target, ignore_index, coef, label_smoothing)
    if grad_logits is not None:
        dlogits = (dlogits + grad_logits.float()).to(hidden.dtype)
        return dlogits @ weight, dlogits.t() @ hidden
    dlogits = dlogits.to(hidden.dtype)
    return (coef[:, None] * unscaled_grad_h).to(hidden.dtype), dlogits.t() @ hidden


@lm_head_loss_backward.register_fake
def _(grad_loss, hidden, weight, target, lse, count, ignore_index, reduction, label_smoothing, grad_logits=None,
      unscaled_grad_h=None, logits=None):
    return torch.empty_like(hidden), torch.empty_like(weight)


# Matmul-class FLOPs as torch.utils.flop_counter counts the unfused graph (FlopCounterMode, the benches):
# the logits' matmul forward, and its two gradient matmuls backward; the kernels' recompute is not useful work.
@register_flop_formula([torch.ops.neuron_inductor.lm_head_loss, torch.ops.neuron_inductor.lm_head_logits_loss])
def _lm_head_loss_flops(hidden_shape, weight_shape, *args, **kwargs) -> int:
    return 2 * math.prod(hidden_shape[:-1]) * weight_shape[0] * weight_shape[1]


@register_flop_formula(torch.ops.neuron_inductor.lm_head_loss_with_grads)
def _lm_head_loss_with_grads_flops(hidden_shape, weight_shape, *args, **kwargs) -> int:
    return 6 * math.prod(hidden_shape[:-1]) * weight_shape[0] * weight_shape[1]


@register_flop_formula(torch.ops.neuron_inductor.lm_head_loss_backward)
def _lm_head_loss_backward_flops(grad_loss_shape, hidden_shape, weight_shape, *args, **kwargs) -> int:
    return 4 * math.prod(hidden_shape[:-1]) * weight_shape[0] * weight_shape[1]


def _save(ctx, inputs, output, with_unscaled_grad_h: bool):
    """Saves h, W, target, lse, count and unscaled_grad_h or the logits (which the backward then
    reads instead of recomputing); only the loss (and the logits) have gradients."""
    hidden, weight, target, ignore_index, reduction, label_smoothing = inputs
    _, lse, count, last = output
    ctx.save_for_backward(hidden, weight, target, lse, count, last)
    ctx.options = (ignore_index, reduction, label_smoothing)
    ctx.mark_non_differentiable(lse, count, *([last] if with_unscaled_grad_h else []))


def _loss_backward(ctx, grad_loss, grad_lse, grad_count, grad_unscaled):
    hidden, weight, target, lse, count, unscaled = ctx.saved_tensors
    grad_hidden, grad_weight = lm_head_loss_backward(grad_loss, hidden, weight, target, lse, count, *ctx.options,
                                                     unscaled_grad_h=unscaled)
    return grad_hidden, grad_weight, None, None, None, None


def _logits_loss_backward(ctx, grad_loss, grad_lse, grad_count, grad_logits):
    hidden, weight, target, lse, count, logits = ctx.saved_tensors
    grad_hidden, grad_weight = lm_head_loss_backward(grad_loss, hidden, weight, target, lse, count, *ctx.options,
                                                     grad_logits=grad_logits, logits=logits)
    return grad_hidden, grad_weight, None, None, None, None


def _save_grads(ctx, inputs, output):
    """Saves the forward's gradients (the backward scales them); only the loss has a gradient."""
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.mark_non_differentiable(grad_hidden, grad_weight)


def _grads_backward(ctx, grad_loss, grad_grad_hidden, grad_grad_weight):
    # one pointwise pass over each gradient, in its parameter's dtype (grad_loss is a 0-d fp32 tensor,
    # which does not promote it)
    grad_hidden, grad_weight = ctx.saved_tensors
    return grad_loss * grad_hidden, grad_loss * grad_weight, None, None, None, None


lm_head_loss_with_grads.register_autograd(_grads_backward, setup_context=_save_grads)
lm_head_loss.register_autograd(_loss_backward, setup_context=lambda ctx, inputs, output: _save(ctx, inputs, output, True))
lm_head_logits_loss.register_autograd(_logits_loss_backward,
                                      setup_context=lambda ctx, inputs, output: _save(ctx, inputs, output, False))


# --- lowering ------------------------------------------------------------------------------------

# SBUF bytes per partition the plan leaves out of its panels: the per-tile working tiles and tiles
# allocated while their predecessors are still live (150 KiB of panels on trn2's 208 KiB).
SBUF_RESERVE = 58 * KIB
# Working tiles of one vocabulary chunk, per partition: a few fp32 rows of the chunk's columns
# (class iota, logits, probabilities, masks, the transposed staging).
CHUNK_TILES = 8 * 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_block(ctx: LoweringContext, rows: int, bytes_per_row: float, fixed: int) -> int:
    """The most rows (a multiple of the partitions, at most `rows` rounded up) whose resident panels
    fit the SBUF budget next to `fixed` bytes per partition; Unsupported when not one row tile fits."""
    partitions = ctx.tile.partitions
    fit = int((ctx.sbuf_budget(SBUF_RESERVE) - fixed) // bytes_per_row) // partitions * partitions
    if fit < partitions:
        raise Unsupported(f"the hidden size is too large for the fused LM head + loss kernel's SBUF panels on "
                          f"{ctx.target.name}")
    return min(fit, _cdiv(rows, partitions) * partitions)


def plan(ctx: LoweringContext, rows: int, hidden: int, vocab: int, itemsize: int, blocks: tuple[str, ...],
         grad_h_in_forward: bool = False) -> dict:
    """Row blocks of the kernel's passes (`blocks`, only those it runs: each must fit the SBUF
    panels): the forward and the grad_h pass keep h^T of a block resident (and an fp32 accumulator
    of softmax @ W or grad_h), the grad_W pass h^T and h; each loads W's chunks once per block. A
    vocabulary chunk is one fp32 PSUM bank of logits per row tile."""
    partitions, chunk = ctx.tile.partitions, ctx.tile.psum_fmax
    k_tiles = _cdiv(hidden, partitions)
    w_chunk = k_tiles * chunk * itemsize  # W^T (or W's rows) of one vocabulary chunk
    chunk_tiles = CHUNK_TILES * chunk
    stats = 6 * 4 / partitions  # per-row-tile fp32 statistics, per row
    # (bytes per row, fixed bytes per partition) of each pass's panels
    grad_h = (k_tiles * (itemsize + 4) + stats, 2 * w_chunk + chunk_tiles + 3 * hidden * 4)
    panels = {
        # grad_h: h^T and the fp32 accumulator per row; W^T and W's rows per chunk (and, in the
        # forward, rows of [P, d]: the result, W[target] and sum(W))
        "grad_h_block": grad_h,
        "forward_block": grad_h if grad_h_in_forward else (k_tiles * itemsize + stats, w_chunk + chunk_tiles),
        # grad_W: h^T, h and the chunk's gradient tiles per row; W^T and a [P, d] fp32 slab per chunk
        "grad_w_block": (2 * k_tiles * itemsize + chunk * itemsize / partitions + stats,
                         w_chunk + chunk_tiles + hidden * 4),
        # gradients in the forward, the larger of its two passes: the second's h rows, fp32 grad_h
        # accumulator and the chunk's dlogits per row (the first's h^T is freed for them); W's rows
        # per chunk (or the first pass's W^T), grad_W's [P, d] fp32 slab and its cast
        "grads_block": (k_tiles * (itemsize + 4) + chunk * itemsize / partitions + stats,
                        w_chunk + chunk_tiles + hidden * (4 + itemsize)),
    }
    sizes = {name: _row_block(ctx, rows, *panels[name]) for name in blocks}
    if "grads_block" in sizes:  # as few blocks as fit, of equal size: each streams W twice and adds into grad_W
        sizes["grads_block"] = _cdiv(_cdiv(rows, _cdiv(rows, sizes["grads_block"])), partitions) * partitions
    return {"rows": rows, "hidden": hidden, "vocab": vocab, "k_tiles": k_tiles, "vocab_chunk": chunk,
            "vocab_chunks": _cdiv(vocab, chunk), "grad_h_in_forward": grad_h_in_forward, **sizes}


def _check(hidden: fx.Node, weight: fx.Node, target: fx.Node, reduction: str) -> tuple[int, int, int]:
    h, w, y = val(hidden), val(weight), val(target)
    if h.dim() != 2 or w.dim() != 2 or y.dim() != 1 or h.shape[1] != w.shape[1] or y.shape[0] != h.shape[0]:
        raise Unsupported(f"shapes h {list(h.shape)}, W {list(w.shape)}, target {list(y.shape)} are not [N, d], [V, d], [N]")
    if h.dtype not in FLOAT_DTYPES or w.dtype != h.dtype:
        raise Unsupported(f"dtypes {h.dtype} / {w.dtype} (takes fp32 or bf16, the same for h and W)")
    if y.dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"target dtype {y.dtype} (takes class indices)")
    if reduction not in REDUCTIONS:
        raise Unsupported(f"reduction {reduction!r}")
    return int(h.shape[0]), int(h.shape[1]), int(w.shape[0])


def target_bounds(vocab: int, ignore_index) -> dict:
    """KernelSpec.index_bounds of a forward, which checks its targets (index_errors.py)."""
    return {"op": "cross_entropy", "dims": [1], "sizes": [vocab], "from_end": False, "error": "IndexError",
            "ignore_index": int(ignore_index)}


def _check_smoothing(label_smoothing) -> float:
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise Unsupported(f"label_smoothing {label_smoothing} (takes 0 <= eps < 1)")
    return float(label_smoothing)


@register_lowering(torch.ops.neuron_inductor.lm_head_loss.default,
                   torch.ops.neuron_inductor.lm_head_logits_loss.default)
def lower_lm_head_loss(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    hidden, weight, target, ignore_index, reduction, label_smoothing = node.args
    rows, dim, vocab = _check(hidden, weight, target, reduction)
    emit_logits = node.target is torch.ops.neuron_inductor.lm_head_logits_loss.default
    outputs = result_values(node)
    # unscaled_grad_h only where a backward reads it (an inference graph has no user for it)
    grad_h_in_forward = not emit_logits and isinstance(outputs[3], fx.Node)
    w = val(weight)
    if grad_h_in_forward and (not w.is_contiguous() or w.storage_offset()):
        raise Unsupported("W is a strided view (its rows are gathered by address from its allocation)")
    params = {"mode": "forward", "row_split": None, "emit_logits": emit_logits, "reduction": reduction,
              "ignore_index": int(ignore_index),
              "label_smoothing": _check_smoothing(label_smoothing),
              **plan(ctx, rows, dim, vocab, val(hidden).dtype.itemsize, ("forward_block",),
                     grad_h_in_forward=grad_h_in_forward)}
    # softmax @ W's partial sums cross between the cores too (rescaled to the rows' max); with label
    # smoothing so would sum(W): that forward stays on one core
    params["split"] = None if grad_h_in_forward and params["label_smoothing"] else _lnc_split(ctx, params)
    # logits, and softmax @ W for the backward
    return KernelSpec("lm_head_loss", params, inputs=[hidden, weight, target],
                      outputs=outputs if emit_logits or grad_h_in_forward else outputs[:3],
                      flops=(4 if grad_h_in_forward else 2) * rows * dim * vocab, index_bounds=target_bounds(vocab, ignore_index),
                      grid=ctx.lnc if params["split"] else 1)


@register_lowering(torch.ops.neuron_inductor.lm_head_loss_with_grads.default)
def lower_lm_head_loss_with_grads(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    hidden, weight, target, ignore_index, reduction, label_smoothing = node.args
    rows, dim, vocab = _check(hidden, weight, target, reduction)
    if reduction not in GRAD_REDUCTIONS:
        raise Unsupported(f"reduction {reduction!r} (the gradients are made in the forward for mean or sum)")
    params = {"mode": "forward_grads", "row_split": None, "emit_logits": False, "has_grad_logits": False,
              "reduction": reduction,
              "ignore_index": int(ignore_index), "label_smoothing": _check_smoothing(label_smoothing),
              **plan(ctx, rows, dim, vocab, val(hidden).dtype.itemsize, ("grads_block",))}
    params["split"] = _lnc_split(ctx, params)
    # the logits, dlogits @ W and dlogits^T @ h: no recompute
    return KernelSpec("lm_head_loss", params, inputs=[hidden, weight, target], outputs=result_values(node),
                      flops=6 * rows * dim * vocab, index_bounds=target_bounds(vocab, ignore_index),
                      grid=ctx.lnc if params["split"] else 1)


def _lnc_split(ctx: LoweringContext, params: dict) -> dict | None:
    """The kernels' LNC split: their vocabulary chunks, dealt out over the programs.

    Vocabulary rather than rows, by what crosses between the cores (through shared HBM), for the
    same halved TensorE work and the same W traffic per core: split by rows, each core would hold
    a partial fp32 grad_W of all V rows, and summing them moves 2 x V x d x 4 bytes (0.5 GB at
    d=2048, V=32000: ~1.4 ms of a core's DMA, which would take the DMA engines from 2.5 to ~3.9 ms
    against TensorE's 5.3 ms, and needs a [V, d] fp32 scratch); split by vocabulary, grad_W stays
    whole on each core, and what crosses is each row's softmax statistics (16 bytes) and grad_h's
    partials, N x d x 4 bytes (16 MB at N=2048: ~0.05 ms). The second is smaller whenever V > N,
    the usual case. None when there is one core or one chunk."""
    return plan_split(ctx, {"vocab_chunks": params["vocab_chunks"]})


@register_lowering(torch.ops.neuron_inductor.lm_head_loss_backward.default)
def lower_lm_head_loss_backward(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    grad_loss, hidden, weight, target, lse, count, ignore_index, reduction, label_smoothing = node.args[:9]
    grad_logits = arg(node, 9, "grad_logits")
    unscaled_grad_h = arg(node, 10, "unscaled_grad_h")
    logits = arg(node, 11, "logits")
    if (grad_logits is None) == (unscaled_grad_h is None) or (grad_logits is None) != (logits is None):
        raise Unsupported("takes grad_logits and logits, or unscaled_grad_h")
    rows, dim, vocab = _check(hidden, weight, target, reduction)
    params = {"mode": "backward", "has_grad_logits": grad_logits is not None, "reduction": reduction,
              "ignore_index": int(ignore_index), "label_smoothing": _check_smoothing(label_smoothing),
              **plan(ctx, rows, dim, vocab, val(hidden).dtype.itemsize,
                     ("grad_h_block", "grad_w_block") if grad_logits is not None else ("grad_w_block",))}
    # LNC split, with no exchange: the grad_W pass by vocabulary chunks, grad_h by rows (row blocks
    # of at most 1 / lnc of the rows given the logits, whose grad_h pass streams W once per block)
    params["split"] = _lnc_split(ctx, params)
    params["row_split"] = None
    if params["split"]:
        if grad_logits is not None:
            share = _cdiv(_cdiv(rows, ctx.lnc), ctx.tile.partitions) * ctx.tile.partitions
            params["grad_h_block"] = min(params["grad_h_block"], share)
            params["row_split"] = {"loop": "grad_h_blocks", "count": _cdiv(rows, params["grad_h_block"])}
        else:
            params["row_split"] = {"loop": "row_tiles", "count": _cdiv(rows, ctx.tile.partitions)}
    # The grad_W pass recomputes the logits (or, given them, reads them; then a grad_h pass reads them too).
    extra = [grad_logits, logits] if logits is not None else [unscaled_grad_h]
    return KernelSpec("lm_head_loss", params, inputs=[grad_loss, hidden, weight, target, lse, count, *extra],
                      outputs=result_values(node), flops=4 * rows * dim * vocab, grid=ctx.lnc if params["split"] else 1)
