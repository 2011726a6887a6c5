"""Kernels that split their work over the two physical cores of an LNC=2 logical core (lowering/lnc.py):
each program of the `kernel[2]` launch computes a disjoint part of the output, the results equal the
LNC=1 kernel's bit for bit (the per-element math is the same), and the cost model charges the slower
program."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.lnc import plan_split
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import DTYPES, graph_values, load_kernel
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
    with pytest.raises(ValueError, match="trn1 logical NeuronCore has 1 to 1"):
        LoweringContext.for_target("trn1", lnc=2)
