"""Instruction traces.

    with neuron_inductor.sim.trace() as t:
        kernel(x)
    t.instructions            # [Instruction(engine="tensor", op="nc_matmul", flops=..., bytes=...), ...]
    t.estimate("trn2")        # cost-model estimate for one NeuronCore (see cost_model.py)
    t.launches                # index of the first instruction of each kernel launch

Traces nest: every instruction is appended to every active trace, so a backend can wrap
each kernel call in its own trace while a user's outer trace sees everything. With no
active trace, an instruction costs one list test; with traces active, one record costs
a few microseconds. Records hold operand shapes, dtypes, buffer names and allocation
identities (for the cost model's dependency chains), never tensors, so tracing does not
keep on-chip memory alive.
"""

from __future__ import annotations

from typing import NamedTuple

from . import context

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")

# The traces currently recording, innermost last. Tested by every instruction.
ACTIVE: list = []


class Operand(NamedTuple):
    role: str      # "dst", "src", "stationary", ...
    shape: tuple
    dtype: str     # NKI dtype name
    buffer: str    # "sbuf", "psum", "shared_hbm", "private_hbm"


class Instruction:
    """One executed ISA instruction."""

    __slots__ = ("engine", "op", "flops", "bytes", "free_size", "partitions", "operands", "kernel", "program_id",
                 "allocs", "dma_run_bytes")

    def __init__(self, engine, op, flops, nbytes, free_size, partitions, operands, kernel, program_id,
                 allocs=(), dma_run_bytes=0):
        self.engine = engine          # "tensor" | "vector" | "scalar" | "gpsimd" | "dma"
        self.op = op                  # ISA op name, e.g. "nc_matmul", "dma_copy", "load"
        self.flops = flops            # 2*K*M*N for matmuls, elements processed otherwise, 0 for DMA
        self.bytes = nbytes           # DMA: bytes transferred; compute: on-chip bytes read + written
        self.free_size = free_size    # elements per partition the engine streams (N for matmul)
        self.partitions = partitions
        self.operands = operands      # tuple of Operand, dst first
        self.kernel = kernel          # name of the jit kernel that issued it ("" outside kernels)
        self.program_id = program_id
        self.allocs = allocs          # per operand: an id of its allocation (dependencies within a launch)
        self.dma_run_bytes = dma_run_bytes  # DMA: contiguous bytes per descriptor (0: bytes per partition)

    @property
    def shapes(self) -> tuple:
        return tuple(o.shape for o in self.operands)

    @property
    def dtypes(self) -> tuple:
        return tuple(o.dtype for o in self.operands)

    @property
    def buffers(self) -> tuple:
        return tuple(o.buffer for o in self.operands)

    def __repr__(self):
        args = ", ".join(f"{o.role}={o.buffer}{list(o.shape)}:{o.dtype}" for o in self.operands)
        return f"<{self.engine}: {self.op}({args}) flops={self.flops} bytes={self.bytes}>"


def record(engine, op, flops, nbytes, free_size, partitions, operands):
    """Append one instruction to every active trace; `operands` = ((role, tensor), ...)."""
    make = tuple.__new__  # Operand(...) without NamedTuple's Python-level __new__
    described, allocs, kept = [], [], []
    for role, t in operands:
        buffer = getattr(t, "buffer", None)
        if buffer is not None:
            described.append(make(Operand, (role, tuple(t.data.shape), t.dtype.name, buffer.name)))
            allocs.append(id(getattr(t, "alloc", None)))
            kept.append(t)
    run = min(map(_contiguous_bytes, kept)) if engine == "dma" and kept else 0
    program = context.current()
    instruction = Instruction(engine, op, flops, nbytes, free_size, partitions, tuple(described),
                              program.kernel_name, program.program_id, tuple(allocs), run)
    for active in ACTIVE:
        active.instructions.append(instruction)


def _contiguous_bytes(t) -> int:
    """Bytes of the innermost contiguous run of `t`'s view: within one partition on chip (a DMA
    descriptor never spans partitions), across rows in HBM when the rows are adjacent."""
    data = t.data
    shape, strides = data.shape, data.stride()
    run = 1
    for dim in range(len(shape) - 1, 0 if t.buffer.on_chip else -1, -1):
        if shape[dim] == 1:
            continue
        if strides[dim] != run:
            break
        run *= shape[dim]
    return run * t.dtype.itemsize


def begin_launch() -> None:
    """Mark the start of a kernel launch in every active trace (the cost model charges each launch
    on its own: no overlap across kernel boundaries, plus a fixed launch cost)."""
    for active in ACTIVE:
        if not active.launches or active.launches[-1] != len(active.instructions):
            active.launches.append(len(active.instructions))


class Trace:
    """Instructions recorded while active (a context manager); traces combine with `+`."""

    def __init__(self, instructions=None, isolated: bool = False, launches=None):
        self.instructions = list(instructions or ())
        self.launches = list(launches or ())  # start index of each kernel launch (begin_launch)
        self._isolated = isolated
        self._hidden: list[Trace] = []  # the enclosing traces an isolated trace keeps from recording

    def __enter__(self) -> Trace:
        if self._isolated:
            self._hidden = ACTIVE[:]
            ACTIVE.clear()
        ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        for i in range(len(ACTIVE) - 1, -1, -1):
            if ACTIVE[i] is self:
                del ACTIVE[i]
                break
        if self._isolated:
            ACTIVE[:0] = self._hidden
            self._hidden = []
        return False

    def __add__(self, other: Trace) -> Trace:
        offset = len(self.instructions)
        return Trace(self.instructions + other.instructions,
                     launches=self.launches + [offset + start for start in other.launches or [0]])

    def __len__(self):
        return len(self.instructions)

    def estimate(self, target=None):
        from .cost_model import estimate
        return estimate(self.instructions, target, self.launches)

    def counts(self) -> dict:
        """{(engine, op): count}."""
        out = {}
        for ins in self.instructions:
            key = (ins.engine, ins.op)
            out[key] = out.get(key, 0) + 1
        return out

    def summary(self, target=None) -> str:
        lines = [f"{engine:>6} {op:<22} x{count}" for (engine, op), count in sorted(self.counts().items())]
        return "\n".join(lines + [repr(self.estimate(target))])


def trace(isolated: bool = False) -> Trace:
    """Record the instructions run inside the `with` block. An isolated trace hides them from the
    traces around it (the compiler's own check runs must not count as the user's work)."""
    return Trace(isolated=isolated)
