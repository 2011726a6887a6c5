"""Lines computed from constants run once when the plan is made (sim/op_replay_folding.py). Each
rule is run on lines built to break it: the folded lines, run call after call on the plan's kept
buffers as a replay runs them, must give the caller the bits the unfolded lines give; and the real
kernels (attention's causal mask) replay with the slow path's bits and trace, their compares gone."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import op_replay, op_replay_folding
from neuron_inductor.sim import replay as sim_replay
from neuron_inductor.sim import tensor as sim_tensor
from neuron_inductor.sim.op_replay_refs import ref_names

from .helpers import bits
from .test_sim_fast_paths import _runs
from .test_sim_replay_forwarding import _line

aten = torch.ops.aten
FP32_MIN = -3.4028234663852886e38


def _copy(dst, src):
    return _line(aten.copy_.default, dst, src)


def _namespace() -> dict:
    """Kept buffers (p), a first value (i) and constants (c): index tiles as iota makes them."""
    rows = torch.arange(128, dtype=torch.float32).reshape(128, 1)
    wide = torch.full((128, 64), float("nan"))
    return {"pRow": torch.full((128, 1), float("nan")), "pIota": rows.clone(), "pKeys": torch.arange(128.0).expand(128, 128).clone(),
            "pT": torch.full((128, 128), float("nan")), "pW0": wide[:, 0:32], "pW1": wide[:, 32:64],
            "iRow": rows * 2, "c0": torch.tensor(3.0)}


def _call(lines: list, namespace: dict, number: int) -> dict:
    """The names' values after one call of `lines` on `namespace`'s buffers (a0 differs per call)."""
    env = dict(namespace, a0=torch.randn(128, 128, generator=torch.Generator().manual_seed(number)))
    for line in lines:
        value = lambda template: op_replay.map_refs(template, lambda r: env[r.name])  # noqa: E731
        result = line.func(*value(line.args), **value(line.kwargs))
        for name, v in zip(ref_names(line.outs), result if isinstance(result, tuple) else (result,)):
            env[name] = v
    return env


def _calls(lines: list, namespace: dict, calls: int = 3) -> list:
    """What the caller sees (the result v1, the argument a0) after each of `calls` calls of `lines`
    on `namespace`'s buffers, kept from call to call."""
    return [(bits(env["v1"]).clone(), bits(env["a0"]).clone())
            for env in (_call(lines, namespace, number) for number in range(calls))]


def _folded(lines: list, namespace: dict, budget: int = 1 << 30) -> list:
    """op_replay_folding.folded, told (as the recorder would) which lines' results are on an input's
    memory without being views."""
    env = _call(lines, _fresh(namespace), 0)
    storage = lambda name: env[name].untyped_storage().data_ptr()  # noqa: E731
    aliased = {name for line in lines if line.new and not line.func.is_view for name in line.new
               if storage(name) in {storage(n) for n in ref_names(line.args) if n[0] != "c"}}
    return op_replay_folding.folded(lines, namespace, {"v1"}, aliased, budget)[0]


def _fresh(namespace: dict) -> dict:
    """A copy of `namespace` whose views still share their bases."""
    bases, out = {}, {}
    for name, t in namespace.items():
        if isinstance(t, torch.Tensor):
            base = t._base if t._base is not None else t
            copy = bases.setdefault(id(base), base.clone())
            out[name] = copy.as_strided(t.shape, t.stride(), t.storage_offset())
        else:
            out[name] = t
    return out


_MASK = [_copy("pRow", "pIota"), _line(aten.le.Tensor, "pKeys", "pRow", out="v2"),
         _line(aten.where.ScalarOther, "v2", "a0", -3.4e38, out="v1")]
