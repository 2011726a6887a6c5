"""The cost model under LNC=2: the programs of an SPMD launch run concurrently on the two physical
cores of a trn2 logical core, so a launch takes its slowest program plus one launch cost; on trn1
(one core per logical core) they run one after another."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl


def vector_rows(x, row_tiles):
    """`row_tiles` [128, 2048] fp32 row tiles of x, each loaded, scaled 8 times on VectorE and stored."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in row_tiles:
        t = nl.ndarray((128, 2048), nl.float32)
        nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, :])
        for _ in range(8):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=t)
    return out


@sim.jit
def split_rows(x):
    """The row tiles split into contiguous halves over the programs (the last takes the remainder)."""
    tiles, programs, me = x.shape[0] // 128, nl.num_programs(0), nl.program_id(0)
    per = -(-tiles // programs)
    return vector_rows(x, range(me * per, min(tiles, (me + 1) * per)))


@sim.jit
def first_program_does_all(x):
    """Program 0 takes every row tile, the others none: no split at all."""
    return vector_rows(x, range(x.shape[0] // 128) if nl.program_id(0) == 0 else range(0))


def estimate(kernel, x, target="trn2"):
    with sim.trace() as t:
        out = kernel(x)
    torch.testing.assert_close(out, x * 256.0)  # every program wrote its part: the output is whole
    return t.estimate(target)


def test_equal_halves_take_about_half_the_time_of_one_program():
    x = torch.randn(1024, 2048)
    one, two = estimate(split_rows, x), estimate(split_rows[2], x)
    launch = sim.get_target("trn2").launch_fixed_s
    assert two.launches[0].programs == 2 and two.launches[0].cores == 2
    assert two.total_seconds - launch == pytest.approx((one.total_seconds - launch) / 2, rel=0.02)
    # engine totals are one physical core's: half the VectorE time of the single program
    assert two.engine_seconds["vector"] == pytest.approx(one.engine_seconds["vector"] / 2, rel=1e-6)
    assert two.matmul_flops == one.matmul_flops and two.dma_bytes == one.dma_bytes
    assert len(two.launches[0].core_seconds) == 2


def test_unequal_halves_take_the_larger_one():
    five = torch.randn(5 * 128, 2048)  # 3 row tiles on core 0, 2 on core 1
    three = torch.randn(3 * 128, 2048)
    split = estimate(split_rows[2], five)
    assert split.total_seconds == pytest.approx(estimate(split_rows, three).total_seconds, rel=1e-6)
    slow, fast = split.launches[0].core_seconds
    assert slow > fast
    # a program with no work adds nothing: the launch costs what the busy program costs alone
    lopsided = estimate(first_program_does_all[2], five)
    assert lopsided.total_seconds == pytest.approx(estimate(first_program_does_all, five).total_seconds, rel=1e-6)


def test_one_core_per_logical_core_runs_programs_one_after_another():
    x = torch.randn(1024, 2048)
    one, two = estimate(split_rows, x, "trn1"), estimate(split_rows[2], x, "trn1")
    assert two.launches[0].cores == 1
    launch = sim.get_target("trn1").launch_fixed_s
    # two programs on one core: their busy time adds up (each program has its own serial term)
    assert two.engine_seconds["vector"] == pytest.approx(one.engine_seconds["vector"], rel=1e-6)
    assert two.total_seconds - launch >= one.total_seconds - launch



def test_side_by_side_programs_record_each_programs_trace_unchanged(monkeypatch):
    """On trn2 the two programs interleave in the trace (their DMAs alternate); each program's own
    instructions are the ones it records when the programs run one after another (trn1), in order,
    so the per-program cost model sees the same work."""
    x = torch.randn(4 * 128, 2048)

    def per_program(target):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
        with sim.trace() as t:
            split_rows[2](x)
        programs = {}
        for ins in t.instructions:
            programs.setdefault(ins.program_id, []).append((ins.engine, ins.op, ins.shapes, ins.dtypes))
        return [ins.program_id for ins in t.instructions], programs

    side_by_side, trn2 = per_program("trn2")
    sequential, trn1 = per_program("trn1")
    assert trn2 == trn1
    assert sequential == sorted(sequential)  # trn1: program 0's instructions, then program 1's
    assert side_by_side != sorted(side_by_side)  # trn2: interleaved at the DMAs
