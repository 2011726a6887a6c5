"""Rendering numbers into kernel source: the `literal` filter and the check for bare non-finite names."""

from __future__ import annotations

import math
import re

import jinja2
import pytest
import torch

from neuron_inductor.codegen import render
from neuron_inductor.codegen.render import TemplateError, literal
from neuron_inductor.lowering.context import LoweringContext

from .harness import CTX


@pytest.mark.parametrize("value", [1.5, -0.0, 3, True, 1e-45, 3.4028234663852886e38, -math.inf, math.inf], ids=repr)
def test_literal_evaluates_back_to_the_same_number(value):
    back = eval(literal(value))
    assert type(back) is type(value) and back == value and math.copysign(1, back) == math.copysign(1, value)


def test_non_finite_floats_are_float_calls():
    written = literal(-math.inf), literal(math.inf), literal(math.nan)
    assert written == ("float('-inf')", "float('inf')", "float('nan')")
    assert math.isnan(eval(literal(math.nan)))


def test_literal_refuses_what_is_not_a_python_number():
    with pytest.raises(TemplateError, match="not a Python number"):
        literal(torch.tensor(1.0))


def test_a_template_writing_a_bare_inf_fails_to_render(monkeypatch):
    source = "def {{ kernel_name }}(in0):\n    return {{ fill }}\n"
    env = jinja2.Environment(loader=jinja2.DictLoader({"bare.py.j2": source}), undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render, "environment", lambda: env)
    with pytest.raises(TemplateError, match=r"bare name\(s\) \['inf'\]"):
        render.render_template("bare", "k0_bare", [], [], {"fill": -math.inf}, CTX)
    env.filters["literal"] = literal
    env.loader.mapping["bare.py.j2"] = "def {{ kernel_name }}(in0):\n    return {{ fill | literal }}\n"
    assert "return float('-inf')" in render.render_template("bare", "k0_bare", [], [], {"fill": -math.inf}, CTX)


def test_a_kernel_without_arguments_fails_to_render(monkeypatch):
    """nki.jit detects the framework from the kernel's tensor arguments: every kernel takes one."""
    env = jinja2.Environment(loader=jinja2.DictLoader({"noargs.py.j2": "def {{ kernel_name }}():\n    return 1\n"}),
                             undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render, "environment", lambda: env)
    with pytest.raises(TemplateError, match="without arguments: nki.jit detects the framework"):
        render.render_template("noargs", "k0_noargs", [], [], {}, CTX)



def test_a_repeated_kernel_renders_once_under_each_name(monkeypatch):
    """A model's repeated layers ask for the same kernel under other names: one render, renamed."""
    source = "def {{ kernel_name }}(in0):\n    return in0 * {{ scale | literal }}\n"
    env = jinja2.Environment(loader=jinja2.DictLoader({"scaled.py.j2": source}), undefined=jinja2.StrictUndefined)
    env.filters["literal"] = literal
    monkeypatch.setattr(render, "environment", lambda: env)
    original, renders = render._render, []
    monkeypatch.setattr(render, "_render", lambda *args: renders.append(args[1]) or original(*args))
    first = render.render_template("scaled", "k0_scaled", [], [], {"scale": 2.0}, CTX)
    second = render.render_template("scaled", "k7_scaled", [], [], {"scale": 2.0}, CTX)
    other = render.render_template("scaled", "k8_scaled", [], [], {"scale": 3.0}, CTX)
    assert renders == ["k0_scaled", "k8_scaled"]
    assert first == "def k0_scaled(in0):\n    return in0 * 2.0"
    assert second == first.replace("k0_scaled", "k7_scaled") and "in0 * 3.0" in other


# Template text that renders to code: Jinja comments dropped, and the comment part of each line.
_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.S)
_LINE_COMMENT = re.compile(r"(^\s*#|\s#\s).*$", re.M)


def test_templates_spell_no_partition_count():
    """Tile sizes come from the render context (`tile.partitions`, ...), not from literal 128s (or
    the 127 of a round-up), so a kernel is written for the target it is rendered for."""
    offenders = []
    for path in sorted(render.templates_dir().glob("*.py.j2")):
        code = _LINE_COMMENT.sub("", _JINJA_COMMENT.sub("", path.read_text()))
        offenders += [f"{path.name}: {line.strip()}" for line in code.splitlines() if re.search(r"\b12[78]\b", line)]
    assert not offenders, "\n".join(offenders)


def test_the_render_context_names_the_target(monkeypatch):
    """`tile` and `target` reach every template, and a kernel param may not shadow them."""
    source = "def {{ kernel_name }}(in0):\n    return in0[0:{{ tile.partitions }}]  # {{ target.name }}\n"
    env = jinja2.Environment(loader=jinja2.DictLoader({"sized.py.j2": source}), undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render, "environment", lambda: env)
    trn3 = LoweringContext.for_target("trn3")
    assert render.render_template("sized", "k0_sized", [], [], {}, trn3).endswith("in0[0:128]  # trn3")
    with pytest.raises(TemplateError, match="may not redefine"):
        render.render_template("sized", "k0_sized", [], [], {"tile": 1}, trn3)
