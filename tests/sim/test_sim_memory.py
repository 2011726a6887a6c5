"""Fresh memory reads as NaN / 4; live SBUF and PSUM bytes are held against the target's capacity."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl


@sim.jit
def store_unwritten(x):
    t = nl.ndarray((128, 64), nl.float32)
    nisa.dma_copy(dst=t[:, 0:32], src=x)
    out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_unwritten_sbuf_reads_as_nan():
    x = torch.randn(128, 32)
    out = store_unwritten(x)
    assert torch.equal(out[:, :32], x)
    assert torch.isnan(out[:, 32:]).all()


def test_unwritten_memory_flows_into_results_as_nan():
    @sim.jit
    def kernel(x):
        t = nl.ndarray((128, 64), nl.float32)
        nisa.dma_copy(dst=t[:, 0:63], src=x)  # last column forgotten
        total = nl.ndarray((128, 1), nl.float32)
        nisa.tensor_reduce(dst=total, op=nl.add, data=t, axis=1)
        out = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=total)
        return out

    assert torch.isnan(kernel(torch.randn(128, 63))).all()


def test_unwritten_integers_read_as_4_and_outputs_as_nan():
    @sim.jit
    def kernel():
        t = nl.ndarray((8, 8), nl.int32)
        ints = nl.ndarray((8, 8), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=ints, src=t)
        never_written = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.shared_hbm)
        return ints, never_written

    ints, never_written = kernel()
    assert torch.equal(ints, torch.full((8, 8), 4, dtype=torch.int32))
    assert never_written.dtype == torch.bfloat16 and torch.isnan(never_written.float()).all()


def keep_tiles(count, free, buffer=nl.sbuf):
    @sim.jit
    def kernel():
        kept = []
        for _ in nl.affine_range(count):
            kept.append(nl.ndarray((128, free), nl.float32, buffer=buffer))
        return None

    return kernel


def test_sbuf_capacity_overflow():
    usable = sim.get_target("trn2").sbuf_usable_bytes  # 208 KiB per partition
    keep_tiles(usable // 4096, 1024)()                  # exactly full: fine
    with pytest.raises(sim.NkiCapacityError) as info:
        keep_tiles(usable // 4096 + 1, 1024)()
    error = info.value
    assert error.op == "nl.ndarray" and "SBUF" in error.rule and error.value == usable + 4096
    assert f"over the {usable} B/partition available on trn2" in str(error)


def test_psum_capacity_overflow():
    keep_tiles(8, 512, nl.psum)()  # 8 banks of 2 KiB
    with pytest.raises(sim.NkiCapacityError) as info:
        keep_tiles(9, 512, nl.psum)()
    assert "PSUM" in info.value.rule and info.value.value == 18 * 1024


def test_capacity_depends_on_target(monkeypatch):
    too_big_for_trn2 = keep_tiles(216 // 4, 1024)  # 216 KiB
    with pytest.raises(sim.NkiCapacityError):
        too_big_for_trn2()
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    too_big_for_trn2()


def test_tiles_are_released_when_garbage_collected():
    @sim.jit
    def kernel(x):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        for _ in nl.affine_range(50):  # 50 x 16 KiB would not fit if tiles leaked
            t = nl.ndarray((128, 4096), nl.float32)
            nisa.memset(t, 0.0)
            nisa.dma_copy(dst=out, src=t[:, 0:64])
        return out

    assert torch.equal(kernel(torch.zeros(1)), torch.zeros(128, 64))


def test_each_program_and_call_has_its_own_memory():
    usable = sim.get_target("trn2").sbuf_usable_bytes
    kernel = keep_tiles(usable // 4096, 1024)
    kernel()
    kernel()           # nothing leaked from the first call
    kernel[2, 2]()     # four programs, each a full NeuronCore


def test_fp32_storage_flag(monkeypatch):
    x = torch.randn(128, 64)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 64), nl.bfloat16)
        nisa.dma_copy(dst=t, src=src)
        sq = nl.ndarray((128, 64), nl.bfloat16)
        nisa.activation(dst=sq, op=nl.square, data=t)
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=sq)
        return out

    rounded = kernel(x)
    assert torch.equal(rounded, (x.bfloat16().float() ** 2).bfloat16().float())
    monkeypatch.setenv(sim.dtypes.FP32_STORAGE_ENV, "1")
    unrounded = kernel(x)
    assert torch.equal(unrounded, x * x)


def test_psum_tiles_take_whole_banks():
    keep_tiles(8, 128, nl.psum)()  # eight 512 B tiles: one bank each
    with pytest.raises(sim.NkiCapacityError) as info:
        keep_tiles(9, 128, nl.psum)()
    assert info.value.value == 9 * 2048
