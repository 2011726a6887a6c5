"""Interpreter behaviour AWS's nki-library kernels depend on, each against its documented semantics:
NKIObject default initializers, unary op0 in tensor_scalar_reduce, zero-step dst patterns, the start partition
of address= tiles, uint32 access patterns, vector_offset tiles with several free dims, dma_transpose to any
start partition, the nki.collectives namespace, nested jit kernels inline, and indirect offsets checked as
addresses. fp32 and bf16."""

from dataclasses import dataclass

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

from .helpers import TOL, on_tiles

DTYPES = [torch.float32, torch.bfloat16]


@dataclass
class _Dims(nl.NKIObject):
    rows: int
    remainder: int  # declared, never passed: the language guide's initializer makes it None
    cols: int = 64


class _Plain(nl.NKIObject):
    a: int
    b: int = 2

    def __post_init__(self):
        self.total = (self.a or 0) + self.b


def test_nki_object_fields_without_a_default_are_none():
    dims = _Dims(rows=4, cols=8)
    assert (dims.rows, dims.remainder, dims.cols) == (4, None, 8)
    assert _Dims(1).remainder is None and _Dims(1, 2).remainder == 2


def test_nki_objects_without_dataclass_get_the_same_initializer():
    plain = _Plain(5)
    assert (plain.a, plain.b, plain.total) == (5, 2, 7)
    assert _Plain(b=3).total == 3 and _Plain().a is None
    with pytest.raises(TypeError, match="positional"):
        _Plain(1, 2, 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_scalar_reduce_takes_a_unary_op0(dtype):
    x = torch.randn(16, 40).to(dtype)

    def body(dst, data):
        peak = nl.ndarray((16, 1), nl.float32)
        nisa.tensor_scalar_reduce(dst=dst, data=data, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum,
                                  reduce_res=peak)
        nisa.tensor_copy(dst=dst[:, 0:1], src=peak)

    out = on_tiles(body, (16, 40), nl.float32, x)
    torch.testing.assert_close(out[:, 1:], x.float().abs()[:, 1:], **TOL[torch.float32])
    torch.testing.assert_close(out[:, 0], x.float().abs().amax(1), **TOL[torch.float32])
    with pytest.raises(sim.NkiRuleError, match="None or 0"):
        on_tiles(lambda d, a: nisa.tensor_scalar_reduce(d, a, nl.abs, 1.0, nl.maximum), (4, 4), nl.float32,
                 torch.ones(4, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_step_dst_keeps_the_last_element_written(dtype):
    x = torch.randn(8, 12).to(dtype)

    def body(dst, data):
        squares = nl.ndarray((8, 1), nl.float32)  # one column, written 12 times per partition
        sums = nl.ndarray((8, 1), nl.float32)
        nisa.activation_reduce(dst=squares.ap(pattern=[[1, 8], [0, 12]]), op=nl.square, data=data, reduce_op=nl.add,
                               reduce_res=sums)
        nisa.tensor_copy(dst=dst[:, 0:1], src=squares)
        nisa.tensor_copy(dst=dst[:, 1:2], src=sums)

    out = on_tiles(body, (8, 2), nl.float32, x)
    torch.testing.assert_close(out[:, 0], x.float()[:, -1] ** 2, **TOL[torch.float32])
    torch.testing.assert_close(out[:, 1], (x.float() ** 2).sum(1), rtol=1e-5, atol=1e-5)


def run_on_address_tile(partition, shape=(1, 6)):
    x = torch.arange(6, dtype=torch.float32).reshape(shape)

    @sim.jit
    def kernel(src):
        t = nl.ndarray(shape, nl.float32, buffer=nl.sbuf, address=(partition, 4000))  # far into the partition
        nisa.dma_copy(dst=t, src=src)
        doubled = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=doubled, data=t, op0=nl.multiply, operand0=2.0)
        out = nl.ndarray(shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=doubled)
        return out

    return x, kernel(x)


@pytest.mark.parametrize("shape", [(1, 6), (1, 2, 3)])
@pytest.mark.parametrize("partition", [0, 32, 96])
def test_start_partition_of_one_partition_address_tiles(partition, shape):
    x, out = run_on_address_tile(partition, shape)  # a legal start for a <= 32-partition access
    assert torch.equal(out, 2 * x)


def test_address_tiles_keep_their_absolute_start_partition():
    with pytest.raises(sim.NkiRuleError, match="starting at partition 5"):
        run_on_address_tile(5)


def test_access_patterns_on_uint32_tiles_and_arguments():
    values = torch.arange(12, dtype=torch.int64).reshape(3, 4)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((3, 4), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src)
        column = nl.ndarray((3, 1), nl.uint32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=column, src=t.ap([[4, 3], [1, 1]], offset=2))  # same dtype: element addressing
        out = nl.ndarray((3, 1), nl.uint32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=column)
        as_int = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=as_int, src=src.ap([[4, 1], [1, 4]], offset=4, dtype=nl.int32))  # reinterpreted bytes
        out2 = nl.ndarray((1, 4), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out2, src=as_int)
        return out, out2

    column, row = kernel(values.to(torch.uint32))
    assert column.to(torch.int64).reshape(-1).tolist() == [2, 6, 10]
    assert row.reshape(-1).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_offset_tiles_may_have_several_free_dims(dtype):
    data = torch.randn(20, 8).to(dtype)
    rows = torch.tensor([3, 17, 0, 9], dtype=torch.int32)

    @sim.jit
    def kernel(table, idx):
        index = nl.ndarray((4, 1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=index, src=idx.reshape((4, 1, 1)))
        gathered = nl.ndarray((4, 8), table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=gathered, src=table.ap([[8, 4], [1, 8]], vector_offset=index, indirect_dim=0))
        out = nl.ndarray((4, 8), table.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=gathered)
        return out

    assert torch.equal(kernel(data, rows), data[rows.long()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_tensor_tensor_takes_operand0_of_any_dtype(dtype):
    """Its docstring: "All input tiles can be any supported NKI data type" (tensor_scalar's operands are fp32)."""
    x, y = torch.randn(8, 16).to(dtype), torch.randn(8, 16).to(dtype)
    scale = torch.randn(8, 1).to(dtype)
    out = on_tiles(lambda d, a, s, b: nisa.scalar_tensor_tensor(d, a, nl.multiply, s, nl.add, b), (8, 16), nl.float32,
                   x, scale, y)
    torch.testing.assert_close(out, x.float() * scale.float() + y.float(), rtol=1e-6, atol=1e-6)
    with pytest.raises(sim.NkiRuleError, match="float32"):
        on_tiles(lambda d, a, s: nisa.tensor_scalar(d, a, nl.multiply, s), (8, 16), nl.float32, x,
                 scale.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [16, 5])
def test_dma_transpose_writes_from_any_start_partition(dtype, start):
    """A DMA queue is not a compute engine: the 0/32/64/96 start-partition rule is the engines' (the
    nki.isa dma_transpose docs list none; AWS's MoE TKG transposes into 16-partition blocks at 16, 32, ...)."""
    x = torch.randn(8, 16).to(dtype)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((48, 8), src.dtype, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        nisa.dma_transpose(dst=t[start:start + 16, :], src=src)
        out = nl.ndarray((48, 8), src.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = kernel(x)
    expected = torch.zeros(48, 8, dtype=dtype)
    expected[start:start + 16] = x.T
    assert torch.equal(out, expected)
    with pytest.raises(sim.NkiRuleError, match="starting at partition"):  # a compute engine still may not
        on_tiles(lambda d, a: nisa.tensor_copy(dst=d[start:start + 8, :], src=a), (48, 16), dtype, x)


def test_nki_collectives_imports_and_every_collective_fails_visibly():
    """AWS's attention_block_tkg imports nki.collectives at module level; with KVDP=1 it calls none of them."""
    from neuron_inductor.sim.errors import NkiNotModelledError

    with sim.as_nki():
        import nki.collectives as ncc
        from nki.collectives import ReplicaGroup

        group = ReplicaGroup([[0, 1], [2, 3]])
        assert group.replica_groups == [[0, 1], [2, 3]]
        with pytest.raises(sim.NkiError, match="overlap"):
            ReplicaGroup([[0, 1], [1, 2]])
        for name in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute", "rank_id"):
            with pytest.raises(NkiNotModelledError, match=f"nki.collectives.{name}: collectives between ranks"):
                getattr(ncc, name)()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nested_jit_kernel_runs_inline(dtype):
    """"a nested @nki.jit sub-kernel ... inline[s] under this kernel's config" (nki.compiler.SpecializationConfig):
    it may return SBUF tiles to its caller, and it runs in the caller's programs (AWS's qkv inside
    attention_block_tkg)."""
    x = torch.randn(8, 16).to(dtype)

    @sim.jit
    def doubled_in_sbuf(t):
        out = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out, data=t, op0=nl.multiply, operand0=2.0)
        return out

    @sim.jit
    def outer(src):
        t = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src)
        tile = doubled_in_sbuf(t)
        out = nl.ndarray(src.shape, src.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[nl.program_id(0) * 4:nl.program_id(0) * 4 + 4, :], src=tile[0:4, :])
        return out

    torch.testing.assert_close(outer(x)[:4], (x.float() * 2).to(dtype)[:4], rtol=0, atol=0)
    twice = outer[2](x)  # each program runs the sub-kernel on its own SBUF
    torch.testing.assert_close(twice, torch.cat([(x.float() * 2).to(dtype)[:4]] * 2), rtol=0, atol=0)

    @sim.jit
    def outer_with_grid(src):
        t = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src)
        return doubled_in_sbuf[2](t)

    with pytest.raises(sim.NkiError, match="runs inline in the caller's programs"):
        outer_with_grid(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_indirect_index_past_the_indexed_dim_is_an_address_inside_the_tensor(dtype):
    """The DGE checks addresses ("out-of-bound address checking", nki.isa.dma_copy): a scalar_offset past
    shape[indirect_dim] that stays inside the tensor writes there (AWS's block KV-cache update indexes flat slots
    through the block-length dim); one past the tensor's end is skipped under oob_mode.skip and raises otherwise."""
    cache = torch.zeros(4, 2, 8).to(dtype)  # [blocks, block_len, d]: 8 slots of 8 elements
    rows = torch.randn(3, 8).to(dtype)

    def scatter(slot, oob):
        @sim.jit
        def kernel(table, new, position):
            idx = nl.ndarray((1, 1), nl.uint32, buffer=nl.sbuf)
            nisa.dma_copy(dst=idx, src=position)
            t = nl.ndarray((3, 8), new.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=new)
            nisa.dma_copy(dst=table.ap(pattern=[[8, 3], [1, 8]], offset=0, scalar_offset=idx, indirect_dim=1),
                          src=t, oob_mode=oob)
            return table

        table = cache.clone()
        kernel(table, rows, torch.tensor([[slot]], dtype=torch.uint32))
        return table

    written = scatter(5, nisa.oob_mode.error).reshape(8, 8)  # slots 5..7: blocks 2 and 3, past block_len 2
    expected = torch.zeros(8, 8, dtype=dtype)
    expected[5:8] = rows
    assert torch.equal(written, expected)
    assert torch.equal(scatter(2**32 - 1, nisa.oob_mode.skip), cache)  # the kernels' "skip this batch" index
    with pytest.raises(sim.NkiIndexError, match="out of bounds"):
        scatter(6, nisa.oob_mode.error)  # slots 6..8: the last row leaves the tensor
