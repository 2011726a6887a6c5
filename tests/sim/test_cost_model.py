"""The stricter cost model's terms, each on real kernels run in the interpreter: launches charged one
after another with a fixed cost, DMA efficiency by size, stride and partitions, dma_transpose by
shape, and dependency chains. Each test pairs two kernels whose estimates must differ in a stated
direction, chosen so that the rule left out (or a plausible wrong rule) would make them equal or
reverse them."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

TRN2 = sim.get_target("trn2")


def traced(kernel, *args):
    with sim.trace() as t:
        kernel(*args)
    return t


@sim.jit
def copy_through(x):
    """HBM -> SBUF -> HBM in [128, F] tiles of x's full width."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in range(x.shape[0] // 128):
        t = nl.ndarray((128, x.shape[1]), x.dtype)
        nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, :])
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=t)
    return out


@sim.jit
def load_rows(x):
    """Loads x[P, F] whole (P <= 128): one DMA over P partitions."""
    t = nl.ndarray(x.shape, x.dtype)
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t[0:1, 0:1])
    return out


@sim.jit
def vector_heavy(x):
    """One load, many VectorE passes over a [128, 2048] fp32 tile, one store."""
    t = nl.ndarray((128, 2048), nl.float32)
    nisa.dma_copy(dst=t, src=x)
    for _ in range(16):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=1.0)
    out = nl.ndarray((128, 2048), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def dma_seconds(t):
    return t.estimate(TRN2).engine_seconds["dma"]


def test_each_launch_is_charged_alone_with_a_launch_cost():
    big = torch.randn(2048, 2048)  # DMA-bound: 32 MiB moved, no compute
    small = torch.randn(128, 2048)  # VectorE-bound
    dma_bound, vector_bound = traced(copy_through, big), traced(vector_heavy, small)
    with sim.trace() as both:
        copy_through(big)
        vector_heavy(small)
    assert both.launches == [0, len(dma_bound)]
    alone = dma_bound.estimate(TRN2).total_seconds + vector_bound.estimate(TRN2).total_seconds
    step = both.estimate(TRN2)
    assert step.total_seconds == pytest.approx(alone)
    assert step.launch_seconds == pytest.approx(2 * TRN2.launch_fixed_s)
    # The old rule overlapped the DMA-bound kernel with the VectorE-bound one: far less than the sum.
    overlapped = sim.estimate(both.instructions, TRN2)  # one launch
    assert overlapped.total_seconds < step.total_seconds - 0.5 * vector_bound.estimate(TRN2).total_seconds
    # Two launches of one kernel are two launches (the same name must not merge them).
    with sim.trace() as twice:
        vector_heavy(small)
        vector_heavy(small)
    assert twice.estimate(TRN2).total_seconds == pytest.approx(2 * vector_bound.estimate(TRN2).total_seconds)
    # Traces combine launch by launch.
    assert (dma_bound + vector_bound).estimate(TRN2).total_seconds == pytest.approx(alone)


def test_small_transfers_cost_more_per_byte():
    # Same 1 MiB, moved in [128, 4096]-byte rows vs [128, 64]-byte rows (16x the descriptors).
    wide, narrow = torch.randn(256, 1024), torch.randn(16384, 16)
    wide_dma, narrow_dma = dma_seconds(traced(copy_through, wide)), dma_seconds(traced(copy_through, narrow))
    fixed = 1.3e-6 / 16
    wide_bytes = (wide_dma - 4 * fixed)  # 2 loads + 2 stores (128 + 128 for narrow)
    narrow_bytes = (narrow_dma - 256 * fixed)
    # Bytes alone (fixed costs removed): 4 KiB runs reach 94%, 64 B runs 20%.
    assert narrow_bytes / wide_bytes == pytest.approx((4096 / (4096 + 256)) / (64 / (64 + 256)), rel=1e-6)


def test_strided_reads_cost_by_their_contiguous_run():
    x = torch.randn(1024, 128).bfloat16()
    rows = traced(load_rows, x[:128].contiguous())          # 256 B per partition, contiguous
    columns = traced(load_rows, x.t()[:, :128])              # the same shape read a 2-byte element at a time
    load_rows_dma, load_columns_dma = (t.instructions[0] for t in (rows, columns))
    assert load_rows_dma.dma_run_bytes == 256 and load_columns_dma.dma_run_bytes == 2
    assert load_rows_dma.bytes == load_columns_dma.bytes
    assert dma_seconds(columns) > 50 * (dma_seconds(rows) - 2 * 1.3e-6 / 16)


def test_few_partitions_reach_few_dma_engines():
    # Same 32 KiB: 8 partitions x 4 KiB (one DMA engine) vs 128 x 256 B (all 16): the longer runs of
    # the first do not make up for the 15 idle engines.
    few, many = traced(load_rows, torch.randn(8, 1024)), traced(load_rows, torch.randn(128, 64))
    assert few.instructions[0].bytes == many.instructions[0].bytes
    assert dma_seconds(few) > 4 * dma_seconds(many)


@sim.jit
def transpose_load(x):
    t = nl.ndarray((x.shape[1], x.shape[0]), x.dtype)
    nisa.dma_transpose(dst=t, src=x)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t[0:1, 0:1])
    return out


