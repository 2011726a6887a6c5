"""NkiTensor: a typed, buffer-tagged view of torch storage.

An NkiTensor is `data` (a torch view of an allocation's storage, in the storage dtype),
the NKI `dtype`, the `buffer` it lives in and the `alloc` it views. Slices, `nl.ds`,
integer indices, `reshape` and `view(dtype)` make new NkiTensors over the same storage,
so writes through any view land in the allocation. Kernel arguments are wrapped the same
way around the caller's torch tensor (strided, expanded or permuted views included),
without a copy: reads go through the view and writes land in the caller's memory.

On-chip tiles keep dim 0 as the partition dim: an integer index there keeps a size-1
dim (the NKI 0.6 rule; generators should emit slices anyway), an on-chip view is never
less than 2-D, and partition slices take step 1. Out-of-range slices raise instead of clamping.

An on-chip tile takes its pool's bytes at its first write (`place`), not at `nl.ndarray`: the
allocator "assigns an address to a tile at its first write and releases the address after its
last read" (nki.compiler.Allocation), so a tile declared early and written late is not live
in between.

PSUM allocations also track which elements have been written, for nc_matmul's
accumulate rules: a flag for "none" / "all" and a bool mask only while partially written.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch

from . import dtypes, rules
from .errors import NkiError, NkiIndexError
from .views import ViewMethods


class Buffer:
    """A memory kind: `nl.sbuf`, `nl.psum`, `nl.shared_hbm`, `nl.private_hbm` (= `nl.hbm`)."""

    __slots__ = ("name", "on_chip")

    def __init__(self, name: str, on_chip: bool):
        self.name = name
        self.on_chip = on_chip

    def __repr__(self):
        return f"nl.{self.name}"


sbuf = Buffer("sbuf", True)
psum = Buffer("psum", True)
shared_hbm = Buffer("shared_hbm", False)
private_hbm = Buffer("private_hbm", False)

UNWRITTEN, PARTLY_WRITTEN, WRITTEN = 0, 1, 2


class Allocation:
    """One piece of storage; gives its bytes back to its pool when garbage-collected."""

    __slots__ = ("storage", "pool", "nbytes", "placed", "written", "mask", "readonly", "f32", "f32_version",
                 "__weakref__")

    def __init__(self, storage: torch.Tensor, pool=None, nbytes: int = 0, readonly: bool = False):
        self.storage = storage
        self.pool = pool
        self.nbytes = nbytes
        self.placed = pool is None  # on-chip: False until the first write takes the pool's bytes (place)
        self.written = UNWRITTEN
        self.mask = None
        self.readonly = readonly
        self.f32 = None  # fp32 copy of storage for reused matmul operands, valid at f32_version
        self.f32_version = -1

    def __del__(self):
        if self.pool is not None:
            if self.placed:
                self.pool.release(self.nbytes, self)
            _recycle(self.storage)


# On-chip storage is recycled by (shape, dtype): fresh pages are slow to fault in (on some
# VMs, milliseconds per tile), and loops allocate the same tile shapes over and over.
_RECYCLED = {}
_RECYCLE_PER_KEY = 8
_RECYCLE_MAX_ELEMENTS = 1 << 23  # don't hold on to tiles bigger than 32 MiB of fp32


def _recycle(storage: torch.Tensor) -> None:
    # Runs from __del__, so from whatever garbage collection the thread is in: inside make_fx or
    # Dynamo a torch op here (detach, say) would be traced into the caller's graph. Only tensor
    # attributes are read. Not reused: storage made under torch.inference_mode() (not writable
    # outside it) and a tile a kernel wrote from tensors requiring grad (called directly under
    # autograd): a recycled tile is fresh memory, which no autograd graph may follow.
    if (storage.numel() <= _RECYCLE_MAX_ELEMENTS and not storage.requires_grad and not storage.is_inference()
            and not storage.is_meta):
        key = (tuple(storage.shape), storage.dtype)
        bucket = _RECYCLED.get(key)
        if bucket is None:
            _RECYCLED[key] = [storage]
        elif len(bucket) < _RECYCLE_PER_KEY:
            bucket.append(storage)


_shape_runs = 0  # > 0 while shapes_only() is active: every allocation is a meta tensor


@contextlib.contextmanager
def shapes_only():
    """Kernels called inside run only their shape logic: all memory is on the meta device (no data,
    no math); rules on shapes, dtypes and capacity still apply. HBM arguments must be meta tensors."""
    global _shape_runs
    _shape_runs += 1
    try:
        with torch.device("meta"):
            yield
    finally:
        _shape_runs -= 1


def _fresh_storage(shape, dtype: torch.dtype, fill) -> torch.Tensor:
    bucket = _RECYCLED.get((shape, dtype)) if not _shape_runs else None
    if bucket:
        return bucket.pop().fill_(fill)
    return torch.full(shape, fill, dtype=dtype)


class DynSlice:
    """`nl.ds(start, size)`: the slice [start, start + size)."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start = operator.index(start)
        self.size = operator.index(size)

    def __repr__(self):
        return f"nl.ds({self.start}, {self.size})"


