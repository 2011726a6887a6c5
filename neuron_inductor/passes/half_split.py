"""Pointwise math around a `cat` of two last-dim halves, computed per half (RoPE's rotate_half).

RoPE's `x * cos + cat([-x2, x1], -1) * sin` (and its backward's `g * cos + cat([p2, -p1], -1)` with
`p = g * sin`) slices and concatenates along the last dim, which ends every pointwise group: four
kernels per rotated tensor, each a pass over HBM. Elementwise ops commute with that split:
`f(cat([a, b]), y) = cat([f(a, y_lo), f(b, y_hi)])`. So the ATen graph is rewritten (before lowering)
so that the connected region of last-dim-D pointwise nodes, half slices and `cat`s of two halves
(D = 2h) is computed as two [..., h] programs: every value v of the region becomes (lo(v), hi(v)), a
half slice of v is lo(v) or hi(v), a `cat([a, b], -1)` is (a, b), and a value read from outside the
region is read through its two half slices (host views). The two halves are one pointwise group;
where a region value is read outside the region it is `cat([lo, hi], -1)`, one copy. Results are the
same elementwise ops on the same elements: equal bit for bit, padded or not.

Default-deny: only `aten.cat.default` of exactly two same-shape halves along the last dim seeds a
region; region nodes are pointwise ops this backend's kernels compute (`pointwise.is_pointwise`) whose
tensor operands are last-dim D or broadcast along it (size 1 there); half slices are
`slice(v, -1, 0, h)`, `slice(v, -1, h, >= D)` and `split_with_sizes(v, [h, h], -1)` items.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ..lowering import pointwise

aten = torch.ops.aten
log = logging.getLogger("neuron_inductor")


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _last(node) -> int | None:
    """The static size of the node's last dim (None: not a tensor, 0-d or symbolic)."""
    value = _val(node)
    if value is None or value.dim() == 0 or not isinstance(value.shape[-1], int):
        return None
    return value.shape[-1]


def _is_last_dim(node: fx.Node, dim) -> bool:
    return isinstance(dim, int) and dim in (-1, _val(node).dim() - 1)


def _seed_halves(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) if node is cat([a, b], -1) of two same-shape static tensors."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if len(tensors) != 2 or not all(_val(t) is not None for t in tensors):
        return None
    a, b = tensors
    if _val(a).shape != _val(b).shape or _val(a).dtype != _val(b).dtype or _last(a) is None:
        return None
    return (a, b) if _is_last_dim(node, dim) else None


def _half_of(node: fx.Node, size: int) -> tuple[fx.Node, int] | None:
    """(v, 0 | 1) if node is the low / high half of v along the last dim (v's last dim = 2 * size)."""
    if node.op != "call_function":
        return None
    if node.target is aten.slice.Tensor:
        source, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1 or _last(source) != 2 * size or not _is_last_dim(source, dim):
            return None
        if start in (0, None) and end == size:
            return source, 0
        if start == size and isinstance(end, int) and end >= 2 * size:
            return source, 1
        return None
    if node.target is operator.getitem:
        split, index = node.args
        if (isinstance(split, fx.Node) and split.op == "call_function"
                and split.target is aten.split_with_sizes.default and list(split.args[1]) == [size, size]
                and _is_last_dim(split.args[0], split.args[2] if len(split.args) > 2 else 0)):
            return split.args[0], index
    return None


