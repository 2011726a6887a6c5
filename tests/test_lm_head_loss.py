"""The fused LM head + cross-entropy on the graphs users produce (passes/lm_head_loss.py): which
Dynamo patterns are rewritten, which are left alone (and why), and compiled training steps against
eager: a plain `F.cross_entropy(h @ W.t(), y)`, Hugging Face's LlamaForCausalLM with labels (which
also returns the logits), the package's TinyLlama (slices the logits before the loss), and padded
buckets. Kernel-level numerics are in tests/kernels/test_lm_head_loss.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from neuron_inductor import config
from neuron_inductor.observe import session
from neuron_inductor.passes.lm_head_loss import fuse_lm_head_loss
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig

V, D = 1000, 64


def rewrites(fn, *args) -> int:
    """How many LM head + losses the pass rewrites in fn's Dynamo graph(s)."""
    counts = []

    def capture(gm, example_inputs):
        counts.append(fuse_lm_head_loss(gm))
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=capture, fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    return sum(counts)


def data(dtype, rows=(130,)):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(*rows, D, generator=generator).to(dtype)
    w = (torch.randn(V, D, generator=generator) / D ** 0.5).to(dtype)
    y = torch.randint(0, V, (torch.Size(rows).numel(),), generator=generator)
    y[::4] = -100
    return h, w, y


PATTERNS = {
    "h @ W.t()": lambda h, w, y: F.cross_entropy(h.reshape(-1, D) @ w.t(), y),
    "matmul(h, W.t()), sum": lambda h, w, y: F.cross_entropy(torch.matmul(h.reshape(-1, D), w.t()), y, reduction="sum"),
    "linear, float, view (HF)": lambda h, w, y: F.cross_entropy(F.linear(h, w).float().view(-1, V), y),
    "linear, to(fp32), reshape, none": lambda h, w, y: F.cross_entropy(F.linear(h, w).to(torch.float32).reshape(-1, V),
                                                                       y, reduction="none"),
    "sliced, contiguous, smoothing": lambda h, w, y: F.cross_entropy(
        (h @ w.t())[:, :-1].contiguous().view(-1, V).float(), y[: y.numel() // 2 * 2].view(2, -1)[:, 1:].reshape(-1),
        label_smoothing=0.1),
}


UPCAST = ["linear, float, view (HF)", "linear, to(fp32), reshape, none", "sliced, contiguous, smoothing"]


@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in PATTERNS] + [(n, torch.bfloat16) for n in UPCAST])
def test_patterns_are_fused(name, dtype):
    h, w, y = data(dtype, rows=(2, 65))
    assert rewrites(PATTERNS[name], h, w, y) == 1


