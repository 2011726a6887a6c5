"""nki.jit, nki.simulate and SPMD launches.

A kernel is called with torch tensors (or NumPy arrays) and returns the same kind.
Tensor arguments are wrapped as shared-HBM NkiTensors around the caller's memory, with
no copy: strided, permuted and expanded views read through, and writes into an argument
update it in place (as the real simulator does). The kernel returns `nl.shared_hbm`
tensors (or a tuple / list of them, or an argument); each becomes the torch tensor that
holds it, in its NKI dtype (uint32 comes back as int64, the storage torch can compute on;
in NumPy mode bf16 / fp8 / uint16 outputs come back as float32 arrays).

`kernel[grid](...)` runs the programs of the grid as cores side by side (in lockstep on their HBM
accesses, meeting at core_barrier / sendrecv, see cores.py), each with its own `nl.program_id`, its own
SBUF/PSUM and ScalarE registers, and the same shared_hbm outputs (the k-th shared_hbm
allocation of every program is one tensor).
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from . import context, cores, op_replay, rules, tracing
from . import replay as replays
from .errors import NkiError
from .targets import get_target
from .tensor import NkiTensor, wrap_hbm

THREADS_ENV = "NEURON_INDUCTOR_SIM_THREADS"


class Kernel:
    """A jit kernel: call it, or index it with a grid for an SPMD launch."""

    def __init__(self, func, grid=(1,), platform_target=None, replay=False):
        self.func = func
        self.grid = grid
        self.platform_target = platform_target
        self.replay = replay  # copy-only runs may be replayed (replay.py): for kernels that read no values
        functools.update_wrapper(self, func)

    def __getitem__(self, grid) -> Kernel:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        if not grid or any(not isinstance(g, int) or g < 1 for g in grid):
            raise NkiError(f"{self.func.__name__}[{grid}]: a grid is one or more positive ints")
        return Kernel(self.func, grid, self.platform_target, self.replay)

    def launch(self, *args, **kwargs):
        """The call, for callers Dynamo does not trace (the backend's compiled programs, which are
        dynamo-disabled as a whole): `__call__` without its per-call Dynamo guard (~3 us a launch)."""
        program = context.running()
        if program is not None:  # a sub-kernel: "a nested @nki.jit sub-kernel ... inline[s]" (SpecializationConfig)
            if self.grid != (1,) and self.grid != program.grid:
                raise NkiError(f"{self!r} called inside {program.kernel_name}[{', '.join(map(str, program.grid))}]: "
                               "a nested kernel runs inline in the caller's programs, so it takes no other grid")
            return self.func(*args, **kwargs)
        return run(self.func, self.grid, args, kwargs, self.platform_target, self.replay)

    __call__ = torch._dynamo.disable(launch, reason="an NKI kernel called directly in code torch.compile traces runs "
                                                    "eagerly (a graph break); register the function calling it with "
                                                    "neuron_inductor.nki_op and call the kernel through wrap_nki to make "
                                                    "it a kernel of the compiled program")

    def __repr__(self):
        grid = "" if self.grid == (1,) else f"[{', '.join(map(str, self.grid))}]"
        return f"<nki kernel {self.func.__name__}{grid}>"


def jit(func=None, *, mode=None, platform_target=None, **options):
    """`@nki.jit` or `@nki.jit(...)`. `platform_target=` (deprecated in NKI) picks the target for
    this kernel over $NEURON_PLATFORM_TARGET_OVERRIDE; `mode` and other options are ignored."""
    if func is None:
        return lambda f: jit(f, mode=mode, platform_target=platform_target, **options)
    if isinstance(func, Kernel):
        return func
    return Kernel(func, platform_target=platform_target)


def simulate(kernel):
    """`nki.simulate(kernel)(*args)`: every call here is a simulation, so this only wraps plain functions."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


def run(func, grid, args, kwargs, platform_target=None, replay=False):
    if _get_current_dispatch_mode_stack() and op_replay.active() is None:
        # The kernel's torch operations are the device's work, not operations of the caller's
        # program: a dispatch mode around the call (AOTAutograd's custom-op aliasing analysis on a
        # compiled graph's first call, a user's FlopCounterMode) must neither see nor slow them.
        # A replay recording an outer kernel (a nested kernel run inline) keeps seeing them.
        with _disable_current_modes():
            return run(func, grid, args, kwargs, platform_target, replay)
    numpy_mode = any(_is_ndarray(a) for a in itertools.chain(args, kwargs.values()))
    if tracing.ACTIVE:
        tracing.begin_launch()
    if replay and not numpy_mode:
        with kernel_threads():  # (making a replay plan is the kernel's work too)
            return replays.run(func, args, kwargs, grid, platform_target,
                               lambda: _launch(func, grid, args, kwargs, platform_target),
                               lambda result: _unwrap(result, False))
    return _unwrap(_launch(func, grid, args, kwargs, platform_target), numpy_mode)


def _launch(func, grid, args, kwargs, platform_target):
    """Run the programs of `grid` on the wrapped arguments; -> program 0's result (NKI tensors)."""
    args = tuple(_wrap(a) for a in args)
    kwargs = {k: _wrap(v) for k, v in kwargs.items()}
    target = get_target(platform_target)
    with kernel_threads():
        return cores.run_programs(func, args, kwargs, target, grid, func.__name__)


class kernel_threads:  # noqa: N801 (a context manager, named as contextlib's are)
    """Torch's intra-op threads set to `_kernel_threads()` inside (restored after). A class rather than
    a generator context manager: it is entered on every kernel launch."""

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        threads, self.previous = _kernel_threads(), torch.get_num_threads()
        if not threads or threads == self.previous:
            self.previous = None
        else:
            torch.set_num_threads(threads)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            torch.set_num_threads(self.previous)


def _kernel_threads() -> int:
    """Torch intra-op threads while a kernel runs ($NEURON_INDUCTOR_SIM_THREADS; 0 keeps torch's setting).

    Default 1: tile-sized ops gain little from intra-op parallelism, and OpenMP teams
    waiting on descheduled threads cost milliseconds per op on a busy machine.
    """
    value = os.environ.get(THREADS_ENV, "1")
    try:
        return max(0, int(value))
    except ValueError:
        raise NkiError(f"{THREADS_ENV}={value!r} is not an integer") from None


def _wrap(value):
    if _is_ndarray(value):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        t = wrap_hbm(value)
        rules.hbm_tensor("nki.jit", "kernel argument", value.shape, t.dtype)
        return t
    if isinstance(value, (tuple, list)):
        return type(value)(_wrap(v) for v in value)
    return value


_NO_NUMPY = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16)


def _is_ndarray(value) -> bool:
    """A NumPy array, checked without importing NumPy (an optional dependency: torch runs without it)."""
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _unwrap(value, numpy_mode):
    if isinstance(value, NkiTensor):
        rules.kernel_output(value)
        out = value.data
        if not numpy_mode:
            return out
        return (out.float() if out.dtype in _NO_NUMPY else out).numpy()
    if isinstance(value, (tuple, list)):
        return type(value)(_unwrap(v, numpy_mode) for v in value)
    return value
