"""The iterations of a replayed tile loop as batched operations.

A compute replay (op_replay.py) makes each instruction's torch operations once per tile: a tile
loop of n iterations makes the same operation n times on views that step by a constant. Here the
generated function's calls are rescheduled so that such operations, when independent, run as one
operation on views with a leading dim of n (strides: the steps).

- Renaming: the interpreter reuses on-chip tiles across iterations (a buffer allocated outside the
  loop, a recycled pool slot), which would order every iteration after the one before. Each kept
  tile's accesses are split into def-use webs, element by element: a read joins the writes whose
  values it reads, a write in place (accumulation) the writes before it. Webs share no value, so
  each gets a buffer of its own; the buffers are laid out in one arena in order of first use, so
  that the iterations' tiles sit at offsets stepping by a constant.
- Scheduling: a dependency graph over the calls (read / write conflicts on overlapping extents of
  one storage; a guard before every write to the caller's tensors, as the plan requires). Ready
  calls that are not batched go first; then the earliest ready batchable call takes the other
  ready calls of its signature whose operands continue its arithmetic progression. Ready calls do
  not depend on one another, so one operation can make them all.
- Exactness: only operations whose every output element is a function of the input elements at
  the same position, computed in one IEEE-exact step, are batched (copies, float conversions,
  + - * /, comparisons, selects, fills). Their result does not depend on the layout or on which
  vector / scalar loop torch takes. Transcendentals (whose vector and scalar paths may differ in
  the last bit), reductions and matmuls (whose summation order depends on the layout) run per
  tile as recorded. A batched operation's output slice handed to an unbatched reader must have
  the layout that reader saw when recorded (checked on meta tensors).
- A written view must address each element once; a read may repeat (a column every iteration
  reads becomes a stride-0 dim).

The trace is the recorded run's (op_replay.Plan); only the torch calls that make the values change.
"""

from __future__ import annotations

import bisect
import heapq

import torch

from . import copy_batching

ARENA_BYTES = 64 << 20  # renamed on-chip tiles per plan (more: the plan is not batched)
MAX_CALLS = 50_000      # planning cost bound (a larger plan is not batched)
_ALIGN = 64

_aten = torch.ops.aten
_AS_STRIDED = _aten.as_strided.default
_EXPAND = _aten.expand.default
_UNBIND = _aten.unbind.int
_OVERWRITE = {"aten::copy_", "aten::fill_", "aten::zero_"}  # write their first argument without reading it
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Element-wise, one exactly rounded step per element (or exact): same bits in any layout and loop.
BATCHED = {_aten.copy_.default, _aten._to_copy.default, _aten.clone.default, _aten.fill_.Scalar, _aten.zero_.default,
           _aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor, _aten.neg.default,
           _aten.abs.default, _aten.reciprocal.default, _aten.maximum.default, _aten.minimum.default,
           _aten.lt.Scalar, _aten.lt.Tensor, _aten.le.Scalar, _aten.le.Tensor, _aten.gt.Scalar, _aten.gt.Tensor,
           _aten.ge.Scalar, _aten.ge.Tensor, _aten.eq.Scalar, _aten.eq.Tensor, _aten.ne.Scalar, _aten.ne.Tensor,
           _aten.masked_fill.Scalar, _aten.masked_fill_.Scalar, _aten.where.self, _aten.bitwise_or.Tensor,
           _aten.bitwise_and.Tensor, _aten.logical_not.default}


class _Operand:
    """A tensor a call names: its storage (`key`) and layout there (elements of `dtype`)."""

    __slots__ = ("kind", "key", "sizes", "strides", "offset", "dtype", "root")

    def __init__(self, kind, key, sizes, strides, offset, dtype, root=None):
        # kind: "p" a kept tile (plan-time tensor, renamed), "i" a plan-time constant, "view" a layout
        # of a caller's tensor or of one the function makes (root: that name), "temp" a tensor an
        # operation makes, "opaque" a view whose region is not known (its whole storage)
        self.kind, self.key, self.sizes, self.strides, self.offset, self.dtype, self.root = \
            kind, key, tuple(sizes), tuple(strides), offset, dtype, root

    def extent(self):
        """[lo, hi) bytes of its storage it may touch (a view op's output: its base's region)."""
        if self.sizes is None:
            return float("-inf"), float("inf")
        if any(s == 0 for s in self.sizes):
            return 0, 0
        size = torch.empty((), dtype=self.dtype).element_size()
        span = sum((n - 1) * st for n, st in zip(self.sizes, self.strides))
        return self.offset * size, (self.offset + span + 1) * size


