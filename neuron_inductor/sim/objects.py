"""nl.NKIObject: the base class of kernel configuration objects and dataclasses.

Kernels declare configs as `@dataclass class Cfg(nl.NKIObject): ...`, often with attributes
that have a default but no annotation (`q_sb = None`), and then construct them with those
attributes as keywords (`Cfg(q_sb=tile)`). A plain dataclass ignores unannotated attributes,
so NKI's base class makes them fields: when a subclass is created (before @dataclass runs)
every public, non-callable class attribute without an annotation gets one. Unhashable
(mutable) defaults become per-instance copies. Subclasses that are not dataclasses keep their own __init__, or
this one, which sets its keyword arguments as attributes.
"""

from __future__ import annotations

import copy
import dataclasses
import typing


class NKIObject:
    """Base class for NKI kernel dataclasses and configuration objects."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        annotations = cls.__dict__.get("__annotations__")
        if annotations is None:
            annotations = {}
            cls.__annotations__ = annotations
        for name, value in list(cls.__dict__.items()):
            if name.startswith("_") or name in annotations or _is_member(value):
                continue
            annotations[name] = typing.Any
            if type(value).__hash__ is None:  # list, dict, set, non-frozen dataclasses: @dataclass refuses them
                setattr(cls, name, dataclasses.field(default_factory=lambda v=value: copy.copy(v)))

    def __init__(self, **kwargs):
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _is_member(value) -> bool:
    """Methods, properties and other descriptors belong to the class, not to its instances' fields."""
    return callable(value) or isinstance(value, (staticmethod, classmethod, property, dataclasses.Field)) or \
        hasattr(value, "__get__")
