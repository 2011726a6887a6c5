"""Reading an ATen node's arguments and results: the helpers every lowering family shares."""

from __future__ import annotations

import operator
import struct

import torch
import torch.fx as fx


def bind_arguments(node: fx.Node) -> dict:
    """The node's arguments by schema name, defaults filled in (None for an absent argument
    without a default)."""
    bound = {}
    for i, argument in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[argument.name] = node.args[i]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value if argument.has_default_value() else None
    return bound


def arg(node: fx.Node, position: int, name: str, default=None):
    """An argument of an ATen call given positionally or by keyword."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def val(value) -> torch.Tensor:
    """The value metadata of a graph node (a FakeTensor, or a tuple of them); other values as they are."""
    return value.meta["val"] if isinstance(value, fx.Node) else value


def result_values(node: fx.Node) -> list:
    """The results a multi-output op produces, in order: its getitem users, or the value metadata
    of a result nobody reads; results it does not produce (None, from an output mask) are left out."""
    getitems = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    return [getitems.get(i, value) for i, value in enumerate(val(node)) if value is not None]


def float32_bits(value: float) -> int:
    """The fp32 bit pattern of `value` as a signed int32 (what kernels select with bit masks)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]