def batched(calls: list, namespace: dict, layouts: dict, result_names: set, ref_type) -> list | None:
    """`calls` with tile loops batched (new plan-time tensors added to `namespace`), or None when
    nothing batches."""
    if len(calls) > MAX_CALLS or not any(c.func in BATCHED for c in calls):
        return None
    resolver = _Resolver(namespace, layouts, ref_type)
    accesses = [resolver.accesses(call) for call in calls]
    if resolver.failed:
        return None
    renamed = _rename(calls, accesses, namespace, resolver, ref_type)
    if renamed is None:
        return None
    calls = renamed
    resolver = _Resolver(namespace, layouts, ref_type)
    accesses = [resolver.accesses(call) for call in calls]
    if resolver.failed:
        return None
    groups = _schedule(calls, accesses, resolver)
    if all(len(g) == 1 for g in groups):
        return None
    return _Emitter(calls, accesses, resolver, namespace, result_names, ref_type).emit(groups)


def _refs(template, ref_type, path=()):
    """(path, name) of every _Ref in a call's args / kwargs template."""
    if isinstance(template, ref_type):
        yield path, template.name
    elif isinstance(template, dict):
        for k, v in template.items():
            yield from _refs(v, ref_type, path + (k,))
    elif isinstance(template, (tuple, list)):
        for i, v in enumerate(template):
            yield from _refs(v, ref_type, path + (i,))


def _replace(template, path, value):
    if not path:
        return value
    if isinstance(template, dict):
        return {k: (_replace(v, path[1:], value) if k == path[0] else v) for k, v in template.items()}
    return type(template)(_replace(v, path[1:], value) if i == path[0] else v for i, v in enumerate(template))


def _written_positions(func) -> set:
    """Top-level argument positions / names a func writes."""
    found = set()
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            found.add(argument.name if argument.kwarg_only else i)
    return found


class _Resolver:
    """Names -> _Operand, followed through the calls in order."""

    def __init__(self, namespace: dict, layouts: dict, ref_type) -> None:
        self.namespace, self.layouts, self.ref_type, self.operands, self.failed = namespace, layouts, ref_type, {}, False
        self.writes_cache: dict = {}

    def operand(self, name: str):
        found = self.operands.get(name)
        if found is not None or name[0] == "c":
            return found
        if name[0] in "pi":
            t = self.namespace[name]
            found = _Operand(name[0], ("s", t.untyped_storage().data_ptr()), t.shape, t.stride(), t.storage_offset(),
                             t.dtype)
        elif name[0] == "a":
            layout = self.layouts[name]
            found = _Operand("view", name, layout[1], layout[2], layout[3], layout[4], root=name)
        else:
            self.failed = True  # a name no call made
            return None
        self.operands[name] = found
        return found

    def accesses(self, call) -> list:
        """[(path, name, operand, reads, writes)] of the call's tensor arguments; defines its outputs."""
        written = self.writes_cache.get(call.func)
        if written is None:
            written = self.writes_cache[call.func] = _written_positions(call.func)
        overwrite = call.func._schema.name in _OVERWRITE
        found = []
        for path, name in _refs((call.args, call.kwargs), self.ref_type):
            operand = self.operand(name)
            if operand is None:
                continue
            is_written = path[1] in written and len(path) == 2
            found.append((path, name, operand, not (is_written and overwrite), is_written))
        for name in call.new:
            if call.func is _AS_STRIDED:
                root = self.operand(call.args[0].name)
                if root is None:
                    continue
                self.operands[name] = _Operand("view", root.key, call.args[1], call.args[2], call.args[3], root.dtype,
                                               root=call.args[0].name)
            elif call.func.is_view:  # (views but as_strided stay within their base's elements)
                base = found[0][2] if found else _Operand("opaque", name, None, None, 0, torch.float32)
                self.operands[name] = _Operand("opaque", base.key, base.sizes, base.strides, base.offset, base.dtype)
            else:
                layout = self.layouts.get(name)
                if layout is None or layout[0] != name:
                    self.operands[name] = _Operand("opaque", name, None, None, 0, torch.float32)
                else:
                    self.operands[name] = _Operand("temp", name, layout[1], layout[2], layout[3], layout[4])
        return found


