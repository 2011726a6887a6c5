"""Repeated casts of an unchanged tile in a replay reuse the first one.

The interpreter's matmul converts its bf16 operands to fp32 on every instruction, and a tile loop
multiplies one stationary or moving tile by many others: at d=1024 a matmul kernel converts the
same tile up to 8 times (453 casts of 139 regions). A cast is a function of its input's values, so
a second cast of the same view of a kept tile, with nothing written to that tile in between, gives
the first one's bits: its readers read the first result instead.

Not reused: a cast whose result (or its first one's) is written anywhere, itself or through a view
(that would change both), or is returned to the caller; a write to a tile forgets the casts of the
bytes it may reach (a write through a view that is no kept tile: all of the tile's casts).

The casts left of tiles whose rows are a page apart or more are moved up to just after the last
write that may reach what they read (`hoisted`): a matmul panel's [128, 128] stationary tiles are
rows of 256 B 16 KiB apart, each in a page of its own, and in matmul order the panel's DMA was long
ago (3x slower than right after it, when the bytes are still in cache). Nothing between the two
places writes those bytes, so the cast reads the same. (Moving the attention kernels' casts, rows
2 KiB apart, made those kernels 16-19% slower.)
"""

from __future__ import annotations

import torch

from .op_replay_refs import Ref, renamed, written_names

_TO_COPY = torch.ops.aten._to_copy.default


def reused(calls: list, namespace: dict, result_names: set) -> list:
    """`calls` less the casts that repeat an earlier one of an unchanged kept tile."""
    unsafe = set(result_names)  # names written somewhere, themselves or through a view of them
    base_of: dict = {}
    for call in calls:
        base = _view_base(call)
        for name in call.new if base is not None else ():
            base_of[name] = base
        for name in written_names(call):
            while name is not None and name not in unsafe:
                unsafe.add(name)
                name = base_of.get(name)
    storage_of: dict = {}  # name -> the storage a write through it changes
    cache: dict = {}       # (cast input storage, layout, arguments) -> the first cast's output name
    rename: dict = {}
    out = []
    for call in calls:
        call = _renamed(call, rename)
        key = _cast_key(call, namespace)
        if key is not None and call.new[0] not in unsafe:
            first = cache.get(key)
            if first is not None:
                rename[call.new[0]] = first
                continue
            cache[key] = call.new[0]
        for name in written_names(call):
            changed, lo, hi = _region(name, namespace, storage_of)
            for k in [k for k in cache if k[0] == changed and k[1] < hi and lo < k[2]]:
                del cache[k]
        _note_view(call, namespace, storage_of)
        out.append(call)
    return out


HOIST_SCAN = 64  # earlier writes to the cast's storage looked at for the one it must follow
HOIST_ROW_BYTES = 4096  # only casts whose rows are a page apart or more are moved (each row a miss of its own);
# closer rows (an attention tile's 2 KiB) convert as fast in place, and moved up their results stay live longer


def hoisted(calls: list, namespace: dict) -> list:
    """`calls` with each cast of a kept tile whose rows are HOIST_ROW_BYTES apart or more moved up to
    just after the last call that may write the bytes it reads (kept in place when that write is not
    among the storage's last HOIST_SCAN)."""
    storage_of: dict = {}
    writes: dict = {}  # storage -> [(call index, first byte, end byte)] in order
    after: dict = {}   # call index -> the casts moved to just after it
    moved = set()
    for index, call in enumerate(calls):
        if _cast_key(call, namespace) is not None:
            source = namespace[call.args[0].name]
            storage, lo, hi = byte_extent(source)
            rows = _row_band(source)
            earlier = writes.get(storage, ()) if rows is not None and rows[0] >= HOIST_ROW_BYTES else ()
            writer = next((i for i, w_lo, w_hi, w_rows in reversed(earlier[-HOIST_SCAN:])
                           if w_lo < hi and lo < w_hi and not _apart(rows, w_rows)), None)
            if writer is not None and writer < index - 1:
                after.setdefault(writer, []).append(call)
                moved.add(index)
        for name in written_names(call):
            region = _region(name, namespace, storage_of)
            target = namespace.get(name) if name not in storage_of else None
            rows = _row_band(target) if isinstance(target, torch.Tensor) and name[0] == "p" else None
            writes.setdefault(region[0], []).append((index,) + region[1:] + (rows,))
        _note_view(call, namespace, storage_of)
    out = []
    for index, call in enumerate(calls):
        if index not in moved:
            out.append(call)
        out.extend(after.get(index, ()))
    return out


def _row_band(t: torch.Tensor):
    """(row bytes, first byte, end byte within a row) of a view whose outermost step is a row that
    holds its other dims whole (a tile's [partitions, free] slice), else None."""
    dims = [(n, st) for n, st in zip(t.shape, t.stride()) if n > 1]
    if not dims:
        return None
    row = max(st for _, st in dims)
    span = sum((n - 1) * st for n, st in dims if st != row) + 1
    if sum(st == row for _, st in dims) != 1 or any(st <= 0 for _, st in dims):
        return None
    start = t.storage_offset() % row
    if start + span > row:
        return None
    size = t.element_size()
    return row * size, start * size, (start + span) * size


def _apart(a, b) -> bool:
    """Whether two views of one storage with these row bands (or None) address no byte in common."""
    return a is not None and b is not None and a[0] == b[0] and (a[2] <= b[1] or b[2] <= a[1])


def _cast_key(call, namespace: dict):
    """What a cast repeating this one has the same of (None: not a cast of a kept tile)."""
    if call.func is not _TO_COPY or len(call.args) != 1 or len(call.new) != 1 or call.guard is not None:
        return None
    source = call.args[0]
    if not (isinstance(source, Ref) and source.name[0] == "p" and source.name in namespace):
        return None
    options = []
    for name, value in sorted(call.kwargs.items()):
        if isinstance(value, Ref):
            value = namespace.get(value.name)
            if value is None or isinstance(value, torch.Tensor):
                return None
        options.append((name, value))
    t = namespace[source.name]
    return byte_extent(t) + (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, tuple(options))


def byte_extent(t: torch.Tensor) -> tuple:
    """(storage, first byte, end byte) of what `t` addresses."""
    size = t.element_size()
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
    return t.untyped_storage().data_ptr(), t.storage_offset() * size, (t.storage_offset() + span + 1) * size


def _view_base(call) -> str | None:
    """The name of the tensor a view line views, or None (no view)."""
    if call.func.is_view and call.new and call.args and isinstance(call.args[0], Ref):
        return call.args[0].name
    return None


def _note_view(call, namespace: dict, storage_of: dict) -> None:
    """Record in `storage_of` the storage a write through each view `call` makes may change: all of
    its base's."""
    base = _view_base(call)
    for name in call.new if base is not None else ():
        storage_of[name] = _region(base, namespace, storage_of)[0]


def _region(name: str, namespace: dict, storage_of: dict) -> tuple:
    """(storage, first byte, end byte) a write through `name` may change."""
    if name in storage_of:
        return storage_of[name], float("-inf"), float("inf")
    t = namespace.get(name)
    if isinstance(t, torch.Tensor) and name[0] == "p":
        return byte_extent(t)
    return name, float("-inf"), float("inf")


def _renamed(call, rename: dict):
    if not rename:
        return call
    return type(call)(call.func, renamed(call.args, rename), renamed(call.kwargs, rename), call.outs, call.new,
                      call.guard)
