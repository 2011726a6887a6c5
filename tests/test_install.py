"""`pip install .` into a fresh virtual environment, then torch.compile(backend="neuron") from a
script that never imports neuron_inductor (the entry point finds it)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    want = model(x)
    want.sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = torch.compile(model, backend="neuron")(x)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    import sys
    assert "neuron_inductor" in sys.modules  # loaded through the entry point, not by this script
    import neuron_inductor, pathlib
    templates = pathlib.Path(neuron_inductor.__file__).parent / "codegen_templates"
    assert (templates / "wrapper.py.j2").is_file(), "templates must ship inside the wheel"
    print("fresh-venv OK", neuron_inductor.__file__)
""")


@pytest.mark.slow
def test_fresh_venv_install_and_entry_point(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, str(REPO)], check=True, cwd=tmp_path)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed copy, not a source tree on the path
    result = subprocess.run([str(python), str(script)], cwd=tmp_path, capture_output=True, text=True, env=clean)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fresh-venv OK" in result.stdout
    assert str(venv) in result.stdout  # the installed copy ran, not the source tree
    assert "NumPy" not in result.stderr, "the base install must bring everything torch imports"


def test_every_package_of_the_source_tree_ships():
    """pyproject lists the packages explicitly (the templates folder is mapped in): a new
    subpackage missing from the list installs nothing and breaks every import of the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "neuron_inductor").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
