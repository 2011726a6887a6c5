"""nl.NKIObject: the base class of kernel configuration objects and dataclasses.

Kernels declare configs as `@dataclass class Cfg(nl.NKIObject): ...`, often with attributes
that have a default but no annotation (`q_sb = None`), and then construct them with those
attributes as keywords (`Cfg(q_sb=tile)`). A plain dataclass ignores unannotated attributes,
so NKI's base class makes them fields: when a subclass is created (before @dataclass runs)
every public, non-callable class attribute without an annotation gets one. Unhashable
(mutable) defaults become per-instance copies.

Fields declared without a default default to None: the NKI language guide ("Class Support") gives
`@dataclass class C(NKIObject): x: int; y: bool = False` the initializer `__init__(self, x=None,
y=False)` followed by `__post_init__()`, with or without @dataclass. Subclasses that are not
dataclasses keep their own __init__, or get that one (this base class's __init__).
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
        for name, annotation in annotations.items():
            if name not in cls.__dict__ and not _is_class_var(annotation):
                setattr(cls, name, None)  # the language guide's default initializer: x=None

    def __init__(self, *args, **kwargs):
        """The default initializer: fields in declaration order (base classes first), then __post_init__."""
        fields = _field_names(type(self))
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__}() takes {len(fields)} positional arguments, got {len(args)}")
        for name, value in zip(fields, args):
            setattr(self, name, value)
        for name, value in kwargs.items():
            setattr(self, name, value)
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _field_names(cls) -> list:
    names = []
    for klass in reversed(cls.__mro__):
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            if name not in names and not _is_class_var(annotation):
                names.append(name)
    return names


def _is_class_var(annotation) -> bool:
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar or \
        (isinstance(annotation, str) and annotation.startswith(("ClassVar", "typing.ClassVar")))


def _is_member(value) -> bool:
    """Methods, properties and other descriptors belong to the class, not to its instances' fields."""
    return callable(value) or isinstance(value, (staticmethod, classmethod, property, dataclasses.Field)) or \
        hasattr(value, "__get__")
