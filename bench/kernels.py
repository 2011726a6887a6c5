"""Per-kernel benchmark: generated kernels run in the NKI interpreter, timed by its Trn2 cost model.

    python bench/kernels.py                 # every case
    python bench/kernels.py matmul_bf16     # cases whose name contains "matmul_bf16"
    python bench/kernels.py --published     # the model next to published hardware measurements

Each case traces a small function with the Neuron decomposition table, lowers the one node of
its `op`, renders the kernel, runs it on real tensors under `neuron_inductor.sim.trace()` and
reports the cost model's one-NeuronCore estimate next to the roofline: TensorE peak (79 TFLOPS
bf16 / 20 TFLOPS fp32 per core) or HBM traffic at the core's DMA bandwidth, whichever is slower.

Adding a family: append `BenchCase`s to KERNELS (`build` returns the function and its inputs) and,
for targets that need extra checks, give the case a `check`; the table and report_row stay as they
are.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_inductor import sim
from neuron_inductor.codegen.kernel_args import kernel_argument
from neuron_inductor.codegen.render import render_kernel
from neuron_inductor.decompositions import neuron_decompositions
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.registry import LOWERINGS, load_lowerings

aten = torch.ops.aten

TENSOR_PEAK_FLOPS = {torch.bfloat16: 79e12, torch.float16: 79e12, torch.float32: 20e12}  # per core, trn2
TARGET = "trn2"


@dataclass(frozen=True)
class BenchCase:
    name: str
    op: torch._ops.OpOverload            # the node of the traced graph to lower
    build: Callable[[], tuple[Callable, tuple[torch.Tensor, ...]]]
    shape: str
    dtype: torch.dtype
    target_fraction: float | None = None  # required fraction of roofline, if any
    pre_dispatch: bool = False  # trace before CompositeImplicit decompositions (keeps _fused_rms_norm)


@dataclass
class Row:
    name: str
    shape: str
    dtype: str
    estimate_us: float
    roofline_us: float
    bound: str
    instructions: int
    wall_s: float
    target_fraction: float | None

    @property
    def fraction(self) -> float:
        return self.roofline_us / self.estimate_us

    @property
    def meets_target(self) -> bool:
        return self.target_fraction is None or self.fraction >= self.target_fraction


def _node_values(gm: fx.GraphModule, args) -> dict[fx.Node, torch.Tensor]:
    values: dict[fx.Node, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            values[node] = super().run_node(node)
            return values[node]

    Recorder(gm).run(*args)
    return values


def report_row(case: BenchCase, estimate: sim.Estimate, flops: int, hbm_bytes: int, instructions: int,
               wall_s: float) -> Row:
    """One table row: the estimate against the roofline max(FLOPs / TensorE peak, bytes / DMA bandwidth)."""
    target = sim.get_target(TARGET)
    dma_bandwidth = target.dma_queues * target.dma_queue_bytes_per_s
    roofline = max(flops / TENSOR_PEAK_FLOPS[case.dtype], hbm_bytes / dma_bandwidth)
    return Row(case.name, case.shape, str(case.dtype).removeprefix("torch."), estimate.total_seconds * 1e6,
               roofline * 1e6, estimate.bound, instructions, wall_s, case.target_fraction)


def trace_case(case: BenchCase):
    """Lower the case's node, render and run its kernel; -> (spec, trace, HBM bytes, wall seconds)."""
    load_lowerings()
    fn, args = case.build()
    gm = make_fx(fn, decomposition_table=neuron_decompositions(), pre_dispatch=case.pre_dispatch)(*args)
    node = next(n for n in gm.graph.nodes if n.target is case.op)
    ctx = LoweringContext.for_target(TARGET)
    spec = LOWERINGS[node.target](ctx, node)
    spec.name = f"k0_{spec.family}"
    kernel = sim.load_kernels(render_kernel(spec, ctx), f"{spec.name}.py")[spec.name]
    values = _node_values(gm, args)
    inputs = [kernel_argument(values[n]) for n in spec.inputs]
    start = time.perf_counter()
    with sim.trace() as recorded:
        kernel(*inputs)
    wall = time.perf_counter() - start
    outputs = [values[o] for o in spec.outputs if isinstance(o, fx.Node)]
    hbm_bytes = sum(t.numel() * t.element_size() for t in [*inputs, *outputs])
    return spec, recorded, hbm_bytes, wall


