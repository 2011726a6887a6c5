"""A kernel in the style of the public NKI 0.3 matmul tutorial, unmodified NKI source.

Run it with `python -m neuron_inductor.sim tutorial_matmul.py [M K N]`.
"""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def nki_matmul_tiled_(lhsT, rhs):
    """result[M, N] = lhsT[K, M].T @ rhs[K, N]."""
    K, M = lhsT.shape
    K_, N = rhs.shape
    assert K == K_, "lhsT and rhs must have the same contraction dimension"

    TILE_M = nl.tile_size.gemm_stationary_fmax  # 128
    TILE_K = nl.tile_size.pmax  # 128
    TILE_N = nl.tile_size.gemm_moving_fmax  # 512

    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)

    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            res_psum = nl.ndarray((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                lhsT_tile = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                rhs_tile = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=lhsT_tile, src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                nisa.dma_copy(dst=rhs_tile, src=rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                nisa.nc_matmul(dst=res_psum, stationary=lhsT_tile, moving=rhs_tile)

            res_sb = nl.ndarray(res_psum.shape, dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res_sb, src=res_psum, dtype=result.dtype)
            nisa.dma_copy(dst=result[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], src=res_sb)

    return result


if __name__ == "__main__":
    import sys

    import numpy as np

    M, K, N = (int(a) for a in sys.argv[1:4]) if len(sys.argv) == 4 else (256, 256, 512)
    rng = np.random.default_rng(0)
    lhsT = rng.standard_normal((K, M), dtype=np.float32)
    rhs = rng.standard_normal((K, N), dtype=np.float32)
    out = nki.simulate(nki_matmul_tiled_)(lhsT, rhs)
    assert isinstance(out, np.ndarray) and np.allclose(out, lhsT.T @ rhs, rtol=1e-4, atol=1e-3)
    print(f"tutorial matmul {M}x{K}x{N}: OK")
