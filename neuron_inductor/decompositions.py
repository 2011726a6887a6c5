"""The Neuron decomposition table, in one place.

Start from PyTorch's core ATen decompositions, remove the ops we lower whole (`KEPT_WHOLE` of the op
table, lowering/registry.py), and add overrides.
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, register_decomposition

from .lowering.registry import KEPT_WHOLE

aten = torch.ops.aten

OVERRIDES: dict = {}


def _override(op):
    return register_decomposition(op, OVERRIDES)


# Multi-tensor (foreach) ops, as clip_grad_norm_ and the foreach optimizers emit them, apply one op
# to every tensor of a list. No kernel takes a tensor list: each becomes one op per tensor (list
# arguments are taken element by element, everything else is shared).
_FOREACH_PER_TENSOR = {
    "add": aten.add, "sub": aten.sub, "mul": aten.mul, "div": aten.div, "lerp": aten.lerp,
    "clamp_min": aten.clamp_min, "clamp_max": aten.clamp_max, "pow": aten.pow, "sqrt": aten.sqrt,
    "neg": aten.neg, "abs": aten.abs, "exp": aten.exp, "reciprocal": aten.reciprocal, "sign": aten.sign,
    "addcmul": lambda self, t1, t2, value=1: aten.addcmul(self, t1, t2, value=value),
    "addcdiv": lambda self, t1, t2, value=1: aten.addcdiv(self, t1, t2, value=value),
}
# Overloads left alone: `out` variants (and addcmul / addcdiv's Tensor, one scalar per list entry).
_FOREACH_SKIPPED = {"out", "Scalar_out", "List_out", "ScalarList_out", "Tensor_out"}


def _per_tensor(fn):
    def decomposition(*args, **kwargs):
        count = next(len(a) for a in args if isinstance(a, (list, tuple)))
        return [fn(*(a[i] if isinstance(a, (list, tuple)) else a for a in args), **kwargs) for i in range(count)]

    return decomposition


for _name, _fn in _FOREACH_PER_TENSOR.items():
    _packet = getattr(aten, f"_foreach_{_name}")
    for _overload in _packet.overloads():
        if _overload in _FOREACH_SKIPPED or (_name in ("addcmul", "addcdiv") and _overload == "Tensor"):
            continue
        register_decomposition(getattr(_packet, _overload), OVERRIDES)(_per_tensor(_fn))


@_override(aten._foreach_norm.Scalar)
def _foreach_norm(tensors, ord=2, dtype=None):
    return [aten.linalg_vector_norm.default(t, ord, None, False, dtype=dtype) for t in tensors]


@_override(aten.index_put.default)
def _index_put_masked_fill(self, indices, values, accumulate=False):
    """`x[mask] = v` with one boolean mask over x's leading dims and a single value (DTensor's
    vocabulary-parallel embedding zeroes foreign rows this way) is a masked fill: a pointwise
    `where` instead of a scatter. Every other index_put stays whole (NotImplemented)."""
    if (accumulate or len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.bool
            or values.numel() != 1 or indices[0].shape != self.shape[:indices[0].dim()]):
        return NotImplemented
    mask = indices[0].reshape(*indices[0].shape, *[1] * (self.dim() - indices[0].dim()))
    return aten.where.self(mask, values.reshape(()).to(self.dtype), self)


@functools.lru_cache(maxsize=None)
def neuron_decompositions() -> dict:
    table = dict(core_aten_decompositions())
    for op in KEPT_WHOLE:
        table.pop(op, None)
    table.update(OVERRIDES)
    return table
