"""Grouped-query attention written as repeated key / value heads becomes SDPA's own GQA, in Dynamo graphs
(before AOTAutograd).

Matched (and nothing else; every other form keeps today's path):

    k2 = k.repeat_interleave(r, dim=1)  |  torch.repeat_interleave(k, r, dim=1)      (dim 1 or -3)
       | k[:, :, None].expand(B, H, r, S, D).reshape(B, H * r, S, D)                (Hugging Face's repeat_kv)
    F.scaled_dot_product_attention(q, k2, v2, ...)     the same r for k and v, q with H * r heads,
                                                       enable_gqa not set, k2 / v2 read by nothing else

becomes `F.scaled_dot_product_attention(q, k, v, ..., enable_gqa=True)`, which PyTorch defines as that
very repeat_interleave of k and v along dim -3: the same values. The attention kernels then read
each key / value head once per group, the [B, H * r, S, D] copies are never made, and the backward's
dK / dV come out summed over the group inside the attention kernel instead of as a separate
reduction over the repeated heads.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

log = logging.getLogger("neuron_inductor")

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _repeat_interleave_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(k, r) if node is k.repeat_interleave(r, dim=1 or -3) of a 4-d k with an int r."""
    if node.op == "call_method" and node.target == "repeat_interleave":
        pass
    elif not (node.op == "call_function" and node.target is torch.repeat_interleave):
        return None
    args = list(node.args)
    source = args[0] if args else None
    repeats = args[1] if len(args) > 1 else node.kwargs.get("repeats")
    dim = args[2] if len(args) > 2 else node.kwargs.get("dim")
    value = _value(source)
    if (value is None or value.dim() != 4 or not isinstance(repeats, int) or repeats < 1 or dim not in (1, -3)
            or set(node.kwargs) - {"repeats", "dim"}):
        return None
    return source, repeats


def _repeat_kv_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(k, r) if node is k[:, :, None].expand(B, H, r, S, D).reshape(B, H * r, S, D) of a 4-d k."""
    if not (node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"
            and _only_user(expand, node)):
        return None
    unsqueezed = expand.args[0]
    if not (isinstance(unsqueezed, fx.Node) and unsqueezed.op == "call_function"
            and unsqueezed.target is operator.getitem and _only_user(unsqueezed, expand)):
        return None
    source, index = unsqueezed.args
    full = slice(None, None, None)
    if not isinstance(index, tuple) or index[:3] != (full, full, None) or any(i not in (full, Ellipsis)
                                                                             for i in index[3:]):
        return None
    k, wide, out = _value(source), _value(expand), _value(node)
    if k is None or wide is None or out is None or k.dim() != 4 or wide.dim() != 5:
        return None
    b, h, s, d = (int(x) for x in k.shape)
    repeats = int(wide.shape[2])
    if tuple(wide.shape) != (b, h, repeats, s, d) or tuple(out.shape) != (b, h * repeats, s, d):
        return None
    return source, repeats


def _repeated_heads(node) -> tuple[fx.Node, int] | None:
    if not isinstance(node, fx.Node):
        return None
    return _repeat_interleave_source(node) or _repeat_kv_source(node)


def _chain(node: fx.Node) -> list[fx.Node]:
    """The nodes of a matched repeat, last first (to erase)."""
    if node.op == "call_method" and node.target in ("reshape", "view"):
        return [node, node.args[0], node.args[0].args[0]]
    return [node]


def fuse_gqa_attention(gm: fx.GraphModule) -> int:
    """Rewrite every matched SDPA in place; returns how many."""
    rewritten = 0
    for sdpa in list(gm.graph.nodes):
        if sdpa.op != "call_function" or sdpa.target not in _SDPA:
            continue
        if len(sdpa.args) > len(_SDPA_PARAMS) or set(sdpa.kwargs) - set(_SDPA_PARAMS):
            continue
        bound = dict(zip(_SDPA_PARAMS, sdpa.args)) | dict(sdpa.kwargs)
        query, key, value = (bound.get(name) for name in ("query", "key", "value"))
        matched = [_repeated_heads(key), _repeated_heads(value)]
        q = _value(query)
        if q is None or q.dim() != 4 or bound.get("enable_gqa", False) is not False or None in matched:
            continue
        (k, k_repeats), (v, v_repeats) = matched
        if key is value or k_repeats != v_repeats or not (_only_user(key, sdpa) and _only_user(value, sdpa)):
            log.debug("neuron_inductor: %s keeps its repeated key / value heads (repeats %s / %s, or read elsewhere)",
                      sdpa.name, k_repeats, v_repeats)
            continue
        if int(q.shape[1]) != int(_value(k).shape[1]) * k_repeats or _value(k).shape[1] != _value(v).shape[1]:
            continue
        bound.update(key=k, value=v, enable_gqa=True)
        sdpa.args = tuple(bound.pop(name) for name in _SDPA_PARAMS[:3])
        sdpa.kwargs = bound
        for node in _chain(key) + _chain(value):
            if not node.users:
                gm.graph.erase_node(node)
        rewritten += 1
        log.info("neuron_inductor: %s reads its %d key / value heads directly (enable_gqa=True) instead of "
                 "%d repeated copies", sdpa.name, int(_value(k).shape[1]), int(q.shape[1]))
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
