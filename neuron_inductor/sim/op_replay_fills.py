"""Fills a replay can skip: the NaN fill of a fresh tile or output whose every element is overwritten
before anything reads it.

The interpreter fills each new tile (and each shared_hbm output) as the real simulator does, so a
kernel reading memory it never wrote sees NaN. Most kernels then write the tile piece by piece
(a matmul's N columns of a PSUM bank, one DMA per row block), which storage-level liveness
(op_replay._mark_live) cannot tell from a read of the fill. Here each element is followed: a fill
is dropped (an output's `full` becomes `empty`) when, in the kept operations after it, every
element it set is overwritten before any operation reads it, and its storage is not the caller's.
Nothing reads a dropped fill's values, so no bit changes.
"""

from __future__ import annotations

import bisect
from itertools import islice

import torch

_FILLS = {"aten::fill_", "aten::zero_"}
_OVERWRITES = {"aten::copy_", "aten::fill_", "aten::zero_"}
_FULL = torch.ops.aten.full.default
MAX_ELEMENTS = 1 << 24  # a storage larger than this is not followed (its fill is kept)
# Mask elements one fill's follow may combine before its fill is kept (a bound on planning time;
# keeping a fill is always correct).
MAX_FOLLOW_ELEMENTS = 1 << 26


def skippable(live: list, layouts: dict, caller_keys: set, persistent: dict) -> set:
    """Indices into `live` of the fills (and outputs' `full`) whose values nothing reads."""
    touching: dict = {}  # storage key -> indices of the operations reading, writing or making it
    for index, op in enumerate(live):
        if not op.view:
            for key in {*op.in_keys, *op.writes, *op.out_keys}:
                touching.setdefault(key, []).append(index)
    found, regions = set(), _Regions(layouts)
    for index, op in enumerate(live):
        name = _filled(op)
        if name is None or (op.func is _FULL and name in persistent):
            continue
        key = op.out_keys[0] if op.func is _FULL else op.in_keys[0]
        if key in caller_keys and op.func is not _FULL:
            continue
        root = name if op.func is _FULL else layouts[name][0]
        region, size = regions.get(name, root), regions.storage_size(root)
        indices = touching[key]
        later = (live[i] for i in islice(indices, bisect.bisect_right(indices, index), None))
        if region is not None and size is not None and _overwritten_before_read(
                later, regions, key, root, region, size, key not in caller_keys):
            found.add(index)
    return found


def _filled(op):
    """The name of the tensor `op` fills, or None."""
    if op.func is _FULL and len(op.new_slots) == 1:
        return op.new_slots[0]
    if op.func._schema.name in _FILLS and op.reads:
        return op.reads[0]
    return None


class _Regions:
    """Regions of names in their roots' storages, each made once: (start, bool mask of the elements
    from start on that the name addresses), so that work on a region costs its span, not its storage."""

    def __init__(self, layouts: dict) -> None:
        self.layouts, self.made = layouts, {}

    def get(self, name: str, root: str):
        """The region, or None when unknown."""
        key = (name, root)
        if key not in self.made:
            self.made[key] = _region(self.layouts, name, root)
        return self.made[key]

    def storage_size(self, root: str) -> int | None:
        base = self.layouts.get(root)
        size = None if base is None else _extent(base[1], base[2], base[3])
        return None if size is None or size > MAX_ELEMENTS else size


def _region(layouts: dict, name: str, root: str):
    layout, base = layouts.get(name), layouts.get(root)
    if layout is None or base is None or layout[0] != root or layout[4] != base[4]:
        return None
    sizes, strides, offset = layout[1], layout[2], layout[3]
    span = _extent(sizes, strides, 0)
    if span is None or span > MAX_ELEMENTS or any(st < 0 for st in strides):
        return None
    mask = torch.zeros(span, dtype=torch.bool)
    mask.as_strided(sizes, strides, 0).fill_(True)
    return offset, mask


def _extent(sizes, strides, offset):
    if any(s == 0 for s in sizes):
        return None
    return offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides))


def _overwritten_before_read(later, regions: _Regions, key: int, root: str, filled: tuple, size: int,
                             private: bool) -> bool:
    """Whether the operations `later` overwrite every element of the `filled` region (of root's
    storage, `key`, `size` elements) before reading one (a `private` storage's elements may also stay
    unread to the end); a read through a layout not known here, or reaching past the storage,
    counts as reading them all."""
    start, mask = filled
    if start + mask.numel() > size:
        return False
    pending = torch.zeros(size, dtype=torch.bool)
    pending[start:start + mask.numel()] = mask
    remaining = int(mask.count_nonzero())  # count_nonzero: several times faster than sum / any on bools
    budget = MAX_FOLLOW_ELEMENTS
    for op in later:
        if key in op.out_keys and key not in op.in_keys:  # freed and made anew: the fill's values are gone
            return True
        overwrite = op.func._schema.name in _OVERWRITES
        for position, (name, read_key) in enumerate(zip(op.reads, op.in_keys)):
            if read_key != key or (overwrite and position == 0):
                continue
            window = _window(pending, regions.get(name, root))
            if window is None or int((window[0] & window[1]).count_nonzero()):
                return False
            budget -= window[1].numel()
        if key in op.writes:
            if not overwrite:
                return False  # written by an operation that may read what it writes (out=, in place)
            window = _window(pending, regions.get(op.reads[0], root))
            if window is None:
                return False
            hit = window[0] & window[1]
            remaining -= int(hit.count_nonzero())
            window[0][hit] = False
            if remaining == 0:
                return True
            budget -= window[1].numel()
        if budget < 0:
            return False  # too costly to follow: the fill is kept
    return private


def _window(pending: torch.Tensor, region):
    """(the slice of `pending` a region spans, the region's mask), or None when the region is
    unknown or reaches past the storage."""
    if region is None:
        return None
    start, mask = region
    if start + mask.numel() > pending.numel():
        return None
    return pending[start:start + mask.numel()], mask