def transpose_seconds_per_byte(x):
    ins = traced(transpose_load, x).instructions[0]
    assert ins.op == "dma_transpose"
    return sim.cost_model.dma_transfer_seconds(ins, TRN2) / ins.bytes


def test_dma_transpose_cost_by_shape():
    aligned = transpose_seconds_per_byte(torch.randn(64, 128).bfloat16())    # dst [128, 64]: whole blocks
    ragged = transpose_seconds_per_byte(torch.randn(72, 128).bfloat16())     # dst [128, 72]: 72 of 80 columns
    few_partitions = transpose_seconds_per_byte(torch.randn(64, 96).bfloat16())  # dst [96, 64]: 96 of 128
    copy_rate = 1 / (16 * TRN2.dma_queue_bytes_per_s)
    assert aligned == pytest.approx(copy_rate / 0.9)
    assert ragged == pytest.approx(copy_rate / (0.9 * 72 / 80))
    # Fewer partitions cost per byte as the unused lanes of each block do (a wrong rule charging by
    # bytes alone, or the flat 90%, makes these equal to `aligned`).
    assert few_partitions == pytest.approx(copy_rate / (0.9 * 96 / 128))
    assert aligned < ragged < few_partitions


@sim.jit
def one_chain(x):
    """16 in-place ops on one tile, alternating ScalarE and VectorE: each waits for the last."""
    a = nl.ndarray((128, 2048), nl.float32)
    b = nl.ndarray((128, 2048), nl.float32)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=x)
    for _ in range(8):
        nisa.activation(dst=a, op=nl.copy, data=a)
        nisa.tensor_scalar(dst=a, data=a, op0=nl.multiply, operand0=1.0)
    out = nl.ndarray((128, 2048), nl.float32, buffer=nl.shared_hbm)
    nisa.tensor_tensor(dst=b, data1=a, data2=b, op=nl.add)
    nisa.dma_copy(dst=out, src=b)
    return out


@sim.jit
def two_chains(x):
    """The same instructions, ScalarE working on one tile and VectorE on another: they overlap."""
    a = nl.ndarray((128, 2048), nl.float32)
    b = nl.ndarray((128, 2048), nl.float32)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=x)
    for _ in range(8):
        nisa.activation(dst=a, op=nl.copy, data=a)
        nisa.tensor_scalar(dst=b, data=b, op0=nl.multiply, operand0=1.0)
    out = nl.ndarray((128, 2048), nl.float32, buffer=nl.shared_hbm)
    nisa.tensor_tensor(dst=b, data1=a, data2=b, op=nl.add)
    nisa.dma_copy(dst=out, src=b)
    return out


def test_a_dependency_chain_cannot_overlap_engines():
    x = torch.randn(128, 2048)
    chained, parallel = traced(one_chain, x).estimate(TRN2), traced(two_chains, x).estimate(TRN2)
    # Same instructions on the same engines: the busy bound cannot tell them apart.
    assert chained.engine_seconds == pytest.approx(parallel.engine_seconds)
    scalar, vector = chained.engine_seconds["scalar"], chained.engine_seconds["vector"]
    # Two chains still wait for the first load to land and the last store to go out whole (a 1 MiB
    # tile each way), which the old serial term (two fixed DMA costs) left out; one chain waits for much more.
    tile = sim.cost_model.dma_transfer_seconds(traced(one_chain, x).instructions[0], TRN2)
    assert 0 < parallel.stall_seconds < 2 * tile + 1e-9
    assert chained.stall_seconds > parallel.stall_seconds + 0.8 * min(scalar, vector)
    # One chain: the ScalarE and VectorE passes add up instead of overlapping.
    assert chained.total_seconds > parallel.total_seconds + 0.8 * min(scalar, vector)
    assert chained.launches[0].chain_seconds > scalar + vector
