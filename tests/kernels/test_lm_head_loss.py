"""Fused LM head + cross-entropy kernels (lowering/lm_head_loss.py), run in the NKI interpreter
against eager: `F.cross_entropy((h @ W.t()).float(), y)` and its autograd gradients.

The forward kernel's loss, lse and count, and the backward kernel's grad_h / grad_W, for fp32 and
bf16, N and d on and off the 128 tile, vocabularies 1000 and 128256, ignored rows, the three
reductions, label smoothing, the logits-writing variant and its cotangent, and the grad_W pass
split over several row blocks; and the training forward that makes both gradients itself
(lm_head_loss_with_grads), scaled by a cotangent that is not 1 as its backward scales them, for one
physical core and split over LNC=2's two (its vocabulary chunks dealt out, the softmax statistics
and grad_h's partials exchanged through shared HBM behind core_barrier: removing either barrier
breaks the results). Tolerances: the loss math is fp32 on logits rounded as eager rounds
them, so fp32-level for the loss in both dtypes; bf16 gradients within the harness's 2e-2 of
their magnitude (eager and the kernel round dlogits and the results to bf16 the same way and differ
only in fp32 summation order; the training forward's bf16 gradients are rounded once more after
the cotangent scales them).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from neuron_inductor import sim
from neuron_inductor.lowering import lm_head_loss as fused
from neuron_inductor.lowering.context import KIB, LoweringContext

from .harness import CTX, DTYPES, assert_close, call_kernel, kernel_for, op_graph

FORWARD = torch.ops.neuron_inductor.lm_head_loss.default
FORWARD_WITH_LOGITS = torch.ops.neuron_inductor.lm_head_logits_loss.default
BACKWARD = torch.ops.neuron_inductor.lm_head_loss_backward.default
WITH_GRADS = torch.ops.neuron_inductor.lm_head_loss_with_grads.default
IGNORE = -100
LNC1 = LoweringContext.for_target("trn2", lnc=1)
LNC2 = LoweringContext.for_target("trn2", lnc=2)
LNCS = {1: LNC1, 2: LNC2}


def run(op, *args, ctx=CTX, source_check=None):
    """The kernel of `op(*args)`'s node for `ctx`, called on the args' tensors."""
    gm, tensors = op_graph(op, *args)
    _, spec, kernel = kernel_for(gm, op, source_check=source_check, ctx=ctx)
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


def check(rows, dim, vocab, dtype, reduction="mean", eps=0.0, with_logits=False, lnc=2):
    """The forward and backward kernels for `lnc` physical cores against eager; under LNC=2 both
    split their vocabulary chunks (the backward also its rows) when they have two, but for the
    forward that makes unscaled_grad_h with label smoothing (sum(W) would cross the cores too)."""
    hidden, weight, target = inputs(rows, dim, vocab, dtype)
    grad = cotangent(rows, reduction)
    grad_logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)).to(dtype) * 1e-3
                   if with_logits else None)
    loss, lse, count, logits, grad_h, grad_w = eager(hidden, weight, target, reduction, eps, grad, grad_logits)

    forward = FORWARD_WITH_LOGITS if with_logits else FORWARD
    results, forward_spec = run(forward, hidden, weight, target, IGNORE, reduction, eps, ctx=LNCS[lnc])
    splits = lnc == 2 and forward_spec.params["vocab_chunks"] > 1
    one_core = forward_spec.params["grad_h_in_forward"] and eps
    assert forward_spec.grid == (2 if splits and not one_core else 1)
    assert_close(results[0], loss)
    assert_close(results[1], lse)
    assert_close(results[2], count)
    if with_logits:
        assert_close(results[3], logits)

    extra = [grad_logits, None, results[3]] if with_logits else [None, results[3]]
    (kernel_grad_h, kernel_grad_w), spec = run(BACKWARD, grad, hidden, weight, target, results[1], results[2], IGNORE,
                                               reduction, eps, *extra, ctx=LNCS[lnc])
    assert spec.grid == (2 if splits else 1)
    assert_close(kernel_grad_h, grad_h, fp32_rtol=2e-5)
    assert_close(kernel_grad_w, grad_w, fp32_rtol=2e-5)
    return spec


@pytest.mark.parametrize("rows,dim", [(128, 128), (200, 96), (1, 33), (300, 260)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", fused.REDUCTIONS)
def test_lm_head_loss_vocab_1000(rows, dim, dtype, reduction):
    check(rows, dim, 1000, dtype, reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", fused.REDUCTIONS)
def test_lm_head_loss_one_core(dtype, reduction):
    check(130, 96, 1000, dtype, reduction, lnc=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_label_smoothing(dtype, reduction):
    check(130, 64, 1000, dtype, reduction, eps=0.1)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_written_and_their_cotangent_added(dtype, lnc):
    check(140, 72, 1000, dtype, "sum", with_logits=True, lnc=lnc)


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


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_w_over_several_row_blocks(dtype, lnc, monkeypatch):
    """The grad_W pass in blocks of 128 rows: the blocks add up in HBM (for bf16 in an fp32
    accumulator, which the last block adds on chip before the one store in W's dtype); 3 vocabulary
    chunks, unevenly shared by LNC=2's programs."""
    force_plan(monkeypatch, grad_w_block=128)
    assert check(300, 136, 1100, dtype, "mean", lnc=lnc).params["grad_w_block"] == 128


def test_hidden_size_beyond_the_panels_is_refused():
    """Too little SBUF for one row tile's panels: the lowering says so, naming the target (the node
    then falls back)."""
    small = dataclasses.replace(CTX, tile=dataclasses.replace(CTX.tile, sbuf_bytes=fused.SBUF_RESERVE + 16 * KIB))
    hidden, weight, target = inputs(8, 64, 1000, torch.float32)
    gm, _ = op_graph(FORWARD, hidden, weight, target, IGNORE, "mean", 0.0)
    with pytest.raises(fused.Unsupported, match="SBUF panels on trn2"):
        kernel_for(gm, FORWARD, ctx=small)


def check_with_grads(rows, dim, vocab, dtype, reduction, eps=0.0, target=None, lnc=2, ctx=None):
    """lm_head_loss_with_grads' kernel for `lnc` physical cores of trn2 (or for `ctx`): the loss, and
    its gradients for a cotangent of 1 (in h's and W's dtype) times a cotangent of 1.5 (what its
    backward computes) against eager's for 1.5. With LNC=2 the kernel splits its vocabulary chunks
    when it has two."""
    ctx = ctx or LNCS[lnc]
    hidden, weight, default_target = inputs(rows, dim, vocab, dtype)
    target = default_target if target is None else target
    grad = torch.tensor(1.5)
    loss, _, _, _, grad_h, grad_w = eager(hidden, weight, target, reduction, eps, grad)
    (kernel_loss, kernel_grad_h, kernel_grad_w), spec = run(WITH_GRADS, hidden, weight, target, IGNORE, reduction, eps,
                                                            ctx=ctx)
    assert kernel_grad_h.dtype == kernel_grad_w.dtype == dtype
    assert spec.grid == (ctx.lnc if spec.params["vocab_chunks"] > 1 else 1)
    assert_close(kernel_loss, loss)
    assert_close(grad * kernel_grad_h, grad_h, fp32_rtol=2e-5)
    assert_close(grad * kernel_grad_w, grad_w, fp32_rtol=2e-5)
    return spec


def test_targets_move_by_whole_row_tiles():
    """A block's targets arrive by one DMA for its whole row tiles and one for a last partial tile, and
    each step on them (int -> fp32, != ignore_index, the range check) is one instruction over those
    tiles: 1020 rows (7 tiles and 124 rows, every third ignored) take 2 target DMAs to count the rows
    not ignored and 2 for the block's pass, where one per row tile took 16 (and the bounds check's one
    probe of 128 elements, _bounds.py.j2); loss and gradients as eager's (check_with_grads)."""
    with sim.trace() as recorded:
        check_with_grads(1020, 64, 256, torch.float32, "mean", lnc=1)
    target_loads = [i for i in recorded.instructions if i.op == "dma_copy" and i.dtypes == ("int32", "int32")]
    assert len(target_loads) == 4 + 1
    assert sum(i.bytes for i in target_loads) == 2 * 1020 * 4 + 128 * 4


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("rows,dim", [(128, 128), (130, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", fused.GRAD_REDUCTIONS)
def test_gradients_in_the_forward_vocab_1000(rows, dim, dtype, reduction, lnc):
    check_with_grads(rows, dim, 1000, dtype, reduction, lnc=lnc)


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_gradients_in_the_forward_on_other_targets(target):
    """trn1 (one core: no split) and trn3 (LNC=2, its own SBUF plan) run the training kernel."""
    ctx = LoweringContext.for_target(target)
    assert check_with_grads(130, 96, 1000, torch.bfloat16, "mean", ctx=ctx).grid == ctx.lnc


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_in_the_forward_with_label_smoothing(dtype, lnc):
    check_with_grads(130, 64, 1000, dtype, "mean", eps=0.1, lnc=lnc)


@pytest.mark.slow
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_in_the_forward_vocab_128256(dtype, lnc):
    check_with_grads(130, 40, 128256, dtype, "sum", lnc=lnc)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_in_the_forward_over_several_row_blocks(dtype, lnc, monkeypatch):
    """Blocks of 128 rows: each block's grad_W adds into an fp32 accumulator by DMA (dma_compute; the
    fp32 output itself for fp32), the last block's on chip before the one store in W's dtype; 3
    vocabulary chunks, so that LNC=2's programs get unequal shares."""
    force_plan(monkeypatch, grads_block=128)
    assert check_with_grads(300, 136, 1100, dtype, "mean", lnc=lnc).params["grads_block"] == 128


def test_lnc2_programs_each_run_half_the_tensor_engine_flops():
    """Split over LNC=2, each program does about half of the 3 x 2NVd TensorE FLOPs (its vocabulary
    chunks' logits, grad_h and grad_W products), as many in all as the one-core kernel, whose grad_W
    it matches; the cost model charges the slower program, under 0.6 of the one-core time."""
    rows, dim, vocab = 256, 256, 2048
    hidden, weight, target = inputs(rows, dim, vocab, torch.bfloat16)
    flops, seconds, grad_w_rows = {}, {}, {}
    for lnc, ctx in LNCS.items():
        gm, tensors = op_graph(WITH_GRADS, hidden, weight, target, IGNORE, "mean", 0.0)
        _, spec, kernel = kernel_for(gm, WITH_GRADS, ctx=ctx)
        with sim.trace() as recorded:
            out = call_kernel(kernel, spec, tensors)
        flops[lnc] = {}
        for i in recorded.instructions:
            if i.engine == "tensor":
                flops[lnc][i.program_id] = flops[lnc].get(i.program_id, 0) + i.flops
        seconds[lnc] = recorded.estimate(target="trn2").total_seconds
        grad_w_rows[lnc] = out[2]
    useful = 6 * rows * vocab * dim
    assert list(flops[1]) == [(0,)] and sorted(flops[2]) == [(0,), (1,)]
    assert sum(flops[2].values()) == pytest.approx(sum(flops[1].values()), rel=1e-3)
    assert sum(flops[1].values()) == pytest.approx(useful, rel=0.02)
    for program_flops in flops[2].values():
        assert program_flops == pytest.approx(useful / 2, rel=0.02)
    assert seconds[2] < 0.6 * seconds[1]
    assert_close(grad_w_rows[2], grad_w_rows[1])


def lnc2_kernel_without(op, barrier_of: str | None):
    """The LNC=2 kernel of `op` (the training forward, or the forward that makes unscaled_grad_h) for
    an uneven split (3 whole vocabulary chunks: program 0 gets 2, program 1 gets 1, so program 1
    reaches each exchange first, by the DMAs of one chunk: more than an exchange's own),
    with the core_barrier on `barrier_of`'s scratch removed from its source (None: intact);
    -> (its results, the op's reference implementation's)."""
    hidden, weight, target = inputs(1000, 64, 3 * CTX.tile.psum_fmax, torch.float32)
    args = (hidden, weight, target, IGNORE, "sum", 0.0)
    gm, tensors = op_graph(op, *args)
    sources = []
    _, spec, kernel = kernel_for(gm, op, source_check=sources.append, ctx=LNC2)
    assert spec.grid == 2 and spec.params["vocab_chunks"] == 3
    if barrier_of is not None:
        barrier = f"nisa.core_barrier(data={barrier_of}, cores=tuple(range(programs)))"
        assert sources[0].count(barrier) == 1
        func = sim.load_kernels(sources[0].replace(barrier, "pass"), f"<{spec.name}>")[spec.name].func
        kernel = sim.Kernel(func, (spec.grid,), LNC2.target.name)
    return call_kernel(kernel, spec, tensors), op(*args)


@pytest.mark.parametrize("op,barriers", [(WITH_GRADS, ("row_stats", "grad_h_parts")), (FORWARD, ("row_stats",))],
                         ids=["with_grads", "forward"])
def test_lnc2_exchanges_are_ordered_by_their_barriers(op, barriers):
    """The split kernel matches its op; without a core_barrier, program 1 reads program 0's slot
    before it is written (the interpreter's lockstep programs and its NaN-filled HBM show it), and
    some results are wrong: without the statistics' barrier program 1's softmax (its grad_W rows,
    the lse of its row tiles), without the partial sums' its row tiles' grad_h. (The forward's
    softmax @ W partials cross right after the statistics' barrier, which both programs leave
    together with the same DMAs ahead of them, so lockstep cannot show a race there; the exchange
    is the same code as the training kernel's grad_h, tested here.)"""
    results, expected = lnc2_kernel_without(op, None)
    for got, want in zip(results, expected):
        assert_close(got, want, fp32_rtol=2e-5)
    for scratch in barriers:
        results, expected = lnc2_kernel_without(op, scratch)
        assert not all(torch.allclose(got, want, rtol=1e-3, atol=1e-3) for got, want in zip(results, expected)), scratch


@pytest.mark.parametrize("grid", [1, 3])
def test_lnc2_kernel_at_other_launch_sizes(grid):
    """The split kernel reads nl.num_programs(0): launched as one program it skips the exchanges and
    matches eager; launched as 3 its core_barrier (cores (0, 1) only, as on hardware) refuses."""
    hidden, weight, target = inputs(130, 64, 1000, torch.bfloat16)
    loss, _, _, _, grad_h, grad_w = eager(hidden, weight, target, "mean", 0.0, torch.tensor(1.0))
    gm, tensors = op_graph(WITH_GRADS, hidden, weight, target, IGNORE, "mean", 0.0)
    _, spec, kernel = kernel_for(gm, WITH_GRADS, ctx=LNC2)
    assert spec.grid == 2
    if grid == 3:
        with pytest.raises(sim.NkiRuleError, match="core_barrier"):
            call_kernel(kernel[grid], spec, tensors)
        return
    results = call_kernel(kernel[grid], spec, tensors)
    for got, want in zip(results, (loss, grad_h, grad_w)):
        assert_close(got, want, fp32_rtol=2e-5)


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
