"""Fuse the LM head with its cross-entropy, in Dynamo graphs (before AOTAutograd).

Matched (and nothing else; every other variant keeps today's path):

    logits = linear(h, W)  |  h @ W.t()  |  matmul(h, W.t())       h [..., d], W [V, d], no bias
    x = logits [.float() | .to(torch.float32)] [.view(-1, V) | .reshape(-1, V)] [.contiguous()]
               [[a:b, c:d] slices of leading dims]                               (any order)
    loss = F.cross_entropy(x, y, ignore_index=int, reduction=..., label_smoothing=float)

with x of shape [N, V], h and W of one dtype (fp32 or bf16), y int64 [N], no class weights, static
d and V. x is fp32 (Hugging Face's loss upcasts bf16 logits) or h's dtype: a bf16 loss is then
computed in fp32 and rounded once (eager rounds every log-probability to bf16 first; the fused
result is the more accurate one, within bf16 rounding of eager's). The match becomes
`neuron_inductor::lm_head_loss(h.reshape(-1, d), W, y, ...)[0]` (lowering/lm_head_loss.py), whose
autograd formula AOTAutograd traces into the backward graph: neither graph holds the [N, V]
logits, their fp32 copy or the log-softmax. A training loss with reduction mean or sum (h and W
need gradients) becomes `lm_head_loss_with_grads` instead: its forward kernel also makes grad_h and
grad_W, and the backward graph only scales them by the loss's cotangent.

When the logits themselves are also used (Hugging Face returns them as an output), the match
becomes `lm_head_logits_loss`, whose forward kernel also writes the logits (in h's dtype, once, as
it computes them) and whose backward adds their cotangent: the fp32 [N, V] tensors are still
avoided. The logits' fp32 / reshaped intermediates must have no other user.

This runs on the graph Dynamo hands the backend, which holds torch functions and Tensor methods;
AOTAutograd then sees the custom op whole (it has no decomposition). On padded graphs (bucketing)
the fused ops' padded rows are neutralised by the pad rule at the end of this module.
"""

from __future__ import annotations

import inspect
import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from ..lowering import lm_head_loss as fused
from ..lowering.common import arg
from ..lowering.registry import pad_rule
from .padded_layout import tensor_val
from .pad_rewriter import Unsafe

aten = torch.ops.aten
log = logging.getLogger("neuron_inductor")

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {operator.matmul, torch.matmul}
_UPCASTS = {"float", "to"}
_RESHAPES = {"view", "reshape"}


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


@dataclass
class _Match:
    loss: fx.Node          # the cross_entropy call
    logits: fx.Node        # the LM head matmul
    between: list[fx.Node]  # upcast / reshape nodes from logits to the loss input, in order
    hidden: fx.Node
    weight: fx.Node
    target: fx.Node
    options: tuple         # (ignore_index, reduction, label_smoothing)


