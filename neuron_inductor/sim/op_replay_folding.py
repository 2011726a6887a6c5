"""Lines of a replay computed from constants alone run once, when the plan is made.

A kernel derives some tiles from constants only: the causal mask's key index compared with each
query row's partition index (an iota copied into a kept tile at the kernel's start), a memset column
scaled by an immediate. Their values are the same on every call, yet the replay recomputed them each
time (the tiny Llama step: 128 `le` compares of [128, 128] index tiles per step). Here such lines run
once, on the plan's own kept buffers, and are dropped from the replay:

- a line making tensors from unchanging tensors only (no guard, no write): its readers read its
  results, new names `k..` of the plan's namespace;
- the writes of a kept buffer written only from unchanging tensors, when no other line reads the
  buffer before its last write: the buffer then holds what those writes leave in it, as on every
  call (they start from what a call starts from: a buffer whose first value is read is
  re-initialised by the plan's first lines, themselves such writes).

Unchanging: a folded result, or a kept buffer (or its first value) whose writes are folded or that
nothing writes. Not folded: a line whose result the caller gets back or a later line writes, itself
or through a view or alias of it, nor the buffers such writes reach. A folded line runs the same
operation on the same values as every call would (the plan is made under the kernel's thread
count, as it runs), so no bit changes.
"""

from __future__ import annotations

import torch

from .op_replay_refs import map_refs, ref_names, renamed, written_names

FOLD_BYTES = 16 << 20  # per plan: the results it keeps; past it (or past `budget`), nothing is folded


def folded(calls: list, namespace: dict, result_names: set, aliased: set, budget: int) -> tuple[list, int]:
    """(`calls` less the lines computed from unchanging tensors, the bytes their results hold); the
    results join `namespace`. `aliased`: the names operations that are no views made on an input's
    memory (`_unsafe_view`); `budget`: the bytes the plans may still keep."""
    buffers = {n: t.untyped_storage().data_ptr() for n, t in namespace.items()
               if n[0] in "pi" and isinstance(t, torch.Tensor)}
    lines = [(written_names(call), _tensor_inputs(call)) for call in calls]  # (what each writes, reads)
    exposed = _exposed(calls, lines, result_names, buffers, aliased)
    unsafe = {buffers[n] for n in exposed if n in buffers}
    last_write, first_read = _buffer_uses(lines, buffers)
    while True:  # a buffer some write of which does not fold is written on every call: look again without it
        fold, failed = _decide(calls, lines, buffers, exposed, unsafe, last_write, first_read)
        if not failed:
            break
        unsafe |= failed
    found = _apply(calls, lines, fold, namespace, min(budget, FOLD_BYTES)) if fold else None
    return (calls, 0) if found is None else found


def _exposed(calls: list, lines: list, result_names: set, buffers: dict, aliased: set) -> set:
    """The names the caller sees or a line writes (kept buffers aside: their writes are followed
    by storage), and, back through every line whose result shares its inputs' memory (a view, an
    operation returning an alias or an `aliased` name), that line's inputs."""
    exposed = set(result_names)
    for written, _ in lines:
        exposed.update(n for n in written if n not in buffers)
    for call, (_, inputs) in zip(reversed(calls), reversed(lines)):
        if any(n in exposed for n in call.new) and (_returns_alias(call.func) or any(n in aliased for n in call.new)):
            exposed.update(inputs)
    return exposed


def _returns_alias(func) -> bool:
    return func.is_view or any(r.alias_info is not None for r in func._schema.returns)


def _buffer_uses(lines: list, buffers: dict) -> tuple[dict, dict]:
    """({storage: index of the last line writing it}, {storage: index of the first line reading it
    other than by writing it})."""
    last_write, first_read = {}, {}
    for index, (names, inputs) in enumerate(lines):
        written = {buffers.get(n) for n in names}
        for storage in written:
            last_write[storage] = index
        for name in inputs:
            if buffers.get(name) not in written:
                first_read.setdefault(buffers.get(name), index)
    return last_write, first_read


def _decide(calls: list, lines: list, buffers: dict, exposed: set, unsafe: set, last_write: dict,
            first_read: dict) -> tuple[set, set]:
    """(indices of the lines to fold, storages of buffers written by a line that does not fold)."""
    settling = {s for s, i in last_write.items()
                if s is not None and s not in unsafe and first_read.get(s, i + 1) > i}
    # what the lines may read: nothing reads a settling buffer before its last write
    settled = settling | {s for s in buffers.values() if s not in unsafe and s not in last_write}
    made: set = set()  # names the folded lines make
    fold, failed = set(), set()
    for index, (call, (written, inputs)) in enumerate(zip(calls, lines)):
        unchanging = all(n in made or buffers.get(n) in settled for n in inputs if n not in written)
        if written:
            targets = {buffers.get(n) for n in written}
            if targets <= settling and unchanging and not call.new:
                fold.add(index)
            else:
                failed |= targets & settling
        elif call.guard is None and call.new and inputs and unchanging and not any(n in exposed for n in call.new):
            fold.add(index)
            made.update(call.new)
    return fold, failed


def _apply(calls: list, lines: list, fold: set, namespace: dict, budget: int) -> tuple[list, int] | None:
    """Runs the folding lines (their results into `namespace`) and returns the others, renamed, and
    the bytes the results hold; None when a line gives what it may not keep (a non-tensor result,
    more than `budget` bytes): the writes folded so far are then done again by their lines on each
    call, as before."""
    rename: dict = {}
    results: dict = {}
    held = 0
    lookup = lambda ref: results.get(ref.name, namespace.get(ref.name))  # noqa: E731
    kept = []
    for index, call in enumerate(calls):
        if index not in fold:
            kept.append((call, lines[index][1]))
            continue
        with torch.no_grad():
            value = call.func(*map_refs(call.args, lookup), **map_refs(call.kwargs, lookup))
        if not call.new:
            continue  # a write of a settling buffer, done
        names = ref_names(call.outs)
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if len(names) != len(values) or not all(isinstance(v, torch.Tensor) for v in values):
            return None
        held += sum(v.untyped_storage().nbytes() for v in values)
        if held > budget:
            return None
        for name, v in zip(names, values):
            results[name] = v
            rename[name] = f"k{name}"
    for name, v in results.items():
        namespace[f"k{name}"] = v
    return [type(c)(c.func, renamed(c.args, rename), renamed(c.kwargs, rename), c.outs, c.new, c.guard)
            if any(n in rename for n in inputs) else c for c, inputs in kept], held


def _tensor_inputs(call) -> list:
    """The names of the tensors a line reads: every name but the constants (c..)."""
    return [n for n in ref_names((call.args, call.kwargs)) if n[0] != "c"]
