"""Indirect access patterns: `.ap(..., scalar_offset= | vector_offset=, indirect_dim=)` gathers and scatters.

An indirect view addresses `base + offset + sum_k i_k * stride_k` over the [[stride, count], ...]
pattern (elements of the view's dtype), plus a dynamic term `index * S`, where S is the
stride of dim `indirect_dim` of the tensor `.ap()` was called on:
- scalar_offset (a one-element SBUF tile or a VirtualRegister): one index for the whole access;
- vector_offset (an SBUF [P, 1] tile, P = the first pattern count): index[i] replaces the first
  pattern dim's term, so row i of the access is row index[i] of the indexed dim (gather /
  scatter by index; vector indirection is HBM-only).

An index is out of bounds when it is negative or its row's addresses leave the allocation: the DGE
does "out-of-bound address checking" (nki.isa.dma_copy docs), so an index past shape[indirect_dim]
that stays inside the tensor is a valid address (AWS's block KV-cache update writes flat slot
indices through the block-length dim). dma_copy(oob_mode=error) raises NkiIndexError;
oob_mode=skip leaves those rows untouched (the documented "skip the DMA transfer for a given
dynamic address or index").
Indices are read when the DMA runs, not when `.ap()` is called.
"""

from __future__ import annotations

import torch

from . import op_replay
from . import tensor as tensors
from .errors import NkiError, NkiIndexError
from .registers import VirtualRegister


class NoData(NkiError, AttributeError):
    """Reading an indirect view's `data`: an NkiError for a kernel that tries, an AttributeError for
    code that asks whether it has one (hasattr: liveness.py's walk over a kernel's variables)."""


class IndirectView(tensors.NkiTensor):
    """An NkiTensor whose addresses depend on index values: an operand of dma_copy only.

    It has a shape, dtype and buffer but no `data`: any other instruction that tries to read
    it gets an NkiError. `resolve()` gives the element addresses when the DMA runs.
    """

    __slots__ = ("flat", "sizes", "strides", "base", "index", "vector", "scale", "bound")

    def __init__(self, owner, flat, sizes, strides, base, index, vector, scale, bound, dtype):
        self.dtype = dtype
        self.buffer = owner.buffer
        self.alloc = owner.alloc
        self.name = owner.name
        self.flat = flat            # the allocation's storage as 1-D, in `dtype`
        self.sizes = sizes
        self.strides = strides
        self.base = base
        self.index = index          # a tile or a VirtualRegister
        self.vector = vector
        self.scale = scale          # S: stride of the indexed dim
        self.bound = bound          # shape[indirect_dim] (for messages: addresses decide what is in bounds)

    @property
    def data(self):
        raise NoData("an indirect view (.ap with scalar_offset / vector_offset) is a dma_copy operand only")

    @property
    def shape(self) -> tuple:
        return tuple(self.sizes)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def is_indirect(self) -> bool:
        return True

    def __repr__(self):
        kind = "vector" if self.vector else "scalar"
        return f"IndirectView({list(self.sizes)}, {self.dtype!r}, {kind} offset, buffer={self.buffer!r})"

    def __getitem__(self, key):
        raise NkiError("an indirect view cannot be sliced further; slice before calling .ap()")

    def resolve(self, api):
        """(addresses [sizes] int64 into flat, rows valid [sizes[0]] bool or None if all valid)."""
        sizes, strides = self.sizes, self.strides
        addr = torch.full((), self.base, dtype=torch.int64)
        for dim, (size, stride) in enumerate(zip(sizes, strides)):
            shape = [1] * len(sizes)
            shape[dim] = size
            if dim == 0 and self.vector:
                continue
            addr = addr + (torch.arange(size, dtype=torch.int64) * stride).reshape(shape)
        indices = self._indices(api)
        rows = indices.reshape([-1] + [1] * (len(sizes) - 1))
        addr = (addr + rows * self.scale).expand(sizes)
        in_range = indices >= 0
        per_row = addr.reshape(sizes[0], -1) if self.vector else addr.reshape(1, -1)
        in_storage = ((per_row >= 0) & (per_row < self.flat.numel())).all(dim=1)
        valid = in_range & in_storage
        if bool(valid.all()):  # (a guard of a replay: a call with rows out of bounds runs on the slow path)
            return addr, None
        # a scatter keeps the valid rows by a mask, whose count comes from the data (so would later shapes)
        op_replay.deny("an indirect DMA with rows out of bounds")
        if not self.vector:
            valid = valid.expand(sizes[0])
        return addr, valid

    def _indices(self, api) -> torch.Tensor:
        index = self.index
        if isinstance(index, VirtualRegister):
            return torch.tensor([index.read(api)], dtype=torch.int64)
        values = index.data
        if index.dtype.kind != "int":
            raise NkiError(f"{api}: indirect offsets must be an integer tile, got {index.dtype.name}")
        # [P, N] index tiles (free dims flattened) are read column by column (indices.T.flatten()), as the DGE does.
        values = (values.reshape(values.shape[0], -1).t() if values.dim() >= 2 else values).reshape(-1).to(torch.int64)
        if self.vector:
            if values.numel() < self.sizes[0]:
                raise NkiError(f"{api}: vector_offset has {values.numel()} indices for an access of "
                               f"{self.sizes[0]} rows (the first pattern count)")
            values = values[:self.sizes[0]]
        return values


