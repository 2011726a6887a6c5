"""Faults around the compile cache and generated kernels.

- kill -9 while a process compiles (holding the key's lock), while it writes an entry, and at
  random moments of a compile loop: the next process finds no corrupt entry and compiles fine;
- a read-only cache folder (a read-only bind mount in a private mount namespace: the tests run as
  root, where chmod does not stop writes) and a full one (a 4 KiB tmpfs, and ENOSPC injected into
  the write for machines without mount privileges);
- two package versions (or code revisions) sharing one folder never hit each other's entries;
- a generated kernel that breaks a hardware rule is reported by kernel name and rule, raises with
  fallback="error", and otherwise runs its ops on the host with eager results.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from neuron_inductor import cache as cache_module
from neuron_inductor import config
from neuron_inductor import observe
from neuron_inductor.observe import session
from neuron_inductor.cache import CompileCache, cache_stats
from neuron_inductor.compiler import UNCHECKED
from neuron_inductor.toolchain.simulator import KernelRuleViolation
from neuron_inductor.toolchain.simulator import SimulatorToolchain

REPO = Path(__file__).resolve().parents[1]
SHAPES = 3  # static shapes the child compiles in its "run" phase (bucketing may map some to one key)

# A child process compiling one function at several static shapes (cache keys). `phase`
# picks where it stops to be killed: "compile" inside the compile (the key's lock held), "write"
# after the entry is written to its temp file but before the rename, "loop" never (it compiles
# ever new shapes until killed), "run" not at all: it compiles SHAPES, runs each twice and prints
# its cache stats, the largest error against eager and the files left in the cache folder.
CHILD = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    import neuron_inductor
    from neuron_inductor import runtime
    phase, marker = sys.argv[1], Path(sys.argv[2])
    torch._dynamo.config.recompile_limit = 10_000  # one static graph per shape

    def stop_here(*args, **kwargs):
        marker.write_text(phase)
        time.sleep(600)

    if phase == "compile":
        runtime.compile_and_build = stop_here
    elif phase == "write":
        os.fsync = stop_here

    def f(x):
        return torch.softmax(x * 2, dim=-1).sum(-1) + x.amax(-1)

    compiled = torch.compile(f, backend="neuron", dynamic=False)
    widths = range(8, 10_000) if phase == "loop" else range(8, 8 + {shapes})
    if phase == "loop":
        marker.write_text(phase)
    error = 0.0
    for width in widths:
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(width))
        for _ in range(2):
            error = max(error, (compiled(x) - f(x)).abs().max().item())
    folder = Path(os.environ["NEURON_INDUCTOR_CACHE_DIR"])
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    print(json.dumps({{"stats": neuron_inductor.cache_stats(), "max_error": error, "files": files}}))
""").format(shapes=SHAPES)


