"""Pointwise, copy and reduction kernels split over the two physical cores of an LNC=2 logical core
(lowering/lnc.py `split_nest`): one loop level of each pointwise region, copy piece or reduction's
output blocks is dealt out over nl.program_id(0). Each case runs the kernel lowered for LNC=1 and for
LNC=2 on the same inputs: the LNC=2 result equals the LNC=1 result bit for bit (the per-element math is
the same) and eager's within the family's tolerance, the programs together store exactly the output's
bytes (every element written once, no races), and the DMA bytes are shared about evenly."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.lowering import pointwise
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.lnc import split_nest

from .harness import DTYPES, aten_graph, call_kernel, graph_values, kernel_for, last_node, load_kernel, widen_int64

LNC1 = LoweringContext.for_target("trn2", lnc=1)
LNC2 = LoweringContext.for_target("trn2", lnc=2)
aten = torch.ops.aten


def randn(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=generator).to(dtype)


def store_bytes(recorded) -> int:
    return sum(i.bytes for i in recorded.instructions if i.engine == "dma" and i.operands[0].buffer == "shared_hbm")


def dma_bytes_per_program(recorded) -> dict:
    shares: dict = {}
    for i in recorded.instructions:
        if i.engine == "dma":
            shares[i.program_id] = shares.get(i.program_id, 0) + i.bytes
    return shares


def pointwise_spec(fn, args, ctx):
    """(spec, graph) of fn's pointwise nodes lowered as one group for `ctx`."""
    graph = aten_graph(fn, *args)
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert all(pointwise.is_pointwise(n) for n in nodes), [str(n.target) for n in nodes]
    result = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    outputs = list(result) if isinstance(result, (list, tuple)) else [result]
    return pointwise.lower_pointwise_group(ctx, nodes, outputs), graph


def run(lowered, ctx, grid=None):
    """(results, spec, trace): `lowered(ctx)` -> (spec, graph, inputs by node) run in the interpreter,
    launched with `grid` programs (None: spec.grid, as the toolchain launches it)."""
    spec, values = lowered(ctx)
    kernel = load_kernel(spec, ctx=ctx)
    if grid is not None:
        kernel = kernel[grid]
    with sim.trace() as recorded:
        results = call_kernel(kernel, spec, [values[n] for n in spec.inputs])
    return results, spec, recorded


def pointwise_case(fn, args):
    def lowered(ctx):
        spec, graph = pointwise_spec(fn, args, ctx)
        return spec, dict(zip([n for n in graph.graph.nodes if n.op == "placeholder"], args))
    return lowered


def node_case(fn, args, op):
    """The last `op` node of fn's ATen graph, with the graph's eager values (its views included)."""
    def lowered(ctx):
        graph = aten_graph(fn, *args)
        _, spec, _ = kernel_for(graph, op, ctx=ctx)
        return spec, graph_values(graph, args)
    return lowered


def check_split(lowered, expected, split: bool, tol: float, balanced=True):
    """LNC=2 vs LNC=1 and eager (`expected`, one tensor per output); `split`: whether LNC=2 deals the
    work out (grid 2) or runs one program; `balanced`: each program moves 40-60% of the DMA bytes."""
    one, one_spec, one_trace = run(lowered, LNC1)
    two, two_spec, two_trace = run(lowered, LNC2)
    assert one_spec.grid == 1 and two_spec.grid == (2 if split else 1)
    for a, b, want in zip(one, two, expected):
        assert torch.equal(a, b)
        b = widen_int64(b, want)  # int64 results come back as int32 (NKI has no 64-bit integers)
        assert b.dtype == want.dtype and b.shape == want.shape
        torch.testing.assert_close(b.float(), want.float(), rtol=tol, atol=tol, equal_nan=True)
    total = sum(t.numel() * t.element_size() for t in two)
    assert store_bytes(two_trace) == store_bytes(one_trace) == total
    shares = dma_bytes_per_program(two_trace)
    assert set(shares) == ({(0,), (1,)} if split else {(0,)})
    if split and balanced:
        for share in shares.values():
            assert 0.4 <= share / sum(shares.values()) <= 0.6, shares
    return two_trace


