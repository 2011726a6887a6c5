"""bench/step.py at its --quick size (a real compile and run of a 1-layer Llama-style training step) and
bench/timeline_png.py on its Perfetto trace."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import struct
import sys
import zlib

import pytest

BENCH = pathlib.Path(__file__).parents[1] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def read_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, raw scanlines) of an 8-bit RGB PNG, checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + 3 * width)
    return width, height, raw


@pytest.mark.slow
def test_quick_step_bench_reports_a_consistent_step(tmp_path):
    from tests.test_perfetto import check_trace_json

    step = load("step")
    trace, summary_file = tmp_path / "step.json", tmp_path / "summary.json"
    assert step.main(["--config", "quick", "--perfetto", str(trace), "--json", str(summary_file)]) == 0
    summary = json.loads(summary_file.read_text())
    kernels = summary["kernels"]
    assert summary["launches"] == len(kernels) > 10 and summary["fallbacks"] == []
    assert summary["step_seconds"] == pytest.approx(sum(k["seconds"] for k in kernels))
    assert sum(f["seconds"] for f in summary["families"].values()) == pytest.approx(summary["step_seconds"])
    assert {"matmul", "attention_fwd", "attention_bwd"} <= set(summary["families"])
    # Every launch pays at least the launch cost, so MFU is below 1; TensorE does at least the useful work.
    assert all(k["seconds"] >= 2e-6 for k in kernels) and 0 < summary["mfu"] < 1
    assert summary["tensor_flops"] >= 0.99 * summary["useful_flops"] > 0
    embedding = [k for k in kernels if "aten.embedding.default" in k["ops"]]
    assert embedding and 0 < summary["embedding_share"] < 1
    document = json.loads(trace.read_text())
    check_trace_json(document, launches=len(kernels))

    png = tmp_path / "step.png"
    assert load("timeline_png").main([str(trace), str(png)]) == 0
    width, height, raw = read_png(png.read_bytes())
    assert width == 1600 and height > 200
    assert len(set(raw)) > 10  # coloured slices and text, not a blank image
