"""The argument templates of a replay plan's lines: values, with a `Ref` (a variable of the generated
function) where a tensor goes, in nested dicts, tuples and lists; and what a line's operation writes.
Shared by the plan (op_replay) and its passes (casts, forwarding, transposes)."""

from __future__ import annotations


class Ref:
    """A variable of the generated replay function: a0.. the arguments, c0.. constants, v0.. the
    kernel's tensors, p.. kept buffers, i.. their first values, k.. results computed from constants
    once (op_replay_folding)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def map_refs(template, on_ref):
    """`template` with each Ref replaced by `on_ref(ref)`."""
    if isinstance(template, Ref):
        return on_ref(template)
    if isinstance(template, dict):
        return {k: map_refs(v, on_ref) for k, v in template.items()}
    if isinstance(template, (tuple, list)):
        return type(template)(map_refs(t, on_ref) for t in template)
    return template


def renamed(template, rename: dict):
    """`template` with the names in `rename` replaced."""
    return map_refs(template, lambda ref: Ref(rename.get(ref.name, ref.name)))


def ref_names(template) -> list:
    """The names of the Refs in `template`, in order (a name once per use)."""
    if isinstance(template, Ref):
        return [template.name]
    if isinstance(template, dict):
        return [n for t in template.values() for n in ref_names(t)]
    if isinstance(template, (tuple, list)):
        return [n for t in template for n in ref_names(t)]
    return []


_WRITTEN: dict = {}  # operation -> written_positions of its schema (looked up once)


def written_positions(call) -> frozenset:
    """Positions (and keyword names) of the arguments a line's operation writes."""
    found = _WRITTEN.get(call.func)
    if found is None:
        found = _WRITTEN[call.func] = frozenset(
            argument.name if argument.kwarg_only else i for i, argument in enumerate(call.func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write)
    return found


def written_names(call) -> list:
    """The names a line's operation writes (through the arguments at its written positions)."""
    positions = written_positions(call)
    return [n for position, value in arguments(call) if position in positions for n in ref_names(value)] \
        if positions else []


def arguments(call):
    """(position or keyword, value) of a line's top-level arguments."""
    yield from enumerate(call.args)
    yield from call.kwargs.items()
