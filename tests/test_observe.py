"""observe/: dumps, verify mode, logging, report() and progress, on really compiled models.

Models are tiny (an MLP, a matmul with a host fallback) so the whole file runs in well under a
minute; every compile goes through Dynamo, AOTAutograd, lowering, rendering and the interpreter.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import neuron_inductor
from neuron_inductor import sim
from neuron_inductor.config import ConfigError
from neuron_inductor.observe import VerifyError, dump, progress, session, verify
from neuron_inductor.observe.replay import replay
from neuron_inductor.toolchain.simulator import SimulatorToolchain

BUCKET_FILES = ("dynamo_graph.py", "aten_graph.py", "lowered_graph.py", "bucket.json", "wrapper.py",
                "cache_key.json", "report.json")


class MLP(nn.Module):
    def __init__(self, d_in=48, d_hidden=160, d_out=24):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(autouse=True)
def fresh_state(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("NEURON_INDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    for flag in ("NEURON_INDUCTOR_DUMP_DIR", "NEURON_INDUCTOR_VERIFY"):
        monkeypatch.delenv(flag, raising=False)
    torch._dynamo.reset()
    session.clear()
    yield
    torch._dynamo.reset()


def _bucket_folders(dump_dir: Path) -> list[Path]:
    return sorted(p.parent for p in dump_dir.rglob("report.json"))


@pytest.fixture(scope="module")
def training_dump(tmp_path_factory):
    """One MLP training step with a dynamic batch of 100 rows (padded to the 128 bucket), compiled
    with dump and verify='raise': (dump folder, compiled buckets)."""
    torch._dynamo.reset()
    session.clear()
    dump_dir = tmp_path_factory.mktemp("dump")
    torch.manual_seed(0)
    options = {"dump_dir": str(dump_dir), "verify": "raise", "cache_dir": str(tmp_path_factory.mktemp("cache"))}
    model = torch.compile(MLP(), backend="neuron", options=options, dynamic=True)
    x, y = torch.randn(100, 48), torch.randn(100, 24)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return dump_dir, list(session.BUCKETS)


@pytest.fixture(scope="module")
def inference_dump(tmp_path_factory):
    """MLP inference with a dump: (dump folder, the compiled model's output)."""
    torch._dynamo.reset()
    dump_dir = tmp_path_factory.mktemp("dump")
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        options = {"dump_dir": str(dump_dir), "cache_dir": str(tmp_path_factory.mktemp("cache"))}
        out = torch.compile(model, backend="neuron", options=options)(torch.randn(130, 48))
    return dump_dir, out


# ---------------------------------------------------------------------------------------------
# NEURON_INDUCTOR_DUMP_DIR


def test_dump_holds_every_artifact_per_graph_bucket(training_dump):
    dump_dir, buckets = training_dump
    runs = [p.parent for p in dump_dir.glob("*/run.json")]
    assert len(runs) == 1 and json.loads((runs[0] / "run.json").read_text())["pid"] == os.getpid()
    folders = _bucket_folders(dump_dir)
    assert [f.name for f in folders] == ["backward_bucket0", "forward_bucket0"]
    for folder, bucket in zip(folders, sorted(buckets, key=lambda b: b.aot.kind)):
        assert folder == bucket.folder
        for name in BUCKET_FILES:
            assert (folder / name).stat().st_size > 0, name
        artifact = bucket.artifact
        assert (folder / "wrapper.py").read_text() == artifact.wrapper_source
        assert "def forward" in (folder / "dynamo_graph.py").read_text()
        assert "torch.ops.aten" in (folder / "aten_graph.py").read_text()
        key = json.loads((folder / "cache_key.json").read_text())
        assert key["parts"]["graph"] == bucket.aot.graph_hash and key["parts"]["kind"] == bucket.aot.kind
        assert bucket.cache["event"] == "miss" and bucket.cache["key"] == key["key"]
        assert re.search(r"f32\[s\d+, 160\]", (folder / "aten_graph.py").read_text())  # symbolic sizes ...
        assert "f32[128, 160]" in (folder / "lowered_graph.py").read_text()  # ... lowered at the bucket size
        for described in artifact.meta["kernels"]:
            name = described["name"]
            dumped = (folder / "kernels" / f"{name}.py").read_text()
            assert dumped.startswith(artifact.kernel_sources[name].rstrip("\n"))
            assert '__name__ == "__main__"' in dumped
            spec = json.loads((folder / "kernels" / f"{name}.json").read_text())
            assert [i["shape"] for i in spec["inputs"]] == described["inputs"]
            assert [o["shape"] for o in spec["outputs"]] == described["outputs"]
            assert (folder / "kernels" / f"{name}.inputs.pt").is_file()
        report = json.loads((folder / "report.json").read_text())
        assert [k["name"] for k in report["kernels"]] == list(artifact.kernel_sources)
        assert all(k["estimated_seconds"] > 0 for k in report["kernels"])


def test_dumped_kernel_runs_standalone_and_reproduces_the_compiled_output(inference_dump):
    dump_dir, out = inference_dump
    (folder,) = _bucket_folders(dump_dir)
    kernels = sorted((folder / "kernels").glob("k*.py"), key=lambda p: int(p.stem[1:].split("_")[0]))
    last = kernels[-1]  # computes the graph's output
    saved = torch.load(last.with_name(f"{last.stem}.outputs.pt"))
    assert torch.equal(saved[0], out)
    run = subprocess.run([sys.executable, "-m", "neuron_inductor.sim", str(last)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "matches the saved outputs of the compiled run exactly" in run.stdout
    assert "estimated trn2 time" in run.stdout


def test_replay_on_random_inputs_keeps_recorded_shapes(inference_dump):
    dump_dir, out = inference_dump
    (folder,) = _bucket_folders(dump_dir)
    first = folder / "kernels" / "k0_matmul.py"
    result = replay(first, random=True, seed=3)
    spec = json.loads(first.with_suffix(".json").read_text())
    assert result.inputs_source == "random" and result.mismatch is None
    assert [list(o.shape) for o in result.outputs] == [o["shape"] for o in spec["outputs"]]
    assert result.estimate.total_seconds > 0 and result.instructions > 0


def test_replay_under_a_real_nki_style_kernel_checks_without_an_estimate(inference_dump):
    """Under the real nki.jit there is no interpreter trace: the replay still runs and checks."""
    dump_dir, _ = inference_dump
    (folder,) = _bucket_folders(dump_dir)
    path = folder / "kernels" / "k0_matmul.py"
    interpreted = sim.load_kernels(path.read_text(), str(path))["k0_matmul"]
    result = replay(path, lambda *args: interpreted(*args))  # not an interpreter Kernel object
    assert result.estimate is None and result.inputs_source == "saved" and result.mismatch is None
    assert "estimated" not in result.summary()
    assert "matches the saved outputs of the compiled run within verify's tolerances" in result.summary()
    slightly_off = replay(path, lambda *args: interpreted(*args) * (1 + 1e-6))
    assert slightly_off.mismatch is None  # hardware rounding may differ from the interpreter's
    wrong = replay(path, lambda *args: interpreted(*args) + 1)
    assert "differs from the saved output" in wrong.mismatch


def test_dump_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_INDUCTOR_DUMP_DIR", str(tmp_path))
    torch.compile(lambda x: x.relu() * 2, backend="neuron")(torch.randn(4, 8))
    (folder,) = _bucket_folders(tmp_path)
    assert (folder / "kernels" / "k0_pointwise.py").is_file()


def test_a_cache_hit_is_dumped_and_reported_too(tmp_path):
    def f(a, b):
        return (a @ b).relu()

    a, b = torch.randn(16, 8), torch.randn(8, 24)
    for _ in range(2):  # the second compile of the same graph is a hit in this process's memory tier
        torch._dynamo.reset()
        torch.compile(f, backend="neuron", options={"dump_dir": str(tmp_path)})(a, b)
    first, second = neuron_inductor.report().buckets
    assert first["cache"]["event"] == "miss" and second["cache"] == {"event": "memory hit"}
    assert second["estimated_seconds"] == first["estimated_seconds"] > 0  # estimates travel with the artifact
    folder = Path(second["folder"])
    assert (folder / "kernels" / "k0_matmul.py").is_file() and (folder / "kernels" / "k0_matmul.inputs.pt").is_file()
    assert json.loads((folder / "report.json").read_text())["cache"]["event"] == "memory hit"


def test_unwritable_dump_dir_says_what_is_accepted(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    compiled = torch.compile(lambda x: x * 2, backend="neuron", options={"dump_dir": str(blocker / "dump")})
    with pytest.raises(ConfigError, match="NEURON_INDUCTOR_DUMP_DIR.*cannot create.*accepted: a path to a folder"):
        compiled(torch.randn(4))


def test_a_failing_observer_does_not_break_the_compile(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dump, "write_bucket", broken)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="neuron_inductor"):
        got = torch.compile(lambda x: x.relu() * 2, backend="neuron", options={"dump_dir": str(tmp_path)})(x)
    torch.testing.assert_close(got, x.relu() * 2)
    assert "observing the compile failed in on_program_compiled" in caplog.text and "disk full" in caplog.text


# ---------------------------------------------------------------------------------------------
# NEURON_INDUCTOR_VERIFY


def test_verify_passes_for_a_padded_training_step(training_dump):
    """Eager runs on the real 100 rows; the forward's saved activations and the backward's inputs
    are compared at their real sizes although the kernels ran on 128 rows."""
    _, buckets = training_dump
    assert sorted(b.aot.kind for b in buckets) == ["backward", "forward"]
    assert all(b.verify["ok"] and "matches eager" in b.verify["message"] for b in buckets)


def test_padding_waste_counts_the_bucketed_rows(training_dump):
    dump_dir, buckets = training_dump
    (forward,) = [b for b in buckets if b.aot.kind == "forward"]
    # Only inputs with a bucketed dim count (the activations), not the weights.
    assert forward.padding == {"real_elements": 100 * 48, "padded_elements": 128 * 48, "fraction": 28 / 128}
    shapes = json.loads((forward.folder / "bucket.json").read_text())
    assert [100, 48] in shapes["real_input_shapes"] and [128, 48] in shapes["compiled_input_shapes"]


@pytest.fixture
def broken_last_kernel(monkeypatch):
    """Make the last kernel of every compiled graph return its result + 1 (a wrong kernel)."""
    build = SimulatorToolchain.build

    def broken_build(self, sources, written=None):
        kernels = build(self, sources, written)
        last = list(kernels)[-1]
        good = kernels[last]
        kernels[last] = lambda *args: good(*args) + 1
        return kernels

    monkeypatch.setattr(SimulatorToolchain, "build", broken_build)


def test_verify_raise_names_the_output_and_the_kernel(broken_last_kernel):
    compiled = torch.compile(MLP(), backend="neuron", options={"verify": "raise"})
    with torch.no_grad(), pytest.raises(VerifyError, match=r"output 0 \(float32\[130, 24\], computed by kernel k\d+_"
                                                           r"\w+\): 3120 of 3120 element\(s\) exceed the tolerance"):
        compiled(torch.randn(130, 48))


def test_verify_warn_logs_and_keeps_running(broken_last_kernel, caplog):
    model = MLP()
    x = torch.randn(16, 48)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="neuron_inductor"):
        got = torch.compile(model, backend="neuron", options={"verify": "warn"})(x)
        want = model(x)
    torch.testing.assert_close(got, want + 1)  # the broken result is returned, and reported:
    assert "differs from eager: output 0" in caplog.text
    assert not neuron_inductor.report().buckets[0]["verify"]["ok"]


def test_verify_env_flag_1_means_warn(broken_last_kernel, monkeypatch, caplog):
    monkeypatch.setenv("NEURON_INDUCTOR_VERIFY", "1")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="neuron_inductor"):
        torch.compile(lambda x: x @ x.T, backend="neuron")(torch.randn(8, 8))
    assert "differs from eager" in caplog.text


def test_bad_verify_env_value_lists_the_accepted_ones(monkeypatch):
    monkeypatch.setenv("NEURON_INDUCTOR_VERIFY", "loud")
    # Dynamo wraps the backend's ConfigError in BackendCompilerFailed; the message is kept.
    with pytest.raises(Exception, match="ConfigError: environment variable NEURON_INDUCTOR_VERIFY: .*'loud'.*"
                                        "accepted values: off, warn, raise"):
        torch.compile(lambda x: x + 1, backend="neuron")(torch.randn(4))


def test_verify_replays_host_rng_and_checks_in_place_mutation():
    def dropout_then_scale(x):
        return torch.nn.functional.dropout(x, p=0.5, training=True) * 3

    def update(cache, new, pos):
        cache.index_copy_(1, pos, new)
        return cache.sum(dim=-1)

    torch.manual_seed(0)
    torch.compile(dropout_then_scale, backend="neuron", options={"verify": "raise"})(torch.randn(64, 32))
    cache = torch.zeros(2, 16, 8)
    with torch.inference_mode():
        torch.compile(update, backend="neuron", options={"verify": "raise"})(
            cache, torch.randn(2, 3, 8), torch.tensor([2, 5, 9]))
    assert [b["verify"]["ok"] for b in neuron_inductor.report().buckets] == [True, True]
    assert cache.abs().sum() > 0


@pytest.mark.parametrize("got, want, message", [
    (torch.ones(3), torch.ones(3), None),
    (torch.ones(3) * (1 + 5e-5), torch.ones(3), None),  # within fp32 rtol 1e-4
    (torch.tensor([1.0, 2.0, 3.1]), torch.tensor([1.0, 2.0, 3.0]), r"1 of 3 element\(s\).*at index \[2\] compiled 3.1"),
    (torch.ones(2, 3), torch.ones(3, 2), r"got float32\[2, 3\], eager gives float32\[3, 2\]"),
    (torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]), "NaN in one result only"),
    (torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]), None),
    (torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]), r"1 element\(s\) differ; at index \[2\]"),
    (torch.ones(4, dtype=torch.bfloat16) * 1.0078125, torch.ones(4, dtype=torch.bfloat16), None),  # one bf16 ulp
    (torch.tensor([1e4 + 0.5]), torch.tensor([1e4]), None),  # atol scales with magnitude: 0.5 < 1e-5*1e4 + 1e-4*1e4
])
def test_difference_tolerances(got, want, message):
    result = verify.difference(got, want)
    if message is None:
        assert result is None
    else:
        assert result is not None and re.search(message, result), result


