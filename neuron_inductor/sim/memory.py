"""Live SBUF / PSUM bytes per partition, checked against the target's capacity.

The real simulator does not check capacity; this one does. Each on-chip `nl.ndarray`
reserves `prod(shape[1:]) * itemsize` bytes on every partition (the allocator hands out
an address range that spans all partitions, whatever the tile's partition count) at its
first write (tensor.place: "an address at its first write", nki.compiler.Allocation) and
gives them back when the last view of the tile is garbage-collected, or, when a new tile
would not fit, at the last use of tiles no live variable reaches any more (liveness.py: the
compiler frees a tile after its last read). A kernel that keeps every loop iteration's tile
alive (say, in a list it reads later) therefore really does use more SBUF.
PSUM tiles take whole 2 KiB banks (so at most 8 live one-bank tiles): the bank is the unit
matmul accumulates into, and the PSUM bank rule assumes tiles start on a bank boundary.
Not modelled: SBUF alignment padding (sbuf_min_align is undocumented), fragmentation,
`address=` placement, and tiles of fewer partitions sharing an address range side by side
(AWS's RoPE test counts B * n_heads * S <= 73728 as fitting, which needs that for d_head 64).
"""

from __future__ import annotations

import weakref

from . import rules


class MemoryPool:
    """Bytes per partition in use in one on-chip buffer of one NeuronCore (one program)."""

    __slots__ = ("buffer_name", "target_name", "capacity", "granule", "live", "allocations")

    def __init__(self, buffer_name: str, target_name: str, capacity: int, granule: int = 1):
        self.buffer_name = buffer_name
        self.target_name = target_name
        self.capacity = capacity
        self.granule = granule  # allocation unit in bytes per partition
        self.live = 0
        self.allocations = {}  # id -> weak reference of each live Allocation, for liveness.reclaim

    def size_of(self, nbytes: int) -> int:
        """Bytes per partition a tile of `nbytes` really takes."""
        return -(-nbytes // self.granule) * self.granule

    def reserve(self, nbytes: int, name: str, shape: tuple, dtype) -> None:
        """Take `nbytes` (already rounded by size_of) for the tile `name` [shape] dtype, or raise NkiCapacityError."""
        if self.live + nbytes > self.capacity:
            from . import liveness  # (it reads the running program's frames: only needed when full)
            liveness.reclaim(self)
            if self.live + nbytes > self.capacity:
                rules.capacity(self, nbytes, f"{name + ' ' if name else ''}{list(shape)} {dtype.name}")
        self.live += nbytes

    def track(self, allocation) -> None:
        self.allocations[id(allocation)] = weakref.ref(allocation)

    def release(self, nbytes: int, allocation) -> None:
        self.live -= nbytes
        self.allocations.pop(id(allocation), None)
