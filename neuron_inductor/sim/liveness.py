"""On-chip tiles freed at their last use, as NKI's allocators do, when a new tile would not fit.

NKI's allocators place a tile by its lifetime in the kernel: the default flow colours the traced
instruction stream, and the linear one "assigns an address to a tile at its first write and
releases the address after its last read" (nki.compiler.Allocation). The interpreter otherwise
frees a tile when Python drops its last reference, which is later: a name bound to a loop
iteration's tile keeps it until the next iteration rebinds the name, although nothing reads it
after the last read of this iteration. When an allocation would overflow SBUF or PSUM,
`reclaim` finds the running program's tiles that no live variable can reach any more and
frees them; only then is the capacity error raised, so a kernel that really keeps too many
tiles live still fails.

A variable is live where some path of its function's control flow reaches a read of it before
a rebinding (backward dataflow over the statements of the function's source: loops, branches,
break / continue, with); a variable an inner function captures is always live. An `if` whose
test the frame's values already fix keeps only its taken branch, as the trace does
(liveness_branches.py). A frame in the middle of a call keeps only what its statement still reads
after the call (its bytecode after f_lasti). What the live
variables of the program's kernel frames reach through lists, tuples, dicts, sets, NKI tensors
and objects' attributes stays. So does every object with more references than those frames and
that walk account for: it is also held elsewhere (an expression being evaluated, the
interpreter's own frames, a global, a closure). A frame whose source cannot be analysed (no
source, `try`, `match`, `global`, `locals()`, `exec`) keeps all its variables: the rule errs
towards keeping tiles, never towards freeing one that is still read.
"""

from __future__ import annotations

import ast
import dis
import functools
import inspect
import math
import pathlib
import sys
import textwrap
import types

import torch

from . import cores, dtypes
from . import liveness_branches as branches
from . import tensor as tensors

_SIM_DIR = str(pathlib.Path(__file__).parent)
_MAX_VISITS = 200_000  # objects walked from the roots before giving up (then nothing is freed)
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.FrameType, torch.Tensor, str, bytes, int, float, complex, bool, type(None))


def reclaim(pool) -> int:
    """Free the tiles of `pool` (the running program's) that no live variable reaches; -> bytes freed."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not cores._run_one.__code__:
        if not frame.f_code.co_filename.startswith(_SIM_DIR):  # the interpreter's frames hold live operands
            frames.append(frame)
        frame = frame.f_back
    if frame is None or not pool.allocations:
        return 0  # outside a kernel launch (tiles made by tests, or the default context): nothing is freed
    dead = _dead_allocations(frames, pool)
    for alloc in dead:
        _free(alloc, pool)
    return sum(alloc.nbytes for alloc in dead)


def _dead_allocations(frames, pool) -> list:
    """The Allocations of `pool` that only dead variables of the kernel frames reach.

    The walk starts from every variable of the kernel frames, dead or live. An object with more
    references than the walk and the frames' bindings explain is also held elsewhere (an expression
    being evaluated, the interpreter's own frames, a module global, a traceback): it counts as live.
    What the live variables and those objects reach stays; the rest of the pool's tiles are dead."""
    bindings, live_ids = {}, set()
    for frame in frames:
        local_vars = frame.f_locals
        factor = 2 if isinstance(local_vars, dict) else 1  # a real f_locals dict holds a reference too
        live = _live_names(frame.f_code, frame.f_lineno, frame.f_lasti, local_vars)
        for name, value in local_vars.items():
            bindings[id(value)] = bindings.get(id(value), 0) + factor
            code = frame.f_code  # a closure's variables may be read by a later call of the inner function
            if live is None or name in live or name in code.co_cellvars or name in code.co_freevars:
                live_ids.add(id(value))
        local_vars = value = None  # (a name left bound here would be one more reference to count)
    nodes, children = _walk(frames)
    if nodes is None:
        return []
    incoming = {}
    for kids in children.values():
        for kid in kids:
            incoming[kid] = incoming.get(kid, 0) + 1
    for key in nodes:
        # held here by `nodes` and by getrefcount's argument
        if sys.getrefcount(nodes[key]) - 2 > incoming.get(key, 0) + bindings.get(key, 0):
            live_ids.add(key)
    reached, stack = set(), [key for key in live_ids if key in nodes]
    while stack:
        key = stack.pop()
        if key not in reached:
            reached.add(key)
            stack.extend(children[key])
    return [alloc for key, ref in list(pool.allocations.items())
            if key in nodes and key not in reached and (alloc := ref()) is not None]


def _walk(frames):
    """({id: object}, {id: [child ids]}) of everything the frames' variables reach, or (None, None)."""
    nodes, children = {}, {}
    stack = [value for frame in frames for value in frame.f_locals.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, _OPAQUE) or id(value) in nodes:
            continue
        nodes[id(value)] = value
        if len(nodes) > _MAX_VISITS:
            return None, None
        kids = _referents(value)
        children[id(value)] = [id(kid) for kid in kids if not isinstance(kid, _OPAQUE)]
        stack.extend(kids)
    return nodes, children


