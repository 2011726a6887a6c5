"""Tensor views: slices with steps, `...`, nl.ds, integer indices, reshape, dtype views, write-through."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl


def copy_view(view_of_input, out_shape, dtype=nl.float32):
    """Kernel: out = view_of_input(x), moved HBM -> SBUF -> HBM."""
    @sim.jit
    def kernel(x):
        src = view_of_input(x)
        t = nl.ndarray(src.shape, src.dtype)
        nisa.dma_copy(dst=t, src=src)
        out = nl.ndarray(out_shape, dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    return kernel


def test_hbm_slices_steps_ellipsis_ds_and_ints():
    x = torch.randn(8, 16, 32)
    assert torch.equal(copy_view(lambda t: t[2:6, ::2, 1:30:3], (4, 8, 10))(x), x[2:6, ::2, 1:30:3])
    assert torch.equal(copy_view(lambda t: t[..., 5], (8, 16))(x), x[..., 5])
    assert torch.equal(copy_view(lambda t: t[3], (16, 32))(x), x[3])  # HBM: NumPy semantics
    assert torch.equal(copy_view(lambda t: t[nl.ds(2, 3), -4:], (3, 4, 32))(x), x[2:5, -4:])
    assert copy_view(lambda t: t[1:3], (2, 16, 32))(x).shape == (2, 16, 32)


def test_tile_views_write_through_and_keep_partition_dim():
    x = torch.randn(128, 64)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 4, 16), nl.float32)
        nisa.dma_copy(dst=t, src=src)
        assert t[5].shape == (1, 4, 16) and t[0:128, 1].shape == (128, 16)  # partition index keeps size 1
        nisa.memset(t[:, 1, 0:16:2], 0.0)       # strided view: writes land in t
        nisa.tensor_copy(t[:, 2], t[:, 3])
        flat = t.reshape((128, 64))
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=flat)
        return out

    expected = x.clone().reshape(128, 4, 16)
    expected[:, 1, 0:16:2] = 0
    expected[:, 2] = expected[:, 3]
    assert torch.equal(kernel(x), expected.reshape(128, 64))


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16])
def test_tile_views_stay_two_dimensional(dtype):
    """On-chip views are always at least 2-D (NkiTensor.__getitem__ docs): `t[:, k]` is [P, 1], so a
    kernel can slice its free dim again (AWS's attention_cte does `bounds[:, k][:num_p, :1]`)."""
    x = torch.randn(128, 4, 8)
    torch_dtype = torch.float32 if dtype is nl.float32 else torch.bfloat16

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 4, 8), dtype)
        nisa.dma_copy(dst=t, src=src)
        column = t[:, 1, 5]
        assert column.shape == (128, 1) and t[:, 1, 5:6].shape == (128, 1)
        assert t[3, 1, 5].shape == (1, 1) and t[..., 0][:, 2].shape == (128, 1)
        assert t[:, 1].shape == (128, 8)  # two dims left: nothing kept
        out = nl.ndarray((128, 1), dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[:64], src=column[:64, :1])
        nisa.dma_copy(dst=out[64:], src=column[64:])
        return out

    assert torch.equal(kernel(x.to(torch_dtype)), x.to(torch_dtype)[:, 1, 5:6])
    hbm = copy_view(lambda t: t[:, 3, 2], (128,))(x)  # HBM keeps NumPy semantics: 1-D
    assert torch.equal(hbm, x[:, 3, 2])


def test_dtype_view_reinterprets_bits():
    x = torch.randn(16, 8).bfloat16()

    @sim.jit
    def kernel(src):
        t = nl.ndarray((16, 8), nl.bfloat16)
        nisa.dma_copy(dst=t, src=src)
        bits = t.view(nl.int16)
        masked = nl.ndarray((16, 8), nl.int16)
        nisa.tensor_scalar(masked, bits, nl.bitwise_and, 0x7FFF)  # clear the sign bit
        out = nl.ndarray((16, 8), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=masked.view(nl.bfloat16))
        return out

    assert torch.equal(kernel(x), x.abs())


def test_hbm_reshape_and_expanded_arguments():
    x = torch.randn(4, 32)
    assert torch.equal(copy_view(lambda t: t.reshape(8, 16), (8, 16))(x), x.reshape(8, 16))
    row = torch.randn(1, 64).expand(128, 64)
    assert torch.equal(copy_view(lambda t: t.reshape(64, 128), (64, 128))(row), row.reshape(64, 128))

    @sim.jit
    def write_into_copy(arg):
        t = nl.ndarray((64, 128), nl.float32)
        nisa.memset(t, 0.0)
        nisa.dma_copy(dst=arg.reshape(64, 128), src=t)

    with pytest.raises(sim.NkiError, match="read-only"):
        write_into_copy(row)


def test_tensor_properties():
    @sim.jit
    def kernel(x):
        t = nl.ndarray((128, 2, 8), nl.bfloat16, name="tile")
        assert (t.shape, t.ndim, t.dtype, t.buffer, t.itemsize) == ((128, 2, 8), 3, nl.bfloat16, nl.sbuf, 2)
        assert x.shape == (3, 5) and x.dtype is nl.float32 and x.buffer is nl.shared_hbm
        assert "tile" in repr(t)
        with pytest.raises(TypeError):
            iter(t)

    kernel(torch.zeros(3, 5))


