"""The fused LM head + cross-entropy: two custom ops and their lowering to the `lm_head_loss`
kernel family (codegen_templates/lm_head_loss.py.j2).

`passes/lm_head_loss.py` rewrites `cross_entropy(linear(h, W).float(), y)` in Dynamo graphs into
`neuron_inductor::lm_head_loss(h, W, y, ...)`; AOTAutograd then traces its autograd formula, so the
forward graph holds `lm_head_loss` and the backward graph `lm_head_loss_backward`. Neither
materialises the [N, V] logits: the kernels compute them one vocabulary chunk at a time on chip.

- forward: loss, lse (per-row log-sum-exp, fp32) and count (rows not ignored, fp32). The logits
  are rounded to h's dtype, as eager's `linear` output is, before the fp32 loss math.
- backward: dlogits = coef * (softmax - (1 - eps) * onehot - eps / V), coef = valid * grad
  (/ count for mean), recomputed per chunk from h, W and lse; grad_h = dlogits @ W,
  grad_W = dlogits^T @ h, with dlogits rounded to h's dtype as eager's cast before its matmuls.

The eager implementations below are the reference semantics and the visible host fallback.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .common import result_values, val
from .ir import KernelSpec, Unsupported
from .registry import register_lowering

REDUCTIONS = ("mean", "sum", "none")
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
                 reduction: str, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cross_entropy(hidden @ weight.T, target) without the logits: (loss, lse, count), fp32."""
    logits = _logits(hidden, weight)
    valid, lse, per_row = _smoothed_pick(logits, target, ignore_index, label_smoothing)
    count = valid.sum().float()
    loss = per_row if reduction == "none" else per_row.sum() / count if reduction == "mean" else per_row.sum()
    return loss, lse, count


@torch.library.custom_op("neuron_inductor::lm_head_logits_loss", mutates_args=())
def lm_head_logits_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                        reduction: str, label_smoothing: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """lm_head_loss when the graph also returns or reads the logits: (loss, lse, count, logits), the
    logits in hidden's dtype, written once by the forward kernel as it computes them."""
    return (*lm_head_loss(hidden, weight, target, ignore_index, reduction, label_smoothing), hidden @ weight.t())


def _fake_loss(hidden, reduction):
    rows = hidden.shape[0]
    loss = hidden.new_empty((rows,) if reduction == "none" else (), dtype=torch.float32)
    return loss, hidden.new_empty((rows,), dtype=torch.float32), hidden.new_empty((), dtype=torch.float32)


@lm_head_loss.register_fake
def _(hidden, weight, target, ignore_index, reduction, label_smoothing):
    return _fake_loss(hidden, reduction)


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
                          label_smoothing: float, grad_logits: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight) of lm_head_loss's loss for the cotangent grad_loss (plus, for
    lm_head_logits_loss, the logits' own cotangent grad_logits)."""
    logits = _logits(hidden, weight)
    vocab = logits.shape[1]
    onehot = torch.zeros_like(logits).scatter_(1, torch.where(target != ignore_index, target, 0)[:, None], 1.0)
    coef = _row_coefficients(grad_loss, target, count, ignore_index, reduction)
    dlogits = coef[:, None] * (torch.exp(logits - lse[:, None]) - (1.0 - label_smoothing) * onehot
                               - label_smoothing / vocab)
    if grad_logits is not None:
        dlogits = dlogits + grad_logits.float()
    dlogits = dlogits.to(hidden.dtype)
    return dlogits @ weight, dlogits.t() @ hidden


@lm_head_loss_backward.register_fake
def _(grad_loss, hidden, weight, target, lse, count, ignore_index, reduction, label_smoothing, grad_logits=None):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, target, ignore_index, reduction, label_smoothing = inputs
    lse, count = output[1], output[2]
    ctx.save_for_backward(hidden, weight, target, lse, count)
    ctx.options = (ignore_index, reduction, label_smoothing)
    ctx.mark_non_differentiable(lse, count)


def _backward(ctx, grad_loss, grad_lse, grad_count, grad_logits=None):
    hidden, weight, target, lse, count = ctx.saved_tensors
    grad_hidden, grad_weight = lm_head_loss_backward(grad_loss, hidden, weight, target, lse, count, *ctx.options,
                                                     grad_logits=grad_logits)
    return grad_hidden, grad_weight, None, None, None, None


lm_head_loss.register_autograd(_backward, setup_context=_setup_context)
lm_head_logits_loss.register_autograd(_backward, setup_context=_setup_context)


# --- lowering ------------------------------------------------------------------------------------