# ---------------------------------------------------------------------------------------------
# neuron_inductor.report()


def test_report_counts_kernels_fallback_flops_and_estimates():
    def f(a, b):
        return torch.special.i0(a @ b)

    a, b = torch.randn(64, 32), torch.randn(32, 48)
    torch.compile(f, backend="neuron")(a, b)
    report = neuron_inductor.report()
    (bucket,) = report.buckets
    assert [k["ops"] for k in bucket["kernels"]] == [["aten.mm.default"]]
    assert bucket["fallbacks"] == [{"op": "aten.i0.default", "reason": "no lowering for aten.i0.default",
                                   "flops": 64 * 48}]
    mm_flops = 2 * 64 * 32 * 48
    assert report.kernel_flop_share == pytest.approx(mm_flops / (mm_flops + 64 * 48))
    assert report.estimated_seconds == pytest.approx(sum(k["estimated_seconds"] for k in bucket["kernels"]))
    assert report.estimated_seconds > 0
    text = str(report)
    assert "k0_matmul" in text and "fallback aten.i0.default" in text
    assert "FLOPs in kernels 98.5%" in text  # 196608 / (196608 + 3072)
    assert json.loads(report.to_json())["totals"]["fallbacks"] == 1


# ---------------------------------------------------------------------------------------------
# Logging