def run_case(case: BenchCase) -> Row:
    spec, recorded, hbm_bytes, wall = trace_case(case)
    return report_row(case, recorded.estimate(TARGET), spec.flops, hbm_bytes, len(recorded), wall)


def format_table(rows: list[Row]) -> str:
    header = (f"{'kernel':<28} {'shape':<22} {'dtype':<9} {'trn2 est':>10} {'roofline':>10} {'% roof':>7} "
              f"{'bound':<7} {'instrs':>7} {'wall':>7}  target")
    lines = [header, "-" * len(header)]
    for r in rows:
        target = "" if r.target_fraction is None else f">= {r.target_fraction:.0%} {'ok' if r.meets_target else 'MISSED'}"
        lines.append(f"{r.name:<28} {r.shape:<22} {r.dtype:<9} {r.estimate_us:>8.1f}us {r.roofline_us:>8.1f}us "
                     f"{r.fraction:>7.1%} {r.bound:<7} {r.instructions:>7} {r.wall_s:>6.1f}s  {target}")
    return "\n".join(lines)


# --- Cases -----------------------------------------------------------------------------------------


def _randn(*shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(math.prod(shape))).to(dtype)


def _mm(m: int, k: int, n: int, dtype: torch.dtype, layout: str = "mk,kn") -> Callable:
    """`a @ b` with A stored [M, K] or [K, M] and B stored [K, N] or [N, K] (see lowering/matmul.py)."""
    a_shape = (m, k) if layout.startswith("mk") else (k, m)
    b_shape = (k, n) if layout.endswith("kn") else (n, k)

    def build():
        def fn(a, b):
            return (a if layout.startswith("mk") else a.t()) @ (b if layout.endswith("kn") else b.t())
        return fn, (_randn(*a_shape, dtype=dtype), _randn(*b_shape, dtype=dtype))
    return build


def _linear(tokens: int, d_in: int, d_out: int, dtype: torch.dtype) -> Callable:
    def build():
        return (torch.nn.functional.linear,
                (_randn(tokens, d_in, dtype=dtype), _randn(d_out, d_in, dtype=dtype), _randn(d_out, dtype=dtype)))
    return build


def _bmm(batch: int, m: int, k: int, n: int, dtype: torch.dtype) -> Callable:
    def build():
        return torch.bmm, (_randn(batch, m, k, dtype=dtype), _randn(batch, k, n, dtype=dtype))
    return build


MATMUL_CASES = [
    BenchCase("matmul_bf16_4096", aten.mm.default, _mm(4096, 4096, 4096, torch.bfloat16), "4096x4096x4096",
              torch.bfloat16, target_fraction=0.85),
    BenchCase("matmul_bf16_2048", aten.mm.default, _mm(2048, 2048, 2048, torch.bfloat16), "2048x2048x2048",
              torch.bfloat16, target_fraction=0.80),
    BenchCase("matmul_bf16_2048_AtB", aten.mm.default, _mm(2048, 2048, 2048, torch.bfloat16, "km,kn"),
              "2048x2048x2048 A^T", torch.bfloat16),
    BenchCase("matmul_fp32_2048", aten.mm.default, _mm(2048, 2048, 2048, torch.float32), "2048x2048x2048",
              torch.float32),
    BenchCase("linear_bf16_4096x2048", aten.addmm.default, _linear(4096, 2048, 2048, torch.bfloat16),
              "4096x2048->2048 +bias", torch.bfloat16),
    BenchCase("linear_fp32_4096x2048", aten.addmm.default, _linear(4096, 2048, 2048, torch.float32),
              "4096x2048->2048 +bias", torch.float32),
    BenchCase("linear_bf16_small_k", aten.mm.default, _mm(4096, 64, 256, torch.bfloat16, "mk,nk"),
              "4096x64->256", torch.bfloat16),
    BenchCase("bmm_bf16_heads", aten.bmm.default, _bmm(16, 512, 128, 512, torch.bfloat16), "16x512x128x512",
              torch.bfloat16),
    BenchCase("matmul_bf16_ragged", aten.mm.default, _mm(1000, 1000, 1000, torch.bfloat16), "1000x1000x1000",
              torch.bfloat16),
]