def ds(start, size) -> DynSlice:
    return DynSlice(start, size)


class NkiTensor(ViewMethods):
    __slots__ = ("data", "dtype", "buffer", "alloc", "name")

    def __init__(self, data: torch.Tensor, dtype: dtypes.NkiDtype, buffer: Buffer, alloc: Allocation, name: str = ""):
        self.data = data
        self.dtype = dtype
        self.buffer = buffer
        self.alloc = alloc
        self.name = name

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __repr__(self):
        label = f" {self.name!r}" if self.name else ""
        return f"NkiTensor{label}({list(self.data.shape)}, {self.dtype!r}, buffer={self.buffer!r})"

    def __iter__(self):
        raise TypeError("NkiTensor is not iterable; index it with slices")

    def __getitem__(self, key) -> NkiTensor:
        data = self.data
        buffer = self.buffer
        return NkiTensor(data[_normalize_index(key, data.shape, buffer.on_chip)], self.dtype, buffer, self.alloc,
                         self.name)

    def reshape(self, *shape) -> NkiTensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        data = self.data
        shape = tuple(_resolve_reshape(shape, data.numel()))
        if self.buffer.on_chip:
            rules.reshape_keeps_partitions(data.shape[0], shape[0])
        try:
            view = data.view(shape)
        except RuntimeError:
            if self.buffer.on_chip:
                raise NkiError(f"reshape of tile view {list(data.shape)} to {list(shape)} needs a contiguous view") from None
            # An HBM argument that torch cannot view (e.g. expanded): read through a copy.
            copy = data.reshape(shape)
            return NkiTensor(copy, self.dtype, self.buffer, Allocation(copy, readonly=True), self.name)
        return NkiTensor(view, self.dtype, self.buffer, self.alloc, self.name)

    def view(self, dtype) -> NkiTensor:
        """Reinterpret the bytes as `dtype` (the last dim scales by the itemsize ratio)."""
        new = dtypes.as_dtype(dtype)
        data = self.data
        if data.dtype is not self.dtype.storage or new.storage.itemsize != new.itemsize:
            raise NkiError(f"view({new!r}) of a {self.dtype!r} tile needs real-dtype storage "
                           f"(unset {dtypes.FP32_STORAGE_ENV}; uint32 has none)")
        if self.buffer is psum and new.itemsize != self.dtype.itemsize:
            raise NkiError("dtype views that change the element size are not supported on PSUM tiles")
        try:
            view = data.view(new.storage)
        except RuntimeError as error:
            raise NkiError(f"view({new!r}) of {list(data.shape)} {self.dtype!r}: {error}") from None
        if self.buffer.on_chip and data.dim() == 1 and view.shape[0] != data.shape[0]:
            rules.reshape_keeps_partitions(data.shape[0], view.shape[0])
        return NkiTensor(view, new, self.buffer, self.alloc, self.name)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None) -> NkiTensor:
        """An explicit access pattern [[stride, count], ...] over the allocation (torch.as_strided).

        Strides, counts and `offset` count elements of `dtype` (default: this tensor's), and
        `offset` is added to this view's first element (None and 0 keep it). Addresses are
        row-major over the allocation: on-chip, element e is partition e // F, column e % F
        (F = the allocation's free size), so the first pair is the partition dim with stride F.
        scalar_offset / vector_offset make an indirect view of an HBM tensor (indirect.py) for dma_copy.
        """
        new = self.dtype if dtype is None else dtypes.as_dtype(dtype)
        strides = [operator.index(stride) for stride, _ in pattern]
        sizes = [operator.index(count) for _, count in pattern]
        extra = 0 if offset is None else operator.index(offset)
        if self.buffer.on_chip and self.alloc.storage.dim() > 1:
            if scalar_offset is not None or vector_offset is not None:
                raise NkiError("NkiTensor.ap: indirect access patterns (scalar_offset / vector_offset) on on-chip "
                               "tiles are not modelled; index an HBM tensor")
            return self._on_chip_ap(pattern, new, extra, strides, sizes)
        flat, base, alloc = self._flat_storage(new)
        base += extra
        if scalar_offset is not None or vector_offset is not None:
            from . import indirect  # indirect views subclass NkiTensor

            owner = self if alloc is self.alloc else NkiTensor(alloc.storage, self.dtype, self.buffer, alloc, self.name)
            return indirect.make(owner, flat, sizes, strides, base, new, scalar_offset, vector_offset, indirect_dim)
        last = base + sum((n - 1) * s for s, n in zip(strides, sizes))
        if base < 0 or min(strides, default=0) < 0 or last >= flat.numel():
            return OutOfBoundsView(self, new, sizes, f"access pattern {pattern} at element {base} leaves the "
                                   f"{flat.numel()}-element tensor")
        view = flat.as_strided(sizes, strides, flat.storage_offset() + base)
        return NkiTensor(view, new, self.buffer, alloc, self.name)

    def _on_chip_ap(self, pattern, new, extra, strides, sizes):
        """ap on a tile: row-major element addresses mapped onto its [P, F] storage rows (which are
        strided views of the buffer for address= tiles)."""
        self._check_real_storage(new)
        storage = self.alloc.storage
        rows = _rows(storage)
        itemsize = self.dtype.itemsize
        into = self.data.storage_offset() - storage.storage_offset()  # elements, in storage's own row stride
        row, column = divmod(into, rows.stride(0))
        first = (row * rows.shape[1] + column) * itemsize  # bytes from the tile's start, row-major
        if new is not self.dtype:
            try:
                rows = rows.view(new.storage)
            except RuntimeError as error:
                raise NkiError(f"NkiTensor.ap(dtype={new!r}) of a {self.dtype!r} tile: {error}") from None
        if first % new.itemsize:
            raise NkiError(f"NkiTensor.ap(dtype={new!r}): the view starts {first} B into the tile, "
                           f"not a multiple of {new.itemsize} B")
        base = first // new.itemsize + extra
        partitions, free = rows.shape
        if strides and strides[0] != free:
            rules.fail("NkiTensor.ap", "partition stride = allocation free size", strides[0],
                       f"partition stride {strides[0]}, expected {free}")
        first_row, column = divmod(base, free) if base >= 0 else (-1, 0)
        in_row = column + sum((n - 1) * s for s, n in zip(strides[1:], sizes[1:]))
        last_row = first_row + (sizes[0] - 1 if sizes else 0)
        if first_row < 0 or min(strides, default=0) < 0 or last_row >= partitions or in_row >= free:
            return OutOfBoundsView(self, new, sizes, f"access pattern {pattern} at element {base} leaves the "
                                   f"[{partitions}, {free}] tile")
        physical = [rows.stride(0)] + strides[1:] if strides else []
        view = rows.as_strided(sizes, physical, rows.storage_offset() + first_row * rows.stride(0) + column)
        return NkiTensor(view, new, self.buffer, self.alloc, self.name)

    def _check_real_storage(self, new):
        """Reinterpreting bytes (ap(dtype=) another dtype) needs storage laid out like the device: the dtype's
        own element size (uint32 tiles live in int64, uint32 kernel arguments in torch.uint32). Same-dtype
        patterns count elements, which any storage does."""
        if new is self.dtype:
            return
        storage = self.alloc.storage
        real = storage.dtype is self.dtype.storage and storage.dtype.itemsize == self.dtype.itemsize or \
            storage.dtype is _RAW_UINT32 and self.dtype.name == "uint32"
        if not real or _raw_storage(new).itemsize != new.itemsize:
            raise NkiError(f"NkiTensor.ap on a {self.dtype!r} tensor needs real-dtype storage "
                           f"(unset {dtypes.FP32_STORAGE_ENV}; on-chip uint32 has none)")

    def _flat_storage(self, new):
        """(storage as 1-D elements of dtype `new`, this view's first element in it, its Allocation)."""
        self._check_real_storage(new)
        storage = self.alloc.storage
        alloc = self.alloc
        if not storage.is_contiguous():
            data = self.data
            if self.buffer.on_chip or data.shape != storage.shape or data.stride() != storage.stride():
                raise NkiError("NkiTensor.ap needs a contiguous allocation (or a whole strided kernel argument)")
            # A strided kernel argument: HBM is row-major on the device, so address a row-major copy (read-only).
            storage = storage.contiguous()
            alloc = Allocation(storage, readonly=True)
        flat = storage.reshape(-1)
        first = self.data.storage_offset() - storage.storage_offset() if alloc is self.alloc else 0
        if new is not self.dtype:
            try:
                flat = flat.view(_raw_storage(new))
            except RuntimeError as error:
                raise NkiError(f"NkiTensor.ap(dtype={new!r}) of a {self.dtype!r} tensor: {error}") from None
            first_bytes = first * self.dtype.itemsize
            if first_bytes % new.itemsize:
                raise NkiError(f"NkiTensor.ap(dtype={new!r}): the view starts {first_bytes} B in, "
                               f"not a multiple of {new.itemsize} B")
            first = first_bytes // new.itemsize
        return flat, first, alloc

    def start_partition(self) -> int:
        """First partition an on-chip view touches."""
        data = self.data
        offset = data.storage_offset()
        if offset == 0:
            return 0
        storage = self.alloc.storage  # address= tiles: a view of the buffer whose dim 0 steps one partition
        partition_bytes = storage.stride(0) * storage.element_size() if storage.dim() else 1
        return offset * data.element_size() // partition_bytes