# -- renaming: def-use webs of each kept tile -------------------------------------------------------

def _rename(calls, accesses, namespace, resolver, ref_type) -> list | None:
    """The calls with each kept tile's webs on buffers of their own, laid out in one arena; a fill
    of a tile narrowed to the elements something reads (dropped when nothing does)."""
    by_storage: dict = {}  # storage key -> [(call index, access index)]
    viewed = set()  # tiles a view operation aliases: its later readers are not followed, so one web
    for index, found in enumerate(accesses):
        for position, (_, _, operand, _, _) in enumerate(found):
            if operand.kind == "p":
                by_storage.setdefault(operand.key, []).append((index, position))
                if calls[index].func.is_view and calls[index].new:
                    viewed.add(operand.key)
    split = []  # per tile: (its uses, the web of each use, the bytes of each web)
    narrowed: dict = {}  # a fill's use -> the view of the elements read after it (None: none are)
    for key, uses in by_storage.items():
        webs, live = ([0] * len(uses), {}) if key in viewed else _webs(uses, calls, accesses, namespace)
        spans: dict = {}
        for node, (use, web) in enumerate(zip(uses, webs)):
            operand = accesses[use[0]][use[1]][2]
            if node in live:
                narrowed[use] = view = _narrowed(operand, live[node])
                if view is None:
                    continue
                operand = view
            lo, hi = operand.extent()
            old = spans.get(web)
            spans[web] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        if spans:
            split.append((uses, webs, spans))
    instance_of: dict = {}  # (call index, access index) -> instance number
    instances: list = []    # [storage, lo, hi, first call]: the bytes [lo, hi) of the tile a web touches
    total = 0
    for uses, webs, spans in sorted(split, key=lambda entry: sum(hi - lo for lo, hi in entry[2].values())):
        # the tiles with the fewest renamed bytes first; one whose copies do not fit keeps one buffer
        if total + sum(hi - lo + _ALIGN for lo, hi in spans.values()) > ARENA_BYTES:
            spans = {0: (min(lo for lo, _ in spans.values()), max(hi for _, hi in spans.values()))}
            webs = [0] * len(uses)
        storage = namespace[accesses[uses[0][0]][uses[0][1]][1]].untyped_storage()
        numbers = {}
        for use, web in zip(uses, webs):
            if web not in spans:
                continue  # (a dropped fill's web)
            number = numbers.get(web)
            if number is None:
                number = numbers[web] = len(instances)
                lo, hi = spans[web]
                instances.append([storage, lo - lo % _ALIGN, hi, use[0]])
                total += hi - lo + _ALIGN
            instance_of[use] = number
    # in the order of first use: the tiles of successive iterations at offsets stepping by a constant
    bases, total = {}, 0
    for number in sorted(range(len(instances)), key=lambda n: instances[n][3]):
        bases[number] = total
        total += -(-(instances[number][2] - instances[number][1]) // _ALIGN) * _ALIGN
    if total > ARENA_BYTES:
        return None
    arena = torch.empty(total, dtype=torch.uint8)
    for number, (storage, lo, hi, _) in enumerate(instances):  # each web starts from the tile's plan-time content
        source = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,))
        arena[bases[number]:bases[number] + hi - lo].copy_(source)
    arena_storage = arena.untyped_storage()
    names: dict = {}
    renamed = []
    for index, call in enumerate(calls):
        args, kwargs = call.args, call.kwargs
        dropped = False
        for position, (path, name, operand, _, _) in enumerate(accesses[index]):
            use = (index, position)
            if use in narrowed and narrowed[use] is None:
                dropped = True
                break
            number = instance_of.get(use)
            if number is None:
                continue
            view = narrowed.get(use, operand)
            layout = (view.sizes, view.strides, view.offset)
            new = names.get((name, number, layout))
            if new is None:
                t = namespace[name]
                new = names[name, number, layout] = f"{name}_w{len(names)}"
                offset = (bases[number] - instances[number][1]) // t.element_size() + view.offset
                namespace[new] = torch.empty(0, dtype=t.dtype).set_(arena_storage, offset, view.sizes, view.strides)
            args, kwargs = _put(args, kwargs, path, ref_type(new))
        if not dropped:
            renamed.append(type(call)(call.func, args, kwargs, call.outs, call.new, call.guard))
    return renamed


