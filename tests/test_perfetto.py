"""The Chrome / Perfetto trace export (observe/perfetto.py): its JSON structure, checked event by
event, from an interpreter trace of two kernel launches and from a compile report (the CLI test is in
test_cli.py and uses `check_trace_json` below)."""

from __future__ import annotations

import json

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.observe import perfetto
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

TRACK_NAMES = {"kernel launches", "TensorE", "VectorE", "ScalarE", "GpSimdE", "DMA"}


def check_trace_json(document: dict, launches: int) -> list[dict]:
    """Assert the structure Perfetto and chrome://tracing read; -> the launch slices in order."""
    json.loads(json.dumps(document))  # plain JSON
    events = document["traceEvents"]
    assert isinstance(events, list) and document["displayTimeUnit"] == "ns"
    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == TRACK_NAMES and len(set(names.values())) == len(TRACK_NAMES)
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["ph"] in ("M", "X") for e in events)
    for e in slices:
        assert isinstance(e["name"], str) and e["name"]
        assert e["pid"] == perfetto.PID and e["tid"] in names.values()
        assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["ts"] >= 0 and e["dur"] >= 0
    launch_slices = [e for e in slices if e["tid"] == names["kernel launches"]]
    assert len(launch_slices) == launches
    end = 0.0
    for launch in launch_slices:  # one after another, no gap, no overlap
        assert launch["ts"] == pytest.approx(end, abs=1e-9) and launch["dur"] > 0
        end = launch["ts"] + launch["dur"]
    assert document["otherData"]["total_us"] == pytest.approx(end)
    # Every engine slice lies inside its launch; instruction slices inside their engine's slice.
    tolerance = 1e-6
    for e in slices:
        if e["cat"] == "launch":
            continue
        owner = [l for l in launch_slices if l["ts"] <= e["ts"] + tolerance][-1]
        assert e["ts"] + e["dur"] <= owner["ts"] + owner["dur"] + tolerance
        if e["cat"] == "instruction":
            engine = next(s for s in slices if s["cat"] == "engine" and s["tid"] == e["tid"] and s["ts"] == owner["ts"])
            assert e["ts"] + e["dur"] <= engine["ts"] + engine["dur"] + tolerance
    return launch_slices


@sim.jit
def scale(x):
    t = nl.ndarray(x.shape, x.dtype)
    nisa.dma_copy(dst=t, src=x)
    nisa.activation(dst=t, op=nl.exp, data=t)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_trace_export_has_one_slice_per_launch_and_per_engine(tmp_path):
    with sim.trace() as t:
        scale(torch.randn(128, 512))
        scale(torch.randn(64, 256))
    document = perfetto.from_trace(t, "trn2")
    launches = check_trace_json(document, launches=2)
    estimate = t.estimate("trn2")
    assert [l["dur"] for l in launches] == pytest.approx([l.seconds * 1e6 for l in estimate.launches])
    assert [l["name"] for l in launches] == ["scale", "scale"]
    instructions = [e for e in document["traceEvents"] if e.get("cat") == "instruction"]
    assert [e["name"] for e in instructions] == [i.op for i in t.instructions]
    engine_slices = [e for e in document["traceEvents"] if e.get("cat") == "engine"]
    assert {e["tid"] for e in engine_slices} == {perfetto._track(e) for e in ("vector", "scalar", "dma")}
    # Without instructions only launch and engine slices; write() gives the same JSON.
    brief = perfetto.from_trace(t, "trn2", instructions=False)
    check_trace_json(brief, launches=2)
    assert not any(e.get("cat") == "instruction" for e in brief["traceEvents"])
    path = perfetto.write(t, tmp_path / "step.json", target="trn2")
    assert json.loads(path.read_text()) == document
