"""Matmul kernels in the NKI interpreter: cost-model % of TensorE peak, CPU time, per-instruction overhead.

    python bench/sim_matmul.py [--size 4096] [--cpu-size 2048] [--repeats 3]

1. Cost model (trn2, one NeuronCore): a well-blocked bf16 matmul (operand blocks loaded
   once per block and reused across the block's tiles, M and N blocked) versus a naive one
   that reloads both operand tiles for every matmul, reported as % of the 79 TF TensorE peak.
2. CPU time (process time; wall time alongside) of the blocked kernel at --cpu-size in
   the interpreter, as a ratio to torch.matmul on the same bf16 operands (best of --repeats).
3. Bookkeeping per ISA call: interpreter time of tiny-tile instructions minus the time of
   the torch operations they run.
"""

from __future__ import annotations

import argparse
import time

import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

P, TILE_N = 128, 512


@sim.jit
def naive_matmul(lhsT, rhs):
    """result = lhsT.T @ rhs, reloading both operand tiles at every K step (the first tutorial kernel)."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // P):
        for n in nl.affine_range(N // TILE_N):
            acc = nl.ndarray((P, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.sequential_range(K // P):
                a = nl.ndarray((P, P), lhsT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * P:(k + 1) * P, m * P:(m + 1) * P])
                b = nl.ndarray((P, TILE_N), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[k * P:(k + 1) * P, n * TILE_N:(n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=k > 0)
            out = nl.ndarray((P, TILE_N), result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=acc)
            nisa.dma_copy(dst=result[m * P:(m + 1) * P, n * TILE_N:(n + 1) * TILE_N], src=out)
    return result


def blocked_matmul_kernel(tiles_m: int = 8, tiles_n: int = 2):
    """result = lhsT.T @ rhs with [K, tiles_m*128] lhsT blocks hoisted out of the N loop and
    [K, tiles_n*512] rhs blocks reused by every M tile of the block."""

    @sim.jit
    def blocked_matmul(lhsT, rhs):
        K, M = lhsT.shape
        _, N = rhs.shape
        block_m, block_n = tiles_m * P, tiles_n * TILE_N
        result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
        for mb in nl.affine_range(M // block_m):
            lhsT_block = []
            for k in nl.affine_range(K // P):
                t = nl.ndarray((P, block_m), lhsT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=t, src=lhsT[k * P:(k + 1) * P, mb * block_m:(mb + 1) * block_m])
                lhsT_block.append(t)
            for nb in nl.affine_range(N // block_n):
                rhs_block = []
                for k in nl.affine_range(K // P):
                    t = nl.ndarray((P, block_n), rhs.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=t, src=rhs[k * P:(k + 1) * P, nb * block_n:(nb + 1) * block_n])
                    rhs_block.append(t)
                for m in nl.affine_range(tiles_m):
                    for n in nl.affine_range(tiles_n):
                        acc = nl.ndarray((P, TILE_N), nl.float32, buffer=nl.psum)
                        for k in nl.sequential_range(K // P):
                            nisa.nc_matmul(dst=acc, stationary=lhsT_block[k][:, m * P:(m + 1) * P],
                                           moving=rhs_block[k][:, n * TILE_N:(n + 1) * TILE_N], accumulate=k > 0)
                        out = nl.ndarray((P, TILE_N), result.dtype, buffer=nl.sbuf)
                        nisa.tensor_copy(dst=out, src=acc)
                        row, col = mb * block_m + m * P, nb * block_n + n * TILE_N
                        nisa.dma_copy(dst=result[row:row + P, col:col + TILE_N], src=out)
                rhs_block = None  # free the block before the next one is loaded
            lhsT_block = None
        return result

    return blocked_matmul


blocked_matmul = blocked_matmul_kernel()


def cost_model_report(size: int, target: str = "trn2") -> dict:
    lhsT = torch.randn(size, size).bfloat16()
    rhs = torch.randn(size, size).bfloat16()
    report = {}
    for name, kernel in (("well-blocked", blocked_matmul), ("naive", naive_matmul)):
        with sim.trace() as t:
            kernel(lhsT, rhs)
        report[name] = t.estimate(target)
    return report


def best_of(repeats: int, fn) -> tuple[float, float]:
    """(best wall seconds, best process CPU seconds) over `repeats` runs."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def cpu_time_report(size: int, repeats: int) -> dict:
    """Wall and CPU seconds of the blocked kernel and of torch.matmul on the same bf16 operands."""
    a = torch.randn(size, size).bfloat16()
    b = torch.randn(size, size).bfloat16()
    out = blocked_matmul(a, b)  # warm-up, and a correctness check
    expected = (a.float().t() @ b.float()).bfloat16()
    at = a.t()
    torch.matmul(at, b)
    return {
        "interpreter": best_of(repeats, lambda: blocked_matmul(a, b)),
        "torch.matmul": best_of(repeats, lambda: torch.matmul(at, b)),
        "relative_error": ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item(),
    }


