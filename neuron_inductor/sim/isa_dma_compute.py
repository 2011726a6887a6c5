"""nisa.dma_compute: DMA engines adding tensors in fp32, including indirect read-modify-write.

Plain form: dst = srcs[0] + srcs[1] + ... (element counts equal, up to 16 sources).
Scatter RMW: dst is an HBM view with vector_offset and one source is that same view:
dst[indices] += the other (SBUF) source. Gather RMW: dst is SBUF, one source is dst and the
other an HBM view with vector_offset: dst += src[indices]. Only nl.add with unit scales and
unique indices are supported, as documented.
"""

from __future__ import annotations

import math

import torch

from . import cores, isa, rules
from . import tensor as tensors
from .indirect import IndirectView

_MAX_SOURCES = 16


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=isa.oob_mode.error, name=None):
    api = "nisa.dma_compute"
    cores.step()
    srcs = list(srcs)
    if getattr(reduce_op, "name", None) != "add":
        rules.fail(api, "reduce_op is nl.add", reduce_op, f"reduce_op={reduce_op!r}")
    if scales is not None and any(float(s) != 1.0 for s in scales):
        rules.fail(api, "scales are all 1.0", list(scales), f"scales={list(scales)}")
    if not 1 <= len(srcs) <= _MAX_SOURCES:
        rules.fail(api, f"1..{_MAX_SOURCES} sources", len(srcs), f"{len(srcs)} sources")
    if isinstance(dst, IndirectView) or any(isinstance(s, IndirectView) for s in srcs):
        _read_modify_write(api, dst, srcs, unique_indices, oob_mode)
    else:
        n = dst.data.numel()
        total = torch.zeros(n)
        for s in srcs:
            rules.element_count(api, n, s.data.numel())
            total = total + s.data.reshape(-1).to(torch.float32)
        isa._write(dst, total.reshape(dst.data.shape))
    if isa.ACTIVE:
        shape = dst.shape
        count = 1
        for s in shape:
            count *= s
        # partitions: the first dim, as for dma_copy (an SBUF side reaches ceil(P / 8) DMA engines)
        partitions = shape[0] if len(shape) > 1 else 1
        isa.record("dma", "dma_compute", count * len(srcs), count * dst.dtype.itemsize * (len(srcs) + 1),
                   count // partitions, partitions,
                   (("dst", _recordable(dst)), *(("src", _recordable(s)) for s in srcs)))


def _read_modify_write(api, dst, srcs, unique_indices, oob_mode):
    if len(srcs) != 2 or not unique_indices:
        raise isa.NkiError(f"{api}: indirect read-modify-write takes exactly 2 sources with unique_indices=True")
    if isinstance(dst, IndirectView):  # scatter: dst[idx] += data
        data = srcs[1] if srcs[0] is dst else srcs[0] if srcs[1] is dst else None
        if data is None:
            raise isa.NkiError(f"{api}: a scatter RMW lists its indirect dst as one of the two sources")
        addr, valid = dst.resolve(api)
        _check_oob(api, valid, oob_mode, dst.bound)
        addends = tensors.allocate(tuple(dst.sizes), dst.dtype, tensors.private_hbm, "", None)
        isa._write(addends, data.data.reshape(-1).to(torch.float32).reshape(addends.data.shape))
        rows = slice(None) if valid is None else valid
        where = addr[rows]
        current = dst.flat[where].to(torch.float32)
        updated = tensors.allocate(tuple(where.shape), dst.dtype, tensors.private_hbm, "", None)
        isa._write(updated, current + addends.data[rows].to(torch.float32))
        dst.flat[where] = updated.data
        return
    # gather: dst += src[idx]
    source = next((s for s in srcs if isinstance(s, IndirectView)), None)
    if source is None or not any(s is dst for s in srcs):
        raise isa.NkiError(f"{api}: a gather RMW lists dst and one indirect HBM source")
    addr, valid = source.resolve(api)
    _check_oob(api, valid, oob_mode, source.bound)
    gathered = source.flat[addr.clamp(0, source.flat.numel() - 1)].to(torch.float32)
    if valid is not None:
        keep = valid.reshape([-1] + [1] * (gathered.dim() - 1)).expand(gathered.shape)
        gathered = torch.where(keep, gathered, torch.zeros(()))
    rules.element_count(api, dst.data.numel(), gathered.numel())
    isa._write(dst, isa._f32(dst).reshape(-1).add(gathered.reshape(-1)).reshape(dst.data.shape))


def _recordable(t):
    """t as a trace operand: an indirect view has no data, so its shape comes from a meta tensor (its
    allocation stays the view's, for the dependency chain). Its rows sit at indexed addresses, never
    next to each other, so the meta tensor's rows are not adjacent either: the cost model's
    contiguous run (tracing._contiguous_bytes) is one row's bytes, what one descriptor moves."""
    if not isinstance(t, IndirectView):
        return t
    sizes = tuple(t.sizes)
    row = math.prod(sizes[1:])
    strides = (row + 1,) + tuple(math.prod(sizes[d + 1:]) for d in range(1, len(sizes)))
    meta = torch.empty_strided(sizes, strides, device="meta")
    return tensors.NkiTensor(meta, t.dtype, t.buffer, t.alloc, t.name)


def _check_oob(api, valid, oob_mode, bound):
    if valid is not None and oob_mode is isa.oob_mode.error:
        bad = int((~valid).nonzero()[0, 0])
        raise isa.NkiIndexError(f"{api}: indirect index for row {bad} is out of bounds (dim of size {bound}); "
                                "pass oob_mode=nisa.oob_mode.skip to skip such rows")
