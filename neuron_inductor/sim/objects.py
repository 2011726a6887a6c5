"""nl.NKIObject: the base class of kernel configuration objects and dataclasses.

Kernels declare their configs as `@dataclass class Cfg(nl.NKIObject): ...` (the dataclass
makes the __init__) or as plain subclasses whose attributes are class-level defaults without
annotations (`q_sb = None`), filled in later by assignment. On hardware NKI traces these
objects at compile time; in the interpreter they are ordinary Python objects, so the base
class only has to accept keyword construction and print readably.
"""

from __future__ import annotations


class NKIObject:
    """Base class for NKI kernel dataclasses and configuration objects."""

    def __init__(self, **kwargs):
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"