_FILLS = {"aten::fill_", "aten::zero_"}


def _webs(uses, calls, accesses, namespace):
    """(the web (a representative node) of each use of one kept tile, in order; {node of a fill:
    the tile's elements whose filled value something reads}). In each call its reads join the
    writes whose values they read (the tile's plan-time content is a write too), then its writes
    land; a call's uses of the tile are one web."""
    parent = list(range(len(uses) + 1))
    init = len(uses)  # the plan-time content

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a, b):
        a, b = find(a), find(b)
        if a != b:
            parent[max(a, b)] = min(a, b)

    operands = [accesses[c][a][2] for c, a in uses]
    if any(o.dtype != operands[0].dtype for o in operands):
        return [0] * len(uses), {}  # viewed as another dtype: one web
    tile = namespace[accesses[uses[0][0]][uses[0][1]][1]]
    numel = tile.untyped_storage().nbytes() // tile.element_size()
    last = torch.full((numel,), init, dtype=torch.int64)
    positions = torch.arange(numel)
    indices: dict = {}
    live: dict = {}  # fill node -> bool mask of the elements whose filled value is read
    pending: list = []
    current = None
    for node, ((c, a), operand) in enumerate(zip(uses, operands)):
        if c != current:
            for idx, writer in pending:
                last[idx] = writer
            pending, current = [], c
        elif node:
            union(node, node - 1)
        layout = (operand.sizes, operand.strides, operand.offset)
        idx = indices.get(layout)
        if idx is None:
            idx = indices[layout] = positions.as_strided(operand.sizes, operand.strides, operand.offset)
        _, _, _, reads, writes = accesses[c][a]
        if reads:
            writers = last[idx]
            for writer in writers.unique().tolist():
                union(node, writer)
                if writer in live:
                    live[writer][idx[writers == writer]] = True
        if writes:
            pending.append((idx, node))
            if a == 0 and calls[c].func._schema.name in _FILLS and len(accesses[c]) == 1:
                live[node] = torch.zeros(numel, dtype=torch.bool)
    return [find(n) for n in range(len(uses))], live


def _narrowed(operand, live):
    """The fill's view cut to the box of its elements in `live` (None: none is)."""
    inside = live[torch.arange(live.numel()).as_strided(operand.sizes, operand.strides, operand.offset)]
    if not bool(inside.any()):
        return None
    offset, sizes = operand.offset, []
    for d, stride in enumerate(operand.strides):
        along = inside.any(dim=tuple(e for e in range(inside.dim()) if e != d)) if inside.dim() > 1 else inside
        hit = along.nonzero().flatten()
        first, end = int(hit[0]), int(hit[-1]) + 1
        offset += first * stride
        sizes.append(end - first)
    return _Operand(operand.kind, operand.key, sizes, operand.strides, offset, operand.dtype)


# -- scheduling -------------------------------------------------------------------------------------

