"""Kernels that split their work over the two physical cores of an LNC=2 logical core (lowering/lnc.py):
each program of the `kernel[2]` launch computes a disjoint part of the output, the results equal the
LNC=1 kernel's bit for bit (the per-element math is the same), and the cost model charges the slower
program. Families: matmul, attention forward / backward, rms_norm, layer_norm forward, softmax forward /
backward."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.config import ConfigError
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.lnc import plan_split
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import DTYPES, graph_values, kernel_for, load_kernel, op_graph
from .test_attention import BACKWARD, FORWARD, Case, attention, capture_graphs, make_inputs, reference
from .test_attention import assert_close as assert_attention_close
from .test_matmul import assert_matches, float64_values, randn, trace

LNC1 = LoweringContext.for_target("trn2", lnc=1)
LNC2 = LoweringContext.for_target("trn2")


def hbm_store_bytes(recorded) -> int:
    return sum(i.bytes for i in recorded.instructions if i.engine == "dma" and i.operands[0].buffer == "shared_hbm")


def run(fn, args, ctx, grid=None):
    """(output, spec, trace) of fn's single matmul lowered for `ctx`, launched with `grid` programs
    (None: as the toolchain launches it, spec.grid)."""
    gm, node = trace(fn, *args)
    spec = LOWERINGS[node.target](ctx, node)
    kernel = load_kernel(spec, ctx=ctx)
    if grid is not None:
        kernel = kernel[grid]
    values = graph_values(gm, args)
    with sim.trace() as recorded:
        out = kernel(*(values[n] for n in spec.inputs))
    return out, spec, recorded, float64_values(gm, args)[node]


CASES = {
    # name: (fn, operand shapes, the loop LNC=2 splits, or None)
    "m_blocks_uneven": (lambda a, b: a @ b, [(1500, 256), (256, 300)], "m"),  # 2 row blocks of 1024 / 476
    "n_blocks_uneven": (lambda a, b: a @ b, [(100, 200), (200, 1100)], "n"),  # M under a tile; 3 column blocks
    "batch_uneven": (lambda a, b: torch.bmm(a, b), [(3, 70, 40), (3, 40, 50)], "batch"),
    "transposed_b": (lambda a, bt: a @ bt.t(), [(200, 130), (700, 130)], "n"),
    "one_block": (lambda a, b: a @ b, [(64, 96), (96, 200)], None),  # nothing to share: one program
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_lnc2_matmul_matches_lnc1_bit_for_bit(case, dtype):
    fn, shapes, loop = CASES[case]
    args = [randn(*shape, dtype=dtype, seed=i) for i, shape in enumerate(shapes)]
    one, one_spec, one_trace, reference = run(fn, args, LNC1)
    two, two_spec, two_trace, _ = run(fn, args, LNC2)
    assert one_spec.grid == 1 and one_spec.params["split"] is None
    assert (two_spec.params["split"] or {}).get("loop") == loop
    assert two_spec.grid == (2 if loop else 1)
    assert_matches(two, reference)
    assert torch.equal(two, one)
    # No races: together the programs store exactly the output's bytes, as the single program does, and
    # the result is whole, so every output element was written by exactly one program.
    assert hbm_store_bytes(two_trace) == hbm_store_bytes(one_trace) == two.numel() * two.element_size()
    assert {i.program_id for i in two_trace.instructions} == ({(0,), (1,)} if loop else {(0,)})


def test_split_kernel_is_whole_at_any_launch_size():
    """The kernel reads nl.num_programs(0): launched with 3 programs over 2 row blocks (the third gets
    no work) or with 1, it computes the same output (the `neuron` toolchain launches with the host's LNC)."""
    fn, shapes, _ = CASES["m_blocks_uneven"]
    args = [randn(*shape, seed=i) for i, shape in enumerate(shapes)]
    two = run(fn, args, LNC2)[0]
    for grid in (1, 3):
        out, _, recorded, _ = run(fn, args, LNC2, grid=grid)
        assert torch.equal(out, two)
        assert hbm_store_bytes(recorded) == out.numel() * out.element_size()


def test_lnc2_halves_a_balanced_matmul():
    fn = lambda a, b: a @ b  # noqa: E731
    # two row blocks of 1024: each program loads half of A and all of B, as each row block does at LNC=1
    args = [randn(2048, 256, dtype=torch.bfloat16), randn(256, 512, dtype=torch.bfloat16, seed=1)]
    one = run(fn, args, LNC1)[2].estimate("trn2")
    two = run(fn, args, LNC2)[2].estimate("trn2")
    fixed = sim.get_target("trn2").launch_fixed_s + one.serial_seconds  # per launch and per core: not shared
    assert two.launches[0].cores == 2 and two.serial_seconds == one.serial_seconds
    for engine in ("tensor", "dma"):
        assert two.engine_seconds[engine] == pytest.approx(one.engine_seconds[engine] / 2, rel=0.01)
    assert two.total_seconds - fixed == pytest.approx((one.total_seconds - fixed) / 2, rel=0.01)
    assert two.matmul_flops == one.matmul_flops
    # peak_fraction counts both occupied cores: the fixed costs each core pays lower it a little
    core_seconds = 2 * two.total_seconds
    assert two.peak_fraction == pytest.approx(two.matmul_flops / core_seconds / two.peak_flops)


def test_plan_split_picks_the_most_even_loop():
    assert plan_split(LNC1, {"m": 4}) is None
    assert plan_split(LNC2, {"batch": 1, "m": 1, "n": 1}) is None
    assert plan_split(LNC2, {"batch": 3, "m": 2, "n": 5}) == {"loop": "m", "count": 2}
    assert plan_split(LNC2, {"batch": 4, "m": 2}) == {"loop": "batch", "count": 4}  # tie: the outer loop
    assert plan_split(LNC2, {"m": 1, "n": 3}) == {"loop": "n", "count": 3}


def test_lnc_is_checked_against_the_target():
    assert LoweringContext.for_target("trn1").lnc == 1 and LNC2.lnc == 2
    with pytest.raises(ConfigError, match="option lnc=2: a trn1 logical NeuronCore has 1 to 1 .* NEURON_LOGICAL_NC_CONFIG"):
        LoweringContext.for_target("trn1", lnc=2)


ATTENTION_CASES = {
    # name: (Case, the loop the forward splits, the loop the backward splits)
    "kv_heads_uneven": (dict(q_heads=3, kv_heads=3, q_len=40, kv_len=50), "kv_heads", "kv_heads"),
    "gqa_group": (dict(q_heads=4, kv_heads=1, q_len=37, kv_len=37, causal=True, gqa="enable_gqa"), "group", None),
    "one_head_causal_q_tiles": (dict(q_heads=1, kv_heads=1, q_len=300, kv_len=300, causal=True), "q_tiles", None),
    "batch": (dict(batch=2, q_heads=1, kv_heads=1, q_len=20, kv_len=30), "batch", "batch"),
}


def run_node(gm, args, op, ctx):
    """(outputs, spec, trace) of the graph's last `op` node lowered for `ctx`, launched with spec.grid."""
    _, spec, kernel = kernel_for(gm, op, ctx=ctx)
    values = graph_values(gm, args)
    with sim.trace() as recorded:
        outputs = kernel(*(values[n] for n in spec.inputs))
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs], spec, recorded


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_lnc2_attention_matches_lnc1_bit_for_bit(case, dtype):
    fields, fw_loop, bw_loop = ATTENTION_CASES[case]
    attention_case = Case(**fields, dtype=dtype)
    inputs = make_inputs(attention_case)
    grad_out = torch.randn(attention_case.batch, attention_case.q_heads, attention_case.q_len,
                           attention_case.head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    graphs = capture_graphs(attention(attention_case), inputs, grad_out)
    expected = reference(attention_case, inputs, grad_out)
    for kind, op, loop, names in (("fw", FORWARD, fw_loop, ("out", "lse")),
                                  ("bw", BACKWARD, bw_loop, ("grad_query", "grad_key", "grad_value"))):
        one, one_spec, one_trace = run_node(*graphs[kind], op, LNC1)
        two, two_spec, two_trace = run_node(*graphs[kind], op, LNC2)
        assert one_spec.grid == 1 and (two_spec.params["split"] or {}).get("loop") == loop, kind
        assert two_spec.grid == (2 if loop else 1)
        for name, a, b in zip(names, one, two):
            assert torch.equal(a, b), name
            assert_attention_close(b, expected[name], dtype, "lse" if name == "lse" else name)
        # every output element stored once, by one program (see the matmul test)
        total = sum(t.numel() * t.element_size() for t in two)
        assert hbm_store_bytes(two_trace) == hbm_store_bytes(one_trace) == total, kind


ROW_CASES = {
    # name: (rows, cols, row tiles split over the programs)
    "two_row_tiles": (200, 1000, True),
    "three_row_tiles_uneven": (300, 64, True),
    "one_row_tile": (3, 7, False),  # nothing to share: one program
}


def row_graphs(rows, cols, dtype):
    """(graph, args, op) of rms_norm, layer_norm, softmax and its backward over [rows, cols]."""
    x = randn(rows, cols, dtype=dtype)
    weight, dy = randn(cols, dtype=dtype, seed=1), randn(rows, cols, dtype=dtype, seed=2)
    y = torch.softmax(x.float(), -1).to(dtype)
    aten = torch.ops.aten
    yield (*op_graph(aten._fused_rms_norm.default, x, [cols], weight, 1e-6), aten._fused_rms_norm.default)
    yield (*op_graph(aten.native_layer_norm.default, x, [cols], weight, dy[0], 1e-5), aten.native_layer_norm.default)
    yield (*op_graph(aten._softmax.default, x, -1, False), aten._softmax.default)
    yield (*op_graph(aten._softmax_backward_data.default, dy, y, -1, dtype), aten._softmax_backward_data.default)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_lnc2_row_kernels_match_lnc1_bit_for_bit(case, dtype):
    rows, cols, split = ROW_CASES[case]
    for gm, args, op in row_graphs(rows, cols, dtype):
        one, one_spec, one_trace = run_node(gm, args, op, LNC1)
        two, two_spec, two_trace = run_node(gm, args, op, LNC2)
        expected = graph_values(gm, args)
        node = next(n for n in gm.graph.nodes if n.target is op)
        assert one_spec.grid == 1 and two_spec.grid == (2 if split else 1) and two_spec.params["lnc_split"] == split
        for a, b, want in zip(one, two, expected[node] if isinstance(expected[node], tuple) else (expected[node],)):
            assert torch.equal(a, b), op
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(b.float(), want.float(), rtol=tol, atol=tol)
        total = sum(t.numel() * t.element_size() for t in two)
        assert hbm_store_bytes(two_trace) == hbm_store_bytes(one_trace) == total, op


class _Block(torch.nn.Module):
    """linear -> RMSNorm -> causal attention -> linear -> softmax, forward and backward."""

    def __init__(self, dim=64, heads=2):
        super().__init__()
        self.heads = heads
        self.up, self.down = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, 600)
        self.norm = torch.nn.RMSNorm(3 * dim)

    def forward(self, x):
        q, k, v = self.norm(self.up(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.down(out.transpose(1, 2).flatten(-2)).softmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=str)
def test_compiled_step_at_lnc2_matches_lnc1(dtype, fresh_compile_state):
    """Through torch.compile: the lnc option picks the split kernels (grid 2 in the artifact), and the
    outputs and gradients equal the LNC=1 step's exactly."""
    from neuron_inductor.observe import session

    results, grids = {}, {}
    for lnc in ("1", "2"):
        torch.manual_seed(0)
        model = _Block().to(dtype)
        x = torch.randn(2, 160, 64, dtype=dtype)
        torch._dynamo.reset()
        first = len(session.BUCKETS)
        out = torch.compile(model, backend="neuron", options={"lnc": lnc})(x)
        out.float().pow(2).sum().backward()
        results[lnc] = [out.detach(), *(p.grad for p in model.parameters())]
        grids[lnc] = {k["family"]: k["grid"] for b in session.BUCKETS[first:] for k in b.artifact.meta["kernels"]
                      if k["grid"] != 1}
    assert grids["1"] == {}
    assert {"matmul", "attention_fwd", "attention_bwd", "softmax"} <= set(grids["2"]) and set(grids["2"].values()) == {2}
    for one, two in zip(results["1"], results["2"]):
        assert torch.equal(one, two)