def _referents(value) -> list:
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, tensors.Allocation):
        return []
    kids = list(getattr(value, "__dict__", {}).values())
    for cls in type(value).__mro__:
        for slot in cls.__dict__.get("__slots__", ()):
            if slot not in ("__weakref__", "__dict__") and hasattr(value, slot):
                kids.append(getattr(value, slot))
    return kids


def _free(alloc, pool) -> None:
    """Give the tile's bytes back now; its storage is poisoned as a reused address would be."""
    pool.release(alloc.nbytes, alloc)
    alloc.pool = None  # (its __del__ then gives nothing back a second time)
    storage = alloc.storage
    storage.fill_(math.nan if storage.is_floating_point() else dtypes.fill_value(dtypes.int32))


# ---------------------------------------------------------------------------- liveness of names

class _Unknown(Exception):
    """Source this analysis does not model: every variable counts as live."""


@functools.lru_cache(maxsize=512)
def _parsed(code):
    """(function AST, its first line in the file, its `if` tests, its stable names) of `code`, or None."""
    try:
        lines, first = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return (function, first) + branches.branch_tests(function)


@functools.lru_cache(maxsize=512)
def _function_liveness(code, decided=()):
    """(statement nodes with their line spans, the names live on entry to each, on exit from each) of
    `code`'s function, the `if`s of `decided` ((key, taken) pairs) keeping only their taken branch."""
    parsed = _parsed(code)
    if parsed is None:
        return None
    function, first = parsed[:2]
    graph = _Graph(first - 1, dict(decided))  # parsed line k is file line first + k - 1
    try:
        graph.block(function.body, None)
    except _Unknown:
        return None
    return graph.solve()


def _live_names(code, lineno, lasti, local_vars) -> set | None:
    """Names whose value may still be read by the statement running at `lineno` (at bytecode offset
    `lasti`) or after it (None: unknown). `if`s that the frame's values already decide
    (liveness_branches) count only their taken branch, as the traced kernel has only that one."""
    parsed = _parsed(code)
    if parsed is None:
        return None
    tests, stable = parsed[2:]
    decided = branches.decisions(tests, stable, code.co_cellvars + code.co_freevars, local_vars) if tests else ()
    analysed = _function_liveness(code, decided)
    if analysed is None:
        return None
    nodes, live_in, live_out = analysed
    spans = [(last - first, i) for i, (first, last) in enumerate(n[0] for n in nodes) if first <= lineno <= last]
    if not spans:
        return None
    narrowest = min(spans)[0]
    running = [i for width, i in spans if width == narrowest]
    if len(running) > 1:  # statements sharing a line (`a = f(); g(a)`): any of them may be the one running
        return frozenset().union(*(live_in[i] for i in running))
    node = running[0]
    (first, last), _, defs, simple = nodes[node]
    later = _loads_after(code, lasti, first, last) if simple else None
    if later is None:
        # its own reads may still come, and what it rebinds without reading is dead already
        return live_in[node]
    # a simple statement mid-call: only the reads after this call are still to come (what it read
    # before is either consumed or waiting on the value stack, where reclaim's reference count sees it)
    return later | (live_out[node] - defs)


_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_NAME", "LOAD_FAST_CHECK",
                    "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_FROM_DICT_OR_DEREF"})


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


@functools.lru_cache(maxsize=512)
def _instructions(code) -> tuple:
    """(offset, local names read, line, jump target or None) per instruction of `code`."""
    rows = []
    for ins in dis.get_instructions(code):
        names = ()
        if ins.opname in _LOADS:
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
        target = ins.argval if ins.opcode in _JUMPS else None
        line = ins.positions.lineno if ins.positions is not None else None
        rows.append((ins.offset, names, line, target))
    return tuple(rows)


def _loads_after(code, lasti, first, last) -> frozenset | None:
    """Local names the statement on lines first..last still reads after offset `lasti` (None: it may
    jump back to `lasti` or before, as an inlined comprehension's loop does, so what it read may come again)."""
    names = set()
    for offset, reads, line, target in _instructions(code):
        if offset <= lasti:
            continue
        if line is not None and not first <= line <= last:
            break  # past the statement
        if target is not None and target <= lasti:
            return None
        names.update(reads)
    return frozenset(names)


class _Loop:
    __slots__ = ("breaks", "header")

    def __init__(self, header):
        self.header, self.breaks = header, []


_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.FunctionDef,
           ast.AsyncFunctionDef, ast.ClassDef)
_INTROSPECTION = frozenset({"locals", "vars", "exec", "eval"})