def test_access_patterns():
    x = torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 64), nl.float32)
        nisa.dma_copy(dst=t, src=src)
        every_other = t[0:64, 0:8].ap([[64, 32], [2, 16]], offset=64 + 1)  # ignores the view it is called on
        out = nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=every_other)
        rows = nl.ndarray((4, 64), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=rows, src=src.ap([[128, 4], [1, 64]]))  # HBM: plain element strides
        return out, rows

    out, rows = kernel(x)
    assert torch.equal(out, x[1:33, 1:33:2])  # element 65 = row 1, col 1; rows step 64, cols step 2
    assert torch.equal(rows, x.reshape(-1).as_strided((4, 64), (128, 1)))


def test_access_pattern_rules():
    @sim.jit
    def bad_partition_stride():
        t = nl.ndarray((128, 64), nl.float32)
        t.ap([[32, 128], [1, 64]])

    with pytest.raises(sim.NkiRuleError, match="partition stride"):
        bad_partition_stride()

    @sim.jit
    def out_of_range():
        t = nl.ndarray((128, 64), nl.float32)
        view = t.ap([[64, 128], [1, 65]])  # building it is allowed (kernels guard its use) ...
        assert view.shape == (128, 65)
        nisa.memset(view, 0.0)  # ... using it is not

    with pytest.raises(sim.NkiIndexError, match="leaves"):
        out_of_range()


@st.composite
def sliced_shapes(draw):
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    index = []
    for size in shape:
        start = draw(st.integers(0, size - 1))
        stop = draw(st.integers(start + 1, size))
        index.append(slice(start, stop, draw(st.integers(1, 3))))
    return shape, tuple(index)


@settings(max_examples=30, deadline=None)
@given(sliced_shapes())
def test_slicing_matches_torch(case):
    shape, index = case
    x = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
    expected = x[index]
    assert torch.equal(copy_view(lambda t: t[index], tuple(expected.shape))(x), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nki_0_4_view_methods(dtype):
    x = torch.randn(16, 4, 6).to(dtype)

    def run(make_view, shape):
        return copy_view(make_view, shape, dtype)(x)

    assert torch.equal(run(lambda t: t.permute((0, 2, 1)), (16, 6, 4)), x.permute(0, 2, 1))
    assert torch.equal(run(lambda t: t[:, 0:1, :].broadcast(1, 3), (16, 3, 6)), x[:, 0:1].expand(16, 3, 6))
    assert torch.equal(run(lambda t: t.expand_dim(1).squeeze_dim(1), (16, 4, 6)), x)
    assert torch.equal(run(lambda t: t.flatten_dims(1, 2).reshape_dim(1, (2, -1)), (16, 2, 12)), x.reshape(16, 2, 12))
    assert torch.equal(run(lambda t: t.slice(2, 1, 6, 2), (16, 4, 3)), x[:, :, 1:6:2])
    assert torch.equal(run(lambda t: t.select(1, 2), (16, 6)), x[:, 2])
    assert torch.equal(run(lambda t: t.rearrange(("p", "a", ("b", "c")), ("p", "c", ("a", "b")), {"b": 2}),
                           (16, 3, 8)), x.reshape(16, 4, 2, 3).permute(0, 3, 1, 2).reshape(16, 3, 8))


def test_view_methods_keep_the_partition_dim():
    @sim.jit
    def kernel():
        t = nl.ndarray((16, 4), nl.float32)
        assert t.is_contiguous() and not t.is_indirect() and t.get_pattern() == [[4, 16], [1, 4]]
        assert not t[:, 0:4:2].is_contiguous() and t.strides == (4, 1) and t.size == 64
        with pytest.raises(sim.NkiError, match="partition"):
            t.permute((1, 0))
        with pytest.raises(sim.NkiError, match="partition"):
            t.select(0, 1)
        with pytest.raises(sim.NkiError, match="partition"):
            t.rearrange(("p", "f"), ("f", "p"))
        with pytest.raises(sim.NkiError, match="not contiguous"):
            nl.ndarray((16, 2, 4), nl.float32).permute((0, 2, 1)).flatten_dims(1, 2)
        with pytest.raises(sim.NkiError, match="dynamic"):
            t.select(1, nl.ndarray((1, 1), nl.int32))

    kernel()


def test_dynamic_select_reads_the_row_an_index_tile_names():
    x = torch.randn(5, 8, 3)

    @sim.jit
    def kernel(src, which):
        index = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=index, src=which)
        row = src.select(0, index)
        assert row.is_indirect() and row.shape == (8, 3)
        t = nl.ndarray((8, 3), nl.float32)
        nisa.dma_copy(dst=t, src=row)
        out = nl.ndarray((8, 3), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    assert torch.equal(kernel(x, torch.tensor([[3]], dtype=torch.int32)), x[3])


def test_vector_select_gathers_one_row_per_partition():
    x = torch.randn(9, 4, 5)
    rows = torch.tensor([[8], [0], [3]], dtype=torch.int32)

    @sim.jit
    def kernel(src, idx_hbm):
        idx = nl.ndarray((3, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=idx_hbm)
        view = src.vector_select(0, idx)
        assert view.shape == (3, 4, 5)
        t = nl.ndarray((3, 4, 5), nl.float32)
        nisa.dma_copy(dst=t, src=view)
        out = nl.ndarray((3, 4, 5), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    assert torch.equal(kernel(x, rows), x[rows[:, 0].long()])