def _schedule(calls, accesses, resolver) -> list:
    """Groups of call indices in an order that keeps every dependency, batched ones together."""
    n = len(calls)
    succ = [set() for _ in range(n)]
    defined: dict = {}
    reads_of: dict = {}   # storage key -> [(lo, hi, index)]
    writes_of: dict = {}
    guards: list = []
    for i, (call, found) in enumerate(zip(calls, accesses)):
        preds = set()
        for _, name, operand, reads, writes in found:
            if name in defined:
                preds.add(defined[name])
            if operand.kind == "view" and operand.root in defined:
                preds.add(defined[operand.root])
            lo, hi = operand.extent()
            key = operand.key
            for lo2, hi2, j in writes_of.get(key, ()):
                if lo < hi2 and lo2 < hi:
                    preds.add(j)
            if writes:
                for lo2, hi2, j in reads_of.get(key, ()):
                    if lo < hi2 and lo2 < hi:
                        preds.add(j)
                if isinstance(key, str) and key[0] == "a":
                    preds.update(guards)  # a failed guard must find the caller's tensors unwritten
        for _, name, operand, reads, writes in found:
            lo, hi = operand.extent()
            if reads:
                reads_of.setdefault(operand.key, []).append((lo, hi, i))
            if writes:
                writes_of.setdefault(operand.key, []).append((lo, hi, i))
        for name in call.new:
            defined[name] = i
        if call.guard is not None:
            guards.append(i)
        preds.discard(i)
        for j in preds:
            succ[j].add(i)
    indegree = [0] * n
    for i in range(n):
        for j in succ[i]:
            indegree[j] += 1
    keys = [_key(call, found, resolver) for call, found in zip(calls, accesses)]
    remaining: dict = {}  # signature -> its calls not yet scheduled
    for key in keys:
        if key is not None:
            remaining[key] = remaining.get(key, 0) + 1
    singles: list = []  # heap of ready calls that are not batched
    ready_by_key: dict = {}  # signature -> its ready calls, in order
    done = [False] * n

    def make_ready(i):
        if keys[i] is None:
            heapq.heappush(singles, i)
        else:
            bisect.insort(ready_by_key.setdefault(keys[i], []), i)

    for i in range(n):
        if indegree[i] == 0:
            make_ready(i)
    groups = []
    while singles or ready_by_key:
        if singles:
            group = [heapq.heappop(singles)]
        else:
            # a signature whose calls are all ready (the earliest such), else the one with most ready
            key = min(ready_by_key, key=lambda k: (len(ready_by_key[k]) < remaining[k], -len(ready_by_key[k]),
                                                   ready_by_key[k][0]))
            ready = ready_by_key[key]
            group = _progression(ready[0], ready, accesses, calls)
            for j in group:
                ready.remove(j)
            if not ready:
                del ready_by_key[key]
            remaining[key] -= len(group)
        groups.append(group)
        for j in group:
            done[j] = True
        for j in group:
            for k in succ[j]:
                indegree[k] -= 1
                if indegree[k] == 0:
                    make_ready(k)
    if not all(done):
        raise AssertionError("op_batching: a dependency cycle")  # cannot happen: edges go forward
    return groups


def _key(call, found, resolver):
    """What calls must share to be batched (None: not batched)."""
    if call.func not in BATCHED or call.guard is not None or not (call.outs is None or len(call.new) == 1) \
            or not found:
        return None
    ndim = len(found[0][2].sizes)
    parts = []
    for _, name, operand, reads, writes in found:
        if operand.kind == "opaque" or len(operand.sizes) != ndim or (operand.kind == "i" and writes):
            return None
        parts.append((operand.kind, operand.sizes, operand.strides, operand.dtype,
                      operand.key if operand.kind == "view" else None, writes))
    if call.func in (_aten.add.Tensor, _aten.sub.Tensor) and (len(call.args) > 2 or call.kwargs.get("alpha", 1) != 1):
        return None  # a + alpha * b: one fused step in torch's vector loop, two in its scalar loop
    if call.func is _aten.copy_.default and found[1][2].dtype.is_floating_point \
            and not found[0][2].dtype.is_floating_point:
        return None  # float -> integer conversions of out-of-range values differ between loops
    if call.func is _aten._to_copy.default:
        dtype = _constant(call.kwargs.get("dtype"), resolver)
        if found[0][2].dtype.is_floating_point and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return None
    return (call.func, tuple(parts), _values(call.args, resolver), _values(call.kwargs, resolver))


def _constant(value, resolver):
    if isinstance(value, resolver.ref_type) and value.name[0] == "c":
        return resolver.namespace[value.name]
    return value


def _values(template, resolver):
    """The call's non-tensor arguments, hashable (tensor names dropped, constants by value)."""
    if isinstance(template, resolver.ref_type):
        if template.name[0] != "c":
            return None
        value = resolver.namespace[template.name]
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype, value.item())
        return ("constant", value)
    if isinstance(template, dict):
        return tuple((k, _values(v, resolver)) for k, v in sorted(template.items()))
    if isinstance(template, (tuple, list)):
        return tuple(_values(v, resolver) for v in template)
    return template


