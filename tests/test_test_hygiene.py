"""The suite itself must not break torch: no test monkeypatches a torch config module.

pytest 9.2's `monkeypatch.setattr` undoes an attribute missing from the target's `__dict__` with
`delattr`; on torch's config modules that hides the option for the rest of the process, and every
later compile fails. `torch._dynamo.config.patch(...)` is the supported way."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def monkeypatched_torch_configs(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("setattr", "delattr") and node.args):
            target = node.args[0]
            name = target.value if isinstance(target, ast.Constant) else _dotted(target)
            if isinstance(name, str) and name.startswith("torch.") and ".config" in name:
                found.append(f"line {node.lineno}: {node.func.attr}({name}, ...)")
    return found


def test_the_checker_sees_a_monkeypatched_config():
    assert monkeypatched_torch_configs('monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)')
    assert monkeypatched_torch_configs('monkeypatch.setattr("torch._inductor.config.fx_graph_cache", False)')
    assert not monkeypatched_torch_configs('monkeypatch.setattr(module, "x", 1)')


def test_no_test_monkeypatches_a_torch_config_module():
    offenders = {path.name: hits for path in TESTS.rglob("*.py")
                 if (hits := monkeypatched_torch_configs(path.read_text()))}
    assert not offenders, f"use torch._dynamo.config.patch(...) instead: {offenders}"