class _Region:
    """One connected region around seed cats of halves of size `h`."""

    def __init__(self, h: int) -> None:
        self.h = h
        self.nodes: set[fx.Node] = set()  # last-dim 2h values computed per half

    def eligible(self, node: fx.Node) -> bool:
        """A pointwise node of last dim 2h whose tensor operands are 2h or 1 wide there."""
        if node.op != "call_function" or _last(node) != 2 * self.h or not pointwise.is_pointwise(node):
            return False
        return all(_val(arg) is not None and (_val(arg).dim() == 0 or _last(arg) in (1, 2 * self.h))
                   for arg in node.all_input_nodes)

    def _seed(self, node: fx.Node) -> bool:
        halves = _seed_halves(node)
        return halves is not None and _last(halves[0]) == self.h

    def _producer_joins(self, node: fx.Node) -> bool:
        """A producer joins only if nothing else needs it whole (its users are region nodes or half
        slices): a value read whole elsewhere stays one value, and its own producers' fusion is kept."""
        return self.eligible(node) and all(
            user in self.nodes or self._seed(user) or self.eligible(user) or _half_of(user, self.h) is not None
            for user in node.users)

    def grow(self, seed: fx.Node) -> None:
        """The seed and every eligible consumer of region values, the producers that only they read,
        and the values whose half slices make a seed's pieces (the backward's p = g * sin)."""
        pending = [seed]
        while pending:
            node = pending.pop()
            if node in self.nodes:
                continue
            self.nodes.add(node)
            pending += [user for user in node.users if self._seed(user) or self.eligible(user)]
            pending += [inp for inp in node.all_input_nodes if self._producer_joins(inp)]
            if self._seed(node):
                pieces = list(_seed_halves(node))
                for piece in pieces + [inp for p in pieces if pointwise.is_pointwise(p) for inp in p.all_input_nodes]:
                    half = _half_of(piece, self.h)
                    if half is not None and self._producer_joins(half[0]):
                        pending.append(half[0])


def _fake(target, args, kwargs, like: torch.Tensor) -> torch.Tensor:
    args, kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    with like.fake_mode:
        return target(*args, **kwargs)


def _call(graph: fx.Graph, target, args, kwargs=None) -> fx.Node:
    node = graph.call_function(target, tuple(args), kwargs or {})
    like = next(a for a in node.all_input_nodes if _val(a) is not None).meta["val"]
    node.meta["val"] = _fake(target, args, kwargs or {}, like)
    return node


def _rewrite(gm: fx.GraphModule, region: _Region) -> None:
    graph, h = gm.graph, region.h
    order = {node: i for i, node in enumerate(graph.nodes)}
    halves: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}

    def half(value: fx.Node, side: int) -> fx.Node:
        if value in halves:
            return halves[value][side]
        if _last(value) != 2 * h:  # broadcast along the last dim (or 0-d): both halves read it whole
            return value
        dim = _val(value).dim() - 1  # host views, made before the first region node reading them
        halves[value] = (_call(graph, aten.slice.Tensor, (value, dim, 0, h)),
                         _call(graph, aten.slice.Tensor, (value, dim, h, 2 * h)))
        return halves[value][side]

    for node in sorted(region.nodes, key=order.__getitem__):
        seed = _seed_halves(node)
        if seed is not None:
            halves[node] = seed
            continue
        with graph.inserting_before(node):
            pair = []
            for side in (0, 1):
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n, s=side: half(n, s))
                pair.append(_call(graph, node.target, args, kwargs))
            halves[node] = tuple(pair)
    for node in sorted(region.nodes, key=order.__getitem__):
        outside = []
        for user in list(node.users):
            if user in region.nodes:
                continue
            sliced = _half_of(user, h)
            if sliced is not None and sliced[0] is node:
                user.replace_all_uses_with(halves[node][sliced[1]])
            elif _seed_halves(node) is None:  # a seed cat read outside stays as it is
                outside.append(user)
        if outside:  # read whole outside the region: the halves joined once, before the first reader
            with graph.inserting_before(min(outside, key=order.__getitem__)):
                joined = _call(graph, aten.cat.default, (list(halves[node]), _val(node).dim() - 1))
            for user in outside:
                user.replace_input_with(node, joined)
    graph.eliminate_dead_code()


def split_concatenated_halves(gm: fx.GraphModule) -> int:
    """Rewrite every region in place; returns how many."""
    regions = 0
    done: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        seed = _seed_halves(node)
        if seed is None or node in done:
            continue
        region = _Region(_last(seed[0]))
        region.grow(node)
        done |= region.nodes
        if len(region.nodes) == 1 and all(_seed_halves(user) is None and not region.eligible(user)
                                          for user in node.users):
            continue  # a cat on its own: nothing to fuse with
        _rewrite(gm, region)
        regions += 1
        log.debug("neuron_inductor: %d nodes around %s computed per last-dim half", len(region.nodes), node.name)
    if regions:
        gm.graph.lint()
        gm.recompile()
    return regions