PARTITIONS = 128
# Vocabulary columns per chunk: one fp32 PSUM bank of logits per 128-row tile.
VOCAB_CHUNK = 512
# SBUF bytes per partition the resident panels and per-chunk tiles may take (trn2 has 176 KiB
# usable; the rest is headroom for tiles allocated while their predecessors are live).
SBUF_BUDGET = 150 * 1024
# Per-partition bytes of the per-chunk working tiles (class iota, logits, probabilities, masks,
# the transposed-gradient staging): a few fp32 rows of VOCAB_CHUNK columns.
CHUNK_TILE_BYTES = 8 * VOCAB_CHUNK * 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_block(rows: int, bytes_per_row: float, fixed: int) -> int:
    """The most rows (a multiple of 128, at most `rows` rounded up) whose resident panels fit SBUF
    next to `fixed` bytes per partition; raises Unsupported when not even 128 rows fit."""
    fit = int((SBUF_BUDGET - fixed) // bytes_per_row) // PARTITIONS * PARTITIONS
    if fit < PARTITIONS:
        raise Unsupported("the hidden size is too large for the fused LM head + loss kernel's SBUF panels")
    return min(fit, _cdiv(rows, PARTITIONS) * PARTITIONS)


def plan(rows: int, hidden: int, vocab: int, itemsize: int) -> dict:
    """Row blocks of each pass: the forward and the grad_h pass keep h^T of a block resident
    (and grad_h's fp32 accumulator), the grad_W pass h^T and h; each loads W's chunks once per block."""
    k_tiles = _cdiv(hidden, PARTITIONS)
    w_chunk = k_tiles * VOCAB_CHUNK * itemsize  # W^T of one vocabulary chunk
    return {
        "rows": rows, "hidden": hidden, "vocab": vocab, "k_tiles": k_tiles, "vocab_chunk": VOCAB_CHUNK,
        "vocab_chunks": _cdiv(vocab, VOCAB_CHUNK),
        "forward_block": _row_block(rows, k_tiles * itemsize + 24 / PARTITIONS * 4, w_chunk + CHUNK_TILE_BYTES),
        # grad_h: h^T and the fp32 accumulator per row; W^T and W's rows per chunk
        "grad_h_block": _row_block(rows, k_tiles * (itemsize + 4), 2 * w_chunk + CHUNK_TILE_BYTES),
        # grad_W: h^T, h and the chunk's gradient tiles per row; W^T per chunk
        "grad_w_block": _row_block(rows, 2 * k_tiles * itemsize + VOCAB_CHUNK * itemsize / PARTITIONS,
                                   w_chunk + CHUNK_TILE_BYTES),
    }


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


@register_lowering(torch.ops.neuron_inductor.lm_head_loss.default,
                   torch.ops.neuron_inductor.lm_head_logits_loss.default)
def lower_lm_head_loss(node: fx.Node) -> KernelSpec:
    hidden, weight, target, ignore_index, reduction, label_smoothing = node.args
    rows, dim, vocab = _check(hidden, weight, target, reduction)
    params = {"mode": "forward", "emit_logits": node.target is torch.ops.neuron_inductor.lm_head_logits_loss.default,
              "reduction": reduction, "ignore_index": int(ignore_index),
              "label_smoothing": float(label_smoothing), **plan(rows, dim, vocab, val(hidden).dtype.itemsize)}
    return KernelSpec("lm_head_loss", params, inputs=[hidden, weight, target], outputs=result_values(node),
                      flops=2 * rows * dim * vocab)


@register_lowering(torch.ops.neuron_inductor.lm_head_loss_backward.default)
def lower_lm_head_loss_backward(node: fx.Node) -> KernelSpec:
    grad_loss, hidden, weight, target, lse, count, ignore_index, reduction, label_smoothing, *rest = node.args
    grad_logits = rest[0] if rest else node.kwargs.get("grad_logits")
    rows, dim, vocab = _check(hidden, weight, target, reduction)
    params = {"mode": "backward", "has_grad_logits": grad_logits is not None, "reduction": reduction,
              "ignore_index": int(ignore_index), "label_smoothing": float(label_smoothing),
              **plan(rows, dim, vocab, val(hidden).dtype.itemsize)}
    extra = [grad_logits] if grad_logits is not None else []
    # The logits are recomputed in each of the two passes; each pass does one gradient matmul.
    return KernelSpec("lm_head_loss", params, inputs=[grad_loss, hidden, weight, target, lse, count, *extra],
                      outputs=result_values(node), flops=8 * rows * dim * vocab)
