"""Kernels of our own in the style of production NKI libraries (NKI 0.3+ source, run under sim.as_nki()).

They exercise what such libraries lean on: NKIObject configs (dataclass fields and unannotated
attributes), TensorView-like `.ap()` access patterns with dtype reinterpretation, explicit
address allocation, indirect DMA with out-of-bounds skipping, virtual registers, top-8 search
and LNC=2 sharding with sendrecv / core_barrier. Each has a torch reference in
tests/sim/test_sim_corpus.py.
"""

from dataclasses import dataclass

import nki
import nki.isa as nisa
import nki.language as nl
from nki.isa.constants import oob_mode

P = 128
BANK_BYTES = 2048


@dataclass
class GatherConfig(nl.NKIObject):
    """Row gather geometry; `rows_per_core` and `first_row` are filled in per program."""

    num_tokens: int
    hidden: int
    vocab: int
    rows_per_core = 0
    first_row = 0


def _gather_config(ids, table) -> GatherConfig:
    cfg = GatherConfig(num_tokens=ids.shape[0], hidden=table.shape[1], vocab=table.shape[0])
    cores = nl.num_programs(0)
    cfg.rows_per_core = (cfg.num_tokens + cores - 1) // cores
    cfg.first_row = nl.program_id(0) * cfg.rows_per_core
    return cfg


@nki.jit
def embedding_lookup(ids, table):
    """out[t] = table[ids[t]], zeros for ids outside [0, vocab) (padding); tokens split over the cores."""
    cfg = _gather_config(ids, table)
    out = nl.ndarray((cfg.num_tokens, cfg.hidden), dtype=table.dtype, buffer=nl.shared_hbm)
    for start in range(cfg.first_row, min(cfg.first_row + cfg.rows_per_core, cfg.num_tokens), P):
        rows = min(P, cfg.num_tokens - start, cfg.first_row + cfg.rows_per_core - start)
        index = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=index, src=ids.ap([[1, rows], [1, 1]], offset=start))
        gathered = nl.ndarray((rows, cfg.hidden), dtype=table.dtype, buffer=nl.sbuf)
        nisa.memset(dst=gathered, value=0.0)
        nisa.dma_copy(dst=gathered,
                      src=table.ap([[cfg.hidden, rows], [1, cfg.hidden]], vector_offset=index, indirect_dim=0),
                      oob_mode=oob_mode.skip)
        nisa.dma_copy(dst=out[start:start + rows, :], src=gathered)
    return out


class NormBuffers(nl.NKIObject):
    """SBUF / PSUM tiles of rmsnorm_matmul, placed by hand (attributes without annotations)."""

    x_sb = None
    w_sb = None
    sums = None
    acc = None


@nki.jit
def rmsnorm_matmul(x, gamma, w, eps=1e-6):
    """(rmsnorm(x) * gamma) @ w for x [N, K<=128], w [K, M<=512]; row tiles of 128 split over the cores.

    The PSUM accumulator of every row tile reuses bank (tile % 2) by address; the normalised
    tile is transposed through PSUM with its own address.
    """
    n, k = x.shape
    m = w.shape[1]
    out = nl.ndarray((n, m), dtype=x.dtype, buffer=nl.shared_hbm)
    bufs = NormBuffers()
    bufs.w_sb = nl.ndarray((k, m), dtype=w.dtype, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=bufs.w_sb, src=w)
    gamma_sb = nl.ndarray((P, k), dtype=gamma.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=gamma_sb, src=gamma.ap([[0, P], [1, k]]))  # one row broadcast to every partition
    tiles = (n + P - 1) // P
    cores = nl.num_programs(0)
    identity = nl.shared_identity_matrix(P, dtype=x.dtype)
    for tile in range(nl.program_id(0), tiles, cores):
        rows = min(P, n - tile * P)
        bufs.x_sb = nl.ndarray((rows, k), dtype=x.dtype, buffer=nl.sbuf, address=(0, 4 * m))
        nisa.dma_copy(dst=bufs.x_sb, src=x[tile * P:tile * P + rows, :])
        squares = nl.ndarray((rows, k), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=squares, data1=bufs.x_sb, data2=bufs.x_sb, op=nl.multiply)
        scaled = nl.ndarray((rows, k), dtype=nl.float32, buffer=nl.sbuf)
        bufs.sums = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)  # mean of squares
        nisa.tensor_scalar_reduce(dst=scaled, data=squares, op0=nl.multiply, operand0=1.0 / k, reduce_op=nl.add,
                                  reduce_res=bufs.sums)
        inv = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=inv, data=bufs.sums, op0=nl.add, operand0=eps)
        nisa.activation(dst=inv, op=nl.rsqrt, data=inv)
        normed = nl.ndarray((rows, k), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=normed, data=bufs.x_sb, op0=nl.multiply, operand0=inv, op1=nl.multiply,
                                  operand1=gamma_sb[0:rows, :])
        transposed_ps = nl.ndarray((k, rows), dtype=x.dtype, buffer=nl.psum, address=(0, 4 * BANK_BYTES))
        nisa.nc_matmul(dst=transposed_ps, stationary=normed, moving=identity[0:rows, 0:rows], is_transpose=True)
        normed_t = nl.ndarray((k, rows), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=normed_t, src=transposed_ps)
        bufs.acc = nl.ndarray((rows, m), dtype=nl.float32, buffer=nl.psum, address=(0, (tile % 2) * BANK_BYTES))
        nisa.nc_matmul(dst=bufs.acc, stationary=normed_t, moving=bufs.w_sb, accumulate=False)
        result = nl.ndarray((rows, m), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=result, src=bufs.acc)
        nisa.dma_copy(dst=out[tile * P:tile * P + rows, :], src=result)
    return out


