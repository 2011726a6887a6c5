"""Instruction traces.

    with neuron_inductor.sim.trace() as t:
        kernel(x)
    t.instructions            # [Instruction(engine="tensor", op="nc_matmul", flops=..., bytes=...), ...]
    t.estimate("trn2")        # cost-model estimate for one NeuronCore (see cost_model.py)

Traces nest: every instruction is appended to every active trace, so a backend can wrap
each kernel call in its own trace while a user's outer trace sees everything. With no
active trace, an instruction costs one list test; with traces active, one record costs
a few microseconds. Records hold operand shapes, dtypes and buffer names, never
tensors, so tracing does not keep on-chip memory alive.
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

    __slots__ = ("engine", "op", "flops", "bytes", "free_size", "partitions", "operands", "kernel", "program_id")

    def __init__(self, engine, op, flops, nbytes, free_size, partitions, operands, kernel, program_id):
        self.engine = engine          # "tensor" | "vector" | "scalar" | "gpsimd" | "dma"
        self.op = op                  # ISA op name, e.g. "nc_matmul", "dma_copy", "load"
        self.flops = flops            # 2*K*M*N for matmuls, elements processed otherwise, 0 for DMA
        self.bytes = nbytes           # DMA: bytes transferred; compute: on-chip bytes read + written
        self.free_size = free_size    # elements per partition the engine streams (N for matmul)
        self.partitions = partitions
        self.operands = operands      # tuple of Operand, dst first
        self.kernel = kernel          # name of the jit kernel that issued it ("" outside kernels)
        self.program_id = program_id

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
    described = tuple(
        make(Operand, (role, tuple(t.data.shape), t.dtype.name, t.buffer.name))
        for role, t in operands if getattr(t, "buffer", None) is not None
    )
    program = context.current()
    instruction = Instruction(engine, op, flops, nbytes, free_size, partitions, described,
                              program.kernel_name, program.program_id)
    for active in ACTIVE:
        active.instructions.append(instruction)


class Trace:
    """Instructions recorded while active (a context manager); traces combine with `+`."""

    def __init__(self, instructions=None, isolated: bool = False):
        self.instructions = list(instructions or ())
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
        return Trace(self.instructions + other.instructions)

    def __len__(self):
        return len(self.instructions)

    def estimate(self, target=None):
        from .cost_model import estimate
        return estimate(self.instructions, target)

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