def _child_env(cache_dir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "NEURON_INDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}


def _run_child(cache_dir: Path, prefix: list[str] = ()) -> tuple[dict, str]:
    """Run the child to completion (phase "run"); returns its report and its stderr."""
    result = subprocess.run([*prefix, sys.executable, "-c", CHILD, "run", os.devnull], env=_child_env(cache_dir),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def _kill_child_at(phase: str, cache_dir: Path, marker: Path, extra_delay: float = 0.0) -> None:
    """Start the child, wait until it reaches `phase` (it writes `marker`), wait `extra_delay`, kill -9."""
    log = marker.with_suffix(".log")  # a file, not a pipe: a chatty child must not block on a full pipe
    with open(log, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", CHILD, phase, str(marker)], env=_child_env(cache_dir),
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert child.poll() is None, f"child exited before reaching {phase!r}: {log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"child never reached {phase!r}"
            time.sleep(0.05)
        time.sleep(extra_delay)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL


def _assert_entries_sound(cache_dir: Path) -> int:
    """Every entry on disk reads back whole (a corrupt one would warn); returns how many there are."""
    store = CompileCache(cache_dir)
    entries = store.entries()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for entry in entries:
            assert entry["parts"] is not None, entry
            assert store.load(entry["key"]) is not None, entry
    return len(entries)


def _assert_next_process_compiles_fine(cache_dir: Path) -> dict:
    """A new process runs every shape correctly and meets no corrupt entry; returns its cache stats."""
    report, _ = _run_child(cache_dir)
    stats = report["stats"]
    assert report["max_error"] < 1e-4
    assert stats["corrupt"] == 0 and stats["disk_errors"] == 0 and stats["compiles"] + stats["disk_hits"] > 0, stats
    # A temp file of a killed writer may stay behind (harmless: it is never read as an entry).
    assert _assert_entries_sound(cache_dir) >= stats["compiles"] + stats["disk_hits"]
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["compile", "write"])
def test_kill_during_compile_or_write_leaves_no_entry_and_no_stuck_lock(tmp_path, phase):
    cache_dir = tmp_path / "cache"
    _kill_child_at(phase, cache_dir, tmp_path / "marker")
    assert _assert_entries_sound(cache_dir) == 0  # killed before the first entry was renamed into place
    stats = _assert_next_process_compiles_fine(cache_dir)  # the dead process's lock is gone
    assert stats["disk_hits"] == 0


@pytest.mark.slow
def test_kill_at_random_moments_of_a_compile_loop(tmp_path):
    cache_dir = tmp_path / "cache"
    delays = random.Random(13).sample([0.2, 0.5, 0.9, 1.4, 2.0, 2.7], 3)
    for round_, delay in enumerate(delays):
        _kill_child_at("loop", cache_dir, tmp_path / f"marker{round_}", extra_delay=delay)
        _assert_entries_sound(cache_dir)
    _assert_next_process_compiles_fine(cache_dir)


# -- read-only and full cache folders --------------------------------------------------------------


def _private_mount_prefix(mount_command: str) -> list[str]:
    """Run a command in a private mount namespace after `mount_command` (nothing leaks to the host)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{mount_command} && exec \"$@\"", "sh"]


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        probe = subprocess.run([*_private_mount_prefix(f"mount -t tmpfs -o size=4k tmpfs {folder}"), "true"],
                               capture_output=True)
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs unshare --mount and mount privileges")


def _entry_files(paths) -> list[str]:
    """Entries and their temp files: whatever lives in the per-key subfolders, except lock files."""
    return [path for path in paths if os.sep in path and not path.endswith(".lock")]


@pytest.mark.slow
@needs_mount
def test_read_only_cache_folder_serves_its_entries_and_compiles_the_rest_in_memory(tmp_path):
    cache_dir = tmp_path / "cache"
    warm, _ = _run_child(cache_dir)  # a writable run fills the folder
    keys = warm["stats"]["compiles"]
    assert keys > 0
    files_before = sorted(p.name for p in cache_dir.rglob("*"))
    report, stderr = _run_child(cache_dir, _private_mount_prefix(f"mount --bind -o ro {cache_dir} {cache_dir}"))
    stats = report["stats"]
    assert report["max_error"] < 1e-4
    assert stats["disk_hits"] == keys and stats["compiles"] == 0, stats
    assert stderr.count("read-only") == 1, stderr[-3000:]

    empty = tmp_path / "empty"
    empty.mkdir()
    report, stderr = _run_child(empty, _private_mount_prefix(f"mount --bind -o ro {empty} {empty}"))
    assert report["max_error"] < 1e-4 and report["stats"]["compiles"] == keys and report["files"] == []
    assert stderr.count("read-only") == 1, stderr[-3000:]
    assert sorted(p.name for p in cache_dir.rglob("*")) == files_before


@pytest.mark.slow
@needs_mount
def test_full_cache_folder_keeps_compiling_and_leaves_no_partial_files(tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    # 4 KiB: folders, lock files and the writability probe fit (they hold no data), entries do not.
    # mode=0700: a tmpfs root is 1777 by default, a folder others can write, whose entries are refused.
    report, _ = _run_child(cache_dir, _private_mount_prefix(f"mount -t tmpfs -o size=4k,mode=0700 tmpfs {cache_dir}"))
    stats = report["stats"]
    assert report["max_error"] < 1e-4
    assert stats["compiles"] > 0 and stats["disk_errors"] == stats["compiles"], stats
    # Kernel-check verdicts (checks/) are small enough to fit whole; compiled-graph entries are not.
    assert [f for f in _entry_files(report["files"]) if not f.startswith("checks/")] == [], report["files"]
    assert [name for name in report["files"] if os.path.basename(name).startswith(".")] == [], report["files"]


class _FullDisk:
    """A NamedTemporaryFile whose write stores half the bytes, then fails with ENOSPC."""

    real = staticmethod(tempfile.NamedTemporaryFile)

    def __init__(self, **kwargs) -> None:
        self.file = self.real(**kwargs)

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def __enter__(self) -> "_FullDisk":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def write(self, data: bytes) -> None:
        self.file.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """Dynamo and the cache's memory tier start empty, as in a new process; the cache folder is tmp."""
    torch._dynamo.reset()
    monkeypatch.setattr(cache_module, "_caches", {})
    with config.patch(cache_dir=str(tmp_path / "cache"), fallback="allow"):
        yield tmp_path / "cache"
    torch._dynamo.reset()


def _softmax_sum(x):
    return torch.softmax(x, dim=-1).sum(-1)


def _compile_and_check(x: torch.Tensor) -> None:
    got = torch.compile(_softmax_sum, backend="neuron")(x)
    torch.testing.assert_close(got, _softmax_sum(x), rtol=1e-5, atol=1e-6)


def test_enospc_on_write_is_counted_and_leaves_no_file(fresh_process, monkeypatch, caplog):
    monkeypatch.setattr(cache_module.tempfile, "NamedTemporaryFile", _FullDisk)
    x = torch.randn(6, 40)
    with caplog.at_level(logging.WARNING, logger="neuron_inductor"):
        _compile_and_check(x)
    assert "No space left on device" in caplog.text
    assert cache_stats()["disk_errors"] == 1 and cache_stats()["compiles"] == 1
    assert _entry_files(str(p.relative_to(fresh_process)) for p in fresh_process.rglob("*") if p.is_file()) == []

    monkeypatch.undo()  # space is back: the next process compiles and stores the entry
    torch._dynamo.reset()
    cache_module._caches.clear()
    with config.patch(cache_dir=str(fresh_process), fallback="allow"):
        _compile_and_check(x)
    assert cache_stats()["compiles"] == 1 and len(CompileCache(fresh_process).entries()) == 1


# -- two package versions sharing one folder ------------------------------------------------------


@pytest.mark.parametrize("part, patch_target, other", [
    ("neuron_inductor", "__version__", "99.0.0"),
    ("code", "package_source_hash", lambda: "0123456789abcdef"),
])
def test_two_package_versions_share_a_folder_without_wrong_hits(fresh_process, monkeypatch, part, patch_target,
                                                                other):
    x = torch.randn(5, 24)

    def new_process() -> dict:
        torch._dynamo.reset()
        cache_module._caches.clear()
        with config.patch(cache_dir=str(fresh_process), fallback="allow"):
            _compile_and_check(x)
        return cache_stats()

    assert new_process()["compiles"] == 1
    with monkeypatch.context() as patched:
        patched.setattr(cache_module, patch_target, other)
        stats = new_process()
    assert stats["compiles"] == 1 and stats["disk_hits"] == 0  # the other version's entry is not taken
    versions = {entry["parts"][part] for entry in CompileCache(fresh_process).entries()}
    assert len(versions) == 2  # both versions' entries live side by side
    stats = new_process()
    assert stats["compiles"] == 0 and stats["disk_hits"] == 1  # the first version finds its own entry again


# -- a generated kernel that breaks a hardware rule -------------------------------------------------

BROKEN_RULE = "partition dim <= 128"


@pytest.fixture
def break_kernels(monkeypatch):
    """`break_kernels(*families)`: kernels of these families, freshly rendered or loaded from the cache,
    also allocate a 256-partition SBUF tile at their end (after their work, before they return), as a
    template bug would. A runtime that keeps rebuilding broken kernels fails the test (after 10 of
    them) instead of hanging it."""
    build = SimulatorToolchain.build
    families: set[str] = set()
    built: list[str] = []

    def with_bug(source: str) -> str:
        lines = source.rstrip("\n").split("\n")
        returns = [i for i, line in enumerate(lines) if line.startswith("    return")]
        lines.insert(returns[-1] if returns else len(lines), "    nl.ndarray((256, 1), dtype=nl.float32, buffer=nl.sbuf)")
        return "\n".join(lines) + "\n"

    def build_with_bugs(self, sources: dict[str, str], written=None, grids=None):
        broken = [name for name in sources if name.split("_", 1)[1] in families]  # names are k<i>_<family>
        built.extend(broken)
        assert len(built) <= 10, f"broken kernels built again and again: {built}"
        return build(self, {name: with_bug(src) if name in broken else src for name, src in sources.items()}, written,
                     grids)

    monkeypatch.setattr(SimulatorToolchain, "build", build_with_bugs)
    return lambda *names: families.update(names)


def _softmax_scale(x, w):
    return torch.softmax(x, dim=-1) * w + 1


def test_rule_violation_raises_in_error_mode_naming_kernel_and_rule(fresh_process, break_kernels):
    break_kernels("softmax")
    x, w = torch.randn(4, 33), torch.randn(33)
    with config.patch(fallback="error"):
        compiled = torch.compile(_softmax_scale, backend="neuron")
        with pytest.raises(KernelRuleViolation, match=rf"generated kernel k0_softmax breaks a hardware rule: "
                                                      rf".*partition dim 256.*\(rule: {BROKEN_RULE}\)"):
            compiled(x, w)


def test_a_kernel_checked_at_first_use_that_breaks_a_rule_is_never_stored_nor_reused(fresh_process, break_kernels):
    """The check is the kernel's first run (compiler.checks_at_first_use): it raises before the graph
    returns, the graph is not written to the disk cache, and the next call checks (and raises) again
    instead of running the kernel from the memory tier."""
    break_kernels("softmax")
    x, w = torch.randn(4, 33), torch.randn(33)
    with config.patch(fallback="error"):
        compiled = torch.compile(_softmax_scale, backend="neuron")
        for _ in range(2):
            with pytest.raises(KernelRuleViolation, match="generated kernel k0_softmax breaks a hardware rule"):
                compiled(x, w)
    assert CompileCache(fresh_process).entries() == []


def test_rule_violation_falls_back_to_eager_and_the_fixed_entry_is_cached(fresh_process, break_kernels, caplog):
    break_kernels("softmax")
    x, w = torch.randn(4, 33), torch.randn(33)
    compiled = torch.compile(_softmax_scale, backend="neuron")
    with caplog.at_level(logging.ERROR, logger="neuron_inductor"):
        for _ in range(2):
            torch.testing.assert_close(compiled(x, w), _softmax_scale(x, w), rtol=1e-5, atol=1e-6)
    assert caplog.text.count("generated kernel k0_softmax breaks a hardware rule") == 1
    assert BROKEN_RULE in caplog.text and "run eagerly on the host" in caplog.text

    # A new process loads the re-lowered entry: softmax on the host, the rest still a kernel.
    torch._dynamo.reset()
    cache_module._caches.clear()
    with config.patch(cache_dir=str(fresh_process), fallback="allow"):
        torch.testing.assert_close(torch.compile(_softmax_scale, backend="neuron")(x, w), _softmax_scale(x, w),
                                   rtol=1e-5, atol=1e-6)
    assert cache_stats()["disk_hits"] == 1 and cache_stats()["compiles"] == 0
    (entry,) = CompileCache(fresh_process).entries()
    meta = CompileCache(fresh_process).load(entry["key"]).meta
    assert [f["op"] for f in meta["fallbacks"]] == ["aten._softmax.default"]
    assert BROKEN_RULE in meta["fallbacks"][0]["reason"] and meta["kernels"]
    # written once every kernel had passed its first-use check, with each kernel's estimate
    assert UNCHECKED not in meta and set(meta["estimates"]) == {k["name"] for k in meta["kernels"]}


def test_a_first_use_violation_leaves_the_session_as_if_lowered_safely_from_the_start(fresh_process, break_kernels,
                                                                                      tmp_path):
    """The failed program's bucket and dump folder go with it: the session and the dump hold one
    bucket, index 0, with the re-lowered kernels only."""
    break_kernels("softmax")
    x, w = torch.randn(4, 33), torch.randn(33)
    session.clear()
    with config.patch(dump_dir=str(tmp_path / "dump")):
        torch.testing.assert_close(torch.compile(_softmax_scale, backend="neuron")(x, w), _softmax_scale(x, w),
                                   rtol=1e-5, atol=1e-6)
    (bucket,) = session.BUCKETS
    assert bucket.index == 0 and bucket.aot.buckets == [bucket] and bucket.source == "compiled"
    assert [f["op"] for f in bucket.artifact.meta["fallbacks"]] == ["aten._softmax.default"]
    assert [b["bucket"]["index"] for b in observe.report().buckets] == [0]
    (folder,) = (p for p in (tmp_path / "dump").rglob("*_bucket*") if p.is_dir())
    assert folder == bucket.folder and folder.name.endswith("_bucket0")
    dumped = {p.stem for p in (folder / "kernels").glob("k*.py")}
    assert dumped == set(bucket.artifact.kernel_sources) and not any("softmax" in name for name in dumped)


def test_two_kernels_breaking_rules_both_end_up_on_the_host(fresh_process, break_kernels):
    """Each violation re-lowers the graph; ops of an earlier violation must not come back as kernels."""
    break_kernels("softmax", "pointwise")
    x, w = torch.randn(4, 33), torch.randn(33)
    torch.testing.assert_close(torch.compile(_softmax_scale, backend="neuron")(x, w), _softmax_scale(x, w),
                               rtol=1e-5, atol=1e-6)
    (entry,) = CompileCache(fresh_process).entries()
    meta = CompileCache(fresh_process).load(entry["key"]).meta
    assert meta["kernels"] == [] and len(meta["fallbacks"]) >= 3  # softmax, mul, add


def test_rule_violation_is_caught_before_any_kernel_touches_user_data(fresh_process, break_kernels):
    """Kernels are checked at compile time on zeros: a violation raises (error mode) before the
    graph's first kernel wrote into a mutated input, and the re-lowered graph applies each update once."""
    def update(a, b):
        a.add_(1)
        b.mul_(2)
        return a.sum() + b.sum()

    break_kernels("copy")  # the copy into `a` would run (and write) before its broken allocation
    a, b = torch.zeros(4, 8), torch.ones(4, 8)
    with config.patch(fallback="error"):
        with pytest.raises(KernelRuleViolation, match=rf"generated kernel k\d+_copy breaks a hardware rule"):
            torch.compile(update, backend="neuron")(a, b)
    torch.testing.assert_close(a, torch.zeros(4, 8))
    torch.testing.assert_close(b, torch.ones(4, 8))

    torch._dynamo.reset()
    out = torch.compile(update, backend="neuron")(a, b)
    torch.testing.assert_close(a, torch.ones(4, 8))
    torch.testing.assert_close(b, torch.full((4, 8), 2.0))
    torch.testing.assert_close(out, torch.tensor(96.0))