def test_torch_logs_turns_on_stage_timings_and_fallback_lines(tmp_path):
    script = tmp_path / "compile_once.py"
    script.write_text("import torch\n"
                      "f = torch.compile(lambda a, b: torch.special.i0(a @ b), backend='neuron')\n"
                      "f(torch.randn(8, 8), torch.randn(8, 8))\n")
    env = dict(os.environ, TORCH_LOGS="+neuron_inductor")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stderr
    log = run.stderr
    assert "graph 0 inference bucket 0 compiled: 1 kernel(s), 1 fallback(s)" in log
    assert "aten.i0.default runs eagerly on the host" in log
    timings = next(line for line in log.splitlines() if "stage timings" in line)
    stages = ("trace", "decompose", "bucket", "lower", "render", "compile")
    assert re.search(r"stage timings: " + ", ".join(rf"{stage} \d+\.\d{{3}}s" for stage in stages), timings), timings


def test_recompiles_are_logged_with_dynamos_reason(caplog):
    compiled = torch.compile(lambda x: x * 2, backend="neuron")
    with caplog.at_level(logging.INFO, logger="neuron_inductor"):
        compiled(torch.randn(8))
        compiled(torch.randn(9))  # Dynamo's first recompile: switches to dynamic shapes (info)
        compiled(torch.randn(9, dtype=torch.float64))  # a second recompile of the frame (warning)
    recompiles = [r for r in caplog.records if "recompiling" in r.getMessage()]
    assert [r.levelno for r in recompiles] == [logging.INFO, logging.WARNING]
    assert "size mismatch" in recompiles[0].getMessage() and "dtype mismatch" in recompiles[1].getMessage()