def tolerance(dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-5


POINTWISE = {
    # name: (fn, operands (dtype) -> args, split at LNC=2, DMA bytes shared evenly)
    "flat_on_tiles": (lambda x, y: x * y + 1, lambda d: [randn(256, 2048, dtype=d), randn(256, 2048, dtype=d, seed=1)],
                      True, True),
    # [128, 1007] plus a 109-element one-partition tail: two column chunks dealt out, the tail on program 1
    "flat_ragged_tail": (lambda x: torch.sigmoid(x), lambda d: [randn(128 * 1007 + 109, dtype=d)], True, True),
    # three row tiles of 100 (dealt 2 / 1) under a row operand every program loads
    "row_broadcast_uneven": (lambda x, w: x * w - x, lambda d: [randn(300, 1000, dtype=d), randn(1000, dtype=d)],
                             True, False),
    # lead dim of 5 dealt out; a transposed operand and an expanded (stride-0) column operand
    "transposed_expanded": (lambda a, b, c: a * b + c,
                            lambda d: [randn(130, 5, 64, dtype=d).permute(1, 0, 2), randn(130, 1, dtype=d).expand(130, 64),
                                       randn(5, 130, 64, dtype=d, seed=2)], True, False),
    "one_tile": (lambda x: x.exp() * 2, lambda d: [randn(3, 7, dtype=d)], False, True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(POINTWISE))
def test_lnc2_pointwise_matches_lnc1_and_eager(case, dtype):
    fn, make, split, balanced = POINTWISE[case]
    args = make(dtype)
    expected = fn(*[a.float() for a in args]).to(dtype)
    check_split(pointwise_case(fn, args), [expected], split, tolerance(dtype), balanced)


def test_pointwise_tail_region_runs_on_the_last_program():
    spec, _ = pointwise_spec(lambda x: x + 1, [randn(128 * 1007 + 109)], LNC2)
    main, tail = spec.params["regions"]
    assert main["split"] == 0 and not main["on_last_program"]  # the column chunks
    assert tail["split"] is None and tail["on_last_program"]


def test_split_pointwise_kernel_is_whole_at_any_launch_size():
    """The kernel reads nl.num_programs(0): launched with 3 programs (the third gets no column chunk, the
    tail goes to it) or 1, it stores the same output once (the `neuron` toolchain launches with the host's LNC)."""
    args = [randn(128 * 1007 + 109)]
    lowered = pointwise_case(lambda x: x * 3 - 1, args)
    two = run(lowered, LNC2)[0][0]
    assert torch.equal(two, args[0] * 3 - 1)
    for grid in (1, 3):
        (out,), _, recorded = run(lowered, LNC2, grid=grid)
        assert torch.equal(out, two)
        assert store_bytes(recorded) == out.numel() * out.element_size()


def test_d2048_elementwise_kernel_halves_its_time():
    """A [2048, 2048] bf16 residual add of the d2048 step's shape (a DMA-bound flat kernel): each
    program moves half the bytes and the launch takes about half the time, less the fixed launch and
    serial costs each core pays (the cost model costs each program on its own core and takes the slower)."""
    args = [randn(2048, 2048, dtype=torch.bfloat16), randn(2048, 2048, dtype=torch.bfloat16, seed=1)]
    lowered = pointwise_case(lambda x, y: x + y, args)
    one = run(lowered, LNC1)[2].estimate("trn2")
    two = run(lowered, LNC2)[2].estimate("trn2")
    fixed = sim.get_target("trn2").launch_fixed_s + one.serial_seconds
    assert two.launches[0].cores == 2
    assert two.engine_seconds["dma"] == pytest.approx(one.engine_seconds["dma"] / 2, rel=0.02)
    assert two.total_seconds - fixed == pytest.approx((one.total_seconds - fixed) / 2, rel=0.02)
    assert two.total_seconds <= 0.55 * one.total_seconds


COPIES = {
    # name: (fn, operands (dtype) -> args, op, split at LNC=2, DMA bytes shared evenly)
    "cat_halves": (lambda a, b: torch.cat([a, b], -1), lambda d: [randn(1, 4, 300, 64, dtype=d),
                                                                   randn(1, 4, 300, 64, dtype=d, seed=1)],
                   aten.cat.default, True, True),
    "clone_transposed": (lambda x: x.transpose(1, 2).contiguous(), lambda d: [randn(1, 5, 300, 64, dtype=d)],
                         aten.clone.default, True, False),
    "slice_scatter": (lambda base, src: torch.slice_scatter(base, src, 1, 100, 350), lambda d: [
        randn(2, 400, 96, dtype=d), randn(2, 250, 96, dtype=d, seed=1)], aten.slice_scatter.default, True, False),
    "pad_broadcast_fill": (lambda x: torch.nn.functional.pad(x, (3, 5, 0, 200), value=1.5),
                           lambda d: [randn(300, 60, dtype=d)], aten.constant_pad_nd.default, True, False),
    # two one-DMA pieces: one each
    "cat_two_small": (lambda a, b: torch.cat([a, b]), lambda d: [randn(3, 5, dtype=d), randn(4, 5, dtype=d, seed=1)],
                      aten.cat.default, True, False),
    "one_dma": (lambda x: torch.flip(x, [0]), lambda d: [randn(1, 7, dtype=d)], aten.flip.default, False, True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(COPIES))
def test_lnc2_copy_matches_lnc1_and_eager(case, dtype):
    fn, make, op, split, balanced = COPIES[case]
    args = make(dtype)
    check_split(node_case(fn, args, op), [fn(*args)], split, 0.0, balanced)


REDUCTIONS = {
    # name: (fn, operand shape, op, split at LNC=2, DMA bytes shared evenly)
    "column_sums": (lambda x: x.sum(0), (2048, 1024), aten.sum.dim_IntList, True, True),  # ones-vector matmuls
    "row_sums_uneven": (lambda x: x.sum(-1), (300, 1000), aten.sum.dim_IntList, True, False),
    "column_max_off_tiles": (lambda x: x.amax(0), (260, 700), aten.amax.default, True, False),
    "row_argmax": (lambda x: x.argmax(-1), (256, 500), aten.argmax.default, True, True),
    "row_var": (lambda x: x.var(-1), (256, 300), aten.var.correction, True, True),
    "fold_middle_dim": (lambda x: x.sum(1), (4, 16, 2048), aten.sum.dim_IntList, True, True),
    "one_block": (lambda x: x.sum(), (3, 7), aten.sum.dim_IntList, False, True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(REDUCTIONS))
def test_lnc2_reduction_matches_lnc1_and_eager(case, dtype):
    fn, shape, op, split, balanced = REDUCTIONS[case]
    x = randn(*shape, dtype=dtype)
    graph = aten_graph(fn, x)
    op = op if any(n.target is op for n in graph.graph.nodes) else last_node(graph, op).target
    want = fn(x.float()).to(fn(x).dtype)
    tol = 2e-2 * max(1.0, want.float().abs().max().item()) if dtype == torch.bfloat16 else 1e-4 * shape[0]
    check_split(node_case(fn, [x], op), [want], split, tol, balanced)


def test_split_nest_picks_the_most_even_level():
    assert split_nest(LNC1, [[4], [8]]) is None
    assert split_nest(LNC2, [[None], [None, None]]) == 1  # one iteration, then two written out
    assert split_nest(LNC2, [[3, None], [2]]) == 0        # 4 iterations: 2 / 2
    assert split_nest(LNC2, [[3], [2]]) == 1              # 3 iterations share as 2 / 1, 2 as 1 / 1
    assert split_nest(LNC2, [[None], [None]]) is None     # a single tile


@pytest.mark.slow
def test_compiled_split_kernels_replay_and_match_lnc1(fresh_compile_state):
    """Through torch.compile at lnc 1 and 2: pointwise, copy and reduction kernels launch with a grid of 2,
    and every call (the first runs the kernels, the second records them, the third replays them, sim/replay.py)
    gives the LNC=1 results exactly and eager's within fp32 rounding."""
    from neuron_inductor.observe import session

    def fn(x, y):
        rotated = torch.cat((-x[..., 64:], x[..., :64]), -1)  # RoPE's rotate-half: pointwise, then a cat
        z = x * y + rotated
        return z.sum(-1), z.transpose(0, 1).contiguous(), torch.sigmoid(z).amax(0)

    results, grids = {}, {}
    for lnc in ("1", "2"):
        torch._dynamo.reset()
        first = len(session.BUCKETS)
        compiled = torch.compile(fn, backend="neuron", options={"lnc": lnc, "fallback": "error"})
        results[lnc] = []
        for seed in range(3):
            args = [randn(300, 4, 128, seed=seed), randn(300, 4, 128, seed=seed + 10)]
            out = compiled(*args)
            for got, want in zip(out, fn(*args)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            results[lnc].append(out)
        grids[lnc] = {}
        for kernel in (k for b in session.BUCKETS[first:] for k in b.artifact.meta["kernels"]):
            grids[lnc].setdefault(kernel["family"], set()).add(kernel["grid"])
    assert set().union(*grids["1"].values()) == {1}
    assert all(2 in grids["2"][family] for family in ("pointwise", "copy", "reduction")), grids["2"]
    for one, two in zip(results["1"], results["2"]):
        for a, b in zip(one, two):
            assert torch.equal(a, b)
