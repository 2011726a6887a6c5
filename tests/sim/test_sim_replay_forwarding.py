"""Copies a replay skips (sim/op_replay_forwarding.py): reads forwarded past copies, dead copies
dropped, `v = op(..); copy_(D, v)` fused into `op(.., out=D)`. Each rule is run on lines built to
break it, both ways, and must give the same bits; the kernels give the slow path's bits and trace."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import op_replay, op_replay_forwarding
from neuron_inductor.sim import replay as sim_replay
from neuron_inductor.sim.op_replay_refs import Ref

from .helpers import bits

aten = torch.ops.aten


def _line(func, *args, out=None, guard=None, **kwargs):
    """A replay line; strings are names."""
    ref = lambda a: Ref(a) if isinstance(a, str) else a  # noqa: E731
    return op_replay._Call(func, tuple(ref(a) for a in args), {k: ref(v) for k, v in kwargs.items()},
                           Ref(out) if out else None, (out,) if out else (), guard)


def _copy(dst, src):
    return _line(aten.copy_.default, dst, src)


def _tiles(dtype) -> dict:
    """Kept tiles (p), a constant (c0) and an argument (a0), with values whose rounding shows."""
    gen = torch.Generator().manual_seed(0)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    rand = lambda *shape, t=dtype: (torch.randn(*shape, generator=gen) * 1e3 + 1 / 3).to(t)  # noqa: E731
    wide, tall = rand(128, 64), rand(256, 16)
    return {
        "pD": torch.full((128, 16), float("nan"), dtype=dtype), "pE": rand(128, 16),
        "pS": rand(128, 16), "pS2": rand(128, 16), "pM": rand(16, 8), "pCast": torch.zeros(128, 16, dtype=other),
        "pW0": wide[:, 0:16], "pW1": wide[:, 8:24], "pT0": tall[0:128], "pT1": tall[64:192],
        "pCastW": torch.zeros(128, 64, dtype=other)[:, 0:16],
        "c0": torch.tensor(3.0), "c1": other, "a0": rand(4200),
    }


def _run(lines: list, tiles: dict) -> dict:
    """The names' values after running `lines` on copies of `tiles` (views kept as views)."""
    copies = {}
    env = {}
    for name, t in tiles.items():
        if not isinstance(t, torch.Tensor):
            env[name] = t
            continue
        base = t._base if t._base is not None else t
        if id(base) not in copies:
            copies[id(base)] = base.clone()
        env[name] = copies[id(base)].as_strided(t.shape, t.stride(), t.storage_offset())
    for line in lines:
        value = lambda template: op_replay.map_refs(template, lambda r: env[r.name])  # noqa: E731
        result = line.func(*value(line.args), **value(line.kwargs))
        if line.guard is not None:
            continue
        if line.new:
            env[line.outs.name] = result
    return env


