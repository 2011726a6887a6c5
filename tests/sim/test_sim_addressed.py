"""Explicit-address allocation and shared constants: nl.ndarray(address=...), nl.shared_constant."""

import numpy as np
import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

BANK = 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reusing_psum_banks_by_address_is_not_an_overflow(dtype):
    a, b = torch.randn(128, 128).to(dtype), torch.randn(128, 512).to(dtype)

    @sim.jit
    def kernel(x, y):
        xs, ys = nl.ndarray((128, 128), x.dtype), nl.ndarray((128, 512), y.dtype)
        nisa.dma_copy(dst=xs, src=x)
        nisa.dma_copy(dst=ys, src=y)
        out = nl.ndarray((24, 128, 512), nl.float32, buffer=nl.shared_hbm)
        for i in range(24):  # 24 one-bank tiles live at once: 3x PSUM, but only 8 distinct banks
            acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, (i % 8) * BANK))
            nisa.nc_matmul(dst=acc, stationary=xs, moving=ys)
            staged = nl.ndarray((128, 512), nl.float32)
            nisa.tensor_copy(dst=staged, src=acc)
            nisa.dma_copy(dst=out[i], src=staged)
        return out

    out = kernel(a, b)
    expected = a.float().t() @ b.float()
    torch.testing.assert_close(out, expected.expand(24, 128, 512), rtol=1e-5, atol=1e-4)


def test_tiles_at_one_address_share_their_bytes():
    @sim.jit
    def kernel(x):
        first = nl.ndarray((32, 16), nl.float32, address=(64, 4096))
        nisa.dma_copy(dst=first, src=x)
        alias = nl.ndarray((32, 32), nl.bfloat16, address=(64, 4096))  # same bytes, other dtype
        lower = nl.ndarray((16, 16), nl.float32, address=(80, 4096))   # partitions 80..95
        outs = (nl.ndarray((32, 32), nl.bfloat16, buffer=nl.shared_hbm),
                nl.ndarray((16, 16), nl.float32, buffer=nl.shared_hbm),
                nl.ndarray((32, 8), nl.float32, buffer=nl.shared_hbm))
        nisa.dma_copy(dst=outs[0], src=alias)
        nisa.dma_copy(dst=outs[1], src=lower)
        nisa.dma_copy(dst=outs[2], src=first.ap([[16, 32], [2, 8]], offset=1))  # ap on an address= tile
        return outs

    x = torch.randn(32, 16)
    alias, lower, odd = kernel(x)
    assert torch.equal(alias.view(torch.int16), x.view(torch.int16))  # bit patterns (some are NaN as bf16)
    assert torch.equal(lower, x[16:])
    assert torch.equal(odd, x[:, 1::2])


def test_addresses_must_fit_the_buffer():
    @sim.jit
    def past_psum():
        nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 7 * BANK + 4))

    with pytest.raises(sim.NkiRuleError, match="16384 B of psum"):
        past_psum()

    @sim.jit
    def past_partitions():
        nl.ndarray((64, 8), nl.float32, address=(96, 0))

    with pytest.raises(sim.NkiRuleError, match="partition 96"):
        past_partitions()

    @sim.jit
    def on_hbm():
        nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm, address=(0, 0))

    with pytest.raises(sim.NkiError, match="no address"):
        on_hbm()


@pytest.mark.parametrize("np_dtype, nl_dtype", [(np.float32, nl.float32), (np.int32, nl.int32)])
def test_shared_constant_is_a_read_only_hbm_tensor(tmp_path, np_dtype, nl_dtype):
    table = np.arange(24, dtype=np_dtype).reshape(4, 6)
    path = tmp_path / "table.npy"
    np.save(path, table)

    @sim.jit
    def kernel(x):
        from_array, from_file = nl.shared_constant(table), nl.shared_constant(str(path))
        assert from_array.dtype is nl_dtype and from_array.buffer is nl.shared_hbm
        t = nl.ndarray((4, 6), nl_dtype)
        nisa.dma_copy(dst=t, src=from_file)
        out = nl.ndarray((4, 6), nl_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        with pytest.raises(sim.NkiError, match="read-only"):
            nisa.dma_copy(dst=from_array, src=t)
        return out

    assert torch.equal(kernel(torch.zeros(1)), torch.from_numpy(table))
