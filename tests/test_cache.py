"""The compile cache: memory and disk tiers, corruption handling, compile-once across processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from neuron_inductor import cache as cache_module
from neuron_inductor.cache import CompileCache, cache_stats, key_of
from neuron_inductor.compiler import CompiledArtifact
from tests.host_lowering import host_only  # noqa: F401  (fixture)

PARTS = {"graph": "g1", "kind": "forward", "mode": "padded", "bucket": [["s0", 128]], "dtypes": ["torch.float32"]}


def _artifact(tag: str = "a") -> CompiledArtifact:
    return CompiledArtifact({"k0_pointwise": f"# kernel {tag}\n"}, "def run(args, kernels, constants):\n    return []\n",
                            [], {"kernels": [], "fallbacks": [], "compile_seconds": 0.5})


def _compile_counter():
    calls = []

    def compile_fn():
        calls.append(1)
        return _artifact(str(len(calls))), "fresh"

    return compile_fn, calls


def test_memory_then_disk_hit(tmp_path):
    compile_fn, calls = _compile_counter()
    first = CompileCache(tmp_path)
    artifact, extra, source = first.get_or_compile(PARTS, "s0=128", compile_fn)
    assert (source, extra, len(calls)) == ("compiled", "fresh", 1)
    assert first.get_or_compile(PARTS, "s0=128", compile_fn)[2] == "memory"
    second = CompileCache(tmp_path)  # a new process, same folder
    loaded, extra, source = second.get_or_compile(PARTS, "s0=128", compile_fn)
    assert (source, extra, len(calls)) == ("disk", None, 1)
    assert loaded.kernel_sources == artifact.kernel_sources and loaded.meta == artifact.meta
    stats = second.stats.as_dict()
    assert stats["disk_hits"] == 1 and stats["compiles"] == 0
    assert stats["per_bucket"] == {"s0=128": {"disk_hits": 1}}


def test_key_parts_are_listed_and_a_miss_is_recorded(tmp_path):
    compile_fn, _ = _compile_counter()
    store = CompileCache(tmp_path)
    store.get_or_compile(PARTS, "s0=128", compile_fn)
    other = {**PARTS, "bucket": [["s0", 256]]}
    store.get_or_compile(other, "s0=256", compile_fn)
    listed = {e["key"]: e["parts"] for e in CompileCache(tmp_path).entries()}
    assert listed == {key_of(PARTS): PARTS, key_of(other): other}
    assert [m["parts"] for m in store.stats.recent_misses] == [PARTS, other]
    store.clear()
    assert CompileCache(tmp_path).entries() == []


@pytest.mark.parametrize("damage", ["truncate", "flip_bit", "bad_header"])
def test_corrupt_entry_is_reported_and_rebuilt(tmp_path, damage):
    compile_fn, calls = _compile_counter()
    CompileCache(tmp_path).get_or_compile(PARTS, "s0=128", compile_fn)
    path = CompileCache(tmp_path).path(key_of(PARTS))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 20]
    elif damage == "flip_bit":
        data[-10] ^= 0x04
    else:
        data[0:1] = b"#"
    path.write_bytes(bytes(data))
    fresh = CompileCache(tmp_path)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        _, _, source = fresh.get_or_compile(PARTS, "s0=128", compile_fn)
    assert source == "compiled" and len(calls) == 2 and fresh.stats.counts["corrupt"] == 1
    assert CompileCache(tmp_path).get_or_compile(PARTS, "s0=128", compile_fn)[2] == "disk"  # rebuilt entry is good


def test_unwritable_folder_degrades_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="not writable") as record:
        store = CompileCache(blocker / "cache")
    assert len(record) == 1 and store.folder is None
    compile_fn, calls = _compile_counter()
    assert store.get_or_compile(PARTS, "b", compile_fn)[2] == "compiled"
    assert store.get_or_compile(PARTS, "b", compile_fn)[2] == "memory" and len(calls) == 1


_WORKER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from neuron_inductor.cache import CompileCache
    from neuron_inductor.compiler import CompiledArtifact
    from pathlib import Path
    store = CompileCache(Path({folder!r}), secret={secret!r})
    def compile_fn(key):
        def build():
            with open({log!r}, "a") as log:
                log.write(key + "\\n")
            time.sleep(0.3)  # a slow compile: the other processes must wait on the lock, not compile
            return CompiledArtifact({{"k": key}}, "def run(args, kernels, constants):\\n    return []\\n", [], {{}}), None
        return build
    for key in ("a", "b", "c"):
        store.get_or_compile({{"graph": key}}, key, compile_fn(key))
    print(store.stats.counts["compiles"], store.stats.counts["disk_hits"])
""")


def assert_processes_compile_each_key_once(folder: Path, log: Path, secret: str | None = None) -> str:
    """4 processes compile keys a, b, c into `folder` at once: each key compiles once, every other lookup is a
    disk hit. Returns the processes' stderr."""
    script = _WORKER.format(root=str(Path(__file__).resolve().parents[1]), folder=str(folder), log=str(log),
                            secret=secret)
    workers = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(4)]
    outputs = [w.communicate(timeout=120) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err for _, err in outputs]
    results = [out.split() for out, _ in outputs]
    assert sorted(log.read_text().split()) == ["a", "b", "c"]
    assert sum(int(compiles) for compiles, _ in results) == 3
    assert sum(int(hits) for _, hits in results) == 9
    return "".join(err for _, err in outputs)


def test_four_processes_compile_each_key_once(tmp_path):
    assert_processes_compile_each_key_once(tmp_path / "cache", tmp_path / "compiles.log")


def test_backend_second_process_compiles_nothing(host_only, tmp_path):
    """Through the backend: a process that finds the entries on disk compiles no kernel set."""
    from neuron_inductor import config

    def run():
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: (x.softmax(1) * 2).sum(1), backend="neuron")
        for n in (5, 9, 200):
            x = torch.randn(2, n, 3)
            torch._dynamo.mark_dynamic(x, 1)
            assert torch.allclose(compiled(x), (x.softmax(1) * 2).sum(1), rtol=1e-5)

    with config.patch(cache_dir=str(tmp_path), fallback="allow"):
        before = cache_stats()
        run()
        cold = cache_stats()
        cache_module._caches.clear()  # forget the memory tier: as a new process would
        run()
        warm = cache_stats()
    assert cold["compiles"] - before["compiles"] == 2  # buckets 128 and 256
    assert warm["compiles"] == 0 and warm["disk_hits"] == 2


def test_cache_stats_shape():
    stats = cache_stats()
    for name in ("compiles", "memory_hits", "disk_hits", "misses", "per_bucket"):
        assert name in stats
    json.dumps(stats)  # plain data, loggable as-is