def _progression(first, candidates, accesses, calls) -> list:
    """`first` and the ready calls of its signature whose operands step on from it by constant steps."""
    group, steps = [first], None
    for j in candidates:
        if j == first:
            continue
        k = len(group)
        if steps is None:
            steps = _steps(accesses[first], accesses[j])
            if steps is None:
                continue
        elif not _continues(accesses[first], accesses[j], steps, k):
            continue
        group.append(j)
    if len(group) > 1 and not _writes_once(accesses[first], steps, len(group)):
        return [first]
    return group


def _steps(a, b):
    """Per tensor argument: its step from call a to call b, "same" (one tensor, read), "stack"
    (plan-time constants), "temp" (settled when emitting); None when b does not continue a."""
    steps = []
    for (_, name_a, oa, _, writes), (_, name_b, ob, _, _) in zip(a, b):
        if name_a == name_b:
            if writes:
                return None
            steps.append("same")
        elif oa.kind == "i":
            steps.append("stack")
        elif oa.kind == "temp":
            steps.append("temp")
        elif oa.key != ob.key or ob.offset < oa.offset or (oa.kind == "view" and oa.root != ob.root):
            return None
        else:
            steps.append(ob.offset - oa.offset)
    return steps


def _continues(a, b, steps, k) -> bool:
    for (_, name_a, oa, _, _), (_, name_b, ob, _, _), step in zip(a, b, steps):
        if step == "same":
            if name_a != name_b:
                return False
        elif isinstance(step, int):
            if ob.key != oa.key or ob.offset != oa.offset + k * step or (oa.kind == "view" and oa.root != ob.root):
                return False
    return True


def _writes_once(found, steps, count) -> bool:
    for (_, _, operand, _, writes), step in zip(found, steps):
        if writes and not (isinstance(step, int) and step > 0 and copy_batching.each_element_once(
                (count,) + operand.sizes, (step,) + operand.strides)):
            return False
    return True


# -- emitting ---------------------------------------------------------------------------------------

