"""The rule check as each kernel's first run (compiler.checks_at_first_use, toolchain FirstUseCheck):
compiling runs no kernel; the first call checks on the real arguments and gives the same cost
estimates as a check on zeros; graphs that could not be re-run after a half-run keep the
compile-time check; verdicts are keyed by source, shapes and target; kernels equal up to their
name share replay plans, each trace keeping its own kernel's name."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from neuron_inductor import config, kernel_checks, sim
from neuron_inductor.compiler import (UNCHECKED, Program, build_kernels, checks_at_first_use, compile_and_build,
                                      rerunnable, rule_checks)
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.graph import lower_graph
from neuron_inductor.lowering.ir import HostStep
from neuron_inductor.toolchain.simulator import FirstUseCheck, KernelRuleViolation, SimulatorToolchain

from .kernels.harness import aten_graph


def _softmax_scale(x, w):
    return (torch.softmax(x, dim=-1) * w + 1,)


def test_compiling_runs_no_kernel_and_the_first_run_gives_the_checks_estimates(tmp_path):
    x, w = torch.randn(130, 72), torch.randn(72)
    gm = aten_graph(_softmax_scale, x, w)
    toolchain = SimulatorToolchain("trn2")
    with sim.trace() as during_compile:
        artifact, lowered, kernels = compile_and_build(gm, "error", toolchain, "trn2",
                                                       kernel_checks.KernelChecks(tmp_path))
    assert not during_compile.instructions and artifact.meta["estimates"] == {}
    assert sorted(artifact.meta[UNCHECKED]) == sorted(artifact.kernel_sources)
    assert all(isinstance(kernel, FirstUseCheck) for kernel in kernels.values())

    with sim.trace() as first_run:
        (got,) = Program.load(artifact, toolchain, {}, kernels)([x, w])
    torch.testing.assert_close(got, _softmax_scale(x, w)[0], rtol=1e-5, atol=1e-6)
    assert artifact.meta[UNCHECKED] == [] and first_run.instructions  # the check was the user's run
    on_zeros = toolchain.check(build_kernels(toolchain, artifact), rule_checks(artifact, lowered))
    assert artifact.meta["estimates"] == on_zeros


def test_a_violation_raises_before_the_kernel_returns_and_is_checked_again_next_call():
    source = ("import nki\nimport nki.language as nl\n\n@nki.jit\ndef k0_broken(x):\n"
              "    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)\n"
              "    nl.ndarray((256, 1), dtype=nl.float32, buffer=nl.sbuf)\n    return out\n")
    toolchain = SimulatorToolchain("trn2")
    estimates, unchecked = {}, ["k0_broken"]
    (kernel,) = toolchain.checked_at_first_use(toolchain.build({"k0_broken": source}), {"k0_broken": source}, None,
                                               estimates, unchecked).values()
    for _ in range(2):
        with pytest.raises(KernelRuleViolation, match="generated kernel k0_broken breaks a hardware rule: .*partition"):
            kernel(torch.zeros(4, 4))
    assert estimates == {} and unchecked == ["k0_broken"]


def _lowered(fn, *args):
    gm = aten_graph(fn, *args)
    return lower_graph(gm, LoweringContext.for_target("trn2", None), "allow", {})


def test_graphs_a_rerun_would_change_keep_the_compile_time_check():
    x = torch.randn(8, 16)

    def updates_input(a):
        a.add_(1)
        return (a * 2,)

    def draws_random(a):
        return (torch.rand_like(a) + a,)

    assert rerunnable(_lowered(lambda a: (a.exp() + 1,), x))
    assert not rerunnable(_lowered(updates_input, x.clone()))  # its copy_ kernel writes the input
    assert not rerunnable(_lowered(draws_random, x))  # a rerun would draw other numbers
    graph = fx.Graph()
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (graph.placeholder("a"), "sum", "0"))
    collective = SimpleNamespace(kernels=[], steps=[HostStep(reduced, "collective")])
    assert not rerunnable(collective)  # the other ranks would not run it again
    plain = _lowered(lambda a: (a.exp() + 1,), x)
    assert checks_at_first_use(SimulatorToolchain("trn2"), "trn2", plain)
    assert not checks_at_first_use(SimulatorToolchain("trn2"), "trn3", plain)  # planned for another chip


def test_a_stored_verdict_is_keyed_by_source_shapes_and_target(tmp_path):
    verdicts = kernel_checks.KernelChecks(tmp_path)
    runs: list[str] = []
    args = [torch.zeros(4, 8)]
    for source, shape, target in [("a", (4, 8), "trn2"), ("a", (4, 8), "trn2"), ("a", (4, 8), "trn3"),
                                  ("b", (4, 8), "trn2"), ("a", (8, 8), "trn2")]:
        args = [torch.zeros(shape)]
        verdicts.verdict(source, args, target, lambda: runs.append(source) or {"seconds": 1.0})
    assert runs == ["a", "a", "b", "a"]  # only the exact repeat is read back
    again = kernel_checks.KernelChecks(tmp_path)  # another process, same folder
    again.verdict("a", [torch.zeros(4, 8)], "trn2", lambda: runs.append("again") or {})
    assert "again" not in runs and again.stats["disk_hits"] == 1


def test_kernels_equal_up_to_their_name_share_plans_and_keep_their_names():
    template = ("import nki\nimport nki.language as nl\n\n@nki.jit\ndef {name}(x):\n"
                "    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)\n"
                "    t = nl.load(x)\n    nl.store(out, value=nl.multiply(nl.exp(t), 2.0))\n    return out\n")
    sim.replay.forget()
    kernels = SimulatorToolchain("trn2").build({name: template.format(name=name) for name in ("k0_pw", "k1_pw")})
    x, y = torch.randn(128, 64), torch.randn(128, 64)
    with sim.trace() as first:
        a = kernels["k0_pw"](x)  # the signature's first call: run
    with sim.trace() as twin:
        b = kernels["k1_pw"](y)  # its second, through the twin: recorded
    with sim.trace() as replayed:
        c = kernels["k0_pw"](y)  # replays the plan its twin recorded
    torch.testing.assert_close(a, torch.exp(x) * 2)  # not overwritten by the twin's calls
    torch.testing.assert_close(b, torch.exp(y) * 2)
    assert torch.equal(c, b)
    traces = [first, twin, replayed]
    assert [{i.kernel for i in trace.instructions} for trace in traces] == [{"k0_pw"}, {"k1_pw"}, {"k0_pw"}]
    assert [(i.op, i.flops, i.bytes, i.operands) for i in twin.instructions] == \
           [(i.op, i.flops, i.bytes, i.operands) for i in first.instructions] == \
           [(i.op, i.flops, i.bytes, i.operands) for i in replayed.instructions]
    (k0_plan,), (k1_plan,) = (sim.replay.plans(kernels[name].func) for name in ("k0_pw", "k1_pw"))
    assert k1_plan.function is k0_plan.function  # one plan, recorded once


def test_kernels_with_a_bounds_check_are_checked_on_zeros_and_bad_ids_first_raise_eagers_error(tmp_path, caplog):
    """An indexing kernel's first run can fail on the data (its bounds check on the ids): that is the
    user's error, not a broken rule, so such kernels are checked on zeros at compile time, and the
    others of the graph at first use."""
    weight = torch.randn(1000, 64)

    def fn(ids):
        return (F.embedding(ids, weight) * 2 + 1,)

    good, bad = torch.tensor([1, 999]), torch.tensor([1, 1000])
    artifact, _, _ = compile_and_build(aten_graph(fn, good), "error", SimulatorToolchain("trn2"), "trn2")
    indexing = {k["name"] for k in artifact.meta["kernels"] if k["index_bounds"]}
    assert indexing and set(artifact.meta["estimates"]) == indexing
    assert set(artifact.meta[UNCHECKED]) == set(artifact.kernel_sources) - indexing

    torch._dynamo.reset()
    with config.patch(cache_dir=str(tmp_path / "cache"), fallback="allow"), \
            caplog.at_level(logging.ERROR, logger="neuron_inductor"):
        compiled = torch.compile(fn, backend="neuron")
        with pytest.raises(IndexError, match="embedding: index out of range"):
            compiled(bad)
        assert torch.equal(compiled(good)[0], fn(good)[0])
    assert "hardware rule" not in caplog.text
    torch._dynamo.reset()
