"""Which way a kernel's Python `if` goes, when that is already fixed, for liveness.py.

NKI traces a kernel: an `if` on Python values runs one branch, and the compiler's allocator only
ever sees that branch. liveness.py reads the kernel's source instead, where both branches are
there. A tile that only the untaken branch reads would then count as live. This module decides
such tests from the running frame's values, so the untaken branch can be dropped, but only when
the decision cannot change for the rest of the frame:
- every name in the test is "stable": never bound in the function (a parameter), or bound by a
  single statement outside every loop and already bound now;
- none of them is captured by an inner function;
- each holds an immutable scalar (bool, int, float, str, None);
- the test uses only constants, those names, `not`, `and` / `or`, comparisons and integer
  arithmetic (no calls, attributes or subscripts, which could run code or see mutation).
Any other test stays undecided, and both branches count.
"""

from __future__ import annotations

import ast
import operator

_SCALARS = (bool, int, float, str, type(None))
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


class _Undecided(Exception):
    pass


def branch_tests(function) -> tuple:
    """((key, test) for each `if` of the function's own body, the function's stable names)."""
    bindings, in_loop, tests = {}, set(), []

    def visit(statements, looping):
        for s in statements:
            for name in _bound(s):
                bindings[name] = bindings.get(name, 0) + 1
                if looping:
                    in_loop.add(name)
            if isinstance(s, ast.If):
                tests.append(((s.lineno, s.col_offset), s.test))
            if isinstance(s, _NESTED):
                continue
            inner = looping or isinstance(s, _LOOPS)
            for field in ("body", "orelse", "finalbody"):
                visit(getattr(s, field, []), inner)
            for handler in getattr(s, "handlers", []):
                visit(handler.body, inner)

    visit(function.body, False)
    parameters = {a.arg for a in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]}
    stable = {name for name in parameters if name not in bindings}
    stable |= {name for name, count in bindings.items() if count == 1 and name not in in_loop}
    return tuple(tests), frozenset(stable)


def _bound(statement) -> set:
    """Names the statement itself binds (its header for compound statements)."""
    if isinstance(statement, _NESTED[:3]):
        return {statement.name}
    if isinstance(statement, (ast.For, ast.AsyncFor)):
        parts = [statement.target]
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        parts = [i.optional_vars for i in statement.items if i.optional_vars is not None]
    elif isinstance(statement, (ast.If, ast.While)):
        parts = [statement.test]
    elif isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in statement.names}
    else:
        parts = [statement]
    names = set()
    for part in parts:
        for node in ast.walk(part):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.id)
    return names


def decisions(tests, stable, captured, local_vars) -> tuple:
    """((key, True | False) for each test decided now; sorted, so it can key a cache."""
    decided = []
    for key, test in tests:
        try:
            value = _evaluate(test, stable, captured, local_vars)
        except _Undecided:
            continue
        decided.append((key, bool(value)))
    return tuple(sorted(decided))


def _evaluate(node, stable, captured, local_vars):
    if isinstance(node, ast.Constant) and isinstance(node.value, _SCALARS):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in stable or node.id in captured or node.id not in local_vars:
            raise _Undecided()
        value = local_vars[node.id]
        if not isinstance(value, _SCALARS):
            raise _Undecided()
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, stable, captured, local_vars)
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(v, stable, captured, local_vars) for v in node.values]  # no short cut: all decided
        if isinstance(node.op, ast.And):
            return next((v for v in values if not v), values[-1])
        return next((v for v in values if v), values[-1])
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _evaluate(node.left, stable, captured, local_vars)
        for op, right_node in zip(node.ops, node.comparators):
            right = _evaluate(right_node, stable, captured, local_vars)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left = _evaluate(node.left, stable, captured, local_vars)
        right = _evaluate(node.right, stable, captured, local_vars)
        if not (type(left) is int and type(right) is int) or (right == 0 and type(node.op) in (ast.FloorDiv, ast.Mod)):
            raise _Undecided()
        return _ARITHMETIC[type(node.op)](left, right)
    raise _Undecided()