class _Emitter:
    def __init__(self, calls, accesses, resolver, namespace, result_names, ref_type) -> None:
        self.calls, self.accesses, self.resolver = calls, accesses, resolver
        self.namespace, self.result_names, self.ref = namespace, result_names, ref_type
        self.count = 0

    def emit(self, groups) -> list:
        groups, unbound = self._settled(groups)
        out, stacked = [], {}  # stacked: a batched call's member output name -> the batched output
        for g, group in enumerate(groups):
            if len(group) == 1:
                out.append(self.calls[group[0]])
            else:
                out.extend(self._batched(group, stacked, g in unbound))
        return out

    def _steps(self, group) -> list:
        return _steps(self.accesses[group[0]], self.accesses[group[1]])

    def _settled(self, groups):
        """(the groups less those whose inputs or outputs cannot be handed over, each dissolved into
        its calls in order; the groups whose members' outputs are also read one by one)."""
        while True:
            produced = {}  # member output name -> (group, member)
            member = {}
            for g, group in enumerate(groups):
                if len(group) > 1:
                    for k, i in enumerate(group):
                        member[i] = g
                        for name in self.calls[i].new:
                            produced[name] = (g, k)
            broken = {g for name, (g, _) in produced.items() if name in self.result_names}
            unbound = set()
            for g, group in enumerate(groups):
                steps = self._steps(group) if len(group) > 1 else None
                for position, (_, name, operand, _, _) in enumerate(self.accesses[group[0]]):
                    if steps is not None and steps[position] == "temp":
                        sources = [produced.get(self.accesses[i][position][1]) for i in group]
                        owners = {s[0] if s else None for s in sources}
                        if None in owners or len(owners) != 1 or [s[1] for s in sources] != list(range(len(group))) \
                                or len(groups[sources[0][0]]) != len(group):
                            broken.add(g)
                            unbound.update(o for o in owners if o is not None)
                        continue
                    for i in group:  # read as one tensor: a batched call's member output must exist by name
                        source = produced.get(self.accesses[i][position][1])
                        if source is not None:  # (as_strided's offsets are its own storage's: no slice)
                            (broken if self.calls[i].func is _AS_STRIDED else unbound).add(source[0])
            for g in unbound - broken:
                if not self._slices_keep_layout(groups[g]):
                    broken.add(g)
            if not broken:
                return groups, unbound
            regrouped = []
            for g, group in enumerate(groups):
                regrouped.extend([[i] for i in group] if g in broken else [group])
            groups = regrouped

    def _slices_keep_layout(self, group) -> bool:
        """Whether the batched output, sliced per member, has each member's recorded layout (an
        unbatched reader may depend on it: a matmul's or a reduction's order follows the layout)."""
        try:
            out = self._on_meta(group)
        except Exception:  # noqa: BLE001 - no meta kernel, or it refuses: keep the calls apart
            return False
        for i in group:
            layout = self.resolver.layouts.get(self.calls[i].new[0])
            if layout is None or tuple(out.shape[1:]) != tuple(layout[1]) or tuple(out.stride()[1:]) != tuple(layout[2]):
                return False
        return True

    def _on_meta(self, group):
        call = self.calls[group[0]]
        args, kwargs = call.args, call.kwargs
        for (path, _, operand, _, _), step in zip(self.accesses[group[0]], self._steps(group)):
            sizes = (len(group),) + operand.sizes
            if isinstance(step, int):
                strides = (step,) + operand.strides
            elif step == "same":
                strides = (0,) + operand.strides
            else:  # stacked: contiguous in front of the member's layout
                strides = (max(1, sum((n - 1) * st for n, st in zip(operand.sizes, operand.strides)) + 1),) \
                    + operand.strides
            meta = torch.empty_strided(sizes, strides, dtype=operand.dtype, device="meta")
            args, kwargs = _put(args, kwargs, path, meta)
        return call.func(*_resolved(args, self), **_resolved(kwargs, self))

    def _batched(self, group, stacked, unbind) -> list:
        calls = []
        first = self.calls[group[0]]
        make = type(first)
        args, kwargs = first.args, first.kwargs
        count = len(group)
        for position, ((path, name, operand, _, _), step) in enumerate(zip(self.accesses[group[0]],
                                                                             self._steps(group))):
            names = [self.accesses[i][position][1] for i in group]
            sizes = (count,) + operand.sizes
            if step == "temp":
                new = stacked[names[0]]
            elif operand.kind in "pi":  # plan-time tensors: the batched view is made here, once
                new = self._name("p")
                t = self.namespace[name]
                if step == "same":
                    self.namespace[new] = t.expand(sizes)
                elif step == "stack":
                    self.namespace[new] = torch.stack([self.namespace[n] for n in names])
                else:
                    self.namespace[new] = t.as_strided(sizes, (step,) + operand.strides, operand.offset)
            else:
                new = self._name("v")
                if step == "same":
                    calls.append(make(_EXPAND, (self.ref(name), list(sizes)), {}, self.ref(new), (new,)))
                else:
                    calls.append(make(_AS_STRIDED, (self.ref(operand.root), sizes, (step,) + operand.strides,
                                                    operand.offset), {}, self.ref(new), (new,)))
            args, kwargs = _put(args, kwargs, path, self.ref(new))
        if not first.new:
            calls.append(make(first.func, args, kwargs, None, ()))
            return calls
        out = self._name("v")
        for i in group:
            stacked[self.calls[i].new[0]] = out
        calls.append(make(first.func, args, kwargs, self.ref(out), (out,)))
        if unbind:
            names = tuple(self.calls[i].new[0] for i in group)
            calls.append(make(_UNBIND, (self.ref(out), 0), {}, tuple(self.ref(n) for n in names), names))
        return calls

    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}b{self.count}"


def _put(args, kwargs, path, value):
    if path[0] == 0:
        return _replace(args, path[1:], value), kwargs
    return args, _replace(kwargs, path[1:], value)


def _resolved(template, emitter):
    """A template with its constants' values (for a meta run)."""
    if isinstance(template, emitter.ref):
        return emitter.namespace[template.name]
    if isinstance(template, dict):
        return {k: _resolved(v, emitter) for k, v in template.items()}
    if isinstance(template, (tuple, list)):
        return type(template)(_resolved(v, emitter) for v in template)
    return template