def overhead_report(calls: int = 2000) -> dict:
    """µs of interpreter bookkeeping per call: best call time minus the best time of the raw torch work.

    Best-of (not mean) so that other load on the machine does not count as bookkeeping.
    """
    def tile(shape, dtype=nl.float32, buffer=nl.sbuf):
        t = nl.ndarray(shape, dtype, buffer=buffer)
        nisa.memset(t, 1.0)
        return t

    a, b, d = tile((128, 8)), tile((128, 8)), tile((128, 8))
    s, m = tile((128, 128), nl.bfloat16), tile((128, 8), nl.bfloat16)
    psum = tile((128, 8), buffer=nl.psum)
    hbm = sim.tensor.wrap_hbm(torch.randn(512, 8))
    raw_a, raw_b, raw_d = a.data, b.data, d.data
    s32, m32 = s.data.float(), m.data.float()
    cases = {
        "tensor_tensor": (lambda: nisa.tensor_tensor(d, a, b, nl.add),
                          lambda: raw_d.copy_(torch.add(raw_a, raw_b))),
        "tensor_scalar": (lambda: nisa.tensor_scalar(d, a, nl.multiply, 2.0, op1=nl.add, operand1=1.0),
                          lambda: raw_d.copy_(raw_a * 2.0 + 1.0)),
        "activation": (lambda: nisa.activation(d, nl.exp, a), lambda: raw_d.copy_(torch.exp(raw_a))),
        "tensor_copy": (lambda: nisa.tensor_copy(d, a), lambda: raw_d.copy_(raw_a)),
        "tensor_reduce": (lambda: nisa.tensor_reduce(d[:, 0:1], nl.add, a, axis=1),
                          lambda: raw_d[:, 0:1].copy_(raw_a.sum(1, keepdim=True))),
        "dma_copy": (lambda: nisa.dma_copy(dst=d, src=hbm[128:256, :]), lambda: raw_d.copy_(hbm.data[128:256])),
        "nc_matmul": (lambda: nisa.nc_matmul(psum, s, m),  # operands' fp32 copies are cached
                      lambda: psum.data.addmm_(s32.t(), m32)),
        "nl.ndarray": (lambda: nl.ndarray((128, 8), nl.float32), lambda: torch.full((128, 8), float("nan"))),
    }

    def per_call(fn):
        samples = []
        for _ in range(10):
            start = time.perf_counter()
            for _ in range(calls // 10):
                fn()
            samples.append((time.perf_counter() - start) / (calls // 10))
        return min(samples) * 1e6

    results = {}
    torch.set_num_threads(1)  # as inside kernels (see NEURON_INDUCTOR_SIM_THREADS)
    for name, (interpreted, raw) in cases.items():
        interpreted(), raw()
        results[name] = (per_call(interpreted), per_call(raw))
    with sim.trace():
        results["tensor_tensor (traced)"] = (per_call(cases["tensor_tensor"][0]), results["tensor_tensor"][1])
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="cost-model matmul size (M = N = K)")
    parser.add_argument("--cpu-size", type=int, default=2048, help="CPU-time matmul size (M = N = K)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    print(f"== cost model, trn2, one NeuronCore, {args.size}^3 bf16 (TensorE peak 79 TF)")
    for name, est in cost_model_report(args.size).items():
        engines = "  ".join(f"{e}={s * 1e3:.3f}ms" for e, s in est.engine_seconds.items())
        print(f"{name:>13}: {est.total_seconds * 1e3:8.3f} ms  {est.peak_fraction:6.1%} of peak  "
              f"{est.bound}-bound  dma={est.dma_bytes / 2**20:.0f} MiB  [{engines}]")

    times = cpu_time_report(args.cpu_size, args.repeats)
    (interp_wall, interp_cpu), (torch_wall, torch_cpu) = times["interpreter"], times["torch.matmul"]
    print(f"== {args.cpu_size}^3 bf16: interpreter (blocked kernel, 1 torch thread inside kernels) "
          f"vs torch.matmul ({torch.get_num_threads()} threads), best of {args.repeats}")
    print(f"CPU time: {interp_cpu:.3f} s vs {torch_cpu:.3f} s = {interp_cpu / torch_cpu:.2f}x   "
          f"(wall: {interp_wall:.3f} s vs {torch_wall:.3f} s = {interp_wall / torch_wall:.2f}x)   "
          f"max |error| / max |out| vs fp32 reference: {times['relative_error']:.1e} (bf16 output)")

    print("== bookkeeping per ISA call (tiny tiles): interpreter - raw torch work, microseconds")
    for name, (interpreted, raw) in overhead_report().items():
        print(f"{name:>24}: {interpreted:6.1f} - {raw:5.1f} = {interpreted - raw:5.1f} us")


if __name__ == "__main__":
    main()