# --- Attention (lowering/attention.py): flash-style SDPA forward / backward ---------------------------
# FLOPs are the kernel's (spec.flops): causal counts the key chunks up to each query tile's diagonal,
# ~(S + 128) / S of the strictly lower-triangular count.


def _sdpa(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype, causal: bool,
          backward: bool = False) -> Callable:
    def build():
        # _randn seeds by shape: draw k / v / grad wider and slice, so they differ from q (and are strided).
        q = _randn(batch, heads, seq, head_dim, dtype=dtype)
        k, v = (_randn(batch, kv_heads, seq, head_dim + i, dtype=dtype)[..., :head_dim] for i in (1, 2))
        forward = aten._scaled_dot_product_flash_attention_for_cpu
        if not backward:
            return (lambda q, k, v: forward(q, k, v, 0.0, causal)), (q, k, v)
        out, lse = forward(q, k, v, 0.0, causal)
        grad = _randn(*out.shape[:-1], head_dim + 3, dtype=dtype)[..., :head_dim]
        return (lambda *args: aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, 0.0, causal),
                (grad, q, k, v, out, lse))
    return build


ATTENTION_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
ATTENTION_CASES = [
    BenchCase("attention_fwd_bf16_causal", ATTENTION_FWD, _sdpa(1, 8, 8, 4096, 128, torch.bfloat16, True),
              "1x8x4096x128 causal", torch.bfloat16, target_fraction=0.40),
    BenchCase("attention_fwd_bf16", ATTENTION_FWD, _sdpa(1, 8, 8, 2048, 128, torch.bfloat16, False),
              "1x8x2048x128", torch.bfloat16),
    BenchCase("attention_fwd_bf16_gqa", ATTENTION_FWD, _sdpa(1, 8, 2, 2048, 64, torch.bfloat16, True),
              "1x8(2)x2048x64 causal", torch.bfloat16),
    BenchCase("attention_fwd_fp32_causal", ATTENTION_FWD, _sdpa(1, 4, 4, 1024, 64, torch.float32, True),
              "1x4x1024x64 causal", torch.float32),
    BenchCase("attention_bwd_bf16_causal", ATTENTION_BWD, _sdpa(1, 8, 8, 4096, 128, torch.bfloat16, True, True),
              "1x8x4096x128 causal", torch.bfloat16),
    BenchCase("attention_bwd_bf16_gqa", ATTENTION_BWD, _sdpa(1, 8, 2, 2048, 64, torch.bfloat16, True, True),
              "1x8(2)x2048x64 causal", torch.bfloat16),
]

# --- Norms, softmax, cross-entropy (lowering/norms.py) ---------------------------------------------
# All memory-bound: the roofline is the HBM traffic at the core's DMA bandwidth.


def _rms_norm(rows: int, cols: int, dtype: torch.dtype) -> Callable:
    def build():
        return ((lambda x, w: aten._fused_rms_norm(x, [cols], w, 1e-6)),
                (_randn(rows, cols, dtype=dtype), _randn(cols, dtype=dtype)))
    return build


