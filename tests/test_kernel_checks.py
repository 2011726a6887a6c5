"""The kernel check's verdicts are stored by kernel source and argument shapes: a kernel that
passed is not checked again in a later process, even for a graph that is compiled anew; a changed
interpreter checks again; results and cost estimates stay those of a real check."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import cache as cache_module
from neuron_inductor import config, generalize, kernel_checks, sim
from neuron_inductor.observe import session


def _scaled_softmax(x, w):
    return torch.softmax(x * w, dim=-1) + 1


@pytest.fixture
def new_process(monkeypatch, tmp_path):
    """`new_process()`: Dynamo and every cache's memory tier start empty, and the compiled graphs
    on disk are deleted (their verdicts stay), so the next call compiles and checks anew."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(cache_module, "_caches", {})

    def start() -> None:
        torch._dynamo.reset()
        generalize.reset()  # the shape families seen (their programs) die with a process too
        cache_module._caches.clear()
        for entry in folder.glob("*/*.nicache"):  # graphs only: checks/ is one level deeper
            entry.unlink()

    with config.patch(cache_dir=str(folder), fallback="error"):
        yield start
    torch._dynamo.reset()
    generalize.reset()


def _compile_and_run(x, w) -> dict:
    """Compile and run once; the program's estimates, and the check verdicts' statistics."""
    out = torch.compile(_scaled_softmax, backend="neuron")(x, w)
    torch.testing.assert_close(out, _scaled_softmax(x, w), rtol=1e-5, atol=1e-6)
    (cache,) = cache_module._caches.values()
    checks = cache.checks.stats
    return {"estimates": session.BUCKETS[-1].artifact.meta["estimates"], "checks": checks,
            "kernels": len(session.BUCKETS[-1].artifact.kernel_sources)}


def test_a_later_process_reuses_the_verdicts_and_their_estimates(new_process):
    x, w = torch.randn(8, 40), torch.randn(40)
    new_process()
    first = _compile_and_run(x, w)
    assert first["kernels"] >= 2 and first["checks"]["compiles"] == first["kernels"]

    new_process()
    again = _compile_and_run(x, w)
    assert again["checks"]["compiles"] == 0 and again["checks"]["disk_hits"] == again["kernels"]
    assert again["estimates"] == first["estimates"]


def test_other_shapes_and_a_changed_interpreter_are_checked_again(new_process, monkeypatch):
    x, w = torch.randn(8, 40), torch.randn(40)
    new_process()
    kernels = _compile_and_run(x, w)["kernels"]

    new_process()
    assert _compile_and_run(torch.randn(8, 72), torch.randn(72))["checks"]["compiles"] == kernels

    monkeypatch.setattr(kernel_checks, "source_hash", lambda names: "0123456789abcdef")
    new_process()
    assert _compile_and_run(x, w)["checks"]["compiles"] == kernels


def test_a_broken_kernel_is_never_stored_as_passing(tmp_path):
    """The rule check stores only passes: a rule violation raises every time it is checked."""
    source = ("import nki.language as nl\n\n@nki.jit\ndef k(x):\n"
              "    nl.ndarray((256, 1), dtype=nl.float32, buffer=nl.sbuf)\n    return x\n")
    verdicts = kernel_checks.KernelChecks(tmp_path)
    kernel = sim.load_kernels("import nki\n" + source, "<broken>")["k"]
    args = [torch.zeros(4, 4)]
    for _ in range(2):
        with pytest.raises(sim.NkiError, match="partition dim"):
            verdicts.verdict(source, args, "trn2", lambda: kernel(*args))
    assert verdicts.stats["compiles"] == 0 and not list((tmp_path / kernel_checks.SUBFOLDER).glob("*/*.nicache"))
