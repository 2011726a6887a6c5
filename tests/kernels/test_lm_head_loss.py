"""Fused LM head + cross-entropy kernels (lowering/lm_head_loss.py), run in the NKI interpreter
against eager: `F.cross_entropy((h @ W.t()).float(), y)` and its autograd gradients.

The forward kernel's loss, lse and count, and the backward kernel's grad_h / grad_W, for fp32 and
bf16, N and d on and off the 128 tile, vocabularies 1000 and 128256, ignored rows, the three
reductions, label smoothing, the logits-writing variant and its cotangent, and the grad_W pass
split over several row blocks; and the training forward that makes both gradients itself
(lm_head_loss_with_grads), scaled by a cotangent that is not 1 as its backward scales them. Tolerances: the loss math is fp32 on logits rounded as eager rounds
them, so fp32-level for the loss in both dtypes; bf16 gradients within the harness's 2e-2 of
their magnitude (eager and the kernel round dlogits and the results to bf16 the same way and differ
only in fp32 summation order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from neuron_inductor.lowering import lm_head_loss as fused
from neuron_inductor.lowering.context import KIB

from .harness import CTX, DTYPES, assert_close, call_kernel, kernel_for, op_graph

FORWARD = torch.ops.neuron_inductor.lm_head_loss.default
FORWARD_WITH_LOGITS = torch.ops.neuron_inductor.lm_head_logits_loss.default
BACKWARD = torch.ops.neuron_inductor.lm_head_loss_backward.default
WITH_GRADS = torch.ops.neuron_inductor.lm_head_loss_with_grads.default
IGNORE = -100


def run(op, *args):
    """The kernel of `op(*args)`'s node, called on the args' tensors."""
    gm, tensors = op_graph(op, *args)
    _, spec, kernel = kernel_for(gm, op)
    return call_kernel(kernel, spec, tensors), spec


def inputs(rows, dim, vocab, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=generator).to(dtype)
    weight = (torch.randn(vocab, dim, generator=generator) * 2 / dim ** 0.5).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=generator)
    target[::3] = IGNORE
    return hidden, weight, target


def eager(hidden, weight, target, reduction, eps, grad, grad_logits=None):
    """Eager's loss, lse, count, logits and gradients (autograd through the unfused graph)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h @ w.t()
    loss = F.cross_entropy(logits.float(), target, ignore_index=IGNORE, reduction=reduction, label_smoothing=eps)
    outputs = [loss] + ([logits] if grad_logits is not None else [])
    torch.autograd.backward(outputs, [grad] + ([grad_logits] if grad_logits is not None else []))
    lse = torch.logsumexp(logits.detach().float(), dim=1)
    count = (target != IGNORE).sum().float()
    return loss.detach(), lse, count, logits.detach(), h.grad, w.grad


def cotangent(rows, reduction):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, generator=generator) if reduction == "none" else torch.tensor(1.5)


def check(rows, dim, vocab, dtype, reduction="mean", eps=0.0, with_logits=False):
    hidden, weight, target = inputs(rows, dim, vocab, dtype)
    grad = cotangent(rows, reduction)
    grad_logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)).to(dtype) * 1e-3
                   if with_logits else None)
    loss, lse, count, logits, grad_h, grad_w = eager(hidden, weight, target, reduction, eps, grad, grad_logits)

    forward = FORWARD_WITH_LOGITS if with_logits else FORWARD
    results, _ = run(forward, hidden, weight, target, IGNORE, reduction, eps)
    assert_close(results[0], loss)
    assert_close(results[1], lse)
    assert_close(results[2], count)
    if with_logits:
        assert_close(results[3], logits)

    extra = [grad_logits, None, results[3]] if with_logits else [None, results[3]]
    (kernel_grad_h, kernel_grad_w), spec = run(BACKWARD, grad, hidden, weight, target, results[1], results[2], IGNORE,
                                               reduction, eps, *extra)
    assert_close(kernel_grad_h, grad_h, fp32_rtol=2e-5)
    assert_close(kernel_grad_w, grad_w, fp32_rtol=2e-5)
    return spec


