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
own byte array and do not count here.
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

    def reserve(self, allocation, nbytes: int, partitions: int, name: str, shape: tuple, dtype) -> int:
        """Place `allocation` (`nbytes` per partition, already rounded by size_of, on `partitions`
        partitions) for the tile `name` [shape] dtype; -> its start partition, or NkiCapacityError."""
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
        return span.start * QUADRANT

    def candidates(self, partitions: int) -> list:
        """The quadrant ranges a tile of `partitions` partitions may occupy, by start partition."""
        count = max(1, -(-partitions // QUADRANT))
        return [range(start // QUADRANT, start // QUADRANT + count)
                for start in rules.legal_start_partitions(partitions)]

    def _first_fit(self, nbytes: int, partitions: int):
        best, best_top = None, None
        for span in self.candidates(partitions):
            top = max(self.quadrants[q] for q in span)
            if top + nbytes <= self.capacity and (best is None or top < best_top):
                best, best_top = span, top
        return best

    def release(self, nbytes: int, allocation) -> None:
        span = self.spans.pop(id(allocation), ())
        for q in span:
            self.quadrants[q] -= nbytes
        self.allocations.pop(id(allocation), None)
