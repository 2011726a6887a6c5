"""Which Python bindings a replay plan may call in place of the operations it recorded.

A generated replay calls each ATen operation through its Python binding (`torch.add`,
`Tensor.copy_`), whose argument parsing is faster than the operation object's. A binding picks the
overload from its arguments' Python types (and whether a tensor is 0-d), so it may dispatch
another overload than the recorded one, or more than one operation; such a line must call the
operation object instead. Which operations a binding dispatches depends on its arguments' kinds and
layouts (and on grad and inference mode), not on their values, so each line is probed once on meta
tensors of its arguments' shapes, strides and dtypes (no math, no copies of the data), and the
verdict is kept for every later line with the same operation, binding and argument kinds, in any
plan of the process.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MAX_VERDICTS = 100_000  # kept probe verdicts (past it the table starts over: probing again is always correct)
_VERDICTS: dict = {}  # (operation, binding, argument kinds) -> whether the binding dispatches exactly it


class TensorSpec(NamedTuple):
    """A tensor of a recorded line, as the probe makes it (on meta)."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype


def dispatches_exactly(func, binding, args: tuple, kwargs: dict) -> bool:
    """Whether `binding(*args, **kwargs)` dispatches `func` and nothing else. Tensors are given as
    TensorSpec, other arguments as the recorded values (0-d tensors included: they stay real)."""
    # (grad and inference mode change which operations reach a dispatch mode)
    key = (func, binding, _kinds(args), _kinds(kwargs), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    verdict = _VERDICTS.get(key)
    if verdict is None:
        if len(_VERDICTS) >= MAX_VERDICTS:
            _VERDICTS.clear()
        verdict = _VERDICTS[key] = _probe(func, binding, _meta(args), _meta(kwargs))
    return verdict


def _kinds(value):
    """What a binding's choice of operations may depend on: a tensor's layout and dtype, a 0-d
    tensor's dtype, the type of any other value (and torch's enum-like constants themselves)."""
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, torch.Tensor):
        return "tensor", value.dtype, tuple(value.shape)
    if isinstance(value, dict):
        return tuple((k, _kinds(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_kinds(v) for v in value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    return type(value)


def _meta(value):
    if isinstance(value, TensorSpec):
        extent = 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride) if n)
        return torch.empty(max(extent, 1), dtype=value.dtype, device="meta").as_strided(value.shape, value.stride)
    if isinstance(value, torch.device):
        return torch.device("meta")  # a factory's tensor is made on meta too
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_meta(v) for v in value)
    return value


class _Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def _probe(func, binding, args: tuple, kwargs: dict) -> bool:
    seen = _Dispatched()
    try:
        with seen:
            binding(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a binding taking other arguments, or an operation meta cannot run
        return False  # (unknown: the line calls the operation object, always right)
    return seen.funcs == [func]
