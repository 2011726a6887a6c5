"""The NKI 0.3+ API surface production kernels use: modules and names, NKIObject, dtypes, .ap(dtype=), registers."""

from dataclasses import dataclass

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

from .helpers import nl_dtype

DTYPES = [torch.float32, torch.bfloat16]

IMPORTS = '''
import nki
import nki.isa as nisa
import nki.language as nl
import neuronxcc.nki.typing as nt
from nki.isa import constants as nisa_constants
from nki.isa.constants import dge_mode, oob_mode
from nki.isa import dma_engine, core_barrier, reduce_cmd
from nki.language import NKIObject


@nki.jit
def copy_kernel(x: nt.tensor, index_dtype: nki.dtype = nl.int32):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x, oob_mode=oob_mode.error, dge_mode=nisa_constants.dge_mode.unknown)
    nisa.dma_copy(dst=out, src=t)
    return out
'''


def test_library_style_imports_resolve_inside_as_nki():
    kernels = sim.load_kernels(IMPORTS, "<imports>")
    x = torch.randn(4, 8)
    assert torch.equal(kernels["copy_kernel"](x), x)
    with sim.as_nki():
        import nki

        assert nki.isa.constants.oob_mode is nisa.oob_mode and nki.dtype.bfloat16 is nl.bfloat16
    import sys

    assert "neuronxcc" not in sys.modules and "nki.isa.constants" not in sys.modules


def test_dtypes_print_as_their_bare_names_and_mx_names_exist():
    assert str(nl.bfloat16) == "bfloat16" and f"{nl.float32}" == "float32"
    for name in ("float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4", "float8_e8m0fnu"):
        assert str(getattr(nl, name)) == name


def test_mx_tiles_move_by_dma_but_no_engine_computes_on_them():
    @sim.jit
    def kernel(x):
        packed = nl.ndarray((2, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.dma_copy(dst=packed, src=x.ap([[4, 2], [1, 4]], dtype=nl.float8_e4m3fn_x4))
        out = nl.ndarray((2, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.activation(dst=out, op=nl.exp, data=packed)

    with pytest.raises(sim.NkiError, match="float8_e4m3fn_x4"):
        kernel(torch.zeros(2, 4, dtype=torch.int32))


def test_nc_version_orders_and_dma_engine_exists():
    assert nisa.nc_version.gen3 > nisa.nc_version.gen2 and nisa.get_nc_version() >= nisa.nc_version.gen3
    assert nisa.nc_version.gen2 <= nisa.nc_version.gen2 < nisa.nc_version.gen4
    with pytest.raises(TypeError):
        nisa.nc_version.gen3 < 3  # noqa: B015
    assert {e.name for e in nisa.dma_engine} == {"dma", "gpsimd_dma"}


@dataclass
class _TileConfig(nl.NKIObject):
    rows: int
    cols: int = 64


@dataclass
class _Buffers(nl.NKIObject):
    staged = None  # attributes without annotations: class-level defaults, filled in later
    result = None
    history = []  # a mutable default: each instance gets its own copy
    inner = _TileConfig(rows=1)  # an unhashable (non-frozen dataclass) default


def test_nki_objects_hold_kernel_configuration():
    config = _TileConfig(rows=128)
    assert (config.rows, config.cols) == (128, 64)
    buffers = _Buffers(result="out")  # unannotated attributes are constructor keywords
    assert buffers.staged is None and buffers.result == "out"
    buffers.staged = "tile"
    buffers.history.append(1)
    assert buffers.staged == "tile" and _Buffers().history == [] and _Buffers().inner == _TileConfig(rows=1)
    assert nl.NKIObject(a=1).a == 1 and "a=1" in repr(nl.NKIObject(a=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ap_offset_counts_from_the_view_and_dtype_reinterprets(dtype):
    x = torch.randn(128, 64).to(dtype)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 64), nl_dtype(dtype))
        nisa.dma_copy(dst=t, src=src)
        shifted = nl.ndarray((128, 8), nl_dtype(dtype), buffer=nl.shared_hbm)
        nisa.dma_copy(dst=shifted, src=t[:, 16:32].ap([[64, 128], [2, 8]], offset=1))  # cols 17, 19, ..., 31
        raw = nl.ndarray((128, 64 * dtype.itemsize), nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=raw, src=t.ap([[64 * dtype.itemsize, 128], [1, 64 * dtype.itemsize]], dtype=nl.uint8))
        return shifted, raw

    shifted, raw = kernel(x)
    assert torch.equal(shifted, x[:, 17:32:2])
    assert torch.equal(raw, x.view(torch.uint8))


def test_ap_dtype_needs_an_aligned_start():
    @sim.jit
    def kernel(src):
        return src[:, 1:].ap([[2, 4], [1, 2]], dtype=nl.float32)

    with pytest.raises(sim.NkiError, match="multiple of 4"):
        kernel(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_registers_drive_dynamic_loops():
    @sim.jit
    def kernel(count, x):
        count_sb = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=count_sb, src=count)
        reg = nisa.register_alloc()
        nisa.register_load(reg, count_sb)
        acc = nl.ndarray((1, 4), nl.float32)
        nisa.memset(acc, 0.0)
        row = nl.ndarray((1, 4), nl.float32)
        for _ in nl.dynamic_range(reg):  # acc += x[0]  `count` times
            nisa.dma_copy(dst=row, src=x[0:1, :])
            nisa.tensor_tensor(acc, acc, row, nl.add)

        def body(i):  # fori_loop: acc += x[i] for i in [1, 3)
            nisa.dma_copy(dst=row, src=x.ap([[4, 1], [1, 4]], scalar_offset=i, indirect_dim=0))
            nisa.tensor_tensor(acc, acc, row, nl.add)

        nl.fori_loop(1, nisa.register_alloc(3), body)
        left = nl.ndarray((1, 1), nl.int32)
        nisa.memset(left, 2)
        one = nl.ndarray((1, 1), nl.int32)
        nisa.memset(one, 1)

        def countdown(r):  # while_loop: runs twice
            nisa.tensor_tensor(acc, acc, acc, nl.add)
            nisa.tensor_tensor(left, left, one, nl.subtract)
            nisa.register_load(r, left)
            return r

        start = nisa.register_alloc(2)
        nl.while_loop(start, countdown)
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        stored = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
        nisa.register_store(stored, start)
        return out, stored

    x = torch.randn(3, 4)
    out, stored = kernel(torch.tensor([[5]], dtype=torch.int32), x)
    torch.testing.assert_close(out[0], 4 * (5 * x[0] + x[1] + x[2]))
    assert stored.item() == 2  # the loop body got a copy of the register


def test_registers_refuse_reads_before_a_value():
    reg = nisa.register_alloc()
    with pytest.raises(sim.NkiError, match="never loaded"):
        list(nl.dynamic_range(reg))
    with pytest.raises(sim.NkiError, match="32-bit"):
        nisa.register_alloc(1 << 40)
