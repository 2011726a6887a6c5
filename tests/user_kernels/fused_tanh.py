"""NKI kernels for tests/test_user_kernels.py, written for the real NKI (imported under sim.as_nki())."""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def scaled_tanh_fwd(x, scale):
    """tanh(scale * x) over [N, D], 128 rows per tile (N need not be a multiple of 128)."""
    n, d = x.shape
    out = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range((n + 127) // 128):
        rows = min(128, n - i * 128)
        t = nl.ndarray((128, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:rows, :], src=x[i * 128:i * 128 + rows, :])
        nisa.activation(dst=t[0:rows, :], op=nl.tanh, data=t[0:rows, :], scale=scale)
        nisa.dma_copy(dst=out[i * 128:i * 128 + rows, :], src=t[0:rows, :])
    return out


@nki.jit
def scaled_tanh_bwd(y, dy, scale):
    """dx = dy * scale * (1 - y^2), from the forward's output y."""
    n, d = y.shape
    dx = nl.ndarray((n, d), dtype=dy.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range((n + 127) // 128):
        rows = min(128, n - i * 128)
        yt = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        gt = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=yt[0:rows, :], src=y[i * 128:i * 128 + rows, :])
        nisa.dma_copy(dst=gt[0:rows, :], src=dy[i * 128:i * 128 + rows, :])
        nisa.tensor_tensor(dst=yt[0:rows, :], data1=yt[0:rows, :], data2=yt[0:rows, :], op=nl.multiply)
        nisa.tensor_scalar(dst=yt[0:rows, :], data=yt[0:rows, :], op0=nl.multiply, operand0=-scale,
                           op1=nl.add, operand1=scale)
        r = nl.ndarray((128, d), dtype=dy.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=r[0:rows, :], data1=yt[0:rows, :], data2=gt[0:rows, :], op=nl.multiply)
        nisa.dma_copy(dst=dx[i * 128:i * 128 + rows, :], src=r[0:rows, :])
    return dx


@nki.jit
def affine_rows_grid(x, mul, add):
    """x * mul + add, one program per 128 rows: launch as kernel[N // 128]."""
    i = nl.program_id(0)
    d = x.shape[1]
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((128, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, :])
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=mul, op1=nl.add, operand1=add)
    nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=t)
    return out


@nki.jit
def accumulate_into(acc, x):
    """acc += x in place (acc is an argument the kernel writes into); returns nothing."""
    n, d = acc.shape
    a = nl.ndarray((n, d), dtype=acc.dtype, buffer=nl.sbuf)
    t = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=acc)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_tensor(dst=a, data1=a, data2=t, op=nl.add)
    nisa.dma_copy(dst=acc, src=a)