def _layer_norm(rows: int, cols: int, dtype: torch.dtype) -> Callable:
    """Forward and backward in one graph (the backward node reads the forward's mean and rstd)."""
    def build():
        def fn(x, w, b, dy):
            _, mean, rstd = aten.native_layer_norm(x, [cols], w, b, 1e-5)
            return aten.native_layer_norm_backward(dy, x, [cols], mean, rstd, w, b, [True, True, True])
        return fn, (_randn(rows, cols, dtype=dtype), _randn(cols, dtype=dtype), _randn(cols + 1, dtype=dtype)[1:],
                    _randn(rows, cols + 1, dtype=dtype)[:, 1:])
    return build


def _softmax(rows: int, cols: int, dtype: torch.dtype, log: bool) -> Callable:
    """Forward and the backward of sum(out * dy) in one graph."""
    def build():
        def fn(x, dy):
            return torch.func.vjp(lambda t: torch.log_softmax(t, -1) if log else torch.softmax(t, -1), x)[1](dy)[0]
        return fn, (_randn(rows, cols, dtype=dtype), _randn(rows, cols + 1, dtype=dtype)[:, 1:])
    return build


def _cross_entropy(rows: int, classes: int, dtype: torch.dtype) -> Callable:
    """F.cross_entropy (mean) and its gradient: _log_softmax, nll_loss_forward / backward, ..."""
    def build():
        target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(rows))
        return (lambda x: torch.func.grad(lambda z: torch.nn.functional.cross_entropy(z, target))(x),
                (_randn(rows, classes, dtype=dtype),))
    return build


NORM_CASES = [
    BenchCase("rms_norm_bf16", aten._fused_rms_norm.default, _rms_norm(8192, 4096, torch.bfloat16), "8192x4096",
              torch.bfloat16, target_fraction=0.60, pre_dispatch=True),
    BenchCase("layer_norm_bf16", aten.native_layer_norm.default, _layer_norm(2048, 4096, torch.bfloat16),
              "2048x4096 +w +b", torch.bfloat16),
    BenchCase("layer_norm_bwd_bf16", aten.native_layer_norm_backward.default,
              _layer_norm(2048, 4096, torch.bfloat16), "2048x4096 dx dw db", torch.bfloat16),
    BenchCase("softmax_bf16", aten._softmax.default, _softmax(2048, 4096, torch.bfloat16, False), "2048x4096",
              torch.bfloat16),
    BenchCase("softmax_bwd_bf16", aten._softmax_backward_data.default, _softmax(2048, 4096, torch.bfloat16, False),
              "2048x4096", torch.bfloat16),
    BenchCase("log_softmax_vocab_fp32", aten._log_softmax.default, _softmax(512, 32000, torch.float32, True),
              "512x32000", torch.float32),
    BenchCase("log_softmax_bwd_vocab_fp32", aten._log_softmax_backward_data.default,
              _softmax(512, 32000, torch.float32, True), "512x32000", torch.float32),
    BenchCase("nll_loss_vocab_fp32", aten.nll_loss_forward.default, _cross_entropy(512, 32000, torch.float32),
              "512x32000 mean", torch.float32),
    BenchCase("nll_loss_bwd_vocab_fp32", aten.nll_loss_backward.default, _cross_entropy(512, 32000, torch.float32),
              "512x32000 mean", torch.float32),
]

# --- Convolution (lowering/convolution.py): implicit GEMM on TensorE --------------------------------


