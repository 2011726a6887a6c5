"""`neuron_inductor.reset()` forgets every process-wide store: a later compile starts from zero."""

from __future__ import annotations

import torch

import neuron_inductor
from neuron_inductor.codegen import render
from neuron_inductor.observe import session
from neuron_inductor.sim import replay


def _compile_and_run(cache_dir):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.sigmoid(x) * 2.0, backend="neuron",
                       options={"cache_dir": str(cache_dir), "fallback": "error"})
    x = torch.randn(8, 16)
    torch.testing.assert_close(fn(x), torch.sigmoid(x) * 2.0)


def test_reset_forgets_programs_records_caches_and_memos(tmp_path):
    neuron_inductor.reset()
    _compile_and_run(tmp_path)
    assert session.BUCKETS and render._rendered and replay._SEEN  # (a kernel's first call, run normally)
    assert neuron_inductor.cache_stats()["compiles"] == 1

    neuron_inductor.reset()
    assert not session.BUCKETS and not session.AOT_GRAPHS and not render._rendered
    assert not replay._SEEN and not replay._PLANS
    assert neuron_inductor.cache_stats()["compiles"] == 0

    # the disk cache stays: the same graph after reset is a disk hit, counted from zero
    _compile_and_run(tmp_path)
    stats = neuron_inductor.cache_stats()
    assert stats["compiles"] == 0 and stats["disk_hits"] == 1 and len(session.BUCKETS) == 1
    torch._dynamo.reset()
