"""Recognise decomposed RMSNorm forwards (and the residual add feeding them) in AOT graphs and
replace each by one `neuron_inductor::rms_norm` node, which lowering/norms.py lowers as one kernel.

AOTAutograd hands us RMSNorm as pointwise ops around a mean, which the walk of lowering/graph.py
turns into four launches (the squares with the residual add, the mean, the rsqrt, the scaling).
The shapes recognised, after the row's input `x` (optionally `x = a + b`, a residual add of two
tensors of x's shape and dtype):

    hand-written: x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps) * w         (any order of muls)
    Hugging Face: w * (xf * rsqrt(mean(xf ** 2, -1, keepdim=True) + eps)).to(x.dtype), xf = x.float()

Default-deny: anything else (another reduced dim, a weight of another dtype or shape, an
intermediate that something outside the norm reads, other than the rsqrt the backward saves) stays
as it is, and the reason is logged at debug level.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

log = logging.getLogger("neuron_inductor")
aten = torch.ops.aten
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("neuron_inductor::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor], eps: float,
             rstd_dtype: torch.dtype) -> list[torch.Tensor]:
    """[y, rstd] of h = x (+ residual), and h itself when a residual is given: rstd = rsqrt(mean(h^2) + eps)
    over the last dim in fp32, y = h * rstd * weight (h * rstd rounded to h's dtype first when that is a
    2-byte type, as the kernel and both recognised forms do)."""
    h = x if residual is None else x + residual
    rstd = torch.rsqrt(h.float().square().mean(-1, keepdim=True) + eps)
    y = h.float() * rstd
    if weight is not None:
        y = y.to(h.dtype) * weight if h.dtype != torch.float32 else y * weight
    results = [y.to(h.dtype), rstd.to(rstd_dtype)]
    return results + ([h] if residual is not None else [])


@rms_norm.register_fake
def _(x, residual, weight, eps, rstd_dtype):
    results = [torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=rstd_dtype)]
    return results + ([torch.empty_like(x)] if residual is not None else [])


RMS_NORM = torch.ops.neuron_inductor.rms_norm.default


class _NoMatch(Exception):
    pass


def _call(node, *targets) -> fx.Node:
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets):
        raise _NoMatch(f"{getattr(node, 'name', node)} is not {' / '.join(str(t) for t in targets)}")
    return node


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _other(mul: fx.Node, known: fx.Node):
    a, b = mul.args[:2]
    if a is known:
        return b
    if b is known:
        return a
    raise _NoMatch(f"{mul.name} does not multiply {known.name}")


def _only_used_by(node: fx.Node, allowed: set[fx.Node]) -> None:
    outside = [u.name for u in node.users if u not in allowed]
    if outside:
        raise _NoMatch(f"{node.name} is also read by {', '.join(outside)}")


def _cast_to(node: fx.Node, dtype: torch.dtype) -> bool:
    return (node.target is aten._to_copy.default and not node.args[1:]
            and set(node.kwargs) == {"dtype"} and node.kwargs["dtype"] == dtype)


def _match(rsqrt: fx.Node) -> dict:
    """The norm around one rsqrt node: {"x", "weight", "eps", "rsqrt", "y", "internal"}."""
    add_eps = _call(rsqrt.args[0], aten.add.Tensor)
    mean, eps = add_eps.args[:2]
    if not isinstance(eps, float) or add_eps.kwargs:
        raise _NoMatch(f"{add_eps.name} adds {eps!r}, not a float eps")
    mean = _call(mean, aten.mean.dim)
    squares, dims = mean.args[:2]
    ndim = _val(mean).dim()
    if not (list(dims) in ([-1], [ndim - 1]) and (mean.args[2:3] == (True,) or mean.kwargs.get("keepdim"))
            and "dtype" not in mean.kwargs):
        raise _NoMatch(f"{mean.name} is not a keepdim mean over the last dim")
    squares = _call(squares, aten.pow.Tensor_Scalar, aten.mul.Tensor)
    xs = squares.args[0]
    if squares.args[1] not in (2, 2.0, xs):
        raise _NoMatch(f"{squares.name} is not a square")
    if not isinstance(xs, fx.Node):
        raise _NoMatch(f"{squares.name} squares a constant")
    # xs is x, or Hugging Face's fp32 copy of it.
    x = xs.args[0] if xs.target is aten._to_copy.default and _cast_to(xs, torch.float32) else xs
    dtype, shape = _val(x).dtype, _val(x).shape
    if dtype not in FLOAT_DTYPES or _val(xs).shape != shape or len(shape) < 1:
        raise _NoMatch(f"the input {x.name} is {dtype} {list(shape)}")
    normed = [u for u in xs.users if u.target is aten.mul.Tensor and rsqrt in u.args[:2]]
    if len(normed) != 1:
        raise _NoMatch(f"no single {xs.name} * {rsqrt.name}")
    normed = normed[0]
    internal = {squares, mean, add_eps, rsqrt, normed}
    scaled = normed
    if len(normed.users) == 1 and _cast_to(next(iter(normed.users)), dtype) and xs is not x:
        scaled = next(iter(normed.users))  # Hugging Face rounds x * rstd to x's dtype before the weight
        internal.add(scaled)
    weight, y = None, scaled
    weight_muls = [u for u in scaled.users if u.target is aten.mul.Tensor]
    if len(scaled.users) == 1 and weight_muls:
        candidate = _other(weight_muls[0], scaled)
        if (isinstance(candidate, fx.Node) and _val(candidate).shape == shape[-1:]
                and _val(candidate).dtype == dtype):
            weight, y = candidate, weight_muls[0]
            internal.add(y)
    if _val(y).dtype != dtype or _val(y).shape != shape:
        raise _NoMatch(f"the result {y.name} is {_val(y).dtype} {list(_val(y).shape)}, not x's")
    for node in (squares, mean, add_eps):
        _only_used_by(node, internal)
    early = [u.name for u in rsqrt.users if u not in internal and not _after(u, y)]
    if early:  # the kernel's rstd exists from y's position on
        raise _NoMatch(f"{rsqrt.name} is read before the norm's result, by {', '.join(early)}")
    if normed is not y:
        _only_used_by(normed, internal)
    if scaled not in (normed, y):
        _only_used_by(scaled, internal)
    return {"x": x, "xs": xs, "weight": weight, "eps": eps, "rsqrt": rsqrt, "y": y, "internal": internal}


def _residual(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) when x = a + b adds two tensors of x's shape and dtype."""
    if x.op != "call_function" or x.target is not aten.add.Tensor or x.kwargs or len(x.args) != 2:
        return None
    a, b = x.args
    if not all(isinstance(t, fx.Node) and isinstance(t.meta.get("val"), torch.Tensor)
               and _val(t).shape == _val(x).shape and _val(t).dtype == _val(x).dtype for t in (a, b)):
        return None
    return a, b