def make(owner, flat, sizes, strides, base, dtype, scalar_offset, vector_offset, indirect_dim):
    """The IndirectView for NkiTensor.ap's scalar_offset / vector_offset arguments."""
    api = "NkiTensor.ap"
    if scalar_offset is not None and vector_offset is not None:
        raise NkiError(f"{api}: scalar_offset and vector_offset are mutually exclusive")
    if not 0 <= indirect_dim < owner.ndim:
        raise NkiError(f"{api}: indirect_dim={indirect_dim} is not a dim of the {owner.ndim}-d tensor")
    vector = vector_offset is not None
    index = vector_offset if vector else scalar_offset
    if vector and owner.buffer.on_chip:
        raise NkiError(f"{api}: vector_offset indexes HBM tensors only (the tensor is in {owner.buffer.name})")
    if not isinstance(index, VirtualRegister):
        if getattr(index, "buffer", None) is None or not index.buffer.on_chip:
            raise NkiError(f"{api}: the offset must be an SBUF tile{'' if vector else ' or a VirtualRegister'}, "
                           f"got {type(index).__name__}")
        if vector and index.data.dim() < 2:
            raise NkiError(f"{api}: vector_offset must be a [P, N...] tile, got {list(index.data.shape)}")
        if not vector and index.data.numel() != 1:
            raise NkiError(f"{api}: scalar_offset must be a one-element tile, got {list(index.data.shape)}")
    scale = owner.data.stride(indirect_dim) * owner.dtype.itemsize // dtype.itemsize
    return IndirectView(owner, flat, sizes, strides, base, index, vector, scale, owner.shape[indirect_dim], dtype)


def dma(api, dst, src, oob, copy) -> None:
    """dma_copy with an indirect src (gather) or dst (scatter); `copy(dst, src)` is the direct DMA."""
    if isinstance(dst, IndirectView) and isinstance(src, IndirectView):
        raise NkiError(f"{api}: only one side of a DMA may be indirect")
    side = src if isinstance(src, IndirectView) else dst
    addr, valid = side.resolve(api)
    if valid is not None and oob.name == "error":
        bad = int((~valid).nonzero()[0, 0])
        raise NkiIndexError(f"{api}: indirect index for row {bad} is out of bounds: it addresses outside the "
                            f"{side.flat.numel()}-element tensor (indexed dim of size {side.bound}); "
                            "pass oob_mode=nisa.oob_mode.skip to skip such rows")
    rows = slice(None) if valid is None else valid
    if side is src:  # gather: read the addressed elements, then DMA them into dst
        gathered = side.flat[addr.clamp(0, side.flat.numel() - 1)]
        staged = tensors.NkiTensor(gathered, side.dtype, side.buffer, tensors.Allocation(gathered), side.name)
        if valid is None:
            copy(dst, staged)
            return
        converted = tensors.allocate(tuple(dst.data.shape), dst.dtype, tensors.private_hbm, "", None)
        copy(converted, staged)
        keep = valid.reshape([-1] + [1] * (len(side.sizes) - 1)).expand(side.sizes).reshape(dst.data.shape)
        if not dst.alloc.placed:
            tensors.place(dst)
        dst.data.copy_(torch.where(keep, converted.data, dst.data))
        if dst.buffer is tensors.psum:
            tensors.mark_written(dst)
        return
    # scatter: convert src to the destination dtype, then write the addressed elements
    converted = tensors.allocate(tuple(side.sizes), side.dtype, tensors.private_hbm, "", None)
    copy(converted, src)
    if dst.alloc.readonly:
        raise NkiError(f"{api}: cannot scatter into a read-only view")
    side.flat[addr[rows]] = converted.data[rows]
