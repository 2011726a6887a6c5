"""Per-program state: target, SBUF/PSUM pools, SPMD ids, ScalarE reduce registers.

One ProgramContext exists per program instance of a launch (`kernel[grid](...)` runs
the programs side by side (cores.py), each as its own NeuronCore with its own on-chip
memory). Calls made outside any kernel (handy in tests) use a default context.
"""

from __future__ import annotations

import threading

from .memory import MemoryPool
from .targets import Target, get_target


class ProgramContext:
    __slots__ = ("target", "sbuf", "psum", "program_id", "grid", "kernel_name", "shared_outputs",
                 "reduce_regs", "reduce_regs_written", "sync_counts", "vector_acc", "address_spaces",
                 "rng_state")

    def __init__(self, target: Target, program_id=(0,), grid=(1,), kernel_name="", shared_outputs=None):
        self.target = target
        self.sbuf = MemoryPool("sbuf", target.name, target.sbuf_usable_bytes)
        self.psum = MemoryPool("psum", target.name, target.psum_bytes, target.psum_bank_bytes)
        self.program_id = program_id
        self.grid = grid
        self.kernel_name = kernel_name
        # shared_hbm tensors of an SPMD launch: the k-th allocation of every program is one tensor.
        self.shared_outputs = shared_outputs if shared_outputs is not None else SharedOutputs()
        self.reduce_regs = None  # ScalarE reduce registers: 128 fp32, made on first use
        self.reduce_regs_written = False
        self.address_spaces = {}  # buffer name -> [128, capacity] uint8 bytes of address= tiles (addressed.py)
        self.vector_acc = None  # VectorE reduce accumulators: 128 fp32, made on first use (isa_scan.py)
        self.sync_counts = {}  # sync-point kind -> how many this program has passed (cores.py)
        self.rng_state = None  # engine name -> [128, words] XORWOW lane states, made on first use (isa_random.py)


class SharedOutputs:
    """shared_hbm allocations of one launch, matched across programs by allocation order."""

    __slots__ = ("tensors", "cursor")

    def __init__(self, tensors=None):
        self.tensors = [] if tensors is None else tensors  # one list per launch; a cursor per program
        self.cursor = 0

    def restart(self):
        self.cursor = 0


_local = threading.local()  # .contexts: this thread's running programs, innermost last
_default = {}


def _contexts() -> list:
    contexts = getattr(_local, "contexts", None)
    if contexts is None:
        contexts = _local.contexts = []
    return contexts


def current() -> ProgramContext:
    contexts = getattr(_local, "contexts", None)
    if contexts:
        return contexts[-1]
    target = get_target()
    context = _default.get(target.name)
    if context is None:
        context = _default[target.name] = ProgramContext(target)
    return context


def running() -> ProgramContext | None:
    """The innermost program running on this thread, or None outside every kernel."""
    contexts = getattr(_local, "contexts", None)
    return contexts[-1] if contexts else None


def push(context: ProgramContext) -> None:
    _contexts().append(context)


def pop() -> None:
    _contexts().pop()