def _rewrite(gm: fx.GraphModule, found: dict) -> None:
    graph, x, y, rsqrt = gm.graph, found["x"], found["y"], found["rsqrt"]
    residual = _residual(x)
    inputs = residual if residual else (x, None)
    with graph.inserting_before(y):
        fused = graph.call_function(RMS_NORM, (*inputs, found["weight"], found["eps"], _val(rsqrt).dtype))
        results = [graph.call_function(operator.getitem, (fused, i)) for i in range(3 if residual else 2)]
    with _val(x).fake_mode:
        fused.meta["val"] = RMS_NORM(*[_val(a) if isinstance(a, fx.Node) else a for a in fused.args])
    for i, node in enumerate(results):
        node.meta["val"] = fused.meta["val"][i]
    y.replace_all_uses_with(results[0])
    rsqrt.replace_all_uses_with(results[1])
    if residual:
        # x's other readers (the next residual, a saved value) read the kernel's copy of a + b,
        # which must then come after them in graph order: the fused node sits at y.
        x.replace_all_uses_with(results[2], delete_user_cb=lambda user: user is not found["xs"]
                                and user not in found["internal"] and _after(user, y))
    for node in sorted(found["internal"], key=_position, reverse=True):
        if not node.users:
            graph.erase_node(node)
    for node in dict.fromkeys((found["xs"], x)):  # (the same node outside Hugging Face's form)
        if node.op == "call_function" and not node.users:
            graph.erase_node(node)


def _position(node: fx.Node) -> int:
    return node.meta.get("_fusion_position", -1)  # -1: a node this pass made


def _after(user: fx.Node, anchor: fx.Node) -> bool:
    return _position(user) > _position(anchor)


def fuse_rms_norms(gm: fx.GraphModule) -> int:
    """Rewrite every recognised RMSNorm forward of `gm` in place; -> how many were fused."""
    for index, node in enumerate(gm.graph.nodes):
        node.meta["_fusion_position"] = index
    fused = 0
    for rsqrt in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.rsqrt.default]:
        try:
            found = _match(rsqrt)
        except _NoMatch as reason:
            log.debug("rms_norm fusion: not at %s: %s", rsqrt.name, reason)
            continue
        _rewrite(gm, found)
        fused += 1
        log.debug("rms_norm fusion: fused the norm of %s (rsqrt %s)", found["x"].name, rsqrt.name)
    for node in gm.graph.nodes:
        node.meta.pop("_fusion_position", None)
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused
