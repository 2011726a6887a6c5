"""Attention family: SDPA forward / backward ATen nodes rendered to NKI and run in the interpreter.

Each case traces `F.scaled_dot_product_attention` with AOTAutograd and the Neuron decomposition
table (so the kernels see exactly the nodes the backend gets), runs the forward and backward
graphs on real values, lowers their attention nodes, runs the kernels on the values of the
nodes' inputs and compares with float64 eager SDPA (output, logsumexp, autograd gradients) on
the same (possibly bf16-rounded) inputs.
Tolerances, relative to the largest reference magnitude of each tensor (at least 0.05): fp32 2e-5
(fp32 accumulation over <= 640 keys); bf16 1e-2 and fp16 2e-3 (P and dS are rounded before their
matmuls, as in eager SDPA; measured: kernel bf16 <= 0.65%, eager bf16 SDPA up to 0.9%, fp16 <= 0.1%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from functorch.compile import aot_function
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_inductor import sim
from neuron_inductor.codegen.render import render_kernel
from neuron_inductor.decompositions import neuron_decompositions
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, graph_values, kernel_for

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class Case:
    batch: int = 1
    q_heads: int = 2
    kv_heads: int = 2
    q_len: int = 37
    kv_len: int = 37
    head_dim: int = 16
    causal: bool = False
    mask: str = ""  # "", "bool", "additive", "heads" ([B, Hq, Sq, Sk]), "padding" ([B, 1, 1, Sk]), "hf_min" (finfo.min rows)
    scale: float | None = None
    gqa: str = ""  # "", "enable_gqa", "repeat" (HF's expand + reshape of k / v)
    dtype: torch.dtype = torch.float32
    seq_major: bool = False  # q / k / v are [B, S, H, D] tensors transposed to [B, H, S, D] (strided views)

    def __str__(self):
        parts = [f"b{self.batch}h{self.q_heads}x{self.kv_heads}", f"q{self.q_len}k{self.kv_len}d{self.head_dim}",
                 "causal" if self.causal else "", self.mask, f"scale{self.scale}" if self.scale else "", self.gqa,
                 "seq_major" if self.seq_major else "", str(self.dtype).removeprefix("torch.")]
        return "-".join(p for p in parts if p)


def make_inputs(case: Case, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(b, h, s, d):
        if case.seq_major:
            return torch.randn(b, s, h, d, generator=gen).to(case.dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, generator=gen).to(case.dtype)

    b, sq, sk, d = case.batch, case.q_len, case.kv_len, case.head_dim
    inputs = dict(query=randn(b, case.q_heads, sq, d), key=randn(b, case.kv_heads, sk, d),
                  value=randn(b, case.kv_heads, sk, d))
    if case.mask == "bool":
        keep = torch.rand(sq, sk, generator=gen) > 0.3
        keep[:, 0] = True
        keep[sq // 2] = False  # one fully masked query row: eager gives output 0, gradients 0
        inputs["mask"] = keep
    elif case.mask == "additive":
        inputs["mask"] = torch.randn(b, 1, sq, sk, generator=gen).to(case.dtype)
    elif case.mask == "heads":
        inputs["mask"] = (3 * torch.randn(b, case.q_heads, sq, sk, generator=gen)).to(case.dtype)
    elif case.mask == "padding":
        padding = torch.zeros(b, 1, 1, sk)
        padding[..., : sk // 3] = float("-inf")  # left padding: the first keys are masked out
        inputs["mask"] = padding.to(case.dtype)
    elif case.mask == "hf_min":
        causal = torch.ones(sq, sk, dtype=torch.bool).tril()
        causal[sq // 2] = False  # a row of finfo.min only: eager softmax is uniform there
        inputs["mask"] = torch.zeros(sq, sk).masked_fill(~causal, torch.finfo(case.dtype).min).to(case.dtype)
    return inputs


def attention(case: Case):
    """The model function: SDPA as a user writes it, for each GQA style."""
    group = case.q_heads // case.kv_heads

    def fn(query, key, value, mask=None):
        if case.gqa == "repeat":
            b, h, s, d = key.shape
            key = key[:, :, None].expand(b, h, group, s, d).reshape(b, h * group, s, d)
            value = value[:, :, None].expand(b, h, group, s, d).reshape(b, h * group, s, d)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=case.causal,
                                              scale=case.scale, enable_gqa=case.gqa == "enable_gqa")

    return fn


def capture_graphs(fn, inputs: dict, grad_out: torch.Tensor) -> dict:
    """{"fw" | "bw": (ATen graph, its real arguments)} of fn under AOTAutograd with our decompositions."""
    graphs = {}

    def capturing(kind):
        def compile_graph(gm, example_inputs):
            def run(args):
                graphs[kind] = (gm, list(args))
                return gm(*args)

            run._boxed_call = True
            return run

        return compile_graph

    compiled = aot_function(fn, fw_compiler=capturing("fw"), bw_compiler=capturing("bw"),
                            decompositions=neuron_decompositions())
    args = {name: t.detach().requires_grad_(t.is_floating_point() and name != "mask") for name, t in inputs.items()}
    compiled(**args).backward(grad_out)
    return graphs


def run_kernel(gm: fx.GraphModule, args: list, target) -> tuple[list[torch.Tensor], object]:
    """Lower the graph's `target` node, render, run in the interpreter on the node's real inputs."""
    assert len([n for n in gm.graph.nodes if n.target is target]) == 1
    _, spec, kernel = kernel_for(gm, target)
    values = graph_values(gm, args)
    outputs = kernel(*(values[n] for n in spec.inputs))
    return list(outputs), spec


def reference(case: Case, inputs: dict, grad_out: torch.Tensor) -> dict:
    """float64 eager SDPA on the same values: output, logsumexp, gradients."""
    wide = {name: (t.double() if t.is_floating_point() else t).detach().requires_grad_(name != "mask" and t.is_floating_point())
            for name, t in inputs.items()}
    out = attention(case)(**wide)
    out.backward(grad_out.double())
    key, value = wide["key"], wide["value"]
    if case.gqa:  # for_cpu's logsumexp, with the kv head each query head reads
        group = case.q_heads // case.kv_heads
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    mask = wide.get("mask")
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    _, lse = FORWARD(wide["query"].detach(), key.detach(), value.detach(), 0.0, case.causal,
                     attn_mask=mask, scale=case.scale)
    return dict(out=out.detach(), lse=lse, grad_query=wide["query"].grad, grad_key=wide["key"].grad,
                grad_value=wide["value"].grad)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    assert actual.dtype == (torch.float32 if what == "lse" else dtype), what
    assert actual.shape == expected.shape, what
    # At least 0.05: cancellation errors (dP - Delta) scale with the unit-normal inputs, not with a
    # result that vanishes (one key: softmax is constant, dQ = 0).
    scale = max(expected.abs().max().item(), 0.05)
    tol = TOLERANCE[dtype] * scale
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=tol, msg=lambda m: f"{what}: {m}")


def check(case: Case):
    inputs = make_inputs(case)
    grad_out = torch.randn(case.batch, case.q_heads, case.q_len, case.head_dim,
                           generator=torch.Generator().manual_seed(1)).to(case.dtype)
    graphs = capture_graphs(attention(case), inputs, grad_out)
    expected = reference(case, inputs, grad_out)

    (out, lse), fw_spec = run_kernel(*graphs["fw"], FORWARD)
    assert_close(out, expected["out"], case.dtype, "out")
    assert_close(lse, expected["lse"], case.dtype, "lse")

    grads, bw_spec = run_kernel(*graphs["bw"], BACKWARD)
    for name, grad in zip(("grad_query", "grad_key", "grad_value"), grads):
        if case.gqa == "repeat" and name != "grad_query":
            # The node saw k / v repeated per query head; the model's gradient sums over each group.
            grad = grad.double().unflatten(1, (case.kv_heads, -1)).sum(2).to(grad.dtype)
        assert_close(grad, expected[name], case.dtype, name)
    return fw_spec, bw_spec


CASES = [
    Case(),
    Case(batch=2, q_len=1, kv_len=37),
    Case(q_len=5, kv_len=1, causal=True),
    Case(q_len=200, kv_len=200, head_dim=64, causal=True),
    Case(q_len=128, kv_len=128, head_dim=128, causal=True),
    Case(q_len=37, kv_len=200, head_dim=64),
    Case(q_len=200, kv_len=37, head_dim=64),
    Case(q_len=130, kv_len=300, head_dim=16, causal=True),
    Case(q_len=300, kv_len=130, head_dim=16, causal=True),
    Case(q_len=512, kv_len=512, head_dim=64, q_heads=1, kv_heads=1, causal=True),
    Case(q_len=640, kv_len=640, head_dim=128, q_heads=1, kv_heads=1),
    Case(q_len=200, kv_len=150, mask="bool"),
    Case(batch=2, q_len=130, kv_len=130, head_dim=64, mask="additive"),
    Case(batch=2, q_len=37, kv_len=600, mask="padding"),
    Case(q_len=150, kv_len=150, mask="hf_min"),
    Case(q_len=200, kv_len=200, q_heads=4, kv_heads=2, causal=True, gqa="enable_gqa"),
    Case(q_len=130, kv_len=130, q_heads=6, kv_heads=2, mask="additive", gqa="enable_gqa"),
    Case(batch=2, q_len=70, kv_len=140, q_heads=4, kv_heads=2, mask="heads", gqa="enable_gqa"),
    Case(q_len=100, kv_len=100, q_heads=4, kv_heads=2, causal=True, gqa="repeat"),
    Case(q_len=100, kv_len=140, head_dim=64, scale=0.3),
    Case(q_len=200, kv_len=200, head_dim=64, causal=True, scale=2.0),
    # out / lse (forward) and Q / dO / O / lse (backward) move 8 whole query tiles at a time: 9 tiles and
    # a partial one (a fully masked row in the first group); query tiles dealt over LNC programs with a
    # partial last tile (one tile per output group)
    Case(batch=2, q_heads=1, kv_heads=1, q_len=1100, kv_len=160, mask="bool"),
    Case(q_len=300, kv_len=300, q_heads=1, kv_heads=1, causal=True),
]
BF16_CASES = [
    Case(q_len=200, kv_len=200, head_dim=64, causal=True, dtype=torch.bfloat16),
    Case(q_len=640, kv_len=640, head_dim=128, q_heads=1, kv_heads=1, causal=True, dtype=torch.bfloat16),
    Case(q_len=37, kv_len=300, head_dim=16, dtype=torch.bfloat16),
    Case(batch=2, q_len=130, kv_len=130, head_dim=64, mask="additive", dtype=torch.bfloat16),
    Case(q_len=150, kv_len=600, mask="padding", dtype=torch.bfloat16),
    Case(q_len=200, kv_len=200, q_heads=4, kv_heads=1, causal=True, gqa="enable_gqa", dtype=torch.bfloat16),
    Case(batch=2, q_len=130, kv_len=130, head_dim=64, causal=True, seq_major=True, dtype=torch.bfloat16),
]
OTHER_CASES = [
    Case(q_len=130, kv_len=130, head_dim=64, seq_major=True),
    Case(q_len=200, kv_len=200, head_dim=64, causal=True, dtype=torch.float16),
]


@pytest.mark.parametrize("case", CASES + BF16_CASES + OTHER_CASES, ids=str)
def test_attention_matches_eager(case):
    check(case)


def _forward_node(case: Case, dropout_p: float = 0.0) -> fx.Node:
    """The forward attention node of a graph calling the op directly (SDPA itself decomposes dropout;
    eager for_cpu rejects it, so trace with fake tensors)."""
    inputs = make_inputs(case)

    def fn(query, key, value):
        return FORWARD(query, key, value, dropout_p, case.causal, scale=case.scale)

    gm = make_fx(fn, tracing_mode="fake")(inputs["query"], inputs["key"], inputs["value"])
    return next(n for n in gm.graph.nodes if n.target is FORWARD)


def test_flops_count_the_computed_scores():
    """QK^T and PV over every (query, key) pair visited; causal skips the chunks above the diagonal."""
    full = LOWERINGS[FORWARD](CTX, _forward_node(Case(q_len=256, kv_len=256, head_dim=64)))
    causal = LOWERINGS[FORWARD](CTX, _forward_node(Case(q_len=256, kv_len=256, head_dim=64, causal=True)))
    heads = 2
    assert full.flops == 2 * 2 * 64 * 256 * 256 * heads
    assert causal.flops == 2 * 2 * 64 * (128 * 128 + 128 * 256) * heads


def test_flops_match_the_traced_matmuls():
    """Without causal / mask helpers every traced matmul FLOP is a QK^T or PV FLOP."""
    case = Case(q_len=200, kv_len=300, head_dim=64)
    graphs = capture_graphs(attention(case), make_inputs(case), torch.randn(1, 2, 200, 64))
    with sim.trace() as t:
        _, spec = run_kernel(*graphs["fw"], FORWARD)
    assert t.estimate("trn2").matmul_flops == spec.flops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_diagonal_is_masked_without_matmuls_on_trn2(dtype):
    """On NeuronCore-v3+ VectorE's range_select masks the causal diagonal (the forward's also takes
    that bank's row maxima): both kernels match eager, and every traced matmul FLOP is a QK^T / PV
    (dO V^T, P^T dO, dS^T Q, dS K) FLOP, with no identity @ mask helper; trn1 (v2) still adds the
    mask on TensorE."""
    # 650 keys: the last query tiles' scores span two PSUM banks, the diagonal in the second one
    case = Case(q_len=650, kv_len=650, head_dim=16, q_heads=2, kv_heads=1, causal=True, gqa="enable_gqa", dtype=dtype)
    with sim.trace() as t:
        fw_spec, bw_spec = check(case)
    ops = {ins.op for ins in t.instructions}
    assert t.estimate("trn2").matmul_flops == fw_spec.flops + bw_spec.flops
    assert "range_select" in ops
    trn1 = LoweringContext.for_target("trn1")
    source = render_kernel(_named(LOWERINGS[FORWARD](trn1, _forward_node(case))), trn1)
    assert "identity" in source and "range_select" not in source


def test_query_tile_rows_move_in_groups_of_eight():
    """1157 query rows are 9 whole tiles and 5 rows: per head the forward writes out and lse for tiles
    0-7, tile 8 and the partial tile (3 DMAs each), not one pair per tile; the backward loads and sums
    -Delta = -rowsum(dO * O) in the same three groups (one tensor_reduce each). Values: CASES."""
    case = Case(q_len=1157, kv_len=1157, q_heads=2, kv_heads=1, causal=True, gqa="enable_gqa")
    graphs = capture_graphs(attention(case), make_inputs(case), torch.randn(1, 2, 1157, 16))
    traces = {}
    for kind, target in (("fw", FORWARD), ("bw", BACKWARD)):
        with sim.trace() as traces[kind]:
            run_kernel(*graphs[kind], target)
    hbm_writes = [ins for ins in traces["fw"].instructions if ins.engine == "dma" and ins.operands[0].buffer.endswith("hbm")]
    assert len(hbm_writes) == 2 * 3 * case.q_heads
    delta_sums = [ins for ins in traces["bw"].instructions if ins.op == "tensor_reduce"]
    assert len(delta_sums) == 3 * case.q_heads


def test_fp32_transposed_loads_fill_a_psum_bank_per_copy_and_read_each_input_once():
    """fp32 Q^T / K^T / V^T / dO^T come from TensorE transposes, four 128-row tiles to a PSUM bank and one
    copy out per bank: 1157 rows (10 tiles) take 3 copies per load, not 10. The forward loads a bank's
    rows per DMA; the backward transposes the Q, dO and K rows it keeps anyway: every input crosses
    from HBM once (the bytes of its HBM -> SBUF DMAs are its size; the LNC programs take one batch
    each). Values: CASES (640 and 1100 rows)."""
    case = Case(batch=2, q_len=1157, kv_len=1157, q_heads=2, kv_heads=1, causal=True, gqa="enable_gqa")
    graphs = capture_graphs(attention(case), make_inputs(case), torch.randn(2, 2, 1157, 16))
    traces, input_bytes, heads = {}, {}, {}
    for kind, target in (("fw", FORWARD), ("bw", BACKWARD)):
        gm, args = graphs[kind]
        _, spec, kernel = kernel_for(gm, target)
        values = graph_values(gm, args)
        input_bytes[kind] = sum(values[n].nbytes for n in spec.inputs)
        heads[kind] = spec.params["batch"] * (spec.params["q_heads"] + spec.params["kv_heads"])
        with sim.trace() as traces[kind]:
            kernel(*(values[n] for n in spec.inputs))
    # copies of transposed [D = 16, rows] blocks out of PSUM
    evacuations = {kind: [ins for ins in t.instructions if ins.op == "activation" and ins.buffers[1] == "psum"
                          and ins.operands[1].shape[0] == 16] for kind, t in traces.items()}
    loads = {"fw": heads["fw"], "bw": 2 * heads["bw"]}  # Q and K / Q, dO, K and V, per head they belong to
    for kind in ("fw", "bw"):
        assert len(evacuations[kind]) == 3 * loads[kind], kind
        hbm_reads = sum(ins.bytes for ins in traces[kind].instructions
                        if ins.op == "dma_copy" and ins.buffers[0] == "sbuf" and ins.buffers[1].endswith("hbm"))
        assert hbm_reads == input_bytes[kind], kind


def _named(spec):
    spec.name = "attention_fwd"
    return spec


def test_causal_forward_skips_masked_tiles():
    """Causal QK^T covers 10 of the 16 (query tile, key chunk) pairs of a 512 x 512 head: the
    chunks above the diagonal are never computed."""
    score_columns = []
    for causal in (False, True):
        case = Case(q_len=512, kv_len=512, head_dim=64, q_heads=1, kv_heads=1, causal=causal, dtype=torch.bfloat16)
        graphs = capture_graphs(attention(case), make_inputs(case), torch.randn(1, 1, 512, 64).bfloat16())
        with sim.trace() as t:
            run_kernel(*graphs["fw"], FORWARD)
        # QK^T is the only matmul contracting over the head dim (stationary Q^T [64, rows]).
        score_columns.append(sum(ins.free_size for ins in t.instructions
                                 if ins.op == "nc_matmul" and ins.operands[1].shape[0] == 64))
    assert score_columns[1] / score_columns[0] == 10 / 16


def test_dropout_falls_back_with_a_reason():
    with pytest.raises(Unsupported, match="dropout > 0"):
        LOWERINGS[FORWARD](CTX, _forward_node(Case(), dropout_p=0.1))


def test_head_dim_above_128_falls_back():
    with pytest.raises(Unsupported, match="head dim 256"):
        LOWERINGS[FORWARD](CTX, _forward_node(Case(head_dim=256)))


def test_sequence_too_long_for_sbuf_falls_back():
    """K^T, V and Q^T of one head stay in SBUF; 32K bf16 tokens at D=128 need 192 KiB per partition."""
    with pytest.raises(Unsupported, match="sequence too long"):
        LOWERINGS[FORWARD](CTX, _forward_node(Case(q_len=32768, kv_len=32768, head_dim=128, dtype=torch.bfloat16)))


def test_default_scale_is_inverse_sqrt_head_dim():
    spec = LOWERINGS[FORWARD](CTX, _forward_node(Case(head_dim=64)))
    assert spec.params["scale"] == pytest.approx(1 / math.sqrt(64))
