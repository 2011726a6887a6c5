"""Out-of-range indices: the exception a compiled graph raises where eager raises one.

An indexing kernel (lowering/indexing.py) checks every id it reads against its dim and ends with an
indirect DMA under oob_mode.error that addresses outside the index tensor when one was out of range
(codegen_templates/_bounds.py.j2): the kernel itself fails, on hardware as in the interpreter. The
interpreter raises `sim.NkiIndexError` there; `guard_kernels` turns it into the exception eager
raises for that op (IndexError for embedding, index_select, x[i], index_put and nll_loss's
targets, RuntimeError for gather and scatter), naming the op, the dim and its size. The kernel's outputs are fresh buffers
the host drops with the exception, and a kernel reads no state of an earlier call, so the next call
with good ids runs normally (the compiled program and its cache entry stay as they were).
"""

from __future__ import annotations

from typing import Callable

from . import sim


class IndexOutOfRangeError(IndexError):
    """An index outside its dim reached an indexing kernel (eager raises IndexError for this op)."""


class IndexOutOfRangeRuntimeError(RuntimeError):
    """An index outside its dim reached a gather or scatter kernel (eager raises RuntimeError)."""


ERRORS = {"IndexError": IndexOutOfRangeError, "RuntimeError": IndexOutOfRangeRuntimeError}


def message(bounds: dict, kernel: str) -> str:
    """What went wrong, for the KernelSpec.index_bounds `bounds` of `kernel`."""
    ranges = [f"[-{size}, {size})" if bounds["from_end"] else f"[0, {size})" for size in bounds["sizes"]]
    if "ignore_index" in bounds:  # a loss's targets
        ranges = [f"{valid} or ignore_index {bounds['ignore_index']}" for valid in ranges]
    dims = ", ".join(f"dim {dim} of size {size} (ids in {valid})"
                     for dim, size, valid in zip(bounds["dims"], bounds["sizes"], ranges))
    return (f"{bounds['op']}: index out of range in self: an index is outside {dims} "
            f"(the bounds check of generated kernel {kernel} failed); check the indices passed to {bounds['op']}")


def guard_kernels(kernels: dict[str, Callable], described: list[dict]) -> dict[str, Callable]:
    """`kernels` with every kernel that has a bounds check (its description in compiler.py's
    artifact meta carries `index_bounds`) raising eager's exception when the check fails."""
    guarded = dict(kernels)
    for kernel in described:
        bounds = kernel.get("index_bounds")
        if bounds and kernel["name"] in guarded:
            guarded[kernel["name"]] = _guard(guarded[kernel["name"]], bounds, kernel["name"])
    return guarded


def _guard(kernel: Callable, bounds: dict, name: str) -> Callable:
    error = ERRORS[bounds["error"]]

    def run(*args):
        try:
            return kernel(*args)
        except sim.NkiIndexError as exc:
            raise error(message(bounds, name)) from exc

    run.__wrapped__ = kernel
    return run