def _conv2d(batch: int, channels: int, size: int, out_channels: int, kernel: int, dtype: torch.dtype,
            backward: bool = False) -> Callable:
    """conv2d stride 1 padding kernel // 2; backward: convolution_backward with every output."""
    def build():
        x = _randn(batch, channels, size, size, dtype=dtype)
        w = _randn(out_channels, channels, kernel, kernel, dtype=dtype)
        if not backward:
            return (lambda x, w: torch.nn.functional.conv2d(x, w, padding=kernel // 2)), (x, w)
        grad = _randn(batch, out_channels, size, size, dtype=dtype)
        return ((lambda grad, x, w: aten.convolution_backward(grad, x, w, [out_channels], [1, 1], [kernel // 2] * 2,
                                                              [1, 1], False, [0, 0], 1, [True, True, True])),
                (grad, x, w))
    return build


def _depthwise_conv1d(batch: int, channels: int, length: int, kernel: int, dtype: torch.dtype) -> Callable:
    """Mamba's causal conv1d: depthwise, padding kernel - 1, with bias."""
    def build():
        return ((lambda x, w, b: torch.nn.functional.conv1d(x, w, b, padding=kernel - 1, groups=channels)),
                (_randn(batch, channels, length, dtype=dtype), _randn(channels, 1, kernel, dtype=dtype),
                 _randn(channels, dtype=dtype)))
    return build


CONV_CASES = [
    BenchCase("conv2d_bf16_3x3", aten.convolution.default, _conv2d(8, 256, 32, 256, 3, torch.bfloat16),
              "8x256x32x32 * 256x256x3x3", torch.bfloat16),
    BenchCase("conv2d_bwd_bf16_3x3", aten.convolution_backward.default,
              _conv2d(8, 256, 32, 256, 3, torch.bfloat16, backward=True), "8x256x32x32 * 256x256x3x3", torch.bfloat16),
    BenchCase("conv1d_depthwise_bf16", aten.convolution.default, _depthwise_conv1d(2, 1536, 1024, 4, torch.bfloat16),
              "2x1536x1024 k4 depthwise", torch.bfloat16),
]

KERNELS: dict[str, BenchCase] = {case.name: case for case in MATMUL_CASES + ATTENTION_CASES + NORM_CASES + CONV_CASES}


# --- Published figures (python bench/kernels.py --published) ---------------------------------------
# Measured on hardware by others, next to what the cost model says for the closest kernel we can run.
# A model figure above a published one means the model is optimistic there (our kernels are not
# better than AWS's hand-tuned ones); see the README's cost-model section.

MATMUL_TUTORIAL = ("aws-neuron-sdk nki/tutorials/matrix_multiplication.rst (commit 1db4d74e, Oct 2025; the tutorial "
                   "code is aws-neuron/nki-samples' matrix_multiplication): [4096,8192] @ [8192,8192] bf16 on "
                   "Trn1.32xlarge, P99 latency")
AUTOTUNE = ("awslabs/nki-autotune kernel_library/README.md and .claude/rules/learnings.md (commit d57bcc3, Jun 2026): "
            "matmul lhsT_rhs 2048^3 bf16 on Trn2, hand kernel")
ATTENTION_CTE = ("awslabs/nki-autotune .claude/rules/learnings.md (commit d57bcc3): hand nkilib.attention_cte "
                 "D=128 bf16 on Trn2, '30/46% @ 2k/16k', 'MAC = 4*SEQ^2*D' (causality and batch/heads not stated)")


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    published: float     # ms, or a fraction of TensorE peak
    unit: str            # "ms" or "MFU"
    model: Callable[[], tuple[float, str]]  # -> (the model's figure in `unit`, what was run)


def _tutorial_kernel(kernel, target: str) -> float:
    lhsT, rhs = _randn(8192, 4096, dtype=torch.bfloat16), _randn(8192, 8192, dtype=torch.bfloat16)
    with sim.trace() as recorded:
        kernel(lhsT, rhs)
    return recorded.estimate(target).total_seconds * 1e3


def _tutorial_tiled() -> tuple[float, str]:
    from sim_matmul import naive_matmul  # bench/ is on sys.path when this runs as a script
    return _tutorial_kernel(naive_matmul, "trn1"), "bench/sim_matmul.py naive_matmul (reloads both tiles per K step)"


def _tutorial_blocked() -> tuple[float, str]:
    from sim_matmul import blocked_matmul_kernel
    return (_tutorial_kernel(blocked_matmul_kernel(tiles_m=4, tiles_n=1), "trn1"),
            "bench/sim_matmul.py blocked_matmul (4 M tiles x 1 N tile blocks, whole K)")


def _generated(case: BenchCase, target: str, flops=None) -> tuple[float, str]:
    spec, recorded, _, _ = trace_case(case)
    estimate = recorded.estimate(target)
    if flops is None:
        return estimate.total_seconds * 1e3, f"our {spec.family} kernel ({case.shape})"
    return flops / (estimate.total_seconds * sim.get_target(target).bf16_flops), \
        f"our {spec.family} kernel ({case.shape}), {flops / 1e9:.1f} GFLOP"


def _attention_mfu(heads: int, seq: int) -> Callable[[], tuple[float, str]]:
    case = BenchCase(f"attention_fwd_{seq}", ATTENTION_FWD, _sdpa(1, heads, heads, seq, 128, torch.bfloat16, False),
                     f"1x{heads}x{seq}x128 non-causal", torch.bfloat16)
    return lambda: _generated(case, TARGET, flops=4 * heads * seq * seq * 128)


PUBLISHED = [
    Published("tutorial Original Tiled (trn1)", MATMUL_TUTORIAL, 51.80, "ms", _tutorial_tiled),
    Published("tutorial Optimization 3 (trn1)", MATMUL_TUTORIAL, 6.97, "ms", _tutorial_blocked),
    Published("tutorial Optimization 3 (trn1)", MATMUL_TUTORIAL, 6.97, "ms", lambda: _generated(
        BenchCase("mm_tutorial", aten.mm.default, _mm(4096, 8192, 8192, torch.bfloat16, "km,kn"), "4096x8192x8192 A^T",
                  torch.bfloat16), "trn1")),
    Published("nki-autotune 2048^3 bf16 (trn2)", AUTOTUNE, 0.9092, "MFU", lambda: _generated(
        KERNELS["matmul_bf16_2048_AtB"], TARGET, flops=2 * 2048 ** 3)),
    Published("attention_cte S=2k D=128 (trn2)", ATTENTION_CTE, 0.30, "MFU", _attention_mfu(8, 2048)),
    Published("attention_cte S=16k D=128 (trn2)", ATTENTION_CTE, 0.46, "MFU", _attention_mfu(1, 16384)),
]


def published_table() -> str:
    header = f"{'published figure':<34} {'published':>10} {'model':>10} {'time ratio':>10}  model ran"
    lines = [header, "-" * len(header)]
    sources = []
    for entry in PUBLISHED:
        value, ran = entry.model()
        shown = (lambda v: f"{v:.2f} ms") if entry.unit == "ms" else (lambda v: f"{v:.1%}")
        # model time / published time: below 1 the model is faster (optimistic) than the hardware was
        ratio = value / entry.published if entry.unit == "ms" else entry.published / value
        lines.append(f"{entry.name:<34} {shown(entry.published):>10} {shown(value):>10} {ratio:>9.2f}x  {ran}")
        print(lines[-1], flush=True)
        if entry.source not in sources:
            sources.append(entry.source)
    notes = ["", "time ratio: the model's time over the published one (for MFU, published MFU over the model's);",
             "below 1 the model is optimistic. MFU counts 2*M*N*K for matmuls and 4*S^2*D per head for",
             "non-causal attention (QK^T and PV); nki-autotune states 'MAC = 4*SEQ^2*D' without saying",
             "whether it counts causal attention, so the attention rows compare like with like only if",
             "their count is the non-causal one.", "", "sources:"]
    return "\n".join(lines + notes + [f"  [{i + 1}] {s}" for i, s in enumerate(sources)])


def main(argv: list[str]) -> int:
    if argv == ["--published"]:
        print(published_table())
        return 0
    selected = [case for name, case in KERNELS.items() if not argv or any(word in name for word in argv)]
    rows = []
    for case in selected:
        rows.append(run_case(case))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    return 0 if all(r.meets_target for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