NEAR_MISSES = {
    "logits cast down": (torch.float32, lambda h, w, y: F.cross_entropy((h @ w.t()).bfloat16(), y)),
    "class weights": (torch.float32, lambda h, w, y: F.cross_entropy(h @ w.t(), y, weight=torch.ones(V))),
    "a bias": (torch.float32, lambda h, w, y: F.cross_entropy(F.linear(h, w, torch.ones(V)), y)),
    "upcast logits used twice": (torch.bfloat16, lambda h, w, y: (lambda x: F.cross_entropy(x, y) + x.mean())(
        (h @ w.t()).float())),
    "a scale between": (torch.float32, lambda h, w, y: F.cross_entropy((h @ w.t()) * 0.5, y)),
    "sliced logits also returned": (torch.float32, lambda h, w, y: (lambda x: (F.cross_entropy(x[:-1], y[:-1]), x))(
        h @ w.t())),
    "logits used before the loss": (torch.float32, lambda h, w, y: (lambda x: (x.argmax(1), F.cross_entropy(x, y)))(
        h @ w.t())),
    "probabilities as targets": (torch.float32, lambda h, w, y: F.cross_entropy(h @ w.t(), torch.softmax(h @ w.t(), 1))),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_unproven_variants_keep_the_unfused_path(name):
    dtype, fn = NEAR_MISSES[name]
    assert rewrites(fn, *data(dtype)) == 0


def test_near_miss_is_logged_with_its_reason(caplog):
    with caplog.at_level(logging.INFO, logger="neuron_inductor"):
        rewrites(NEAR_MISSES["class weights"][1], *data(torch.float32))
    assert "keeps the unfused LM head + loss path: class weights" in caplog.text


def fused_kernels(before: int) -> list[str]:
    """Families of the kernels compiled since `before` that are the fused LM head + loss."""
    return [k["family"] for p in session.BUCKETS[before:] for k in p.artifact.meta["kernels"]
            if k["family"] == "lm_head_loss"]


def compiled_step(fn, args, **options):
    """fn's result and the gradients of its float arguments, compiled (every op in a kernel)."""
    leaves = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error", **options):
            out = torch.compile(fn, backend="neuron")(*leaves)
            out.sum().backward()
    finally:
        torch._dynamo.reset()
    return out.detach(), [a.grad for a in leaves if a.is_floating_point()]


def eager_step(fn, args):
    leaves = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = fn(*leaves)
    out.sum().backward()
    return out.detach(), [a.grad for a in leaves if a.is_floating_point()]


@pytest.mark.parametrize("name,dtype", [("h @ W.t()", torch.float32), ("linear, float, view (HF)", torch.bfloat16),
                                        ("sliced, contiguous, smoothing", torch.float32),
                                        ("h @ W.t()", torch.bfloat16), ("matmul(h, W.t()), sum", torch.float32),
                                        ("linear, to(fp32), reshape, none", torch.bfloat16)])
def test_compiled_step_matches_eager(name, dtype, fresh_compile_state):
    """Mean and sum: one fused kernel, the forward, makes the loss and both gradients (the backward
    scales them by the cotangent, here 1); "none" keeps a forward and a backward kernel."""
    h, w, y = data(dtype, rows=(2, 65))
    fn = PATTERNS[name]
    before = len(session.BUCKETS)
    loss, grads = compiled_step(fn, (h, w, y))
    assert fused_kernels(before) == ["lm_head_loss"] * (2 if name.endswith("none") else 1)
    expected, expected_grads = eager_step(fn, (h, w, y))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if loss.dtype == torch.bfloat16:  # eager rounds each log-probability to bf16 before the mean
        tol_loss = 2 ** -7
    else:
        tol_loss = 1e-5
    torch.testing.assert_close(loss, expected, rtol=tol_loss, atol=tol_loss)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, rtol=tol, atol=tol * want.abs().max().item())


def test_training_step_runs_three_vocabulary_matmuls_on_tensor_engine(fresh_compile_state):
    """The forward makes both gradients: TensorE does the logits, dlogits @ W and dlogits^T @ h
    (3 x 2NVd, plus the loss's row sums), counted from the step's instruction traces, with no
    recompute; and a cotangent that is not 1 (the loss times 2.5) reaches both gradients. grad_W
    is made in W's dtype (bf16): the backward's one kernel over [V, d] scales it, and no kernel
    writes an fp32 [V, d]."""
    h, w, y = data(torch.bfloat16)
    fn = lambda h, w, y: PATTERNS["h @ W.t()"](h, w, y) * 2.5  # noqa: E731
    before = len(session.BUCKETS)
    loss, grads = compiled_step(fn, (h, w, y))
    kernels = [k for p in session.BUCKETS[before:] for k in p.artifact.meta["kernels"]]
    flops = sum(p.artifact.meta["estimates"][k["name"]]["tensor_flops"]
                for p in session.BUCKETS[before:] for k in p.artifact.meta["kernels"])
    assert flops == pytest.approx(3 * 2 * h.shape[0] * V * D, rel=0.01)
    assert [(k["family"], dtype) for k in kernels for shape, dtype in zip(k["outputs"], k["output_dtypes"])
            if shape == [V, D]] == [("lm_head_loss", "torch.bfloat16"), ("pointwise", "torch.bfloat16")]
    expected, expected_grads = eager_step(fn, (h, w, y))
    # a bf16 loss: eager rounds each log-probability to bf16 before the mean
    torch.testing.assert_close(loss, expected, rtol=2 ** -7, atol=2 ** -7)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_frozen_weight_keeps_the_forward_backward_pair(fresh_compile_state, caplog):
    """W without a gradient (a frozen LM head): grad_W is not made; the backward kernel makes grad_h."""
    h, w, y = data(torch.float32)
    h = h.requires_grad_()
    before = len(session.BUCKETS)
    torch._dynamo.reset()
    try:
        with caplog.at_level(logging.INFO, logger="neuron_inductor"), config.patch(fallback="error"):
            torch.compile(PATTERNS["h @ W.t()"], backend="neuron")(h, w, y).backward()
    finally:
        torch._dynamo.reset()
    assert "gradients made in the forward" not in caplog.text
    assert fused_kernels(before) == ["lm_head_loss", "lm_head_loss"]
    h_ref = h.detach().clone().requires_grad_()
    PATTERNS["h @ W.t()"](h_ref, w, y).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5 * h_ref.grad.abs().max().item())


