"""Live SBUF / PSUM bytes per partition quadrant, checked against the target's capacity.

The real simulator does not check capacity; this one does. Each on-chip `nl.ndarray` of P
partitions reserves `prod(shape[1:]) * itemsize` bytes per partition (PSUM: whole 2 KiB banks)
at its first write (tensor.place: the allocator "assigns an address to a tile at its first write
and releases the address after its last read", nki.compiler.Allocation), and gives them back when
the last view of the tile is garbage-collected, or, when a new tile would not fit, at the last use
of tiles no live variable reaches any more (liveness.py). A kernel that keeps every loop
iteration's tile alive (say, in a list it reads later) therefore really does use more SBUF.

Placement is two-dimensional, as the hardware's addresses are: an SBUF / PSUM address is a
(partition, byte) pair (`nl.ndarray(address=(partition_offset, free_offset))`; the direct
allocation APIs `nki.compiler.sbuf.mod_alloc` / `psum.mod_alloc` take a `base_partition` besides
the byte / bank address, "NKI Direct Allocation Developer Guide"). The compute engines access a
tile only from a start partition of 0 for more than 64 partitions, 0 / 64 for 33 to 64, and
0 / 32 / 64 / 96 for at most 32 (rules.legal_start_partitions, the nki.isa start-partition rule
spelled out at nc_stream_shuffle), so the automatic allocator can put tiles of at most 64
partitions side by side, and a tile occupies whole 32-partition quadrants: a tile of P partitions
started at s takes ceil(P / 32) quadrants from s / 32 (no other tile can start inside the rest of
its last quadrant). Each quadrant counts its live bytes per partition; a tile goes to the legal
start whose quadrants hold the fewest bytes (the lowest free address; ties: the lowest start), and
the buffer is full only when every legal start has some quadrant without room. A 128-partition
tile therefore still needs its bytes on all four quadrants, as before. AWS's RoPE test counts
B * n_heads * S <= 73728 as fitting for d_head 64, which needs its 64-partition tiles side by side.
PSUM tiles take whole 2 KiB banks (so at most 8 live one-bank tiles per quadrant): the bank is
the unit matmul accumulates into, and the PSUM bank rule assumes tiles start on a bank boundary.
Not modelled: SBUF alignment padding (sbuf_min_align is undocumented) and fragmentation within
a quadrant (bytes are counted, not placed at offsets); `address=` tiles (addressed.py) keep their
own byte array and do not count here, so automatic tiles may overlap them. AWS's kernels address
all of a buffer's tiles or none (mlp_tkg: `address=None if sbm.is_auto_alloc() else ...`), and the
legacy nki.compiler.sbuf.auto_alloc docs require "all SBUF tensors in a kernel" to be one or the other.
"""

from __future__ import annotations

import weakref

from . import rules

QUADRANT = 32  # partitions: the granule of the documented start partitions (0 / 32 / 64 / 96)
QUADRANTS = rules.PMAX // QUADRANT


class MemoryPool:
    """Bytes per partition in use in each partition quadrant of one on-chip buffer of one NeuronCore."""

    __slots__ = ("buffer_name", "target_name", "capacity", "granule", "quadrants", "allocations", "spans")

    def __init__(self, buffer_name: str, target_name: str, capacity: int, granule: int = 1):
        self.buffer_name = buffer_name
        self.target_name = target_name
        self.capacity = capacity
        self.granule = granule  # allocation unit in bytes per partition
        self.quadrants = [0] * QUADRANTS  # live bytes per partition of each 32-partition quadrant
        self.allocations = {}  # id -> weak reference of each live Allocation, for liveness.reclaim
        self.spans = {}  # id -> range of quadrants each live Allocation occupies

    @property
    def live(self) -> int:
        """Live bytes on the fullest partition."""
        return max(self.quadrants)

    def size_of(self, nbytes: int) -> int:
        """Bytes per partition a tile of `nbytes` really takes."""
        return -(-nbytes // self.granule) * self.granule

    def reserve(self, allocation, nbytes: int, partitions: int, name: str, shape: tuple, dtype) -> None:
        """Place `allocation` (`nbytes` per partition, already rounded by size_of, on `partitions`
        partitions) for the tile `name` [shape] dtype, or raise NkiCapacityError."""
        span = self._first_fit(nbytes, partitions)
        if span is None:
            from . import liveness  # (it reads the running program's frames: only needed when full)
            liveness.reclaim(self)
            span = self._first_fit(nbytes, partitions)
            if span is None:
                rules.capacity(self, nbytes, partitions, f"{name + ' ' if name else ''}{list(shape)} {dtype.name}")
        for q in span:
            self.quadrants[q] += nbytes
        self.spans[id(allocation)] = span
        self.allocations[id(allocation)] = weakref.ref(allocation)

    def held_at_starts(self, partitions: int) -> dict:
        """{start partition: bytes per partition already held on the quadrants a tile of `partitions`
        partitions would occupy from there} for each start the engines may access it from."""
        return {start: max(self.quadrants[q] for q in _span(start, partitions))
                for start in rules.legal_start_partitions(partitions)}

    def _first_fit(self, nbytes: int, partitions: int):
        held = self.held_at_starts(partitions)
        start = min(held, key=held.get)  # the lowest free address (dicts keep the starts in order: ties to the lowest)
        if held[start] + nbytes > self.capacity:
            return None
        return _span(start, partitions)

    def release(self, nbytes: int, allocation) -> None:
        span = self.spans.pop(id(allocation), ())
        for q in span:
            self.quadrants[q] -= nbytes
        self.allocations.pop(id(allocation), None)


def _span(start: int, partitions: int) -> range:
    """The quadrants a tile of `partitions` partitions started at partition `start` occupies."""
    first = start // QUADRANT
    return range(first, min(QUADRANTS, first + max(1, -(-partitions // QUADRANT))))
