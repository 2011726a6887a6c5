"""Instruction traces (engines, flops, bytes, nesting) and the cost model."""

import importlib.util
import pathlib

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim.tracing import ACTIVE, Operand


@sim.jit
def every_engine(x, ids):
    a = nl.ndarray((128, 64), nl.bfloat16)
    nisa.dma_copy(dst=a, src=x)
    b = nl.ndarray((128, 64), nl.bfloat16)
    nisa.tensor_tensor(dst=b, data1=a, data2=a, op=nl.add)
    nisa.tensor_scalar(dst=b, data=b, op0=nl.multiply, operand0=2.0)
    nisa.activation(dst=b, op=nl.exp, data=b)
    s = nl.ndarray((128, 1), nl.float32)
    nisa.tensor_reduce(dst=s, op=nl.add, data=b, axis=1)
    nisa.reciprocal(dst=s, data=s)
    stats = nl.ndarray((128, 6), nl.float32)
    nisa.bn_stats(dst=stats, data=b)
    acc = nl.ndarray((64, 64), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=a, moving=b)
    t = nl.ndarray((64, 128), nl.bfloat16, buffer=nl.psum)
    nisa.nc_transpose(dst=t, data=a)
    c = nl.ndarray((64, 64), nl.float32)
    nisa.tensor_copy(dst=c, src=acc)
    nisa.tensor_copy(dst=c, src=c, engine=nisa.engine.scalar)
    nisa.memset(dst=acc, value=0.0)
    i = nl.ndarray((128, 64), nl.int32)
    nisa.iota(dst=i, pattern=[[1, 64]])
    nisa.dma_copy(dst=i, src=ids)
    nisa.tensor_tensor(dst=i, data1=i, data2=i, op=nl.add)
    out = nl.ndarray((64, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=c)
    return out


def run_traced():
    with sim.trace() as t:
        every_engine(torch.randn(128, 64).bfloat16(), torch.zeros(128, 64, dtype=torch.int32))
    return t


def test_engines_ops_flops_bytes():
    t = run_traced()
    seen = [(i.engine, i.op) for i in t.instructions]
    assert seen == [
        ("dma", "dma_copy"), ("vector", "tensor_tensor"), ("vector", "tensor_scalar"), ("scalar", "activation"),
        ("vector", "tensor_reduce"), ("vector", "reciprocal"), ("vector", "bn_stats"), ("tensor", "nc_matmul"),
        ("tensor", "nc_transpose"), ("vector", "tensor_copy"), ("scalar", "tensor_copy"), ("vector", "memset"),
        ("gpsimd", "iota"), ("dma", "dma_copy"), ("gpsimd", "tensor_tensor"), ("dma", "dma_copy"),
    ]
    by_op = {(i.engine, i.op): i for i in t.instructions}
    matmul = by_op[("tensor", "nc_matmul")]
    assert matmul.flops == 2 * 128 * 64 * 64 and matmul.free_size == 64 and matmul.partitions == 128
    assert matmul.shapes == ((64, 64), (128, 64), (128, 64))
    assert matmul.dtypes == ("float32", "bfloat16", "bfloat16")
    assert matmul.buffers == ("psum", "sbuf", "sbuf")
    assert by_op[("vector", "tensor_tensor")].flops == 128 * 64
    first_dma, ids_dma, last_dma = [i for i in t.instructions if i.engine == "dma"]
    assert first_dma.bytes == 128 * 64 * 2 and first_dma.buffers == ("sbuf", "shared_hbm")
    assert ids_dma.bytes == 128 * 64 * 4  # int32 ids read from HBM
    assert last_dma.bytes == 64 * 64 * 4
    assert all(i.kernel == "every_engine" for i in t.instructions)


def test_no_trace_no_records_and_nesting():
    assert not ACTIVE
    with sim.trace() as outer:
        every_engine(torch.randn(128, 64).bfloat16(), torch.zeros(128, 64, dtype=torch.int32))
        with sim.trace() as inner:
            every_engine(torch.randn(128, 64).bfloat16(), torch.zeros(128, 64, dtype=torch.int32))
        assert len(ACTIVE) == 1
    assert not ACTIVE
    assert len(inner) == 16 and len(outer) == 32
    assert outer.instructions[16:] == inner.instructions
    combined = inner + inner
    assert len(combined) == 32 and isinstance(combined, sim.Trace)
    assert combined.counts()[("tensor", "nc_matmul")] == 2
    # Records describe operands; they never hold tensors (which would keep on-chip memory alive).
    for ins in outer.instructions:
        for operand in ins.operands:
            assert all(isinstance(v, (str, tuple)) for v in operand)


def test_isolated_trace_hides_its_instructions_from_enclosing_traces():
    with sim.trace() as outer:
        with sim.trace(isolated=True) as isolated:
            every_engine(torch.randn(128, 64).bfloat16(), torch.zeros(128, 64, dtype=torch.int32))
            assert ACTIVE == [isolated]
        assert ACTIVE == [outer]
        every_engine(torch.randn(128, 64).bfloat16(), torch.zeros(128, 64, dtype=torch.int32))
    assert not ACTIVE
    assert len(isolated) == 16 and len(outer) == 16


def one(op, engine, free_size, operands):
    return sim.Instruction(engine, op, 0, 0, free_size, 128,
                           tuple(Operand("x", (128, free_size), d, "sbuf") for d in operands),
                           "", (0,))


def test_cycle_rules():
    trn2 = sim.get_target("trn2")
    est = sim.estimate([one("nc_matmul", "tensor", 512, ["float32", "bfloat16", "bfloat16"])], "trn2")
    assert est.engine_seconds["tensor"] == pytest.approx(512 / 2.4e9)
    est = sim.estimate([one("nc_matmul", "tensor", 512, ["float32", "float32", "float32"])], "trn2")
    assert est.engine_seconds["tensor"] == pytest.approx(4 * 512 / 2.4e9)
    est = sim.estimate([one("nc_matmul", "tensor", 16, ["float32", "bfloat16", "bfloat16"])], "trn2")
    assert est.engine_seconds["tensor"] == pytest.approx(64 / 2.4e9)
    est = sim.estimate([one("tensor_tensor", "vector", 512, ["float32"] * 3)], "trn2")
    assert est.engine_seconds["vector"] == pytest.approx((2 * 512 + 64) / 0.96e9)
    est = sim.estimate([one("tensor_tensor", "vector", 512, ["bfloat16"] * 3)], "trn2")
    assert est.engine_seconds["vector"] == pytest.approx((512 + 64) / 0.96e9)
    est = sim.estimate([one("tensor_tensor", "vector", 512, ["bfloat16"] * 3)], "trn1")  # no perf mode on v2
    assert est.engine_seconds["vector"] == pytest.approx((2 * 512 + 64) / 1.12e9)
    est = sim.estimate([one("activation", "scalar", 32, ["float32"] * 2)], "trn2")
    assert est.engine_seconds["scalar"] == pytest.approx(64 / 1.2e9)
    dma = sim.Instruction("dma", "dma_copy", 0, 1 << 20, 0, 128, (), "", (0,))
    est = sim.estimate([dma] * 32, "trn2")
    efficiency = 8192 / (8192 + 256)  # 1 MiB over 128 partitions: 8 KiB contiguous per descriptor
    expected = 32 * (1 << 20) / (16 * 23e9 * efficiency) + 32 * 1.3e-6 / 16
    assert est.engine_seconds["dma"] == pytest.approx(expected)
    assert est.total_seconds == pytest.approx(expected + 2 * trn2.dma_fixed_s + trn2.launch_fixed_s)
    assert est.bound == "dma" and est.dma_bytes == 32 << 20
    assert set(est.engine_seconds) == {"tensor", "vector", "scalar", "gpsimd", "dma"}


def test_estimate_of_real_trace_and_targets():
    t = run_traced()
    trn2, trn3 = t.estimate("trn2"), t.estimate(target="trn3")
    (launch,) = trn2.launches
    pipelined = max(trn2.engine_seconds.values()) + trn2.serial_seconds
    assert trn2.total_seconds == pytest.approx(max(pipelined, launch.chain_seconds) + launch.launch_seconds)
    assert trn2.matmul_flops == 2 * 128 * 64 * 64 and 0 < trn2.peak_fraction < 1
    assert trn3.engine_seconds["dma"] < trn2.engine_seconds["dma"]  # 528 vs 368 GB/s per core
    assert "trn2" in t.summary("trn2")


def load_bench():
    path = pathlib.Path(__file__).parents[2] / "bench" / "sim_matmul.py"
    spec = importlib.util.spec_from_file_location("sim_matmul_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blocked_matmul_is_tensor_bound_and_naive_is_dma_bound():
    bench = load_bench()
    report = bench.cost_model_report(1024)
    blocked, naive = report["well-blocked"], report["naive"]
    assert blocked.bound == "tensor" and blocked.peak_fraction > 0.8
    assert naive.bound == "dma" and naive.peak_fraction < 0.5
    assert blocked.matmul_flops == naive.matmul_flops == 2 * 1024 ** 3


def test_bench_kernels_compute_the_matmul():
    bench = load_bench()
    a, b = torch.randn(256, 1024).bfloat16(), torch.randn(256, 1024).bfloat16()
    expected = a.float().t() @ b.float()
    small_blocks = bench.blocked_matmul_kernel(tiles_m=2, tiles_n=1)
    for kernel in (bench.naive_matmul, small_blocks):
        torch.testing.assert_close(kernel(a, b).float(), expected, rtol=1e-2, atol=0.2)
