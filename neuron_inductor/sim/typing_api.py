"""`nki.typing` (and the legacy `neuronxcc.nki.typing`): annotation names only.

Kernels annotate arguments with `nt.tensor`, `nt.mutable_tensor` or `nt.tensor[shape, dtype]`;
the annotations are never checked at run time, so each name is a subscriptable marker.
"""

from __future__ import annotations


class _Annotation:
    __slots__ = ("name", "args")

    def __init__(self, name, args=()):
        self.name = name
        self.args = args

    def __getitem__(self, args):
        return _Annotation(self.name, args if isinstance(args, tuple) else (args,))

    def __call__(self, *args):
        return _Annotation(self.name, args)

    def __repr__(self):
        return f"nt.{self.name}" + (f"[{', '.join(map(repr, self.args))}]" if self.args else "")


tensor = _Annotation("tensor")
mutable_tensor = _Annotation("mutable_tensor")
