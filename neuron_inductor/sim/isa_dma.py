"""nki.isa DMA instructions: dma_copy (direct or indirect through .ap) and dma_transpose."""

from __future__ import annotations

from . import cores, indirect, replay, rules
from .errors import NkiError, NkiIndexError
from .indirect import IndirectView
from .isa_enums import dge_mode, engine, oob_mode
from .isa_operands import _F32, _I64, _copy_exact, _same_storage, _write
from .tracing import ACTIVE, record


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """Copy between HBM and SBUF (never PSUM); only element counts must match.

    An indirect side (`.ap(scalar_offset= / vector_offset=)`) makes it a gather or scatter
    (indirect.py); oob_mode says what out-of-bounds indices do.
    """
    api = "nisa.dma_copy"
    cores.step()
    if isinstance(dst, IndirectView) or isinstance(src, IndirectView):
        indirect.dma(api, dst, src, oob_mode, lambda d, s: _dma_copy(api, "dma_copy", d, s, dge_mode))
        return
    _dma_copy(api, "dma_copy", dst, src, dge_mode)


_DMA_BUFFERS = frozenset({"sbuf", "shared_hbm", "private_hbm"})


def _dma_copy(api, op_name, dst, src, mode=dge_mode.unknown):
    for role, t in (("dst", dst), ("src", src)):
        buffer = getattr(t, "buffer", None)
        if buffer is None or buffer.name not in _DMA_BUFFERS:
            rules.on_chip(api, role, t, ("sbuf", "shared_hbm", "private_hbm"))
        if buffer.on_chip:
            rules.partition_limit(api, role, t)
            rules.dtype_on_chip(api, role, t.dtype)
    n = dst.data.numel()
    if n != src.data.numel():
        rules.element_count(api, n, src.data.numel())
    if mode is dge_mode.hwdge:
        rules.dma_dtypes(api, dst, src)
    if _same_storage(dst, src):
        _copy_exact(dst, src)
        replay.note_copy(dst, src)
    elif dst.dtype.kind == "int" and src.dtype.kind == "int":
        _write(dst, src.data.to(_I64))
    else:
        _write(dst, src.data.to(_F32))
    if ACTIVE:
        nbytes = n * max(dst.dtype.itemsize, src.dtype.itemsize)
        p = dst.data.shape[0] if dst.buffer.on_chip else src.data.shape[0] if src.buffer.on_chip else 1
        record("dma", op_name, 0, nbytes, n // p, p, (("dst", dst), ("src", src)))


_DMA_TRANSPOSE_PERMS = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """dst = src permuted ([1, 0] for 2-D, [2, 1, 0] for 3-D, [3, 1, 2, 0] for 4-D) for 2-byte dtypes,
    HBM -> SBUF or SBUF -> SBUF; an indirect src (`.ap(vector_offset=)`) gathers its rows first."""
    api = "nisa.dma_transpose"
    cores.step()
    rules.on_chip(api, "src", src, ("sbuf", "shared_hbm", "private_hbm"))
    # a DMA queue, not a compute engine: any start partition (the 0/32/64/96 rule is the engines' access rule)
    rules.tile(api, "dst", dst, ("sbuf",))
    if dge_mode is globals()["dge_mode"].hwdge or isinstance(src, IndirectView):
        rules.two_byte_dtype(api, "src", src)  # documented for the hardware-DGE and indirect transposes only
    rules.same_dtype(api, "dst", dst, "src", src)
    ndim = len(src.shape)
    perm = _DMA_TRANSPOSE_PERMS.get(ndim)
    if perm is None or (axes is not None and tuple(axes) != perm):
        raise NkiError(f"{api}: {ndim}-d src with axes={axes}: the DMA transposes 2-d (1, 0), 3-d (2, 1, 0) and "
                       "4-d (3, 1, 2, 0) tiles")
    if isinstance(src, IndirectView):
        if dge_mode is globals()["dge_mode"].hwdge:
            raise NkiError(f"{api}: an indirect transpose runs on the software DGE (dge_mode swdge or unknown)")
        addr, valid = src.resolve(api)
        if valid is not None:
            raise NkiIndexError(f"{api}: an indirect index is out of bounds (dim of size {src.bound})")
        values = src.flat[addr]
    else:
        values = src.data
    values = values.permute(perm)
    expected = tuple(values.shape)
    if dst.data.shape[0] != expected[0] or dst.data.numel() != values.numel():
        rules.fail(api, "dst is src transposed", list(dst.data.shape),
                   f"dst has shape {list(dst.data.shape)}, expected {list(expected)}")
    if not isinstance(src, IndirectView) and src.alloc is dst.alloc:
        values = values.clone()
    a, b = values.shape[0], values.numel() // values.shape[0]
    if dst.dtype is src.dtype and dst.data.dtype is values.dtype:
        _write(dst, values, wrap=True)
    else:
        _write(dst, values.to(_F32))
    if ACTIVE:
        record("dma", "dma_transpose", 0, a * b * src.dtype.itemsize, b, a, (("dst", dst), ("src", src)))