@pytest.mark.parametrize("rows,dim", [(128, 128), (200, 96), (1, 33), (300, 260)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", fused.REDUCTIONS)
def test_lm_head_loss_vocab_1000(rows, dim, dtype, reduction):
    check(rows, dim, 1000, dtype, reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_label_smoothing(dtype, reduction):
    check(130, 64, 1000, dtype, reduction, eps=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_written_and_their_cotangent_added(dtype):
    check(140, 72, 1000, dtype, "sum", with_logits=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_128256(dtype):
    check(130, 40, 128256, dtype, "mean")


def test_all_rows_ignored_mean_is_nan_with_zero_gradients():
    hidden, weight, target = inputs(50, 32, 1000, torch.float32)
    target[:] = IGNORE
    results, _ = run(FORWARD, hidden, weight, target, IGNORE, "mean", 0.0)
    assert torch.isnan(results[0]) and results[2] == 0
    grads, _ = run(BACKWARD, torch.tensor(1.0), hidden, weight, target, results[1], results[2], IGNORE, "mean", 0.0,
                   None, results[3])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def force_plan(monkeypatch, **overrides):
    """Makes the lowering's plan() return `overrides` over what it would choose (e.g. smaller blocks)."""
    plan = fused.plan
    monkeypatch.setattr(fused, "plan", lambda *args, **kwargs: {**plan(*args, **kwargs), **overrides})


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_w_over_several_row_blocks(dtype, monkeypatch):
    """The grad_W pass in blocks of 128 rows: the blocks add up in HBM (an fp32 accumulator for bf16)."""
    force_plan(monkeypatch, grad_w_block=128)
    assert check(300, 136, 1000, dtype, "mean").params["grad_w_block"] == 128


def test_hidden_size_beyond_the_panels_is_refused():
    """Too little SBUF for one row tile's panels: the lowering says so, naming the target (the node
    then falls back)."""
    small = dataclasses.replace(CTX, tile=dataclasses.replace(CTX.tile, sbuf_bytes=fused.SBUF_RESERVE + 16 * KIB))
    hidden, weight, target = inputs(8, 64, 1000, torch.float32)
    gm, _ = op_graph(FORWARD, hidden, weight, target, IGNORE, "mean", 0.0)
    with pytest.raises(fused.Unsupported, match="SBUF panels on trn2"):
        kernel_for(gm, FORWARD, ctx=small)


def check_with_grads(rows, dim, vocab, dtype, reduction, eps=0.0, target=None):
    """lm_head_loss_with_grads' kernel: the loss, and its fp32 gradients for a cotangent of 1 times a
    cotangent of 1.5 in h's dtype (what its backward computes) against eager's for 1.5."""
    hidden, weight, default_target = inputs(rows, dim, vocab, dtype)
    target = default_target if target is None else target
    grad = torch.tensor(1.5)
    loss, _, _, _, grad_h, grad_w = eager(hidden, weight, target, reduction, eps, grad)
    (kernel_loss, kernel_grad_h, kernel_grad_w), spec = run(WITH_GRADS, hidden, weight, target, IGNORE, reduction, eps)
    assert kernel_grad_h.dtype == kernel_grad_w.dtype == torch.float32
    assert_close(kernel_loss, loss)
    assert_close((grad * kernel_grad_h).to(dtype), grad_h, fp32_rtol=2e-5)
    assert_close((grad * kernel_grad_w).to(dtype), grad_w, fp32_rtol=2e-5)
    return spec


@pytest.mark.parametrize("rows,dim", [(128, 128), (130, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", fused.GRAD_REDUCTIONS)
def test_gradients_in_the_forward_vocab_1000(rows, dim, dtype, reduction):
    check_with_grads(rows, dim, 1000, dtype, reduction)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_in_the_forward_with_label_smoothing(dtype):
    check_with_grads(130, 64, 1000, dtype, "mean", eps=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_in_the_forward_vocab_128256(dtype):
    check_with_grads(130, 40, 128256, dtype, "sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_in_the_forward_over_several_row_blocks(dtype, monkeypatch):
    """Blocks of 128 rows: each block's grad_W adds into the fp32 output by DMA (dma_compute)."""
    force_plan(monkeypatch, grads_block=128)
    assert check_with_grads(300, 136, 1000, dtype, "mean").params["grads_block"] == 128


def test_gradients_in_the_forward_all_rows_ignored():
    """An all-ignored mean: loss NaN (as eager), both gradients 0 (1 / count is clamped finite)."""
    hidden, weight, target = inputs(50, 32, 1000, torch.float32)
    target[:] = IGNORE
    (loss, grad_h, grad_w), _ = run(WITH_GRADS, hidden, weight, target, IGNORE, "mean", 0.0)
    assert torch.isnan(loss)
    assert torch.equal(grad_h, torch.zeros_like(grad_h)) and torch.equal(grad_w, torch.zeros_like(grad_w))


def test_gradients_in_the_forward_refuse_reduction_none():
    """A per-row cotangent cannot be folded in before the backward: the lowering says so."""
    hidden, weight, target = inputs(8, 32, 1000, torch.float32)
    gm, _ = op_graph(WITH_GRADS, hidden, weight, target, IGNORE, "sum", 0.0)
    call = next(n for n in gm.graph.nodes if n.target is WITH_GRADS)
    call.args = (*call.args[:4], "none", call.args[5])
    with pytest.raises(fused.Unsupported, match="reduction 'none'"):
        kernel_for(gm, WITH_GRADS)
