"""Fills a replay can skip: the NaN fill of a fresh tile or output whose every element is overwritten
before anything reads it.

The interpreter fills each new tile (and each shared_hbm output) as the real simulator does, so a
kernel reading memory it never wrote sees NaN. Most kernels then write the tile piece by piece
(a matmul's N columns of a PSUM bank, one DMA per row block), which storage-level liveness
(op_replay._mark_live) cannot tell from a read of the fill. Here each element is followed: a fill
is dropped (an output's `full` becomes `empty`; a kept tile's `full` is no longer copied back in on
each call) when, in the kept operations after it, every element it set is overwritten before any
operation reads it, and its storage is not the caller's. Nothing reads a dropped fill's values (nor
what an earlier call left in a kept tile), so no bit changes.
"""

from __future__ import annotations

import bisect
from itertools import islice

import torch

from .copy_batching import each_element_once
from .op_replay_refs import arguments, ref_names, written_positions

_FILLS = {"aten::fill_", "aten::zero_"}
_OVERWRITES = {"aten::copy_", "aten::fill_", "aten::zero_"}
_FULL = torch.ops.aten.full.default
MAX_ELEMENTS = 1 << 24  # a storage larger than this is not followed (its fill is kept)
# Mask elements one fill's follow may combine before its fill is kept (a bound on planning time;
# keeping a fill is always correct).
MAX_FOLLOW_ELEMENTS = 1 << 26


def skippable(live: list, layouts: dict, caller_keys: set) -> set:
    """Indices into `live` of the fills (and the `full`s of outputs and kept tiles) whose values nothing reads."""
    touching: dict = {}  # storage key -> indices of the operations reading, writing or making it
    for index, op in enumerate(live):
        if not op.view:
            for key in {*op.in_keys, *op.writes, *op.out_keys}:
                touching.setdefault(key, []).append(index)
    found = set()
    for index, op in enumerate(live):
        name = _filled(op)
        if name is None:
            continue
        key = op.out_keys[0] if op.func is _FULL else op.in_keys[0]
        if key in caller_keys and op.func is not _FULL:
            continue
        root = name if op.func is _FULL else layouts[name][0]
        indices = touching[key]
        later = (live[i] for i in islice(indices, bisect.bisect_right(indices, index), None))
        if _overwritten_before_read(later, _Storage(layouts, root), key, name, key not in caller_keys):
            found.add(index)
    return found


def _filled(op):
    """The name of the tensor `op` fills, or None."""
    if op.func is _FULL and len(op.new_slots) == 1:
        return op.new_slots[0]
    if op.func._schema.name in _FILLS and op.reads:
        return op.reads[0]
    return None


class _Storage:
    """A root's storage as one bool per element (set: still holds the fill's value); each name's
    elements are a strided view of it, so work on a name costs its elements, not its span."""

    def __init__(self, layouts: dict, root: str) -> None:
        self.layouts, self.root = layouts, root
        base = layouts.get(root)
        size = None if base is None else _extent(base[1], base[2], base[3])
        self.pending = None if size is None or size > MAX_ELEMENTS else torch.zeros(size, dtype=torch.bool)

    def elements(self, name: str):
        """`name`'s elements in the storage, or None when its layout is unknown here (another root or
        dtype) or reaches past the storage."""
        layout, base = self.layouts.get(name), self.layouts.get(self.root)
        if layout is None or base is None or layout[0] != self.root or layout[4] != base[4]:
            return None
        sizes, strides, offset = layout[1], layout[2], layout[3]
        end = _extent(sizes, strides, offset)
        if end is None or end > self.pending.numel() or any(st < 0 for st in strides):
            return None
        return self.pending.as_strided(sizes, strides, offset)


def _extent(sizes, strides, offset):
    if any(s == 0 for s in sizes):
        return None
    return offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides))


def _overwritten_before_read(later, storage: _Storage, key: int, filled: str, private: bool) -> bool:
    """Whether the operations `later` overwrite every element of the `filled` name (of the storage
    `key`) before reading one (a `private` storage's elements may also stay unread to the end); a
    read through a layout not known here, or reaching past the storage, counts as reading them all.
    An in-place operation that is no overwrite (`addmm_`) reads what it writes, so its written elements
    were checked as read and stay as they were; an out= argument is written whole, never read."""
    if storage.pending is None:
        return False
    elements = storage.elements(filled)
    if elements is None:
        return False
    elements.fill_(True)
    remaining = int(storage.pending.count_nonzero())  # count_nonzero: several times faster than sum / any
    budget = MAX_FOLLOW_ELEMENTS
    for op in later:
        if key in op.out_keys and key not in op.in_keys:  # freed and made anew: the fill's values are gone
            return True
        overwrite = op.func._schema.name in _OVERWRITES
        outs = _out_names(op)
        for position, (name, read_key) in enumerate(zip(op.reads, op.in_keys)):
            if read_key != key or (overwrite and position == 0) or name in outs:
                continue
            read = storage.elements(name)
            if read is None or int(read.count_nonzero()):
                return False
            budget -= read.numel()
        if key in op.writes:
            targets = [op.reads[0]] if overwrite else [n for n, k in zip(op.reads, op.in_keys) if k == key and n in outs]
            for target in targets:
                written = storage.elements(target)
                if written is None:
                    return False
                if each_element_once(tuple(written.shape), written.stride()):
                    remaining -= int(written.count_nonzero())
                    written.fill_(False)
                else:  # (a fill through a view with repeated elements: counted on the storage)
                    written.fill_(False)
                    remaining = int(storage.pending.count_nonzero())
                budget -= written.numel()
            if remaining == 0:
                return True
        if budget < 0:
            return False  # too costly to follow: the fill is kept
    return private


def _out_names(op) -> set:
    """The names `op` writes through out= arguments (keyword-only, written) and reads nowhere else."""
    positions = written_positions(op)
    if not positions:
        return set()
    outs, inputs = set(), set()
    for position, value in arguments(op):
        (outs if isinstance(position, str) and position in positions else inputs).update(ref_names(value))
    return outs - inputs
