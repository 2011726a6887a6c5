"""Rendering numbers into kernel source: the `literal` filter and the check for bare non-finite names."""

from __future__ import annotations

import math

import jinja2
import pytest
import torch

from neuron_inductor.codegen import render
from neuron_inductor.codegen.render import TemplateError, literal


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
        render.render_template("bare", "k0_bare", [], [], {"fill": -math.inf})
    env.filters["literal"] = literal
    env.loader.mapping["bare.py.j2"] = "def {{ kernel_name }}(in0):\n    return {{ fill | literal }}\n"
    assert "return float('-inf')" in render.render_template("bare", "k0_bare", [], [], {"fill": -math.inf})


def test_a_kernel_without_arguments_fails_to_render(monkeypatch):
    """nki.jit detects the framework from the kernel's tensor arguments: every kernel takes one."""
    env = jinja2.Environment(loader=jinja2.DictLoader({"noargs.py.j2": "def {{ kernel_name }}():\n    return 1\n"}),
                             undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render, "environment", lambda: env)
    with pytest.raises(TemplateError, match="without arguments: nki.jit detects the framework"):
        render.render_template("noargs", "k0_noargs", [], [], {})



def test_a_repeated_kernel_renders_once_under_each_name(monkeypatch):
    """A model's repeated layers ask for the same kernel under other names: one render, renamed."""
    source = "def {{ kernel_name }}(in0):\n    return in0 * {{ scale | literal }}\n"
    env = jinja2.Environment(loader=jinja2.DictLoader({"scaled.py.j2": source}), undefined=jinja2.StrictUndefined)
    env.filters["literal"] = literal
    monkeypatch.setattr(render, "environment", lambda: env)
    original, renders = render._render, []
    monkeypatch.setattr(render, "_render", lambda *args: renders.append(args[1]) or original(*args))
    first = render.render_template("scaled", "k0_scaled", [], [], {"scale": 2.0})
    second = render.render_template("scaled", "k7_scaled", [], [], {"scale": 2.0})
    other = render.render_template("scaled", "k8_scaled", [], [], {"scale": 3.0})
    assert renders == ["k0_scaled", "k8_scaled"]
    assert first == "def k0_scaled(in0):\n    return in0 * 2.0"
    assert second == first.replace("k0_scaled", "k7_scaled") and "in0 * 3.0" in other