_CASES = {  # name: (lines, the functions of the lines left after folding)
    "a causal mask from a buffer settled by one copy": (
        _MASK, [aten.where.ScalarOther]),
    "the settled buffer re-initialised first, then scaled in place": (
        [_copy("pRow", "iRow"), _line(aten.mul_.Tensor, "pRow", "c0"), *_MASK[1:]], [aten.where.ScalarOther]),
    "a chain of folded results": (
        [_line(aten.mul.Tensor, "pIota", "c0", out="v3"), _line(aten.neg.default, "v3", out="v4"),
         _line(aten.add.Tensor, "a0", "v4", out="v1")], [aten.add.Tensor]),
    "a view of a buffer nothing writes": (
        [_line(aten.as_strided.default, "pKeys", (128, 64), (128, 1), 64, out="v3"),
         _line(aten.exp.default, "v3", out="v4"), _line(aten.as_strided.default, "a0", (128, 64), (128, 1), 0, out="v5"),
         _line(aten.mul.Tensor, "v5", "v4", out="v1")], [aten.as_strided.default, aten.mul.Tensor]),
    "the buffer is also written from the argument": (
        [*_MASK, _line(aten.as_strided.default, "a0", (128, 1), (128, 1), 0, out="v3"), _copy("pRow", "v3")],
        [aten.copy_.default, aten.le.Tensor, aten.where.ScalarOther, aten.as_strided.default, aten.copy_.default]),
    "the buffer is written from the argument too, before anything reads it": (
        [_copy("pRow", "pIota"), _line(aten.as_strided.default, "a0", (128, 1), (128, 1), 0, out="v3"),
         _copy("pRow", "v3"), *_MASK[1:]],
        [aten.copy_.default, aten.as_strided.default, aten.copy_.default, aten.le.Tensor, aten.where.ScalarOther]),
    "the buffer is read before its last write": (
        [_line(aten.le.Tensor, "pKeys", "pRow", out="v3"), *_MASK[:2],
         _line(aten.bitwise_and.Tensor, "v2", "v3", out="v6"), _line(aten.where.ScalarOther, "v6", "a0", -3.4e38, out="v1")],
        [aten.le.Tensor, aten.copy_.default, aten.le.Tensor, aten.bitwise_and.Tensor, aten.where.ScalarOther]),
    "a buffer written through a view": (
        [_line(aten.as_strided.default, "pRow", (64, 1), (1, 1), 0, out="v3"), _line(aten.fill_.Scalar, "v3", 2.0),
         *_MASK[1:]], [aten.as_strided.default, aten.fill_.Scalar, aten.le.Tensor, aten.where.ScalarOther]),
    "another view of the buffer's memory is written from the argument": (
        [_copy("pW0", "pIota"), _line(aten.neg.default, "pW0", out="v3"),
         _line(aten.as_strided.default, "a0", (128, 32), (128, 1), 0, out="v4"), _copy("pW1", "v4"),
         _line(aten.add.Tensor, "v3", "pW1", out="v1")],
        [aten.copy_.default, aten.neg.default, aten.as_strided.default, aten.copy_.default, aten.add.Tensor]),
    "a folded result would be written in place": (
        [_line(aten.mul.Tensor, "pKeys", "c0", out="v3"), _line(aten.add_.Tensor, "v3", "a0"),
         _line(aten.neg.default, "v3", out="v1")], [aten.mul.Tensor, aten.add_.Tensor, aten.neg.default]),
    "a folded result would be written through a view of it": (
        [_line(aten.mul.Tensor, "pKeys", "c0", out="v3"), _line(aten.as_strided.default, "v3", (128, 64), (128, 1), 0, out="v4"),
         _line(aten.as_strided.default, "a0", (128, 64), (128, 1), 0, out="v5"), _copy("v4", "v5"),
         _line(aten.neg.default, "v3", out="v1")],
        [aten.mul.Tensor, aten.as_strided.default, aten.as_strided.default, aten.copy_.default, aten.neg.default]),
    "a folded result would be written through an operation returning its memory": (
        [_line(aten.clone.default, "pKeys", out="v3"), _line(aten._unsafe_view.default, "v3", [128, 128], out="v4"),
         _line(aten.mul_.Tensor, "v4", "c0"), _line(aten.add.Tensor, "v3", "a0", out="v1")],
        [aten.clone.default, aten._unsafe_view.default, aten.mul_.Tensor, aten.add.Tensor]),
    "the caller gets the result back": (
        [_line(aten.mul.Tensor, "pKeys", "c0", out="v1")], [aten.mul.Tensor]),
    "a guard on constants": (
        [_line(aten.any.default, "pKeys", guard="g0"), _line(aten.add.Tensor, "pKeys", "a0", out="v1")],
        [aten.any.default, aten.add.Tensor]),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_each_rule_gives_the_same_bits_call_after_call_and_folds_only_what_it_may(case):
    lines, expected = _CASES[case]
    namespace = _namespace()
    unfolded = _calls(lines, _fresh(namespace))
    folded_namespace = _fresh(namespace)
    folded = _folded(lines, folded_namespace)
    assert [line.func for line in folded] == expected
    assert all(n in folded_namespace for line in folded for n in ref_names((line.args, line.kwargs))
               if n[0] == "k")
    for (result, arg), (result_folded, arg_folded) in zip(unfolded, _calls(folded, folded_namespace)):
        assert torch.equal(result, result_folded) and torch.equal(arg, arg_folded)


@pytest.mark.parametrize("limit", ["per plan", "what the plans may still keep"])
def test_past_its_byte_budget_nothing_is_folded(limit, monkeypatch):
    """The settling write already done then stays a line, and the lines give the same bits."""
    below_the_mask = 128 * 128 - 1  # the bool mask takes 128 * 128 bytes
    if limit == "per plan":
        monkeypatch.setattr(op_replay_folding, "FOLD_BYTES", below_the_mask)
    namespace = _namespace()
    unfolded = _calls(_MASK, _fresh(namespace))
    folded_namespace = _fresh(namespace)
    assert _folded(_MASK, folded_namespace, budget=below_the_mask if limit != "per plan" else 1 << 30) == _MASK
    assert not any(name[0] == "k" for name in folded_namespace)
    for seen, seen_folded in zip(unfolded, _calls(_MASK, folded_namespace)):
        assert all(torch.equal(a, b) for a, b in zip(seen, seen_folded))


# -- a kernel, replayed and run normally ----------------------------------------------------------------

def _causal_rows(x):
    """Each 128-row tile of x with the columns past its row's diagonal masked (range_select against
    an iota column made once per call, as the attention kernels mask), its row maxima in a last column."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols + 1), dtype=x.dtype, buffer=nl.shared_hbm)
    index = nl.ndarray((128, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(index, [[0, 1]], offset=0, channel_multiplier=1)
    row = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=row, src=index)
    for t in range((rows + 127) // 128):
        n = min(128, rows - t * 128)
        tile = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile[0:n], src=x[t * 128:t * 128 + n, :])
        row_max = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=tile[0:n], on_true_tile=tile[0:n], comp_op0=nl.less_equal, comp_op1=nl.less_equal,
                          bound0=row[0:n], bound1=row[0:n], range_start=-t * 64, on_false_value=FP32_MIN,
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=row_max[0:n], reduce_op=nl.maximum)
        nisa.dma_copy(dst=out[t * 128:t * 128 + n, 0:cols], src=tile[0:n])
        nisa.dma_copy(dst=out[t * 128:t * 128 + n, cols:cols + 1], src=row_max[0:n])
    return out


def _calls_made(monkeypatch, folding: bool, x) -> int:
    """The plan's replayed calls, recorded on fresh tiles (none of an earlier kernel's storage)."""
    sim_replay.forget()
    kernel = sim.Kernel(_causal_rows, replay=True)
    kernel(x)  # run normally: the next call records
    with monkeypatch.context() as patched:
        patched.setattr(sim_tensor, "_RECYCLED", {})
        if not folding:
            patched.setattr(op_replay_folding, "folded", lambda calls, *rest: (calls, 0))
        kernel(x)
    (plan,) = sim_replay.plans(_causal_rows)
    return plan.counts["replayed"]


@pytest.mark.parametrize("rows", [256, 200])  # on and off the partition tile
def test_a_masking_kernel_replays_with_the_same_bits_and_trace_and_its_compares_folded(rows, monkeypatch):
    make = lambda call: torch.randn(rows, 96, generator=torch.Generator().manual_seed(call))  # noqa: E731
    runs = _runs(_causal_rows, make)
    for (out, arg, ops), (ref_out, ref_arg, ref_ops) in zip(runs[True], runs[False]):
        assert ops == ref_ops and torch.equal(bits(out), bits(ref_out)) and torch.equal(arg, ref_arg)
    # per tile: the compare of the iota column with the key index (and its cast) no longer runs
    assert _calls_made(monkeypatch, True, make(0)) <= _calls_made(monkeypatch, False, make(0)) - 2 * ((rows + 127) // 128)