def test_inference_graph_skips_the_backward_product(fresh_compile_state):
    """Under no_grad nothing reads softmax @ W: the forward kernel computes only the logits' loss."""
    h, w, y = data(torch.float32)
    before = len(session.BUCKETS)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), config.patch(fallback="error"):
            loss = torch.compile(PATTERNS["h @ W.t()"], backend="neuron")(h, w, y)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss, PATTERNS["h @ W.t()"](h, w, y), rtol=1e-5, atol=1e-5)
    kernels = [k for p in session.BUCKETS[before:] for k in p.artifact.meta["kernels"]
               if k["family"] == "lm_head_loss"]
    assert [k["flops"] for k in kernels] == [2 * h.shape[0] * D * V]


def test_option_off_keeps_the_unfused_kernels(fresh_compile_state):
    before = len(session.BUCKETS)
    compiled_step(PATTERNS["h @ W.t()"], data(torch.float32), fuse_lm_head_loss=False)
    assert fused_kernels(before) == []


def tiny_llama_steps(lengths) -> tuple[list[str], list[str]]:
    """TinyLlama (its loss reads logits[:, :-1]) compiled with dynamic=False, one training step per
    length, each with loss and gradients as eager's; returns the compiled programs' buckets and
    the fused kernels compiled."""
    cfg = TinyLlamaConfig(n_layers=1)
    model, reference = TinyLlama(cfg), TinyLlama(cfg)
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    before = len(session.BUCKETS)
    with config.patch(fallback="error"):
        for length in lengths:
            ids = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
            labels = ids.clone()
            labels[1, :3] = cfg.ignore_index
            loss, expected = compiled(ids, labels), reference(ids, labels)
            loss.backward()
            expected.backward()
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
            for param, want in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(param.grad, want.grad, rtol=1e-5, atol=1e-6 * want.grad.abs().max().item())
            model.zero_grad()
            reference.zero_grad()
    buckets = [p.plan.split("=")[-1] for p in session.BUCKETS[before:] if p.source == "compiled"]
    return buckets, fused_kernels(before)


def test_tiny_llama_training_step(fresh_compile_state):
    assert tiny_llama_steps([9]) == (["static", "static"], ["lm_head_loss"])


@pytest.mark.slow
def test_tiny_llama_training_steps_padded_to_buckets(fresh_compile_state):
    """After two exact-shape compiles the third length runs padded to the 128 bucket through the fused
    kernels (the pad rule makes padded rows ignored)."""
    assert tiny_llama_steps([5, 9, 30]) == (["static", "static", "128", "128"], ["lm_head_loss"] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hugging_face_llama_training_step(dtype, fresh_compile_state, caplog):
    """LlamaForCausalLM(labels=...) returns the loss and the logits: the fused kernels write the
    logits once and add their (zero) cotangent; loss, logits and every gradient as eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model, reference = transformers.LlamaForCausalLM(cfg).to(dtype), transformers.LlamaForCausalLM(cfg).to(dtype)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :7] = -100
    with caplog.at_level(logging.INFO, logger="neuron_inductor"), config.patch(fallback="error"):
        out = torch.compile(model, backend="neuron", dynamic=False)(input_ids=ids, labels=labels)
        out.loss.backward()
    assert "fused LM head + cross-entropy at loss (with the logits written once" in caplog.text
    expected = reference(input_ids=ids, labels=labels)
    expected.loss.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.loss, expected.loss, rtol=tol, atol=tol)
    torch.testing.assert_close(out.logits, expected.logits, rtol=tol, atol=tol * expected.logits.abs().max().item())
    for param, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, want.grad, rtol=tol, atol=tol * want.grad.abs().max().item())


def test_flop_counter_counts_the_fused_ops_as_the_unfused_matmuls():
    """FlopCounterMode (and the benches' NKI FLOPs share) counts the fused loss like the matmuls it replaces."""
    from torch.utils.flop_counter import FlopCounterMode

    from neuron_inductor.lowering import lm_head_loss  # noqa: F401  (registers the ops and their formulas)

    def counted(loss_of):
        h = torch.randn(6, 16, requires_grad=True)
        w = torch.randn(40, 16, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            loss_of(h, w, torch.randint(0, 40, (6,))).backward()
        return counter.get_total_flops()

    def fused(h, w, t):
        return torch.ops.neuron_inductor.lm_head_loss(h, w, t, -100, "mean", 0.0)[0]

    assert counted(fused) == counted(lambda h, w, t: F.cross_entropy(h @ w.t(), t)) == 6 * 6 * 40 * 16
