"""OpInfo conformance (bench/opinfo.py as tests): the first sample of each op_db entry under
`backend="neuron"` must neither crash nor silently differ from eager (fp32 forward + backward, bf16
forward; tolerances and outcome definitions in bench/opinfo.py). An op whose aot_eager baseline fails
is skipped (a Dynamo limit), and so is an op eager cannot run or reproduce.

FAST_OPS run by default; every other op_db entry is marked `sweep` and runs with `--sweep` (the
whole op_db takes as long as bench/opinfo.py, too long for the regular suite). Known root causes
(`opinfo.KNOWN_ISSUES`, each with a repro in the lead's report) are strict xfails: a fix makes the
test fail until its entry is removed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from neuron_inductor.testing import time_limit


def _load_bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "opinfo.py"
    spec = importlib.util.spec_from_file_location("bench_opinfo", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


opinfo = _load_bench()
OPS = opinfo.op_by_name()

# Common training-graph ops, one or more per kernel family (pointwise, reduction, softmax, norms,
# matmul, gather, copy), checked in both dtypes on every run.
FAST_OPS = (
    "add", "mul", "div.no_rounding_mode", "exp", "rsqrt", "sigmoid", "nn.functional.silu",
    "nn.functional.gelu", "where", "sum", "mean", "amax", "softmax", "log_softmax", "mm", "bmm",
    "nn.functional.linear", "nn.functional.layer_norm", "nn.functional.embedding", "cat",
    "combinations",  # a data-dependent (unbacked) size
)


def _params():
    for name in OPS:
        for dtype in opinfo.DTYPES:
            marks = [] if name in FAST_OPS else [pytest.mark.sweep]
            issue = opinfo.known_issue(name, dtype)
            if issue is not None:
                marks.append(pytest.mark.xfail(reason=f"({issue[0]}) {issue[1]}", strict=True))
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}")


pytestmark = pytest.mark.usefixtures("fresh_module_cache")


@pytest.mark.parametrize("name,dtype", list(_params()))
def test_opinfo(name, dtype):
    with time_limit(opinfo.TIMEOUT_SECONDS):
        row = opinfo.check_op(OPS[name], opinfo.DTYPES[dtype])
    if "skip" in row:
        pytest.skip(row["skip"])
    outcome = row["neuron"]
    assert outcome["status"] == "pass", f"{outcome['kind']}: {outcome['detail']} ({outcome.get('raised_at', '')})"


def test_fast_ops_are_in_op_db():
    assert set(FAST_OPS) <= set(OPS)


# -- the harness itself: it must see a silent mismatch and a crash --------------------------------

def _off_by_one_backend(gm, example_inputs):
    def run(*args):
        return tuple(o + 1 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in gm(*args))

    return run


def _raising_backend(gm, example_inputs):
    raise RuntimeError("boom")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_harness_reports_silent_mismatch_and_crash(dtype):
    op = OPS["mul"]
    case = opinfo.Case(op, next(iter(op.sample_inputs("cpu", dtype))))
    expected = opinfo.run_case(case, case.fn, backward=False)
    wrong = opinfo.check_backend(case, _off_by_one_backend, expected, dtype, backward=False)
    assert (wrong["status"], wrong["kind"]) == ("fail", "mismatch")
    crash = opinfo.check_backend(case, _raising_backend, expected, dtype, backward=False)
    assert (crash["status"], crash["kind"]) == ("fail", "crash") and "boom" in crash["detail"]
    same = opinfo.check_backend(case, "aot_eager", expected, dtype, backward=False)
    assert same["status"] == "pass"


def test_harness_compares_gradients():
    op = OPS["mul"]
    case = opinfo.Case(op, next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=True))))
    expected = opinfo.run_case(case, case.fn, backward=True)
    assert expected.grads and all(g is not None for g in expected.grads)
    bumped = opinfo.Run(expected.outputs, [g + 1e-2 for g in expected.grads])
    assert opinfo.compare(bumped, expected, torch.float32).startswith("grads[0]")
    assert opinfo.compare(expected, expected, torch.float32) is None


@pytest.mark.slow
def test_sweep_in_worker_processes(tmp_path):
    records = opinfo.sweep(["add", "empty_like"], workers=1, timeout=300, log_dir=tmp_path)
    assert [r["op"] for r in records] == ["add", "empty_like"]
    assert opinfo.status(records[0]["float32"], "neuron") == "pass"
    assert records[0]["float32"]["neuron"]["where"] == "kernels"
    assert "nondeterministic" in records[1]["bfloat16"]["skip"]
