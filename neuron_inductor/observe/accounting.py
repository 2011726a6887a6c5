"""FLOPs of ATen nodes, to tell what share of a graph's work its kernels do (the rest is host fallbacks)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry


def _value(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def node_flops(node: fx.Node) -> int:
    """FLOPs of one ATen node: torch's formula where it has one (matmuls, convolutions, attention),
    else one per output element (pointwise, reductions, copies: what the op touches)."""
    out = node.meta.get("val")
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is not None:
        args = fx.node.map_aggregate(node.args, _value)
        kwargs = fx.node.map_aggregate(node.kwargs, _value)
        try:
            return int(formula(*args, out_val=out, **kwargs))
        except Exception:  # a formula that does not accept this overload's arguments: count elements
            pass
    values = out if isinstance(out, (tuple, list)) else (out,)
    return sum(v.numel() for v in values if isinstance(v, torch.Tensor))

