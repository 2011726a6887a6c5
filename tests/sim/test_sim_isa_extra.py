"""Indirect DMA, scans, fused reductions, top-8 search, nonzero compaction and LNC2 sync, against their documented semantics."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

from .helpers import TOL, nl_dtype, on_tiles

DTYPES = [torch.float32, torch.bfloat16]


def close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected.to(dtype), **TOL[dtype])


# ---------------------------------------------------------------------------- indirect DMA

def gather_kernel(oob):
    @sim.jit
    def kernel(data, indices):
        p, f = indices.shape[0], data.shape[1]
        idx = nl.ndarray((p, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=indices)
        rows = nl.ndarray((p, f), data.dtype)
        nisa.memset(rows, -3.4028235e38)  # the library's "minus infinity" fill
        nisa.dma_copy(dst=rows, src=data.ap([[f, p], [1, f]], vector_offset=idx, indirect_dim=0), oob_mode=oob)
        out = nl.ndarray((p, f), data.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=rows)
        return out

    return kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p, f", [(128, 64), (37, 5)])
def test_vector_offset_gathers_rows(dtype, p, f):
    data = torch.randn(300, f).to(dtype)
    indices = torch.randint(0, 300, (p, 1), dtype=torch.int32)
    out = gather_kernel(nisa.oob_mode.error)(data, indices)
    assert torch.equal(out, data[indices[:, 0].long()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_bounds_indices_raise_or_are_skipped(dtype):
    data = torch.randn(10, 4).to(dtype)
    indices = torch.tensor([[3], [10], [-1], [9]], dtype=torch.int32)
    with pytest.raises(sim.NkiIndexError, match="row 1 is out of bounds"):
        gather_kernel(nisa.oob_mode.error)(data, indices)
    out = gather_kernel(nisa.oob_mode.skip)(data, indices)
    fill = torch.tensor(-3.4028235e38, dtype=torch.float64).float().expand(4).to(dtype)
    assert torch.equal(out[0], data[3]) and torch.equal(out[3], data[9])
    assert torch.equal(out[1], fill) and torch.equal(out[2], fill)  # skipped rows keep what dst held


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_offset_scatters_rows_into_an_argument(dtype):
    src = torch.randn(6, 8).to(dtype)
    indices = torch.tensor([[5], [0], [7], [2], [99], [3]], dtype=torch.int32)
    output = torch.zeros(8, 8, dtype=dtype)

    @sim.jit
    def kernel(values, idx_hbm, out):
        tile = nl.ndarray((6, 8), values.dtype)
        nisa.dma_copy(dst=tile, src=values)
        idx = nl.ndarray((6, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=idx_hbm)
        nisa.dma_copy(dst=out.ap([[8, 6], [1, 8]], vector_offset=idx, indirect_dim=0), src=tile,
                      oob_mode=nisa.oob_mode.skip)
        return out

    kernel(src, indices, output)
    expected = torch.zeros(8, 8, dtype=dtype)
    for row, index in enumerate(indices[:, 0].tolist()):
        if index < 8:
            expected[index] = src[row]
    assert torch.equal(output, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_offset_scales_by_the_indexed_dim_stride(dtype):
    data = torch.randn(4, 16, 32).to(dtype)

    @sim.jit
    def kernel(x, which):
        index = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=index, src=which)
        tile = nl.ndarray((16, 8), x.dtype)
        # rows of block `which`, columns 4..11: offset 4 plus index * stride(dim 0) = index * 512
        nisa.dma_copy(dst=tile, src=x.ap([[32, 16], [1, 8]], offset=4, scalar_offset=index, indirect_dim=0))
        out = nl.ndarray((16, 8), x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    assert torch.equal(kernel(data, torch.tensor([[2]], dtype=torch.int32)), data[2, :, 4:12])


def test_indirect_views_are_dma_operands_only():
    @sim.jit
    def kernel(x):
        idx = nl.ndarray((1, 1), nl.int32)
        nisa.memset(idx, 0)
        view = x.ap([[4, 4], [1, 4]], scalar_offset=idx, indirect_dim=0)
        assert view.shape == (4, 4)
        with pytest.raises(sim.NkiError, match="sliced further"):
            view[0:2]
        view.data

    with pytest.raises(sim.NkiError, match="dma_copy operand only"):
        kernel(torch.zeros(4, 4, dtype=torch.bfloat16))

    @sim.jit
    def on_chip():
        idx = nl.ndarray((1, 1), nl.int32)
        nl.ndarray((4, 4), nl.float32).ap([[4, 4], [1, 4]], scalar_offset=idx)

    with pytest.raises(sim.NkiError, match="not modelled"):
        on_chip()


# ---------------------------------------------------------------------------- scans and fused reductions

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(128, 256), (3, 7)])
def test_tensor_tensor_scan_is_a_first_order_recurrence(dtype, shape):
    decay, inputs = torch.rand(shape).to(dtype), torch.randn(shape).to(dtype)
    init = torch.randn(shape[0], 1)

    def body(dst, a, b, start):
        nisa.tensor_tensor_scan(dst=dst, data0=a, data1=b, initial=start, op0=nl.multiply, op1=nl.add)

    out = on_tiles(body, shape, nl_dtype(dtype), decay, inputs, init)
    state, expected = init[:, 0], torch.empty(shape)
    for i in range(shape[1]):
        state = decay[:, i].float() * state + inputs[:, i].float()
        expected[:, i] = state
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), rtol=1e-5 if dtype is torch.float32 else 1e-2,
                               atol=1e-5 if dtype is torch.float32 else 1e-2)


def test_tensor_tensor_scan_reverse_and_scalar_initial():
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    out = on_tiles(lambda d, x, y: nisa.tensor_tensor_scan(d, x, y, 1.5, nl.subtract, nl.subtract,
                                                           reverse0=True, reverse1=True), (4, 5), nl.float32, a, b)
    state, expected = torch.full((4,), 1.5), torch.empty(4, 5)
    for i in range(5):
        state = b[:, i] - (state - a[:, i])
        expected[:, i] = state
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_scalar_reduce_accumulates_across_calls(dtype):
    x, y = torch.randn(64, 32).to(dtype), torch.randn(64, 32).to(dtype)

    def body(dst, a, b):
        scaled = nl.ndarray((64, 32), nl.float32)
        total = nl.ndarray((64, 1), nl.float32)
        nisa.tensor_scalar_reduce(dst=scaled, data=a, op0=nl.multiply, operand0=2.0, reduce_op=nl.maximum)
        nisa.tensor_scalar_reduce(dst=scaled, data=b, op0=nl.add, operand0=1.0, reduce_op=nl.maximum,
                                  reduce_res=total, reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.tensor_scalar_reduce(dst=scaled, data=a, op0=nl.add, operand0=0.0, reduce_op=nl.add,
                                  reduce_res=dst, reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=total)

    out = on_tiles(body, (64, 1), nl.float32, x, y)
    running_max = torch.maximum((2 * x.float()).amax(1), (y.float() + 1).amax(1))
    torch.testing.assert_close(out[:, 0], running_max + x.float().sum(1))


# ---------------------------------------------------------------------------- top-8 search

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(128, 512), (5, 8), (16, 4, 9)])
def test_max8_then_find_index8(dtype, shape):
    x = torch.randn(shape).to(dtype)
    p = shape[0]

    def body(dst, data):
        top = nl.ndarray((p, 8), nl.float32)
        nisa.max8(dst=top, src=data)
        nisa.nc_find_index8(dst=dst, data=data, vals=top)

    indices = on_tiles(body, (p, 8), nl.uint32, x)
    flat = x.reshape(p, -1).float()
    values, expected = flat.topk(8, dim=1)
    torch.testing.assert_close(flat.gather(1, indices), values)
    assert torch.equal(torch.gather(flat, 1, expected), torch.gather(flat, 1, indices))


def test_find_index8_pairs_duplicates_ascending_and_flags_missing():
    data = torch.tensor([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], dtype=torch.float32)
    vals = torch.tensor([[3, 8, 8, 8, 8, 8, 8, 7]], dtype=torch.float32)
    out = on_tiles(lambda d, x, v: nisa.nc_find_index8(d, x, v), (1, 8), nl.uint32, data, vals)
    assert out.tolist() == [[2, 4, 5, 6, 7, 8, 9, 0xFFFFFFFF]]


def test_match_replace8_follows_the_documented_example():
    data = torch.tensor([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], dtype=torch.float32)
    vals = torch.tensor([[3, 8, 8, 8, 8, 8, 8, 8]], dtype=torch.float32)

    @sim.jit
    def kernel(d, v):
        dt, vt = nl.ndarray((1, 11), nl.float32), nl.ndarray((1, 8), nl.float32)
        nisa.dma_copy(dst=dt, src=d)
        nisa.dma_copy(dst=vt, src=v)
        replaced, idx = nl.ndarray((1, 11), nl.bfloat16), nl.ndarray((1, 8), nl.uint32)
        nisa.nc_match_replace8(dst=replaced, data=dt, vals=vt, imm=-3.4028235e38, dst_idx=idx)
        outs = nl.ndarray((1, 11), nl.bfloat16, buffer=nl.shared_hbm), nl.ndarray((1, 8), nl.uint32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=outs[0], src=replaced)
        nisa.dma_copy(dst=outs[1], src=idx)
        return outs

    replaced, idx = kernel(data, vals)
    assert idx.tolist() == [[2, 10, 9, 8, 7, 6, 5, 4]]
    lowest = torch.tensor(-3.4028235e38).bfloat16().item()
    assert replaced.float().tolist() == [[1, 2, lowest, 4] + [lowest] * 7]


def test_top8_rules():
    with pytest.raises(sim.NkiRuleError, match="8 <= src elements"):
        on_tiles(lambda d, x: nisa.max8(d, x), (4, 8), nl.float32, torch.randn(4, 7))
    with pytest.raises(sim.NkiRuleError, match="uint16 or uint32"):
        on_tiles(lambda d, x: nisa.nc_find_index8(d, x, x), (4, 8), nl.int32, torch.randn(4, 8))


# ---------------------------------------------------------------------------- nonzero_with_count

@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_nonzero_with_count_on_gpsimd_core_partitions(dtype):
    x = (torch.rand(128, 40) > 0.6).to(dtype)
    x[0] = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0] * 5, dtype=dtype)
    out = on_tiles(lambda d, s: nisa.nonzero_with_count(d, s, index_offset=16, padding_val=-1), (128, 41), nl.int32, x)
    for row in range(0, 128, 16):
        found = x[row].nonzero()[:, 0] + 16
        expected = torch.full((41,), -1, dtype=torch.int32)
        expected[:len(found)] = found.int()
        expected[-1] = len(found)
        assert torch.equal(out[row], expected)
    assert torch.equal(out[0, :4], torch.tensor([17, 18, 21, 25], dtype=torch.int32))
    assert (out[1] == 4).all()  # other partitions are not written (fresh int32 memory holds 4)


# ---------------------------------------------------------------------------- LNC2: two cores

@pytest.mark.parametrize("dtype", DTYPES)
def test_lnc2_cores_exchange_tiles_and_meet_at_barriers(dtype):
    x = torch.randn(2, 64, 32).to(dtype)

    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        other = 1 - me
        mine = nl.ndarray((64, 32), data.dtype)
        nisa.dma_copy(dst=mine, src=data[me])
        theirs = nl.ndarray((64, 32), data.dtype)
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=other, recv_from_rank=other, pipe_id=0)
        total = nl.ndarray((64, 32), nl.float32)
        nisa.tensor_tensor(total, mine, theirs, nl.subtract)
        shared = nl.ndarray((2, 64, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=shared[me], src=total)
        nisa.core_barrier(shared, cores=(0, 1))
        check = nl.ndarray((64, 32), nl.float32)  # after the barrier the other core's half is there
        nisa.dma_copy(dst=check, src=shared[other])
        sums = nl.ndarray((2, 64, 32), nl.float32, buffer=nl.shared_hbm)
        summed = nl.ndarray((64, 32), nl.float32)
        nisa.tensor_tensor(summed, total, check, nl.add)
        nisa.dma_copy(dst=sums[me], src=summed)
        return shared, sums

    shared, sums = kernel[2](x)
    a, b = x[0].float(), x[1].float()
    close(shared[0], a - b, torch.float32)
    close(shared[1], b - a, torch.float32)
    assert torch.count_nonzero(sums) == 0


def test_unmatched_sync_points_are_a_deadlock():
    @sim.jit
    def kernel(data):
        shared = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 0:
            nisa.core_barrier(shared, cores=(0, 1))
        return shared

    with pytest.raises(sim.NkiError, match="deadlocked"):
        kernel[2](torch.zeros(1))
    with pytest.raises(sim.NkiError, match="kernel\\[2\\]"):
        kernel(torch.zeros(1))


def test_cores_waiting_at_different_sync_points_deadlock_with_both_named():
    @sim.jit
    def kernel(data):
        shared = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((2, 4), nl.float32)
        nisa.dma_copy(dst=tile, src=data)
        if nl.program_id(0) == 0:
            nisa.core_barrier(shared, cores=(0, 1))
        else:
            nisa.sendrecv(src=tile, dst=tile, send_to_rank=0, recv_from_rank=0, pipe_id=3)
        return shared

    with pytest.raises(sim.NkiRuleError, match="deadlocked") as error:
        kernel[2](torch.zeros(2, 4))
    message = str(error.value)
    assert "program 0 waits at nisa.core_barrier #0 with programs [0, 1]" in message
    assert "program 1 waits at nisa.sendrecv(pipe_id=3) #0 with programs [0, 1]" in message
    assert error.value.op == "nisa.core_barrier"


def test_a_failing_core_stops_the_core_waiting_for_it():
    @sim.jit
    def kernel(data):
        shared = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 1:
            raise ValueError("core 1 failed")
        nisa.core_barrier(shared, cores=(0, 1))
        return shared

    with pytest.raises(ValueError, match="core 1 failed"):
        kernel[2](torch.zeros(1))


# ---------------------------------------------------------------------------- SBUF data movement

@pytest.mark.parametrize("dtype", DTYPES)
def test_stream_shuffle_permutes_partitions_within_quadrants(dtype):
    x = torch.randn(64, 16).to(dtype)
    mask = [31 - i for i in range(30)] + [255, 255]
    out = on_tiles(lambda d, s: (nisa.memset(d, 0.0), nisa.nc_stream_shuffle(dst=d, src=s, shuffle_mask=mask)),
                   (64, 16), nl_dtype(dtype), x)
    for q in (0, 32):
        for i in range(30):
            assert torch.equal(out[q + i], x[q + 31 - i])
        assert (out[q + 30:q + 32] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_local_gather_matches_the_documented_numpy_semantics(dtype):
    src = torch.randn(128, 64, 4).to(dtype)
    per_core = torch.randint(0, 64, (16, 4), dtype=torch.int32)
    index = (per_core.repeat(8, 1) * 4).to(torch.uint16)  # element offsets: index * num_elem_per_idx
    out = on_tiles(lambda d, s, i: nisa.local_gather(d, s, i, num_elem_per_idx=4, num_valid_indices=40),
                   (128, 40, 4), nl_dtype(dtype), src, index)
    flat = per_core.t().reshape(-1)[:40].long()  # partition dim first
    assert torch.equal(out, src[:, flat, :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_nc_n_gather_gathers_within_each_partition(dtype):
    data = torch.randn(32, 6, 8).to(dtype)
    indices = torch.randint(0, 48, (32, 20), dtype=torch.int32)
    out = on_tiles(lambda d, x, i: nisa.nc_n_gather(dst=d, data=x, indices=i), (32, 20), nl_dtype(dtype), data,
                   indices.to(torch.int64).to(torch.uint32))
    assert torch.equal(out, torch.gather(data.reshape(32, 48), 1, indices.long()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, ref", [(nl.add, lambda x: x.sum(0)), (nl.maximum, lambda x: x.amax(0))])
def test_tensor_partition_reduce(dtype, op, ref):
    x = torch.randn(128, 32, 4).to(dtype)
    out = on_tiles(lambda d, s: nisa.tensor_partition_reduce(dst=d, op=op, data=s), (1, 32, 4), nl_dtype(dtype), x)
    torch.testing.assert_close(out[0].float(), ref(x.float()).to(dtype).float(), rtol=1e-5 if dtype is torch.float32
                               else 1e-2, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_copy_predicated_keeps_dst_where_false(dtype):
    src, old = torch.randn(16, 8).to(dtype), torch.randn(16, 8).to(dtype)
    predicate = (torch.rand(16, 8) > 0.5).to(torch.uint8)

    def body(dst, s, o, p):
        nisa.tensor_copy(dst=dst, src=o)
        nisa.tensor_copy_predicated(dst=dst, src=s, predicate=p)

    assert torch.equal(on_tiles(body, (16, 8), nl_dtype(dtype), src, old, predicate),
                       torch.where(predicate.bool(), src, old))

    def reverse(dst, o, p):
        nisa.tensor_copy(dst=dst, src=o)
        nisa.tensor_copy_predicated(dst=dst, src=2.5, predicate=p, reverse_pred=True)

    expected = torch.where(predicate.bool(), old, torch.tensor(2.5).to(dtype))
    assert torch.equal(on_tiles(reverse, (16, 8), nl_dtype(dtype), old, predicate), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dma_transpose_3d_and_4d(dtype):
    x3, x4 = torch.randn(4, 8, 16).to(dtype), torch.randn(2, 3, 4, 8).to(dtype)

    @sim.jit
    def kernel(a, b):
        t3 = nl.ndarray((16, 8, 4), a.dtype)
        nisa.dma_transpose(dst=t3, src=a)
        t4 = nl.ndarray((8, 3, 4, 2), b.dtype)
        nisa.dma_transpose(dst=t4, src=b)
        outs = nl.ndarray((16, 8, 4), a.dtype, buffer=nl.shared_hbm), nl.ndarray((8, 3, 4, 2), b.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=outs[0], src=t3)
        nisa.dma_copy(dst=outs[1], src=t4)
        return outs

    out3, out4 = kernel(x3, x4)
    assert torch.equal(out3, x3.permute(2, 1, 0)) and torch.equal(out4, x4.permute(3, 1, 2, 0))


def test_indirect_dma_transpose_gathers_rows_first():
    src = torch.randn(64, 32).bfloat16()
    idx = torch.randperm(64)[:32].reshape(32, 1).to(torch.int32)

    @sim.jit
    def kernel(s, i):
        index = nl.ndarray((32, 1), nl.int32)
        nisa.dma_copy(dst=index, src=i)
        t = nl.ndarray((32, 32), s.dtype)
        nisa.dma_transpose(dst=t, src=s.ap([[32, 32], [1, 32]], vector_offset=index, indirect_dim=0), axes=(1, 0))
        out = nl.ndarray((32, 32), s.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    assert torch.equal(kernel(src, idx), src[idx[:, 0].long()].t())


# ---------------------------------------------------------------------------- selects with max reduction, dma_compute

@pytest.mark.parametrize("dtype", DTYPES)
def test_select_reduce_selects_and_keeps_a_running_max(dtype):
    a, b = torch.randn(32, 40).to(dtype), torch.randn(32, 40).to(dtype)
    pa, pb = (torch.rand(32, 40) > 0.5).to(torch.uint8), (torch.rand(32, 40) > 0.5).to(torch.uint8)

    def body(dst, x, y, p, q):
        first = nl.ndarray((32, 40), nl.float32)
        nisa.select_reduce(dst=first, predicate=p, on_true=x, on_false=-5.0, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        second = nl.ndarray((32, 40), nl.float32)
        nisa.select_reduce(dst=second, predicate=q, on_true=y, on_false=-5.0, reduce_res=dst,
                           reduce_cmd=nisa.reduce_cmd.reduce, reverse_pred=True)

    out = on_tiles(body, (32, 1), nl.float32, a, b, pa, pb)
    first = torch.where(pa.bool(), a.float(), -5.0)
    second = torch.where(~pb.bool(), b.float(), -5.0)
    assert torch.equal(out[:, 0], torch.maximum(first.amax(1), second.amax(1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_range_select_masks_by_column_bounds(dtype):
    x = torch.randn(16, 64).to(dtype)
    lo, hi = torch.randint(0, 30, (16, 1)).float(), torch.randint(30, 64, (16, 1)).float()

    def body(dst, t, b0, b1):
        peak = nl.ndarray((16, 1), nl.float32)
        nisa.range_select(dst=dst, on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=b0, bound1=b1,
                          reduce_res=peak, range_start=10)

    out = on_tiles(body, (16, 64), nl.float32, x, lo, hi)
    cols = 10 + torch.arange(64).float()[None, :]
    fp32_min = torch.tensor(-3.4028234663852886e38)
    expected = torch.where((cols >= lo) & (cols < hi), x.float(), fp32_min)
    assert torch.equal(out, expected)
    with pytest.raises(sim.NkiRuleError, match="FP32_MIN"):
        on_tiles(lambda d, t, b0, b1: nisa.range_select(d, t, nl.less, nl.less, b0, b1, on_false_value=0.0),
                 (16, 64), nl.float32, x, lo, hi)


def test_range_select_with_one_test_twice_or_two_bounds_of_one_op():
    """A one-sided range (the causal mask: one op, one bound, twice) keeps what that test keeps; one op
    over two different bounds applies both (the interpreter tests once only for the same view)."""
    x = torch.randn(16, 64)
    lo, hi = torch.randint(0, 30, (16, 1)).float(), torch.randint(30, 64, (16, 1)).float()
    cols = -5 + torch.arange(64).float()[None, :]
    fp32_min = torch.tensor(-3.4028234663852886e38)

    def one_sided(dst, t, b0, b1):
        nisa.range_select(dst=dst, on_true_tile=t, comp_op0=nl.less_equal, comp_op1=nl.less_equal,
                          bound0=b1[:, 0:1], bound1=b1[:, 0:1], range_start=-5)

    def both(dst, t, b0, b1):
        nisa.range_select(dst=dst, on_true_tile=t, comp_op0=nl.less_equal, comp_op1=nl.less_equal,
                          bound0=b1, bound1=b0, range_start=-5)  # the second, lower bound decides

    assert torch.equal(on_tiles(one_sided, (16, 64), nl.float32, x, lo, hi), torch.where(cols <= hi, x, fp32_min))
    assert torch.equal(on_tiles(both, (16, 64), nl.float32, x, lo, hi),
                       torch.where(cols <= lo, x, fp32_min))


def test_a_reset_max_reduce_gives_the_row_maxima_bits_nan_and_negative_zero_included():
    """reset_reduce with maximum starts from -inf: the result is each row's amax itself, a NaN row
    NaN and a row of -0.0 -0.0 (not +0.0)."""
    x = torch.randn(8, 32)
    x[1] = -0.0
    x[2, 5] = float("nan")
    x[3] = float("-inf")
    zero = torch.zeros(8, 1)

    def body(dst, t, b):
        nisa.range_select(dst=t, on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.greater_equal,
                          bound0=b, bound1=b, reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=dst)

    out = on_tiles(body, (8, 1), nl.float32, x, zero)
    assert torch.equal(out.view(torch.int32), x.amax(1, keepdim=True).view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dma_compute_adds_and_scatter_adds(dtype):
    a, b = torch.randn(8, 16).to(dtype), torch.randn(8, 16).to(dtype)
    table = torch.randn(10, 16).to(dtype)
    rows = torch.tensor([[3], [0], [9], [5]], dtype=torch.int32)

    @sim.jit
    def kernel(x, y, t, idx_hbm):
        xs, ys = nl.ndarray((8, 16), x.dtype), nl.ndarray((8, 16), y.dtype)
        nisa.dma_copy(dst=xs, src=x)
        nisa.dma_copy(dst=ys, src=y)
        total = nl.ndarray((8, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_compute(dst=total, srcs=[xs, ys, x], reduce_op=nl.add)
        idx = nl.ndarray((4, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=idx_hbm)
        target = t.ap([[16, 4], [1, 16]], vector_offset=idx, indirect_dim=0)
        nisa.dma_compute(dst=target, srcs=[target, xs[0:4, :]], reduce_op=nl.add)  # t[rows] += x[0:4]
        acc = nl.ndarray((4, 16), nl.float32)
        nisa.memset(acc, 1.0)
        nisa.dma_compute(dst=acc, srcs=[acc, t.ap([[16, 4], [1, 16]], vector_offset=idx, indirect_dim=0)],
                         reduce_op=nl.add)  # acc += t[rows]
        gathered = nl.ndarray((4, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=gathered, src=acc)
        return total, gathered

    updated = table.clone()
    total, gathered = kernel(a, b, updated, rows)
    close(total, 2 * a.float() + b.float(), torch.float32)
    expected = table.clone()
    expected[rows[:, 0].long()] = (table[rows[:, 0].long()].float() + a[:4].float()).to(dtype)
    assert torch.equal(updated, expected)
    close(gathered, 1 + expected[rows[:, 0].long()].float(), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exponential_sums_through_the_accumulators_on_trn3(dtype, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    x = torch.randn(32, 64).to(dtype)
    peak = x.float().amax(1, keepdim=True)

    def body(dst, s, m):
        total = nl.ndarray((32, 1), nl.float32)
        nisa.exponential(dst=dst, src=s, max_value=m, reduce_res=total, reduce_cmd=nisa.reduce_cmd.load_reduce,
                         reduce_init=1.0)
        nisa.tensor_copy(dst=dst[:, 0:1], src=total)

    out = on_tiles(body, (32, 64), nl.float32, x, peak)
    exps = torch.exp(x.float() - peak)
    torch.testing.assert_close(out[:, 1:], exps[:, 1:])
    torch.testing.assert_close(out[:, 0], 1 + exps.sum(1))


def test_exponential_needs_trn3():
    with pytest.raises(sim.NkiRuleError, match="NeuronCore-v4"):
        on_tiles(lambda d, s: nisa.exponential(d, s), (4, 4), nl.float32, torch.zeros(4, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_scalar_cumulative_is_a_running_reduction(dtype):
    x = torch.randn(16, 50).to(dtype)

    def body(dst, s):
        nisa.tensor_scalar_cumulative(dst=dst, src=s, op0=nl.multiply, op1=nl.add, imm0=2.0)
        second = nl.ndarray((16, 50), nl.float32)  # continue the running max from the accumulators
        nisa.tensor_scalar_cumulative(dst=second, src=s, op0=nl.add, op1=nl.maximum, imm0=0.0,
                                      reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.tensor_tensor(dst=dst, data1=dst, data2=second, op=nl.subtract)

    out = on_tiles(body, (16, 50), nl.float32, x)
    running = (2 * x.float()).cumsum(1)
    carried = torch.cummax(torch.cat([running[:, -1:], x.float()], 1), 1).values[:, 1:]
    torch.testing.assert_close(out, running - carried, rtol=1e-5, atol=1e-4)