class OutOfBoundsView(NkiTensor):
    """An access pattern outside its tensor. Building one is allowed (kernels build patterns they then
    skip with a bounds test, as the compiler allows); any instruction that reads or writes it raises."""

    __slots__ = ("sizes", "problem")

    def __init__(self, owner, dtype, sizes, problem):
        self.dtype = dtype
        self.buffer = owner.buffer
        self.alloc = owner.alloc
        self.name = owner.name
        self.sizes = tuple(sizes)
        self.problem = problem

    @property
    def data(self):
        raise NkiIndexError(self.problem)

    @property
    def shape(self) -> tuple:
        return self.sizes

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def __repr__(self):
        return f"OutOfBoundsView({list(self.sizes)}, {self.dtype!r}: {self.problem})"


def _rows(storage):
    """A [P, F] view of a tile whose free dims are contiguous within each partition (an address= tile)."""
    flat_free = storage.numel() // storage.shape[0]
    try:
        return storage.view(storage.shape[0], flat_free)
    except RuntimeError:
        raise NkiError("NkiTensor.ap needs the tile's free dims contiguous within each partition") from None


def _resolve_reshape(shape, numel):
    shape = [operator.index(s) for s in shape]
    if shape.count(-1) == 1:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


def _normalize_index(key, shape, on_chip: bool) -> tuple:
    """Torch index for `key` after NKI's checks (bounds, steps, partition-dim rules)."""
    if type(key) is not tuple:
        key = (key,)
    if len(key) <= len(shape):  # the hot case, slices the templates emit: in-range int bounds, no step
        for k, size in zip(key, shape):
            if type(k) is not slice or k.step is not None:
                break
            start, stop = k.start, k.stop
            if type(start) is not int or type(stop) is not int or not 0 <= start < stop <= size:
                break
        else:
            return key
    return _checked_index(key, shape, on_chip)


