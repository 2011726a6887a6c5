"""Whole kernels written by hand (matmul with K accumulated in PSUM, row softmax, rmsnorm) against torch."""

import numpy as np
import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

P = 128


@sim.jit
def tiled_matmul(lhsT, rhs):
    """result[M, N] = lhsT[K, M].T @ rhs[K, N]; K accumulated in PSUM, edge tiles via min()."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m0 in nl.affine_range((M + P - 1) // P):
        m = min(P, M - m0 * P)
        for n0 in nl.affine_range((N + 511) // 512):
            n = min(512, N - n0 * 512)
            acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
            for k0 in nl.sequential_range((K + P - 1) // P):
                k = min(P, K - k0 * P)
                a = nl.ndarray((k, m), lhsT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k0 * P:k0 * P + k, m0 * P:m0 * P + m])
                b = nl.ndarray((k, n), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k0 * P:k0 * P + k, n0 * 512:n0 * 512 + n])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=k0 > 0)
            out = nl.ndarray((m, n), lhsT.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)
            nisa.dma_copy(dst=result[m0 * P:m0 * P + m, n0 * 512:n0 * 512 + n], src=out)
    return result


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("k, m, n", [(384, 256, 640), (128, 128, 512), (200, 72, 33)])
def test_tiled_matmul(k, m, n, dtype, tol):
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    out = tiled_matmul(a.t(), b)  # a strided (transposed) view as lhsT: no copy needed
    expected = (a.float() @ b.float()).to(dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * k ** 0.5)


@sim.jit
def row_softmax(x):
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range((rows + P - 1) // P):
        r = min(P, rows - i * P)
        t = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * P:i * P + r, :])
        neg_max = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=t, axis=1, negate=True)
        exps = nl.ndarray((r, cols), nl.float32, buffer=nl.sbuf)
        sums = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=exps, op=nl.exp, data=t, bias=neg_max, reduce_op=nl.add, reduce_res=sums,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        inv = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=sums)
        y = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=exps, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[i * P:i * P + r, :], src=y)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_row_softmax(dtype, tol):
    x = (torch.randn(300, 257) * 4).to(dtype)
    out = row_softmax(x)
    torch.testing.assert_close(out.float(), torch.softmax(x.float(), dim=-1), rtol=tol, atol=tol)


@sim.jit
def rmsnorm(x, weight, eps):
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range((rows + P - 1) // P):
        r = min(P, rows - i * P)
        t = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * P:i * P + r, :])
        w = nl.ndarray((r, cols), weight.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w, src=weight[0:r, :])  # weight is a stride-0 broadcast view
        squares = nl.ndarray((r, cols), nl.float32, buffer=nl.sbuf)
        ss = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=squares, op=nl.square, data=t, reduce_op=nl.add, reduce_res=ss)
        inv = nl.ndarray((r, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=inv, data=ss, op0=nl.multiply, operand0=1.0 / cols, op1=nl.add, operand1=eps)
        nisa.activation(dst=inv, op=nl.rsqrt, data=inv)
        normed = nl.ndarray((r, cols), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=normed, data=t, op0=nl.multiply, operand0=inv)
        y = nl.ndarray((r, cols), x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=y, data1=normed, data2=w, op=nl.multiply)
        nisa.dma_copy(dst=out[i * P:i * P + r, :], src=y)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rmsnorm(dtype, tol):
    x, weight = torch.randn(200, 96).to(dtype), torch.randn(96).to(dtype)
    out = rmsnorm(x, weight.expand(P, 96), 1e-6)
    xf = x.float()
    expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_spmd_grid_program_ids_and_shared_output():
    @sim.jit
    def add_one(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        i, j = nl.program_id(0), nl.program_id(axis=1)
        rows, cols = x.shape[0] // nl.num_programs(0), x.shape[1] // nl.num_programs(1)
        assert nl.program_ndim() == 2 and nl.num_programs(None) == nl.num_programs((0, 1))[0] * nl.num_programs(1)
        t = nl.ndarray((rows, cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(10 * i + j))
        nisa.dma_copy(dst=out[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols], src=t)
        return out

    x = torch.zeros(256, 96)
    out = add_one[2, 3](x)
    assert torch.equal(out[:128, :32], torch.zeros(128, 32))
    assert torch.equal(out[128:, 64:], torch.full((128, 32), 12.0))
    assert torch.equal(sim.simulate(add_one)[2, 3](x), out)


def test_tuple_outputs_numpy_mode_and_in_place_arguments():
    @sim.jit
    def kernel(x, scratch):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        doubled = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=doubled, src=t)
        nisa.dma_copy(dst=scratch[0:x.shape[0], :], src=t)  # written through into the caller's tensor
        halves = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=0.25)
        nisa.dma_copy(dst=halves, src=t)
        return doubled, halves

    x, scratch = torch.randn(64, 8), torch.zeros(100, 8)
    doubled, halves = kernel(x, scratch[:, :])
    assert torch.equal(doubled, 2 * x) and halves.dtype == torch.bfloat16
    assert torch.equal(scratch[:64], 2 * x) and torch.equal(scratch[64:], torch.zeros(36, 8))
    doubled_np, halves_np = kernel(x.numpy(), np.zeros((64, 8), np.float32))
    assert isinstance(doubled_np, np.ndarray) and np.array_equal(doubled_np, 2 * x.numpy())
    assert halves_np.dtype == np.float32


def test_lists_of_tiles_and_positional_dst():
    @sim.jit
    def kernel(x):
        tiles = [[nl.ndarray((32, 16), nl.float32) for _ in range(2)] for _ in range(2)]
        for i in range(2):
            for j in range(2):
                nisa.dma_copy(tiles[i][j], x[i * 32:(i + 1) * 32, j * 16:(j + 1) * 16])
        out = nl.ndarray((64, 32), nl.float32, buffer=nl.shared_hbm)
        for i in range(2):
            for j in range(2):
                nisa.tensor_tensor(tiles[i][j], tiles[i][j], tiles[1 - i][1 - j], nl.add)
        for i in range(2):
            for j in range(2):
                nisa.dma_copy(out[i * 32:(i + 1) * 32, j * 16:(j + 1) * 16], tiles[i][j])
        return out

    x = torch.randn(64, 32)
    out = kernel(x)
    flipped = torch.flip(x.reshape(2, 32, 2, 16), dims=(0, 2)).reshape(64, 32)
    assert torch.equal(out[:32, :16], x[:32, :16] + flipped[:32, :16])


def test_platform_target_of_jit_selects_limits():
    def body():
        tiles = [nl.ndarray((128, 1024), nl.float32) for _ in range(55)]  # 220 KiB: only trn3 has room
        for t in tiles:
            nisa.memset(t, 0.0)  # (a tile takes its bytes at its first write)

    with pytest.raises(sim.NkiCapacityError):
        sim.jit(body)()
    sim.jit(platform_target="trn3")(body)()