@nki.jit
def router_top8(logits):
    """Per token: the 8 largest logits (descending), their expert ids, and a softmax over them.

    The two cores each route half of the tokens, then swap their halves with sendrecv so
    that both hold every token's expert ids, and core 0 writes them out after a barrier.
    """
    tokens, experts = logits.shape
    half = tokens // 2
    me = nl.program_id(0)
    other = 1 - me
    values_out = nl.ndarray((tokens, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    ids_out = nl.ndarray((tokens, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
    probs_out = nl.ndarray((tokens, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    scores = nl.ndarray((half, experts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=scores, src=logits[me * half:(me + 1) * half, :])
    top = nl.ndarray((half, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=top, src=scores)
    ids = nl.ndarray((half, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=ids, data=scores, vals=top)
    neg_max = nl.ndarray((half, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_max, data=top[:, 0:1], op0=nl.multiply, operand0=-1.0)
    exps = nl.ndarray((half, 8), dtype=nl.float32, buffer=nl.sbuf)
    total = nl.ndarray((half, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=exps, op=nl.exp, data=top, reduce_op=nl.add, reduce_res=total, bias=neg_max)
    inv = nl.ndarray((half, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=total)
    probs = nl.ndarray((half, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=probs, data=exps, op0=nl.multiply, operand0=inv)
    nisa.dma_copy(dst=values_out[me * half:(me + 1) * half, :], src=top)
    nisa.dma_copy(dst=probs_out[me * half:(me + 1) * half, :], src=probs)
    theirs = nl.ndarray((half, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.sendrecv(src=ids, dst=theirs, send_to_rank=other, recv_from_rank=other, pipe_id=0)
    nisa.core_barrier(data=values_out, cores=(0, 1))
    if me == 0:
        nisa.dma_copy(dst=ids_out[0:half, :], src=ids)
        nisa.dma_copy(dst=ids_out[half:tokens, :], src=theirs)
    return values_out, ids_out, probs_out


@nki.jit
def running_sum(x, num_tiles):
    """Row-wise inclusive cumulative sum of the first num_tiles (a runtime value) 128-row tiles of x.

    The tile count goes through a register into a dynamic loop whose row offset lives in SBUF
    (a scalar_offset, in rows); the carry between column chunks is the last column of the
    previous chunk, read with an .ap view.
    """
    rows_max, cols = x.shape
    chunk = min(cols, 512)
    out = nl.ndarray((rows_max, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    count_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=count_sb, src=num_tiles)
    count = nisa.register_alloc()
    nisa.register_load(count, count_sb)
    row_start = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=row_start, value=0)
    ones = nl.ndarray((P, chunk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    for _ in nl.dynamic_range(count):
        carry = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=carry, value=0.0)
        for c in range(0, cols, chunk):
            width = min(chunk, cols - c)
            tile = nl.ndarray((P, width), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=x.ap([[cols, P], [1, width]], offset=c, scalar_offset=row_start,
                                             indirect_dim=0))
            summed = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor_scan(dst=summed, data0=ones[:, 0:width], data1=tile, initial=carry,
                                    op0=nl.multiply, op1=nl.add)
            nisa.tensor_copy(dst=carry, src=summed.ap([[width, P], [1, 1]], offset=width - 1))
            result = nl.ndarray((P, width), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=result, src=summed)
            nisa.dma_copy(dst=out.ap([[cols, P], [1, width]], offset=c, scalar_offset=row_start, indirect_dim=0),
                          src=result)
        nisa.tensor_scalar(dst=row_start, data=row_start, op0=nl.add, operand0=P, engine=nisa.engine.vector)
    return out


@nki.jit
def sharded_init_then_scatter(values, destinations, barrier=False, late_core_loads=0):
    """A MoE-backward-style gradient: each core zeroes its half of a shared [2 * rows, hidden] buffer,
    then scatters its `rows` value rows to their destination rows (which may lie in the other core's
    half). With barrier=True a core_barrier separates the two phases; without it the result depends on
    how far the cores are apart, as on hardware: `late_core_loads` extra HBM reads on core 1 before its
    zeroing let core 0's scatter into core 1's half land first, and core 1's zeroing then wipes it.
    """
    cores_rows, hidden = values.shape
    rows = cores_rows // 2
    me = nl.program_id(0)
    grad = nl.ndarray((cores_rows, hidden), dtype=values.dtype, buffer=nl.shared_hbm)
    mine = nl.ndarray((rows, hidden), dtype=values.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=values[me * rows:(me + 1) * rows, :])
    where = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=where, src=destinations.ap([[1, rows], [1, 1]], offset=me * rows))
    if me == 1:
        for _ in range(late_core_loads):
            nisa.dma_copy(dst=mine, src=values[me * rows:(me + 1) * rows, :])
    zeros = nl.ndarray((rows, hidden), dtype=values.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    nisa.dma_copy(dst=grad[me * rows:(me + 1) * rows, :], src=zeros)
    if barrier:
        nisa.core_barrier(data=grad, cores=(0, 1))
    nisa.dma_copy(dst=grad.ap([[hidden, rows], [1, hidden]], vector_offset=where, indirect_dim=0), src=mine)
    return grad