class _Graph:
    """Statement-level control flow of one function: node = (line span, uses, defs), with successors."""

    def __init__(self, line_offset, decided):
        self.offset = line_offset
        self.decided = decided  # (line, column) of an `if` -> the branch it takes, when already known
        self.nodes, self.succ = [], []
        self.exit = self._node((0, -1), set(), set())

    def _node(self, span, uses, defs, simple=False) -> int:
        """simple: a statement without a body (its bytecode is one straight run, see _loads_after)."""
        self.nodes.append((span, uses, defs, simple))
        self.succ.append([])
        return len(self.nodes) - 1

    def _span(self, first, last):
        return (first.lineno + self.offset, last.end_lineno + self.offset)

    def _link(self, ends, target):
        for end in ends:
            self.succ[end].append(target)

    def block(self, statements, loop) -> tuple[int | None, list[int]]:
        """Add `statements`; -> (entry node, or None if empty; the nodes falling through past them)."""
        entry, open_ends = None, []
        for statement in statements:
            first, ends = self.statement(statement, loop)
            self._link(open_ends, first)
            entry = first if entry is None else entry
            open_ends = ends
        return entry, open_ends

    def _branches(self, head, blocks, loop) -> list[int]:
        """`head` continuing into each block (an empty block: past it); -> the open ends."""
        ends = []
        for statements in blocks:
            entry, block_ends = self.block(statements, loop)
            if entry is None:
                ends.append(head)
            else:
                self.succ[head].append(entry)
                ends += block_ends
        return ends

    def _loop(self, head, body, orelse, loop) -> list[int]:
        inner = _Loop(head)
        entry, ends = self.block(body, inner)
        if entry is not None:
            self.succ[head].append(entry)
        self._link(ends, head)
        return self._branches(head, [orelse], loop) + inner.breaks

    def statement(self, s, loop) -> tuple[int, list[int]]:
        if isinstance(s, ast.If):
            test = self._node(self._span(s.test, s.test), _uses(s.test), set())
            taken = self.decided.get((s.lineno, s.col_offset))
            blocks = [s.body, s.orelse] if taken is None else [s.body if taken else s.orelse]
            return test, self._branches(test, blocks, loop)
        if isinstance(s, ast.While):
            test = self._node(self._span(s.test, s.test), _uses(s.test), set())
            return test, self._loop(test, s.body, s.orelse, loop)
        if isinstance(s, (ast.For, ast.AsyncFor)):
            header = self._node(self._span(s.target, s.iter), _uses(s.iter) | _uses(s.target), _defs(s.target))
            return header, self._loop(header, s.body, s.orelse, loop)
        if isinstance(s, (ast.With, ast.AsyncWith)):
            items = [i.context_expr for i in s.items]
            targets = [i.optional_vars for i in s.items if i.optional_vars is not None]
            header = self._node(self._span(items[0], items[-1]), set().union(*map(_uses, items + targets)),
                                set().union(set(), *map(_defs, targets)))
            return header, self._branches(header, [s.body], loop)
        if not isinstance(s, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Pass, ast.Break,
                              ast.Continue, ast.Delete, ast.Assert, ast.Raise, ast.Import, ast.ImportFrom,
                              ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise _Unknown()  # try / match / global / nonlocal: not modelled
        uses = _uses(s)
        if uses & _INTROSPECTION:
            raise _Unknown()
        node = self._node(self._span(s, s), uses, _defs(s), simple=not isinstance(s, _SCOPES))
        if isinstance(s, (ast.Return, ast.Raise)):
            self.succ[node].append(self.exit)
            return node, []
        if isinstance(s, (ast.Break, ast.Continue)):
            if loop is None:
                raise _Unknown()
            if isinstance(s, ast.Continue):
                self.succ[node].append(loop.header)
            else:
                loop.breaks.append(node)
            return node, []
        return node, [node]

    def solve(self):
        """(nodes, live-in per node, live-out per node), by backward dataflow to the fixed point."""
        count = len(self.nodes)
        live_in = [frozenset()] * count
        preds = [[] for _ in range(count)]
        for node, successors in enumerate(self.succ):
            for successor in successors:
                preds[successor].append(node)
        work = list(range(count))
        while work:
            node = work.pop()
            out = frozenset().union(*(live_in[s] for s in self.succ[node]))
            _, uses, defs, _ = self.nodes[node]
            new_in = uses | (out - defs)
            if new_in != live_in[node]:
                live_in[node] = frozenset(new_in)
                work.extend(preds[node])
        live_out = [frozenset().union(*(live_in[s] for s in successors)) for successors in self.succ]
        return self.nodes, live_in, live_out


def _uses(node) -> set:
    """Every name the node reads, nested scopes included (more uses only keep more tiles)."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        names.add(node.target.id)
    return names


def _defs(node) -> set:
    """The names the node (re)binds in its own scope: not a comprehension's or a nested function's."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.AnnAssign) and node.value is None:
        return set()
    names, stack = set(), [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif not isinstance(n, _SCOPES) or n is node:
            stack.extend(ast.iter_child_nodes(n))
    return names