# ---------------------------------------------------------------------------------------------
# Progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_only_on_a_terminal():
    quiet = io.StringIO()
    line = progress.ProgressLine("graph 0", stream=quiet, delay=0)
    line.update("kernel 1/2")
    line.close()
    assert quiet.getvalue() == ""
    terminal = _Terminal()
    line = progress.ProgressLine("graph 0", stream=terminal, delay=0)
    line.update("kernel 1/2")
    line.close()
    assert terminal.getvalue().startswith("\rneuron_inductor: graph 0: kernel 1/2")
    assert terminal.getvalue().endswith("\r")  # erased when done


def test_compile_shows_kernel_progress_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(progress, "DELAY_SECONDS", 0.0)
    with torch.no_grad():
        torch.compile(MLP(), backend="neuron")(torch.randn(8, 48))
    shown = terminal.getvalue()
    kernels = len(session.BUCKETS[0].artifact.kernel_sources)
    assert f"neuron_inductor: compiling: render, kernel 1/{kernels} (k0_" in shown
    assert f"graph 0 inference bucket 0: first run, kernel 1/{kernels} (k0_" in shown
    assert f"first run, kernel {kernels}/{kernels}" in shown
    assert shown.endswith("\r")  # the line is erased once the run finished


@pytest.mark.slow
def test_inspect_kernels_example_runs(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "inspect_kernels.py"
    run = subprocess.run([sys.executable, str(example), "--dump-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert "verify: matches eager" in run.stdout and "result matches the saved outputs" in run.stdout
    assert len(_bucket_folders(tmp_path)) == 2


def test_observers_only_read_the_records_they_are_given():
    """observe/ never reaches back into the pipeline: it imports neither the runtime, the cache nor
    the compiler (type names under TYPE_CHECKING aside), and nothing inside a function (the late
    import that dodges an import cycle)."""
    import ast

    pipeline = {"runtime", "cache", "compiler", "backend"}
    offenders = []
    for path in sorted((Path(neuron_inductor.__file__).parent / "observe").glob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") ==
                       "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in typing_only:
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            modules = {part for name in names for part in name.split(".")} | (
                {a.name for a in node.names} if isinstance(node, ast.ImportFrom) and node.level == 2 else set())
            if modules & pipeline or node.col_offset > 0:
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders
