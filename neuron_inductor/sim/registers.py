"""Engine-sequencer virtual registers and the loops they drive (nisa.register_*, nl.fori_loop / while_loop).

A VirtualRegister holds one 32-bit integer. Kernels fill it from a one-element SBUF/HBM
tensor (register_load) and use it as a dynamic loop bound (`nl.dynamic_range(reg)`,
`nl.fori_loop`, `nl.while_loop`, `while reg:`) or as the scalar_offset of an indirect
access pattern. The interpreter runs eagerly, so a register's value is known when it is
read: dynamic loops become Python loops over the current value.
"""

from __future__ import annotations

import operator

from . import cores
from .errors import NkiError
from .objects import NKIObject

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


class VirtualRegister(NKIObject):
    """A 32-bit register of an engine sequencer (nisa.register_alloc)."""

    def __init__(self, value=None):
        self.value = value

    def read(self, api="register") -> int:
        if self.value is None:
            raise NkiError(f"{api}: reads a register that was allocated without a value and never loaded "
                           "(nisa.register_alloc(x), register_move or register_load it first)")
        return self.value

    def __bool__(self):
        return self.read("while reg") != 0

    def __index__(self):
        return self.read("int(reg)")

    def __repr__(self):
        return f"VirtualRegister({self.value})"


def _int32(api, value) -> int:
    value = operator.index(value)
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise NkiError(f"{api}: {value} does not fit a 32-bit register")
    return value


def register_alloc(x=None) -> VirtualRegister:
    return VirtualRegister(None if x is None else _int32("nisa.register_alloc", x))


def register_move(dst, src) -> None:
    _check_register("nisa.register_move", dst)
    dst.value = src.read("nisa.register_move") if isinstance(src, VirtualRegister) else _int32("nisa.register_move", src)


def _one_element(api, t):
    """t's one element; reading or writing it in HBM is an HBM access of the running program (cores.step)."""
    data = getattr(t, "data", None)
    if data is None or data.numel() != 1:
        raise NkiError(f"{api}: needs a one-element tensor ([1] or [1, 1]), got "
                       f"{list(data.shape) if data is not None else type(t).__name__}")
    if t.dtype.itemsize > 4 or t.dtype.kind not in ("int", "float", "bool"):
        raise NkiError(f"{api}: registers hold 32-bit values, not {t.dtype.name}")
    if not t.buffer.on_chip:
        cores.step()
    return data


def register_load(dst, src) -> None:
    _check_register("nisa.register_load", dst)
    value = _one_element("nisa.register_load", src).reshape(()).item()
    dst.value = _int32("nisa.register_load", int(value))


def register_store(dst, src) -> None:
    from . import isa  # isa imports this module

    _one_element("nisa.register_store", dst)
    isa.fill(dst, src.read("nisa.register_store"))


def _check_register(api, reg):
    if not isinstance(reg, VirtualRegister):
        raise NkiError(f"{api}: dst must be a register from nisa.register_alloc(), got {type(reg).__name__}")


def bound(value) -> int:
    """A loop bound or offset: an int, or the current value of a register."""
    return value.read("dynamic bound") if isinstance(value, VirtualRegister) else operator.index(value)


def dynamic_range(start, stop=None, step=1):
    if stop is None:
        start, stop = 0, start
    step = operator.index(step)
    if step <= 0:
        raise NkiError(f"nl.dynamic_range: step must be a positive compile-time int, got {step}")
    return range(bound(start), bound(stop), step)


# Open `with nl.no_reorder():` blocks, which refuse register-based dynamic loops (nl.no_reorder docstring).
NO_REORDER_DEPTH = [0]


def _outside_no_reorder(api):
    if NO_REORDER_DEPTH[0]:
        raise NkiError(f"{api}: register-based dynamic loops are not supported inside a nl.no_reorder() block")


def fori_loop(lower, upper, body_fun, step=1) -> None:
    """body_fun(i) for i in [lower, upper) by step; i is a register passed by value."""
    _outside_no_reorder("nl.fori_loop")
    for i in dynamic_range(lower, upper, step):
        body_fun(VirtualRegister(i))


def while_loop(init, body_fun) -> None:
    """r = init; while r != 0: r = body_fun(r) (the body gets a copy and returns the next condition)."""
    _outside_no_reorder("nl.while_loop")
    _check_register("nl.while_loop", init)
    condition = init
    while condition.read("nl.while_loop") != 0:
        condition = body_fun(VirtualRegister(condition.value))
        _check_register("nl.while_loop body result", condition)
