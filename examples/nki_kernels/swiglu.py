"""A fused SwiGLU kernel and its backward, written for the real NKI (`import nki`).

On a CPU host, import this file inside `neuron_inductor.sim.as_nki()` (examples/custom_kernel.py
does) and the kernels run in the NKI interpreter; on a Trainium host they run under nki.jit.
"""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def swiglu_fwd(gate, up):
    """silu(gate) * up over [N, D], one pass over HBM: 128 rows per tile, any N."""
    n, d = gate.shape
    out = nl.ndarray((n, d), dtype=gate.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range((n + 127) // 128):
        rows = min(128, n - i * 128)
        g = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        u = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=g[0:rows, :], src=gate[i * 128:i * 128 + rows, :])
        nisa.dma_copy(dst=u[0:rows, :], src=up[i * 128:i * 128 + rows, :])
        nisa.activation(dst=g[0:rows, :], op=nl.silu, data=g[0:rows, :])
        r = nl.ndarray((128, d), dtype=gate.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=r[0:rows, :], data1=g[0:rows, :], data2=u[0:rows, :], op=nl.multiply)
        nisa.dma_copy(dst=out[i * 128:i * 128 + rows, :], src=r[0:rows, :])
    return out


@nki.jit
def swiglu_bwd(gate, up, grad):
    """(d gate, d up) = (grad * up * silu'(gate), grad * silu(gate))."""
    n, d = gate.shape
    d_gate = nl.ndarray((n, d), dtype=gate.dtype, buffer=nl.shared_hbm)
    d_up = nl.ndarray((n, d), dtype=up.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range((n + 127) // 128):
        rows = min(128, n - i * 128)
        g = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        u = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        dy = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=g[0:rows, :], src=gate[i * 128:i * 128 + rows, :])
        nisa.dma_copy(dst=u[0:rows, :], src=up[i * 128:i * 128 + rows, :])
        nisa.dma_copy(dst=dy[0:rows, :], src=grad[i * 128:i * 128 + rows, :])
        s = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        ds = nl.ndarray((128, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=s[0:rows, :], op=nl.silu, data=g[0:rows, :])
        nisa.activation(dst=ds[0:rows, :], op=nl.silu_dx, data=g[0:rows, :])
        r = nl.ndarray((128, d), dtype=up.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=r[0:rows, :], data1=s[0:rows, :], data2=dy[0:rows, :], op=nl.multiply)
        nisa.dma_copy(dst=d_up[i * 128:i * 128 + rows, :], src=r[0:rows, :])
        nisa.tensor_tensor(dst=ds[0:rows, :], data1=ds[0:rows, :], data2=u[0:rows, :], op=nl.multiply)
        q = nl.ndarray((128, d), dtype=gate.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=q[0:rows, :], data1=ds[0:rows, :], data2=dy[0:rows, :], op=nl.multiply)
        nisa.dma_copy(dst=d_gate[i * 128:i * 128 + rows, :], src=q[0:rows, :])
    return d_gate, d_up