def _forwarded(lines: list, tiles: dict, visible=("v1", "a0")) -> list:
    env = _run(lines, tiles)  # (the layouts and aliases the recorder would have noted)
    layouts = {n: (n, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for n, t in env.items()
               if n[0] in "av" and isinstance(t, torch.Tensor)}
    storage = lambda name: env[name].untyped_storage().data_ptr()  # noqa: E731
    aliasing = {line.outs.name: True for line in lines if line.new and not line.func.is_view
                and storage(line.outs.name) == storage(line.args[0].name)}
    namespace = {n: t for n, t in tiles.items() if n[0] in "pc"}
    return op_replay_forwarding.forwarded(lines, namespace, layouts, set(visible), aliasing, lambda line: True)


def _reads(line) -> list:
    return [a.name for a in line.args if isinstance(a, Ref)]


_STAGED = _line(aten.as_strided.default, "a0", (128, 16), (16, 1), 5, out="vA")  # misaligned argument view
_CASES = {  # name: (lines, what the rewritten lines must be)
    "forwarded, then dropped": (
        [_copy("pD", "pS"), _line(aten.exp.default, "pD", out="v1")],
        lambda out: len(out) == 1 and _reads(out[0]) == ["pS"]),
    "a staged load from a misaligned argument view": (
        [_STAGED, _copy("pD", "vA"), _line(aten.exp.default, "pD", out="v9"),
         _line(aten.mul.Tensor, "pD", "v9", out="v1")],
        lambda out: len(out) == 3 and _reads(out[2]) == ["vA", "v9"]),
    "the source is written before the read": (
        [_copy("pD", "pS"), _line(aten.mul_.Tensor, "pS", "c0"), _line(aten.exp.default, "pD", out="v1")],
        lambda out: len(out) == 3 and _reads(out[2]) == ["pD"]),
    "the destination is written in place": (
        [_copy("pD", "pS"), _line(aten.add_.Tensor, "pD", "c0"), _line(aten.exp.default, "pD", out="v1")],
        lambda out: len(out) == 3 and _reads(out[1]) == ["pD", "c0"] and _reads(out[2]) == ["pD"]),
    "a forwarded read by an in-place operation": (
        [_copy("pD", "pS"), _copy("pE", "pS2"), _line(aten.add_.Tensor, "pE", "pD"),
         _line(aten.exp.default, "pE", out="v1")],
        lambda out: len(out) == 3 and _reads(out[1]) == ["pE", "pS"] and _reads(out[2]) == ["pE"]),
    "source and destination overlap": (
        [_copy("pW1", "pW0"), _line(aten.exp.default, "pW1", out="v1")],
        lambda out: len(out) == 2 and _reads(out[1]) == ["pW1"]),
    "a copy that casts": (
        [_copy("pCast", "pS"), _line(aten.exp.default, "pCast", out="v1")],
        lambda out: len(out) == 2 and _reads(out[1]) == ["pCast"]),
    "a copy into a view of other strides": (
        [_copy("pW0", "pS"), _line(aten.exp.default, "pW0", out="v1")],
        lambda out: len(out) == 2 and _reads(out[1]) == ["pW0"]),
    "part of the destination is read through another view": (
        [_copy("pT0", "pS"), _line(aten.exp.default, "pT1", out="v1")],
        lambda out: len(out) == 2),
    "a matmul reads the destination": (
        [_copy("pD", "pS"), _line(aten.mm.default, "pD", "pM", out="v1")],
        lambda out: len(out) == 2 and _reads(out[1]) == ["pD", "pM"]),
    "a guard reads the destination": (
        [_copy("pD", "pS"), _line(aten.exp.default, "pD", out="v1"), _line(aten.any.default, "pD", guard="g0")],
        lambda out: len(out) == 3 and _reads(out[1]) == ["pS"] and _reads(out[2]) == ["pD"]),
    "a copy into an argument nothing reads": (
        [_line(aten.as_strided.default, "a0", (128, 16), (16, 1), 64, out="vA"), _copy("vA", "pS"),
         _line(aten.exp.default, "pS", out="v1")],
        lambda out: len(out) == 3),
    "a chain of copies": (
        [_copy("pD", "pS"), _copy("pE", "pD"), _line(aten.exp.default, "pE", out="v1")],
        lambda out: len(out) == 1 and _reads(out[0]) == ["pS"]),
    "a copy back into the source": (
        [_copy("pD", "pS"), _copy("pS", "pD"), _line(aten.exp.default, "pS", out="v1")],
        lambda out: len(out) == 1 and _reads(out[0]) == ["pS"]),
    "a result copied into a tile a matmul reads: fused": (
        [_line(aten.add.Tensor, "pS", "pS2", out="v9"), _copy("pD", "v9"), _line(aten.mm.default, "pD", "pM", out="v1")],
        lambda out: len(out) == 2 and out[0].func is aten.add.out and out[0].kwargs["out"].name == "pD"),
    "a result copied into the caller's result: fused": (
        [_line(aten.full_like.default, "pS", 0.0, out="v1"),
         _line(aten.as_strided.default, "v1", (128, 16), (16, 1), 0, out="v8"),
         _line(aten.sub.Tensor, "pT0", "pS", out="v9"), _copy("v8", "v9")],
        lambda out: len(out) == 3 and out[2].func is aten.sub.out and out[2].kwargs["out"].name == "v8"),
    "a copied result read again": (
        [_line(aten.add.Tensor, "pS", "pS2", out="v9"), _copy("pD", "v9"), _line(aten.mul.Tensor, "v9", "pS", out="v7"),
         _line(aten.mm.default, "pD", "pM", out="v1")],
        lambda out: out[0].func is aten.add.Tensor and len(out) == 4),
    "a result copied with a cast": (
        [_line(aten.add.Tensor, "pS", "pS2", out="v9"), _copy("pCast", "v9"), _line(aten.exp.default, "pCast", out="v1")],
        lambda out: out[0].func is aten.add.Tensor and len(out) == 3),
    "a result copied into a tile one of its inputs overlaps": (
        [_line(aten.add.Tensor, "pT0", "pS", out="v9"), _copy("pT1", "v9"), _line(aten.mm.default, "pT1", "pM", out="v1")],
        lambda out: out[0].func is aten.add.Tensor and len(out) == 3),
    "a result copied into the tile it was computed from: fused": (
        [_line(aten.mul.Tensor, "pT1", "c0", out="v9"), _copy("pT1", "v9"), _line(aten.mm.default, "pT1", "pM", out="v1")],
        lambda out: out[0].func is aten.mul.out and len(out) == 2),
    "a fused result copied on into the caller's result: written there": (
        [_line(aten.full_like.default, "pS", 0.0, out="v1"),
         _line(aten.as_strided.default, "v1", (128, 16), (16, 1), 0, out="v8"), _copy("pD", "pS2"),
         _line(aten.add.Tensor, "pS", "pS2", out="v9"), _copy("pD", "v9"), _copy("v8", "pD")],
        lambda out: len(out) == 3 and out[2].func is aten.add.out and out[2].kwargs["out"].name == "v8"),
    "a fused result copied on, its tile read after": (
        [_line(aten.add.Tensor, "pS", "pS2", out="v9"), _copy("pD", "v9"), _copy("pE", "pD"),
         _line(aten.mm.default, "pD", "pM", out="v1"), _line(aten.mm.default, "pE", "pM", out="v7")],
        lambda out: len(out) == 4 and out[0].kwargs["out"].name == "pD"),
    "a clone copied into a tile of other strides: one copy": (
        [_line(aten.clone.default, "pW0", out="v9"), _copy("pD", "v9"), _line(aten.mm.default, "pD", "pM", out="v1")],
        lambda out: len(out) == 2 and out[0].func is aten.copy_.default and _reads(out[0]) == ["pD", "pW0"]),
    "a cast copied on: one converting copy": (
        [_line(aten._to_copy.default, "pS", dtype="c1", out="v9"), _copy("pCast", "v9"),
         _line(aten.exp.default, "pCast", out="v1")],
        lambda out: len(out) == 2 and _reads(out[0]) == ["pCast", "pS"]),
    "a cast copied into a tile of other strides": (
        [_line(aten._to_copy.default, "pS", dtype="c1", out="v9"), _copy("pCastW", "v9"),
         _line(aten.exp.default, "pCastW", out="v1")],
        lambda out: len(out) == 3 and out[0].func is aten._to_copy.default),
    "a clone copied into a tile it overlaps": (
        [_line(aten.clone.default, "pT0", out="v9"), _copy("pT1", "v9"), _line(aten.mm.default, "pT1", "pM", out="v1")],
        lambda out: len(out) == 3 and out[0].func is aten.clone.default),
    "a tensor given another storage: nothing rewritten": (
        [_line(aten.full_like.default, "pS", 0.0, out="v9"), _copy("pD", "pS"), _line(aten.set_.source_Tensor, "v9", "pS2"),
         _line(aten.exp.default, "pD", out="v1")],
        lambda out: len(out) == 4 and _reads(out[3]) == ["pD"]),
    "the source's storage written through an operation returning an alias": (
        [_line(aten.clone.default, "pS", out="v9"), _line(aten._unsafe_view.default, "v9", [128, 16], out="v8"),
         _copy("pD", "v8"), _line(aten.mul_.Tensor, "v9", "c0"), _line(aten.exp.default, "pD", out="v1")],
        lambda out: len(out) == 5 and _reads(out[4]) == ["pD"]),
    "a guard between a result and its copy": (
        [_line(aten.add.Tensor, "pS", "pS2", out="v9"), _line(aten.any.default, "pS", guard="g0"), _copy("pD", "v9"),
         _line(aten.mm.default, "pD", "pM", out="v1")],
        lambda out: out[0].func is aten.add.Tensor and len(out) == 4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_CASES))
def test_each_rule_gives_the_same_bits_and_skips_only_what_it_may(case, dtype):
    lines, expected = _CASES[case]
    tiles = _tiles(dtype)
    out = _forwarded(lines, tiles)
    assert expected(out), [(line.func, _reads(line), line.kwargs) for line in out]
    before, after = _run(lines, tiles), _run(out, tiles)
    for name in ("v1", "a0"):
        assert torch.equal(bits(after[name]), bits(before[name])), name


# -- kernels, replayed and run normally ---------------------------------------------------------------

def _staged_chain(x, y):
    """Staged loads read by elementwise instructions, results copied through tiles, a tile updated in
    place (its later readers must see the update), a tile kept and re-filled in a loop."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.sbuf)
    b = nl.ndarray((rows, cols), dtype=y.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=y)
    acc = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=acc, data1=a, data2=b, op=nl.multiply)
    for j in range(3):
        t = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=t, op=nl.exp, data=acc, scale=0.01)
        if j == 1:
            nisa.tensor_scalar(dst=a, data=a, op0=nl.multiply, operand0=3.0)  # a changes: its copies are stale
        nisa.tensor_tensor(dst=acc, data1=t, data2=a, op=nl.add)
    res = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    nisa.dma_copy(dst=out, src=res)
    return out


def _calls_made(monkeypatch, forwarding: bool, x, y) -> int:
    sim_replay.forget()
    kernel = sim.Kernel(_staged_chain, replay=True)
    kernel(x, y)  # run normally: the next call records
    with monkeypatch.context() as patched:
        if not forwarding:
            patched.setattr(op_replay_forwarding, "forwarded", lambda calls, *rest: calls)
        kernel(x, y)
    (plan,) = sim_replay.plans(_staged_chain)
    return plan.counts["replayed"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 100])  # on and off the partition tile
def test_forwarded_kernels_replay_with_the_same_bits_and_trace(dtype, rows, monkeypatch):
    make = lambda call: tuple(torch.randn(rows, 48, generator=torch.Generator().manual_seed(call + s)).to(dtype)
                              for s in (0, 10))  # noqa: E731
    found = {}
    for replay in (True, False):
        kernel = sim.Kernel(_staged_chain, replay=replay)
        found[replay] = []
        for call in range(3):
            x, y = make(call)
            with sim.trace() as recorded:
                out = kernel(x, y)
            found[replay].append((out.clone(), [(i.engine, i.op, i.bytes, i.operands) for i in recorded.instructions]))
    for (out, ops), (ref_out, ref_ops) in zip(found[True], found[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out))
    assert _calls_made(monkeypatch, True, *make(0)) < _calls_made(monkeypatch, False, *make(0))
