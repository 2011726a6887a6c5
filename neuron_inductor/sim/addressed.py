"""Explicit-address allocation: `nl.ndarray(..., address=(partition_offset, free_offset))`.

Kernels that manage SBUF / PSUM themselves place tiles at fixed byte offsets and reuse them:
two tensors given the same address are the same bytes (a PSUM bank reused by the next tile
group, an SBUF scratch area shared by phases). The interpreter models that literally: each
program has one byte array per on-chip buffer ([128 partitions, capacity] uint8, filled with
0xFF, which reads as NaN in every float type), and an addressed tile is a typed view into it.
Addressed tiles therefore never count against the automatic allocator's capacity (reuse is
not overflow), and their range must lie inside the buffer. Each addressed tile keeps its own
PSUM written-state (a new tensor at a reused address starts unwritten, as the compiler's
accumulate analysis sees it).
"""

from __future__ import annotations

import operator

import torch

from . import context, dtypes, rules
from . import tensor as tensors
from .errors import NkiError

_FRESH_BYTE = 0xFF


def allocate(shape, dtype, buffer, name, address):
    api = "nl.ndarray"
    try:
        partition, offset = (operator.index(a) for a in address)
    except (TypeError, ValueError):
        raise NkiError(f"{api}: address={address!r} must be (partition_offset, free_offset_bytes)") from None
    if dtypes.storage_for(dtype, True) is not dtype.storage or dtype.storage.itemsize != dtype.itemsize:
        raise NkiError(f"{api}: address= needs real-dtype storage for {dtype.name} "
                       f"(unset {dtypes.FP32_STORAGE_ENV}; uint32 has none)")
    program = context.current()
    capacity = program.target.sbuf_usable_bytes if buffer is tensors.sbuf else program.target.psum_bytes
    partitions = shape[0] if shape else 1
    free = 1
    for s in shape[1:]:
        free *= s
    nbytes = free * dtype.itemsize
    if partition < 0 or partition + partitions > rules.PMAX:
        rules.fail(api, f"addressed tile inside partitions [0, {rules.PMAX})", partition,
                   f"{name or 'tile'} {list(shape)} at partition {partition} leaves the {rules.PMAX} partitions")
    if offset < 0 or offset + nbytes > capacity or offset % dtype.itemsize:
        rules.fail(api, f"addressed tile inside the {capacity} B of {buffer.name} per partition, aligned to its dtype",
                   offset, f"{name or 'tile'} {list(shape)} {dtype.name} at byte {offset} ({nbytes} B/partition)")
    space = program.address_spaces.get(buffer.name)
    if space is None:
        space = program.address_spaces[buffer.name] = torch.full((rules.PMAX, capacity), _FRESH_BYTE, dtype=torch.uint8)
    rows = space[partition:partition + partitions, offset:offset + nbytes].view(dtype.storage)
    # as_strided, not view(shape): a view gives a one-partition tile a dim-0 stride of its row length, and the
    # start partition (rules.start_partition) is measured in steps of dim 0
    inner = [1]
    for s in reversed(shape[2:]):
        inner.insert(0, inner[0] * s)
    view = rows.as_strided(shape, (rows.stride(0),) + tuple(inner[:len(shape) - 1]), rows.storage_offset()) \
        if len(shape) > 1 else rows.reshape(shape)
    return tensors.NkiTensor(view, dtype, buffer, tensors.Allocation(view), name)
