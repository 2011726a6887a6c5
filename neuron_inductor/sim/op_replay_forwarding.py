"""Copies a replay need not make: reads forwarded to the copy's source, dead copies dropped, and
an elementwise result written straight into the tile it was copied to.

The interpreter stages every value through tiles: an instruction computes `v = op(..)` and copies
it into its destination tile (`copy_(tile, v)`), a DMA copies an HBM view into an SBUF tile that
the next instruction reads, and kept buffers are copied into one another. In attention_fwd's
replay 726 of 1606 lines are such copies. These rewrites remove some, each changing no bit:

- forwarding: after `copy_(D, S)` with D and S of one shape, strides and dtype (a copy that casts
  is not one), a later elementwise reader of exactly D's view (any name of it) reads S instead,
  until D's or S's bytes are written again. The reader runs the same kernel on the same geometry
  (only its input's address differs): the same bits. Readers whose bits may depend on where the
  data sits (matmuls, through MKL; reductions) are not forwarded; neither are views (a view of S
  could be written through) nor the written arguments of an in-place operation.
- dead copies: a copy into a tile whose bytes nothing reads before a copy, fill or out= of the
  same view overwrites them, or the call ends (a kept tile's first value is re-initialised by the
  plan where it is read), is dropped. A copy into an argument, a result or a view of them is kept.
  `op(.., out=D); copy_(E, D)` with D read by nothing after becomes `op(.., out=E)`.
- out-fusion: `v = op(..); copy_(D, v)` with op elementwise, v read by nothing else and of D's
  shape, strides and dtype becomes `op(.., out=D)`, where op has an out= overload whose Python
  binding dispatches exactly it: the same iteration over the same geometry, written into D.
  `v = clone(x); copy_(D, v)` (or `_to_copy`) becomes `copy_(D, x)`: without a dtype change the
  same elements moved (any layouts), with one the same conversion on the same geometry.

Storage is tracked per name: a kept tile by its storage and byte extent, an argument, a result or
a tensor the replay makes by the name owning its storage (a view: its base's), with its byte
extent where it is an as_strided of its root and the whole storage otherwise. Whatever two names
may share, a write through one forgets what is known of the other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .op_replay_casts import byte_extent
from .op_replay_refs import Ref, arguments, ref_names, written_names, written_positions

_COPY = torch.ops.aten.copy_.default
_AS_STRIDED = torch.ops.aten.as_strided.default
_OVERWRITES = (_COPY, torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default)
# readers computing each output element from the same input elements whatever their address
_ELEMENTWISE_READERS = (_COPY, torch.ops.aten._to_copy.default, torch.ops.aten.clone.default)
_UNKNOWN = (float("-inf"), float("inf"))
_NEW_STORAGE = {"aten::set_", "aten::resize_", "aten::resize_as_", "aten::_resize_output_", "aten::swap_"}


class Region(NamedTuple):
    """The bytes a name addresses: `group` is the storage (or the name owning it), `key` the exact
    view (group, byte offset, shape, strides, dtype), None where the extent is not known."""

    group: object
    lo: float
    hi: float
    key: tuple | None


def forwarded(calls: list, namespace: dict, layouts: dict, visible: set, aliasing: dict, exact_binding) -> list:
    """`calls` with reads forwarded past copies, dead copies dropped and copied results fused.
    `layouts`: {name: (root, shape, strides, offset, dtype)} of the recorded tensors; `visible`: the
    names the caller sees (arguments, results); `aliasing`: {name: whether it is on its first
    input's storage} of the names made on an input's storage by operations that are no views
    (`_unsafe_view`); `exact_binding(call)`: whether the call's Python binding dispatches exactly
    its operation."""
    if not all(aliasing.values()) or any(call.func._schema.name in _NEW_STORAGE or (
            set(call.new) & aliasing.keys() and not (call.args and isinstance(call.args[0], Ref)))
            for call in calls):
        return calls  # a tensor given another storage, or an alias of no known base: regions would not hold
    regions = _Regions(namespace, layouts, aliasing)
    read_count: dict = {}
    for call in calls:
        for name in ref_names((call.args, call.kwargs)):
            read_count[name] = read_count.get(name, 0) + 1
    fused: set = set()  # the out= lines made here
    calls = _forward(calls, regions, read_count, visible, exact_binding, fused)
    return _without_dead_copies(calls, regions, visible, exact_binding, fused)


class _Regions:
    """Region of each name, as the calls make them (views share their base's group)."""

    def __init__(self, namespace: dict, layouts: dict, aliasing: dict) -> None:
        self.namespace, self.layouts, self.aliasing, self.known = namespace, layouts, aliasing, {}

    def of(self, name: str) -> Region | None:
        region = self.known.get(name)
        if region is None:
            region = self.known[name] = self._first(name)
        return region

    def _first(self, name: str) -> Region | None:
        t = self.namespace.get(name)
        if isinstance(t, torch.Tensor):  # a kept tile, a view of one, an initial value
            storage, lo, hi = byte_extent(t)
            return Region(("storage", storage), lo, hi,
                          (("storage", storage), t.storage_offset() * t.element_size(), tuple(t.shape), t.stride(), t.dtype))
        if name[0] == "c" or name not in self.layouts:
            return None  # a constant (no tensor the replay writes)
        _, shape, strides, offset, dtype = self.layouts[name]
        return _strided(("name", name), tuple(shape), tuple(strides), offset, dtype)

    def made(self, call) -> None:
        """Note the regions of the names `call` makes."""
        base = call.args[0] if call.args and isinstance(call.args[0], Ref) else None
        for name in call.new:
            if not call.func.is_view and name not in self.aliasing:
                self.known[name] = self._first(name)
                continue
            root = self.of(base.name) if base is not None else None
            if root is None:
                self.known[name] = Region(("name", name), *_UNKNOWN, None)
            elif call.func is _AS_STRIDED and len(call.args) == 4 and root.key is not None:
                sizes, strides, offset = call.args[1:4]
                self.known[name] = _strided(root.group, tuple(sizes), tuple(strides), offset, root.key[4])
            else:
                self.known[name] = Region(root.group, *_UNKNOWN, None)


def _strided(group, shape: tuple, strides: tuple, offset: int, dtype: torch.dtype) -> Region:
    size = dtype.itemsize
    span = sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else -1
    return Region(group, offset * size, (offset + span + 1) * size, (group, offset * size, shape, strides, dtype))


def _overlap(a: Region, b: Region) -> bool:
    return a.group == b.group and a.lo < b.hi and b.lo < a.hi


def _same_layout(a: Region, b: Region) -> bool:
    return a.key is not None and b.key is not None and a.key[2:] == b.key[2:]


_ELEMENTWISE: dict = {}  # operation -> whether it is an elementwise reader


def _written_regions(call, regions: _Regions) -> list:
    return [r for r in map(regions.of, written_names(call)) if r is not None]


def _visible_groups(regions: _Regions, visible: set) -> set:
    return {r.group for r in map(regions.of, visible) if r is not None}


def _is_elementwise_reader(call) -> bool:
    func = call.func
    if func not in _ELEMENTWISE:
        _ELEMENTWISE[func] = not func.is_view and (func in _ELEMENTWISE_READERS or torch.Tag.pointwise in func.tags)
    return call.guard is None and _ELEMENTWISE[func]


def _copy_pair(call, regions: _Regions):
    """(D, S) regions of `copy_(D, S)` between two views of one layout that do not overlap, or None."""
    if call.func is not _COPY or len(call.args) != 2 or call.kwargs or call.guard is not None:
        return None
    if not all(isinstance(a, Ref) for a in call.args):
        return None
    d, s = (regions.of(a.name) for a in call.args)
    if d is None or s is None or not _same_layout(d, s) or _overlap(d, s):
        return None
    return d, s


def _forward(calls: list, regions: _Regions, read_count: dict, visible: set, exact_binding, fused_ids: set) -> list:
    facts: dict = {}      # exact view of D -> (name of S, D's region, S's region): D holds S's values
    by_group: dict = {}   # group -> the views in `facts` with D or S in it
    out: list = []
    for call in calls:
        written = _written_regions(call, regions)
        if _is_elementwise_reader(call) and facts:
            call = _substituted(call, facts, written, regions)
            if call is None:
                continue  # a copy of a view into itself
        producer = out[-1] if out else None
        collapsed = _collapsed(producer, call, regions, read_count, visible)
        fused = None if collapsed is not None else _fused(producer, call, regions, read_count, visible,
                                                           exact_binding)
        if collapsed is not None:
            out[-1] = call = collapsed
        elif fused is not None:
            out[-1] = call = fused
            fused_ids.add(fused)
            written = _written_regions(call, regions)
        else:
            out.append(call)
        regions.made(call)
        for w in written:
            for key in list(by_group.get(w.group, ())):  # (every key here has its fact)
                _, d, s = facts[key]
                if _overlap(w, d) or _overlap(w, s):
                    del facts[key]
                    by_group[d.group].discard(key)
                    by_group[s.group].discard(key)
        pair = _copy_pair(call, regions) if fused is None else None
        if pair is not None:
            d, s = pair
            facts[d.key] = (call.args[1].name, d, s)
            by_group.setdefault(d.group, set()).add(d.key)
            by_group.setdefault(s.group, set()).add(d.key)
    return out


def _substituted(call, facts: dict, written: list, regions: _Regions):
    """`call` reading the source of each forwarded view it reads (not those it writes); None for a
    copy that then copies a view into itself."""
    positions = written_positions(call)
    changed = {}
    for position, value in arguments(call):
        if position in positions or not isinstance(value, Ref):
            continue
        r = regions.of(value.name)
        fact = facts.get(r.key) if r is not None and r.key is not None else None
        if fact is None:
            continue
        if call.func is _COPY and position == 1 and written and written[0].key == fact[2].key:
            return None  # a copy of D into S, which holds D's values already
        if not any(_overlap(w, fact[2]) for w in written):
            changed[position] = Ref(fact[0])
    if not changed:
        return call
    args = tuple(changed.get(i, a) for i, a in enumerate(call.args))
    kwargs = {k: changed.get(k, v) for k, v in call.kwargs.items()}
    return type(call)(call.func, args, kwargs, call.outs, call.new, call.guard)


_OUT_OVERLOADS: dict = {}


def _out_overload(func):
    """The out= overload of an operation: its arguments and one kwarg-only `out`, or None."""
    if func not in _OUT_OVERLOADS:
        arguments = [(a.name, str(a.type)) for a in func._schema.arguments]
        found = None
        for name in func.overloadpacket.overloads():
            candidate = getattr(func.overloadpacket, name)
            schema = candidate._schema
            outs = [a for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
            rest = [(a.name, str(a.type)) for a in schema.arguments if a not in outs]
            if len(outs) == 1 and outs[0].name == "out" and rest == arguments and len(schema.returns) == 1:
                found = candidate
                break
        _OUT_OVERLOADS[func] = found
    return _OUT_OVERLOADS[func]


_COPIES = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)


def _single_use(producer, call, read_count: dict, visible: set) -> bool:
    """Whether `call` is `copy_(D, v)` of producer's result v, which nothing else reads."""
    if producer is None or call.func is not _COPY or len(call.args) != 2 or call.kwargs or call.guard is not None:
        return False
    dst, src = call.args
    return (isinstance(dst, Ref) and isinstance(src, Ref) and producer.new == (src.name,)
            and isinstance(producer.outs, Ref) and producer.guard is None
            and read_count.get(src.name) == 1 and src.name not in visible)


def _collapsed(producer, call, regions: _Regions, read_count: dict, visible: set):
    """`copy_(D, x)` where producer is `v = clone(x)` or `v = _to_copy(x)` and `call` is `copy_(D, v)`
    of its only read, or None. Without a dtype change the two copies move the same elements as
    one (any layouts); a conversion is made on the same geometry (D's shape and strides are v's)."""
    if not _single_use(producer, call, read_count, visible) or producer.func not in _COPIES \
            or len(producer.args) != 1 or not isinstance(producer.args[0], Ref):
        return None
    x, d, v = (regions.of(a.name) for a in (producer.args[0], *call.args))
    if x is None or d is None or v is None or None in (x.key, d.key, v.key) or _overlap(x, d):
        return None
    if d.key[4] != v.key[4] or d.key[2] != v.key[2] or (x.key[4] != v.key[4] and d.key[3] != v.key[3]):
        return None
    return type(call)(_COPY, (call.args[0], producer.args[0]), {}, None, ())


def _fused(producer, call, regions: _Regions, read_count: dict, visible: set, exact_binding):
    """`producer` writing into D where `call` is `copy_(D, v)` of its only read of producer's result
    v (same shape, strides, dtype), or None."""
    if not _single_use(producer, call, read_count, visible) or producer.func.is_view \
            or torch.Tag.pointwise not in producer.func.tags or written_positions(producer) or "out" in producer.kwargs:
        return None
    dst, src = call.args
    d, v = regions.of(dst.name), regions.of(src.name)
    if d is None or v is None or not _same_layout(d, v):
        return None
    if _partly_in(producer, d, regions):
        return None
    out_func = _out_overload(producer.func)
    if out_func is None:
        return None
    fused = type(call)(out_func, producer.args, {**producer.kwargs, "out": dst}, None, ())
    return fused if exact_binding(fused) else None


def _partly_in(producer, d: Region, regions: _Regions) -> bool:
    """Whether an input of `producer` shares bytes with D other than as D's own view: torch refuses
    such an out= (or the order of its writes would matter)."""
    return any(r is not None and _overlap(r, d) and (r.key is None or r.key != d.key)
               for _, r in _input_regions(producer, regions))


def _without_dead_copies(calls: list, regions: _Regions, visible: set, exact_binding, fused: set) -> list:
    """Backward: a copy into a view whose bytes nothing reads before they are overwritten whole (by
    a copy, fill or out= of the same view) or the call ends is dropped, unless the caller sees them;
    `op(.., out=D); copy_(E, D)` with D read by nothing after becomes `op(.., out=E)`."""
    shown = _visible_groups(regions, visible)
    needed: dict = {}  # group -> {view key (or a unique id): (lo, hi)} read later
    unread = lambda r: r.group not in shown and not any(  # noqa: E731
        r.lo < hi and lo < r.hi for lo, hi in needed.get(r.group, {}).values())
    kept = []
    for index in range(len(calls) - 1, -1, -1):
        call = calls[index]
        writes_out = _writes_out(call, regions, fused)
        overwritten = _overwritten(call, regions, writes_out)
        if call.func is _COPY and overwritten is not None and call.guard is None:
            if unread(overwritten):
                continue  # nothing reads what it wrote
            retargeted = _retargeted(calls[index - 1] if index else None, call, regions, fused, unread)
            if retargeted is not None and exact_binding(retargeted):
                calls[index - 1] = retargeted
                fused.add(retargeted)
                continue
        if overwritten is not None and overwritten.key is not None:
            needed.get(overwritten.group, {}).pop(overwritten.key, None)
        skip = "out" if writes_out else 0
        for position, value in arguments(call):
            if position == skip and overwritten is not None:
                continue
            for name in ref_names(value):
                r = regions.of(name)
                if r is not None:
                    needed.setdefault(r.group, {})[r.key if r.key is not None else (index, name)] = (r.lo, r.hi)
        kept.append(call)
    kept.reverse()
    return kept


def _retargeted(producer, call, regions: _Regions, fused: set, unread):
    """`producer` (an out= line made here, writing D) writing into E instead, where `call` is
    `copy_(E, D)` between views of one layout and nothing reads D after; or None."""
    if producer is None or producer not in fused or len(call.args) != 2 or call.kwargs:
        return None
    dst, src = call.args
    if not isinstance(src, Ref) or producer.kwargs["out"].name != src.name:
        return None
    e, d = regions.of(dst.name), regions.of(src.name)
    if e is None or d is None or not _same_layout(e, d) or not unread(d) or _partly_in(producer, e, regions):
        return None
    return type(call)(producer.func, producer.args, {**producer.kwargs, "out": dst}, None, ())


def _overwritten(call, regions: _Regions, writes_out: bool) -> Region | None:
    """The region a copy, fill or out= line overwrites whole without reading it, or None."""
    if call.guard is not None:
        return None
    value = call.kwargs["out"] if writes_out else call.args[0] if call.func in _OVERWRITES and call.args else None
    return regions.of(value.name) if isinstance(value, Ref) else None


def _writes_out(call, regions: _Regions, fused: set) -> bool:
    """Whether `call` writes its out= argument whole without reading it: an out= line made here, or a
    recorded one (the interpreter's matmul into its PSUM bank: an out overload never reads `out`) none
    of whose inputs shares bytes with it."""
    if call in fused:
        return True
    out = call.kwargs.get("out")
    if not isinstance(out, Ref) or "out" not in written_positions(call):
        return False
    d = regions.of(out.name)
    if d is None or d.key is None:
        return False
    return all(not _overlap(r, d) if r is not None else name[0] == "c" for name, r in _input_regions(call, regions))


def _input_regions(call, regions: _Regions) -> list:
    """(name, region or None) of each tensor `call` reads, its out= argument left out."""
    inputs = {k: v for k, v in call.kwargs.items() if k != "out"}
    return [(name, regions.of(name)) for name in ref_names((call.args, inputs))]
