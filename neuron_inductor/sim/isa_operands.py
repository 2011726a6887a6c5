"""Operand access shared by the nki.isa instructions: [P, F] views, fp32 / int64 reads,
scalar operands and immediates, the casting store into dst, and the elementwise shape check."""

from __future__ import annotations

import torch

from . import dtypes, rules
from . import tensor as tensors
from .errors import NkiError

_F32 = torch.float32
_I64 = torch.int64
_SBUF = frozenset({"sbuf"})
_PSUM = frozenset({"psum"})

def _flat(t) -> torch.Tensor:
    """The [P, F] storage view (or copy, for non-viewable strides) of a tile."""
    data = t.data
    if data.dim() == 2:
        return data
    if data.dim() < 2:
        return data.reshape(-1, 1)
    return data.reshape(data.shape[0], -1)


def _f32(t) -> torch.Tensor:
    data = _flat(t)
    return data if data.dtype is _F32 else data.to(_F32)


def _f32_reused(t) -> torch.Tensor:
    """_f32 for operands read many times (matmul tiles): the allocation is converted once per version."""
    data = t.data
    alloc = t.alloc
    storage = alloc.storage
    if data.dtype is _F32 or data.dtype is not storage.dtype or data.numel() * 8 < storage.numel() \
            or storage.storage_offset() or not storage.is_contiguous() \
            or storage.is_inference():  # address= tiles view a shared buffer; inference tensors have no version
        return _f32(t)
    version = storage._version  # shared by every view: bumps on any in-place write
    if alloc.f32_version != version:
        alloc.f32 = storage.to(_F32)
        alloc.f32_version = version
    view = alloc.f32.as_strided(data.size(), data.stride(), data.storage_offset())
    return view if view.dim() == 2 else view.reshape(view.shape[0], -1)


def _i64(t) -> torch.Tensor:
    return _flat(t).to(_I64)


def _scalar(operand, integer=False):
    """A number or a [P, 1] tile as something that broadcasts against [P, F]."""
    if getattr(operand, "buffer", None) is None:
        return torch.scalar_tensor(operand, dtype=_I64) if integer else f32_immediate(operand)
    return _i64(operand) if integer else _f32(operand)


def f32_immediate(value) -> torch.Tensor:
    """A Python number as the fp32 immediate the engines see: rounded to nearest, so the
    library's -3.4028235e38 "minus infinity" fill (just past FLT_MAX in float64) becomes -FLT_MAX."""
    if -_F32_MAX <= value <= _F32_MAX:  # the common case: exactly representable range, one conversion
        return torch.scalar_tensor(value, dtype=_F32)
    return torch.scalar_tensor(value, dtype=torch.float64).to(_F32)


_F32_MAX = 3.4028234663852886e38


def _is_int(operand) -> bool:
    dtype = getattr(operand, "dtype", None)
    return dtype.kind == "int" if dtype is not None else isinstance(operand, int)


def _write(dst, values: torch.Tensor, wrap: bool = False) -> None:
    """Store engine results into dst: cast to dst.dtype (rounding / saturating), mark PSUM written."""
    alloc = dst.alloc
    if alloc.readonly:
        raise NkiError("cannot write a read-only HBM view (a reshape torch could only copy)")
    if not alloc.placed:
        tensors.place(dst)
    data = dst.data
    dtype = dst.dtype
    if dtype in _NEEDS_CAST and not wrap:
        values = dtypes.cast_for_store(values, dtype, data.dtype)
    if values.shape != data.shape:
        data, values = _matched(data, values)
    _store(data, values)
    if dst.buffer is tensors.psum:
        tensors.mark_written(dst)


def _matched(data: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) of one shape, the same elements in row-major order: the values viewed as dst's shape,
    else (a strided source, e.g. a permuted or broadcast HBM view, that reshape would first copy
    compact) dst viewed as the values' shape, so the copy reads the source in place; else the values
    reshaped. A dst with zero steps keeps its shape (_store's pattern order)."""
    try:
        return data, values.view(data.shape)
    except RuntimeError:
        pass
    if 0 not in data.stride():
        try:
            return data.view(values.shape), values
        except RuntimeError:
            pass
    return data, values.reshape(data.shape)


def _store(data: torch.Tensor, values: torch.Tensor) -> None:
    """data.copy_(values); a dst pattern with zero steps (`.ap([[1, n], [0, F]])`) writes one location
    several times in pattern order, so the last element along each zero-step dim is what stays."""
    try:
        data.copy_(values)
    except RuntimeError:
        if 0 not in data.stride():
            raise
        for dim, (size, stride) in enumerate(zip(data.shape, data.stride())):
            if stride == 0 and size > 1:
                data, values = data.narrow(dim, size - 1, 1), values.narrow(dim, size - 1, 1)
        data.copy_(values)


_NEEDS_CAST = frozenset(d for d in dtypes.ALL if d.kind != "float") | {dtypes.tfloat32, dtypes.float8_e4m3}


def _copy_exact(dst, src) -> None:
    """Bit-exact copy between tiles of the same dtype and storage."""
    if dst.alloc.readonly:
        raise NkiError("cannot write a read-only HBM view (a reshape torch could only copy)")
    if not dst.alloc.placed:
        tensors.place(dst)
    values = src.data
    if src.alloc is dst.alloc:
        values = values.clone()  # overlapping views of one allocation
    data = dst.data
    if values.shape != data.shape:
        data, values = _matched(data, values)
    _store(data, values)
    if dst.buffer is tensors.psum:
        tensors.mark_written(dst)


def _same_storage(a, b) -> bool:
    return a.dtype is b.dtype and a.data.dtype is b.data.dtype


def _bytes(*tiles) -> int:
    return sum(t.data.numel() * t.dtype.itemsize for t in tiles if getattr(t, "buffer", None) is not None)


def _check_elementwise(op, dst, *inputs):
    """dst and inputs: on-chip operands with equal partitions and elements per partition -> (P, F)."""
    p, n = rules.operand(op, "dst", dst)
    for role, t in inputs:
        pi, ni = rules.operand(op, role, t)
        if pi != p:
            rules.same_partitions(op, "dst", dst, role, t)
        if ni != n:
            rules.same_free_size(op, "dst", n, role, ni)
    return p, n