def _checked_index(key: tuple, shape, on_chip: bool) -> tuple:
    """_normalize_index for any key: Ellipsis, None bounds, negative and integer indices, nl.ds."""
    ndim = len(shape)
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = key[:at] + (slice(None),) * (ndim - len(key) + 1) + key[at + 1:]
    if len(key) > ndim:
        raise NkiIndexError(f"too many indices ({len(key)}) for a tensor of shape {list(shape)}")
    index = []
    for dim, k in enumerate(key):
        size = shape[dim]
        if type(k) is slice:
            start, stop, step = k.start, k.stop, k.step
            if step is None and type(start) is int and type(stop) is int and 0 <= start < stop <= size:
                index.append(k)  # the common case, already in range: use as is
                continue
            step = 1 if step is None else operator.index(step)
            start = 0 if start is None else operator.index(start)
            stop = size if stop is None else operator.index(stop)
            if start < 0:
                start += size
            if stop < 0:
                stop += size
            if step <= 0:
                raise NkiIndexError(f"slice step {step} on dim {dim}: steps must be positive")
            if step != 1 and on_chip and dim == 0:
                raise NkiIndexError(f"partition-dim slice with step {step}: partitions are contiguous lanes")
            if not 0 <= start < stop <= size:
                raise NkiIndexError(f"slice {start}:{stop} out of range for dim {dim} of size {size}")
            index.append(slice(start, stop, step))
        elif type(k) is DynSlice:
            start, stop = k.start, k.start + k.size
            if not 0 <= start < stop <= size:
                raise NkiIndexError(f"nl.ds({k.start}, {k.size}) out of range for dim {dim} of size {size}")
            index.append(slice(start, stop))
        else:
            try:
                i = operator.index(k)
            except TypeError:
                raise NkiIndexError(f"unsupported index {k!r} on dim {dim}") from None
            if i < 0:
                i += size
            if not 0 <= i < size:
                raise NkiIndexError(f"index {k} out of range for dim {dim} of size {size}")
            index.append(slice(i, i + 1) if on_chip and dim == 0 else i)
    if on_chip and ndim >= 2:
        _keep_two_dims(index, ndim)
    return tuple(index)


