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

import torch

_FILLS = {"aten::fill_", "aten::zero_"}
_OVERWRITES = {"aten::copy_", "aten::fill_", "aten::zero_"}
_FULL = torch.ops.aten.full.default
MAX_ELEMENTS = 1 << 24  # a storage larger than this is not followed (its fill is kept)


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
        region = regions.get(name, root)
        later = [live[i] for i in touching[key] if i > index]
        if region is not None and _overwritten_before_read(later, regions, key, root, region, key not in caller_keys):
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
    """Regions of names in their roots' storages, each made once."""

    def __init__(self, layouts: dict) -> None:
        self.layouts, self.made = layouts, {}

    def get(self, name: str, root: str, size: int | None = None):
        """The region (a bool mask), padded to `size` elements if given, or None when unknown."""
        key = (name, root, size)
        if key not in self.made:
            region = _region(self.layouts, name, root)
            if size is not None and region is not None:
                region = None if region.numel() > size else torch.cat([region, region.new_zeros(size - region.numel())])
            self.made[key] = region
        return self.made[key]


def _region(layouts: dict, name: str, root: str):
    """The elements of root's storage that `name` addresses, as a bool mask, or None when unknown."""
    layout, base = layouts.get(name), layouts.get(root)
    if layout is None or base is None or layout[0] != root or layout[4] != base[4]:
        return None
    size = _extent(base[1], base[2], base[3])
    if size is None or size > MAX_ELEMENTS:
        return None
    mask = torch.zeros(size, dtype=torch.bool)
    mask.as_strided(layout[1], layout[2], layout[3]).fill_(True)
    return mask


def _extent(sizes, strides, offset):
    if any(s == 0 for s in sizes):
        return None
    return offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides))


def _overwritten_before_read(later: list, regions: _Regions, key: int, root: str, pending: torch.Tensor,
                             private: bool) -> bool:
    """Whether the operations `later` overwrite every element of `pending` (of root's storage, `key`)
    before reading one (a `private` storage's elements may also stay unread to the end); a read
    through a layout not known here counts as reading them all."""
    pending = pending.clone()
    size = pending.numel()
    for op in later:
        if key in op.out_keys and key not in op.in_keys:  # freed and made anew: the fill's values are gone
            return True
        overwrite = op.func._schema.name in _OVERWRITES
        for position, (name, read_key) in enumerate(zip(op.reads, op.in_keys)):
            if read_key != key or (overwrite and position == 0):
                continue
            region = regions.get(name, root, size)
            if region is None or bool((region & pending).any()):
                return False
        if key in op.writes:
            if not overwrite:
                return False  # written by an operation that may read what it writes (out=, in place)
            region = regions.get(op.reads[0], root, size)
            if region is None:
                return False
            pending &= ~region
            if not bool(pending.any()):
                return True
    return private