def _lm_head(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(h, W) of `linear(h, W)` / `h @ W.t()`, else None."""
    if node.op != "call_function":
        return None
    if node.target in _LINEAR and len(node.args) in (2, 3) and not node.kwargs:
        if len(node.args) == 3 and node.args[2] is not None:
            return None
        return node.args[0], node.args[1]
    if node.target in _MATMUL and len(node.args) == 2 and not node.kwargs:
        transposed = node.args[1]
        if (isinstance(transposed, fx.Node) and transposed.op == "call_method" and transposed.target == "t"
                and len(transposed.args) == 1 and not transposed.kwargs):
            return node.args[0], transposed.args[0]
    return None


def _leading_slices(node: fx.Node) -> bool:
    """`x[a:b, c:d]`: slices of dims before the last (the vocabulary), which commute with the LM head."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    before = _value(node.args[0])
    return (before is not None and 0 < len(index) < before.dim()
            and all(isinstance(i, slice) and all(isinstance(v, (int, type(None))) for v in (i.start, i.stop, i.step))
                    for i in index))


def _step_back(node: fx.Node) -> fx.Node | None:
    """The input of a value-preserving step between the LM head and the loss, else None: an upcast to
    fp32, a reshape to [-1, V] that keeps the element order, contiguous(), or leading-dim slices."""
    if _leading_slices(node):
        return node.args[0]
    if node.op != "call_method" or node.target not in _UPCASTS | _RESHAPES | {"contiguous"} or not node.args:
        return None
    source, out = node.args[0], _value(node)
    before = _value(source)
    if out is None or before is None:
        return None
    if node.target == "contiguous":
        return source if len(node.args) == 1 and not node.kwargs else None
    if node.target in _UPCASTS:  # float() / to(torch.float32): same shape, fp32
        extra = list(node.args[1:]) + list(node.kwargs.values())
        if node.target == "float" and extra or node.target == "to" and extra != [torch.float32]:
            return None
        return source if out.dtype == torch.float32 and out.shape == before.shape else None
    if out.dim() == 2 and before.dim() >= 2 and out.shape[1] == before.shape[-1] and out.dtype == before.dtype:
        return source  # a view / reshape to [rows, V]: row-major order is unchanged
    return None


def _cross_entropy_options(node: fx.Node) -> tuple[fx.Node, fx.Node, tuple] | str:
    try:
        bound = _CROSS_ENTROPY.bind(*node.args, **node.kwargs)
    except TypeError as exc:
        return f"unreadable cross_entropy arguments ({exc})"
    bound.apply_defaults()
    a = bound.arguments
    if a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None:
        return "class weights or the legacy size_average / reduce arguments"
    if not isinstance(a["ignore_index"], int) or not isinstance(a["label_smoothing"], (int, float)):
        return "ignore_index / label_smoothing computed in the graph"
    if not 0.0 <= a["label_smoothing"] < 1.0:
        return f"label_smoothing {a['label_smoothing']} (fused: 0 <= eps < 1)"
    if a["reduction"] not in fused.REDUCTIONS:
        return f"reduction {a['reduction']!r}"
    return a["input"], a["target"], (a["ignore_index"], a["reduction"], float(a["label_smoothing"]))


def _match(node: fx.Node) -> _Match | str | None:
    """The fusable pattern ending at a cross_entropy call; a reason string when it is close but
    not taken; None when `node` is no cross_entropy."""
    if node.op != "call_function" or node.target is not F.cross_entropy:
        return None
    read = _cross_entropy_options(node)
    if isinstance(read, str):
        return read
    x, target, options = read
    between: list[fx.Node] = []
    head = None
    current = x
    while isinstance(current, fx.Node) and head is None:
        head = _lm_head(current)
        if head is None:
            previous = _step_back(current)
            if previous is None:
                return None if not between else "an op other than an fp32 upcast or a reshape between the LM head and the loss"
            between.insert(0, current)
            current = previous
    if head is None:
        return None
    hidden, weight = head
    h, w, y, logits_in = _value(hidden), _value(weight), _value(target), _value(x)
    if any(v is None for v in (h, w, y, logits_in)):
        return "missing example values"
    if any(type(v) is not FakeTensor for v in (h, w, y)):
        return "tensor subclasses (e.g. DTensor) have no rule for the fused op"
    if w.dim() != 2 or h.dim() < 2 or h.shape[-1] != w.shape[1] or not all(isinstance(s, int) for s in w.shape):
        return f"h {list(h.shape)} and W {list(w.shape)} are not [..., d] and [V, d] with static d and V"
    if h.dtype != w.dtype or h.dtype not in fused.FLOAT_DTYPES:
        return f"h / W dtypes {h.dtype} / {w.dtype}"
    if logits_in.dtype not in (torch.float32, h.dtype) or logits_in.dim() != 2:
        return f"the loss input is {logits_in.dtype} of rank {logits_in.dim()} (fused: fp32 or h's dtype, [N, V])"
    if y.dtype != torch.int64 or y.dim() != 1:
        return f"target {y.dtype} of rank {y.dim()} (fused: int64 class indices [N])"
    if any(len(n.users) != 1 for n in between):
        return "the upcast / reshaped logits are also used elsewhere"
    others = [user for user in current.users if user not in between and user is not node]
    if others and any(_leading_slices(n) for n in between):
        return "the logits are also used, and the loss reads a slice of them"
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    if any(order[user] < order[node] for user in others):
        return "the logits are also used before the loss"
    return _Match(node, current, between, hidden, weight, target, options)


def _rewrite(graph: fx.Graph, m: _Match) -> str:
    h = _value(m.hidden)
    chain = set(m.between) | {m.loss}
    others = [user for user in m.logits.users if user not in chain]
    op = fused.lm_head_logits_loss if others else fused.lm_head_loss_with_grads if _gradients_in_forward(m) else fused.lm_head_loss
    with graph.inserting_before(m.loss):
        rows = m.hidden
        for step in m.between:  # the logits' leading-dim slices, taken of h instead
            if _leading_slices(step):
                rows = graph.call_function(operator.getitem, (rows, step.args[1]))
        rows = graph.call_method("reshape", (rows, -1, int(_value(m.weight).shape[1]))) if rows is not m.hidden or h.dim() != 2 else rows
        call = graph.call_function(op._opoverload, (rows, m.weight, m.target, *m.options))
        loss = graph.call_function(operator.getitem, (call, 0))
        if _value(m.loss).dtype != torch.float32:  # a loss of bf16 logits: computed in fp32, rounded once
            loss = graph.call_method("to", (loss, _value(m.loss).dtype))
    m.loss.replace_all_uses_with(loss)
    graph.erase_node(m.loss)
    for node in reversed(m.between):
        graph.erase_node(node)
    if others:
        with graph.inserting_after(loss):
            flat = graph.call_function(operator.getitem, (call, 3))
        logits = flat
        if h.dim() != 2:  # back to h's leading dims (sizes read in the graph: they may be symbolic)
            with graph.inserting_after(flat):
                size = graph.call_method("size", (m.hidden,))
            with graph.inserting_after(size):
                leading = graph.call_function(operator.getitem, (size, slice(None, -1)))
            with graph.inserting_after(leading):
                logits = graph.call_method("unflatten", (flat, 0, leading))
        m.logits.replace_all_uses_with(logits)
    transposed = m.logits.args[1] if m.logits.target in _MATMUL else None
    graph.erase_node(m.logits)
    if transposed is not None and not transposed.users:
        graph.erase_node(transposed)
    if others:
        return "with the logits written once (the graph also uses them)"
    return "logits never written" + (", gradients made in the forward" if op is fused.lm_head_loss_with_grads else "")


def _gradients_in_forward(m: _Match) -> bool:
    """A training loss (it, h and W need gradients) with a scalar cotangent (mean / sum): the forward
    makes both gradients and the backward only scales them. A frozen W, or reduction "none", keeps
    the forward + backward pair."""
    return (m.options[1] in fused.GRAD_REDUCTIONS
            and all(_value(n).requires_grad for n in (m.loss, m.hidden, m.weight)))


def fuse_lm_head_loss(gm: fx.GraphModule) -> int:
    """Rewrite every matched LM head + cross-entropy of a Dynamo graph; returns how many. Each
    rewrite, and each near miss with its reason, is logged."""
    done = 0
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None:
            continue
        if isinstance(match, str):
            log.info("neuron_inductor: cross_entropy %s keeps the unfused LM head + loss path: %s", node.name, match)
            continue
        how = _rewrite(gm.graph, match)
        log.info("neuron_inductor: fused LM head + cross-entropy at %s (%s)", node.name, how)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


# op -> positions of (hidden, weight, target, ignore_index) in its arguments; the backward's
# grad_logits (position 9) has padded rows too (its unscaled_grad_h is finite there: the forward's
# padded rows of h are zeroed, and their coefficient is 0).
_PADDED_ROWS = {
    fused.lm_head_loss._opoverload: (0, 1, 2, 3),
    fused.lm_head_logits_loss._opoverload: (0, 1, 2, 3),
    fused.lm_head_loss_with_grads._opoverload: (0, 1, 2, 3),
    fused.lm_head_loss_backward._opoverload: (1, 2, 3, 6),
}
_GRAD_LOGITS = 9


def _set_argument(node: fx.Node, position: int, name: str, value: fx.Node) -> None:
    if len(node.args) > position:
        node.update_arg(position, value)
    else:
        node.update_kwarg(name, value)


@pad_rule(*_PADDED_ROWS, what="padded rows: target -> ignore_index, h (and grad_logits) -> 0; refused on a padded d or V")
def _neutral_padded_rows(rewriter, node: fx.Node) -> None:
    """Padded rows then add nothing to the loss, the count or grad_W, and get grad_h 0 (h is zeroed
    too, so that their logits are finite: 0 * a non-finite value would poison grad_W)."""
    hidden_at, weight_at, target_at, ignore_at = _PADDED_ROWS[node.target]
    hidden, weight, target = node.args[hidden_at], node.args[weight_at], node.args[target_at]
    if rewriter.padded_dims(weight) or rewriter.padded_dims(hidden, [1]):
        raise Unsafe("the hidden or vocabulary dim is padded")
    mask = rewriter.mask_for(target, None)
    if mask is None:
        return
    ignore = rewriter.call(aten.scalar_tensor.default, node.args[ignore_at], dtype=tensor_val(target).dtype)
    node.update_arg(target_at, rewriter.call(aten.where.self, mask, target, ignore))
    node.update_arg(hidden_at, rewriter.masked(hidden, [0], "zero"))
    grad_logits = arg(node, _GRAD_LOGITS, "grad_logits") if node.target is fused.lm_head_loss_backward._opoverload else None
    if grad_logits is not None:
        _set_argument(node, _GRAD_LOGITS, "grad_logits", rewriter.masked(grad_logits, [0], "zero"))
    rewriter.note(node, "padded rows: target -> ignore_index, h -> 0")