def _keep_two_dims(index: list, ndim: int) -> None:
    """An on-chip view is always at least 2-D (NkiTensor.__getitem__ docs): when integer indices would
    leave only the partition dim, the last one selects a size-1 slice instead (`t[:, k]` is [P, 1])."""
    kept = ndim - len(index) + sum(type(k) is slice for k in index)
    if kept >= 2:
        return
    last = max(dim for dim, k in enumerate(index) if type(k) is not slice)
    index[last] = slice(index[last], index[last] + 1)


def allocate(shape, dtype: dtypes.NkiDtype, buffer: Buffer, name: str, pool) -> NkiTensor:
    """A fresh tensor filled like the real simulator's (NaN floats, 4 integers); on-chip if `pool`."""
    storage_dtype = dtypes.storage_for(dtype, buffer.on_chip)
    fill = dtypes.fill_value(dtype)
    if pool is None:
        storage = torch.full(shape, fill, dtype=storage_dtype)
        return NkiTensor(storage, dtype, buffer, Allocation(storage), name)
    nbytes = pool.size_of(math.prod(shape[1:]) * dtype.itemsize)
    storage = _fresh_storage(shape, storage_dtype, fill)
    return NkiTensor(storage, dtype, buffer, Allocation(storage, pool, nbytes), name)


def place(t: NkiTensor) -> None:
    """The first write of on-chip tile `t`: its pool's bytes are taken now (or NkiCapacityError), and
    from here on liveness.reclaim may free it. Writers call this when `t.alloc.placed` is False."""
    alloc = t.alloc
    pool = alloc.pool
    shape = tuple(alloc.storage.shape)
    pool.reserve(alloc, alloc.nbytes, shape[0] if shape else 1, t.name, shape, t.dtype)
    alloc.placed = True


_RAW_UINT32 = torch.uint32


def _raw_storage(dtype) -> torch.dtype:
    """The torch dtype holding `dtype`'s bytes as the device does (uint32's compute storage is int64)."""
    return _RAW_UINT32 if dtype.name == "uint32" else dtype.storage


def wrap_hbm(value: torch.Tensor, name: str = "") -> NkiTensor:
    """A kernel argument: the caller's tensor itself, tagged as shared HBM."""
    return NkiTensor(value, dtypes.of_torch(value.dtype), shared_hbm, Allocation(value), name)


def written_mask(t: NkiTensor) -> torch.Tensor:
    data = t.data
    return t.alloc.mask.as_strided(data.size(), data.stride(), data.storage_offset() - t.alloc.storage.storage_offset())


def mark_written(t: NkiTensor) -> None:
    alloc = t.alloc
    if alloc.written == WRITTEN:
        return
    if t.data.numel() == alloc.storage.numel() or alloc.storage.is_meta:  # (meta: no values to track)
        alloc.written, alloc.mask = WRITTEN, None
        return
    if alloc.mask is None:  # laid out like the storage (address= tiles are strided views of the buffer)
        storage = alloc.storage
        extent = 1 + sum((n - 1) * st for n, st in zip(storage.shape, storage.stride()))
        alloc.mask = torch.zeros(extent, dtype=torch.bool).as_strided(storage.shape, storage.stride())
    written_mask(t).fill_(True)
    alloc.written = PARTLY_WRITTEN


def written_state(t: NkiTensor):
    """(UNWRITTEN | PARTLY_WRITTEN | WRITTEN, mask of the view or None) for a PSUM view."""
    state = t.alloc.written
    if state != PARTLY_WRITTEN:
        return state, None
    mask = written_mask(t)
    if bool(mask.all()):
        return WRITTEN, None
    if not bool(mask.any()):
        return UNWRITTEN, None
    return PARTLY_WRITTEN, mask
