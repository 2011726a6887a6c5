"""The `neuron-inductor` console script on a really compiled model: cache, report and replay verbs,
and the errors bad arguments give."""

from __future__ import annotations

import json
import shutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from neuron_inductor import cli
from neuron_inductor.observe import session


def _compile(cache_dir: Path, dump_dir: Path | None = None, **options):
    """i0(a @ b): one matmul kernel and one host fallback, inference only."""
    torch._dynamo.reset()
    options = {"cache_dir": str(cache_dir), **({"dump_dir": str(dump_dir)} if dump_dir else {}), **options}
    compiled = torch.compile(lambda a, b: torch.special.i0(a @ b), backend="neuron", options=options)
    with torch.no_grad():
        return compiled(torch.randn(64, 32), torch.randn(32, 48))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(dump folder, cache folder) of one compile; the cache then holds exactly one entry."""
    session.clear()
    dump_dir, cache_dir = tmp_path_factory.mktemp("dump"), tmp_path_factory.mktemp("cache")
    _compile(cache_dir, dump_dir)
    return dump_dir, cache_dir


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_is_declared():
    (script,) = entry_points(group="console_scripts", name="neuron-inductor")
    assert script.load() is cli.main


# ---------------------------------------------------------------------------------------------
# report


def test_report_shows_kernels_fallbacks_flop_share_and_estimates(compiled, capsys):
    dump_dir, _ = compiled
    code, out, _ = run(capsys, "report", str(dump_dir))
    assert code == 0
    assert "the newest run in" in out and "graph 0 inference" in out
    assert "k0_matmul" in out and "fallback aten.i0.default" in out
    assert "FLOPs in kernels 98.5%" in out and "estimated trn2 time" in out and "not run yet" not in out


def test_report_json_from_the_environment_flag(compiled, capsys, monkeypatch):
    dump_dir, _ = compiled
    monkeypatch.setenv("NEURON_INDUCTOR_DUMP_DIR", str(dump_dir))
    code, out, _ = run(capsys, "report", "--json")
    totals = json.loads(out)["totals"]
    assert code == 0 and totals["kernels"] == 1 and totals["fallbacks"] == 1 and totals["estimated_seconds"] > 0
    assert totals["target"] == "trn2" and totals["cache"] == {"miss": 1}


def test_report_takes_the_newest_run_unless_all_runs(compiled, capsys, tmp_path):
    dump_dir, _ = compiled
    (run_folder,) = [p.parent for p in dump_dir.glob("*/run.json")]
    shutil.copytree(run_folder, tmp_path / run_folder.name)
    shutil.copytree(run_folder, tmp_path / "run-99991231-235959-pid1")
    _, newest, _ = run(capsys, "report", str(tmp_path), "--json")
    _, every, _ = run(capsys, "report", str(tmp_path), "--json", "--all-runs")
    assert "run-99991231-235959-pid1" in json.loads(newest)["source"]
    assert json.loads(newest)["totals"]["buckets"] == 1 and json.loads(every)["totals"]["buckets"] == 2


def test_report_errors_say_what_to_pass(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("NEURON_INDUCTOR_DUMP_DIR", raising=False)
    code, _, err = run(capsys, "report")
    assert code == 2 and "pass DUMP_DIR or set NEURON_INDUCTOR_DUMP_DIR" in err
    code, _, err = run(capsys, "report", str(tmp_path))
    assert code == 2 and "no report.json under" in err
    code, _, err = run(capsys, "report", str(tmp_path / "missing"))
    assert code == 2 and "is not a folder" in err
    (tmp_path / "report.json").write_text(json.dumps({"format": 0}))
    code, _, err = run(capsys, "report", str(tmp_path))
    assert code == 2 and "written by another neuron_inductor version" in err


# ---------------------------------------------------------------------------------------------
# replay


def test_replay_reproduces_the_saved_result(compiled, capsys):
    dump_dir, _ = compiled
    code, out, _ = run(capsys, "replay", str(dump_dir / "k0_matmul"))
    assert code == 0
    assert "kernel k0_matmul on saved inputs: out0 float32[64, 48]" in out
    assert "estimated trn2 time" in out and "matches the saved outputs of the compiled run exactly" in out


def test_replay_random_inputs_on_trn3(compiled, capsys):
    dump_dir, _ = compiled
    (kernel,) = dump_dir.rglob("kernels/k0_matmul.py")
    code, out, _ = run(capsys, "replay", str(kernel.with_suffix("")), "--random", "--seed", "7", "--target", "trn3")
    assert code == 0 and "on random inputs" in out and "estimated trn3 time" in out and "saved outputs" not in out


def test_replay_fails_when_the_result_differs_from_the_saved_one(compiled, capsys, tmp_path):
    dump_dir, _ = compiled
    (kernels,) = dump_dir.rglob("kernels")
    copy = shutil.copytree(kernels, tmp_path / "kernels")
    outputs = copy / "k0_matmul.outputs.pt"
    torch.save([t + 1 for t in torch.load(outputs)], outputs)
    code, out, _ = run(capsys, "replay", str(copy / "k0_matmul.py"))
    assert code == 1 and "differs from the saved output by up to 1" in out


def test_replay_errors_list_the_candidates(compiled, capsys, tmp_path):
    dump_dir, _ = compiled
    code, _, err = run(capsys, "replay", str(dump_dir / "k7_attention"))
    assert code == 2 and "no dumped kernel at" in err and "DUMP_DIR/KERNEL_NAME" in err
    shutil.copytree(dump_dir, tmp_path / "a")
    shutil.copytree(dump_dir, tmp_path / "b")
    code, _, err = run(capsys, "replay", str(tmp_path / "k0_matmul"))
    assert code == 2 and "2 dumped kernels are named k0_matmul" in err and str(tmp_path / "b") in err


# ---------------------------------------------------------------------------------------------
# cache


def test_cache_list_and_show(compiled, capsys):
    dump_dir, cache_dir = compiled
    code, out, _ = run(capsys, "cache", "--cache-dir", str(cache_dir), "list")
    assert code == 0 and out.startswith("1 entry, ") and "inference" in out
    key = out.splitlines()[1].split()[0]
    code, out, _ = run(capsys, "cache", "--cache-dir", str(cache_dir), "show", key[:6])
    assert code == 0 and f"key {key}" in out and "kernel k0_matmul" in out and "fallback aten.i0.default" in out
    code, source, _ = run(capsys, "cache", "--cache-dir", str(cache_dir), "show", key, "--kernel", "k0_matmul")
    (dumped,) = dump_dir.rglob("kernels/k0_matmul.py")
    assert code == 0 and dumped.read_text().startswith(source)
    code, wrapper, _ = run(capsys, "cache", "--cache-dir", str(cache_dir), "show", key, "--wrapper")
    assert code == 0 and "kernels.k0_matmul(" in wrapper and "aten.i0.default(" in wrapper


def test_cache_explain_names_the_differing_key_part_and_clear_empties_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEURON_INDUCTOR_CACHE_DIR", str(tmp_path))
    code, out, _ = run(capsys, "cache", "explain")
    assert code == 0 and "no cache misses recorded" in out
    _compile(tmp_path)
    _compile(tmp_path, target="trn3")  # a code-generating option: a new key
    code, out, _ = run(capsys, "cache", "explain", "--last", "1")
    assert code == 0 and "differs first in 'config', code-generating options differ" in out
    code, out, _ = run(capsys, "cache", "explain")
    assert "the cache held no other entry" in out  # the very first compile
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and out.startswith("removed 2 entries")
    assert "0 entries" in run(capsys, "cache", "list")[1]
    assert "no cache misses recorded" in run(capsys, "cache", "explain")[1]


def test_cache_show_unknown_key(compiled, capsys):
    _, cache_dir = compiled
    code, _, err = run(capsys, "cache", "--cache-dir", str(cache_dir), "show", "zzzz")
    assert code == 2 and "no cache entry with a key starting 'zzzz'" in err and "cache list" in err


# ---------------------------------------------------------------------------------------------
# usage errors


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: {cache,report,replay}"),
    (["bogus"], "invalid choice: 'bogus' (choose from 'cache', 'report', 'replay')"),
    (["cache", "purge"], "invalid choice: 'purge' (choose from 'list', 'show', 'clear', 'explain')"),
    (["cache", "show"], "the following arguments are required: KEY"),
    (["cache", "explain", "--last", "0"], "'0' is not a positive integer"),
    (["replay", "x", "--target", "trn9"], "invalid choice: 'trn9' (choose from 'trn1', 'trn2', 'trn3')"),
    (["replay", "x", "--seed", "one"], "invalid int value: 'one'"),
])
def test_bad_arguments_say_what_is_accepted(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_environment_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("NEURON_INDUCTOR_DUMP_DIR", "NEURON_INDUCTOR_VERIFY", "NEURON_INDUCTOR_CACHE_DIR"):
        assert flag in out


def test_report_writes_a_perfetto_trace_of_the_kernels(compiled, capsys, tmp_path):
    from tests.test_perfetto import check_trace_json

    dump_dir, _ = compiled
    path = tmp_path / "step.json"
    code, out, _ = run(capsys, "report", str(dump_dir), "--perfetto", str(path))
    assert code == 0 and f"wrote {path}" in out
    document = json.loads(path.read_text())
    (launch,) = check_trace_json(document, launches=1)
    assert launch["name"] == "k0_matmul" and launch["args"]["family"] == "matmul"
    engines = {e["tid"] for e in document["traceEvents"] if e.get("cat") == "engine"}
    assert len(engines) >= 2  # the kernel's per-engine busy times travel in report.json
    code, out, err = run(capsys, "report", str(dump_dir), "--json", "--perfetto", str(path))
    assert code == 0 and json.loads(out) and "wrote" in err  # stdout stays JSON
