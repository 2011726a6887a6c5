"""The differential bucketing sweep (bench/pad_sweep.py) as tests: for each OpInfo, a sample resized
along one dim to lengths inside a bucket and past it, under default torch.compile, dynamic=False and
dynamic=True (buckets "8"), must equal eager at every length (fp32, rtol = atol = 1e-5). A mode
fails on a mismatch (padding or not) and on a crash where aot_eager runs.

PADDING_OPS (ops that place data by position, or reduce, along the padded dim: issue 13's list) are
the named tier: FAST_OPS run by default, the rest under `--runslow`; every other op_db entry is
marked `sweep` (`--sweep`, as long as the bench). Known pad-safety bugs are strict xfails naming
the bug: a fix makes the test fail until its entry in PAD_BUGS is removed.
"""

from __future__ import annotations

import pytest
import torch

from bench import opinfo, pad_sweep
from neuron_inductor.testing import time_limit
from tests.test_opinfo import _off_by_one_backend, _raising_backend  # the harness tests' backends

OPS = opinfo.op_by_name()

PADDING_OPS = (
    "cat", "stack", "split", "chunk", "unbind", "narrow", "slice_scatter", "index_put", "scatter",
    "constant_pad_nd", "roll", "flip", "repeat", "cumsum", "sort", "topk", "softmax", "mean", "var", "matmul",
)
FAST_OPS = ("cat", "narrow", "softmax", "flip")

# Ops the sweep shows padding breaks, each with its cause (strict xfail: a fix makes its test fail
# until its entry goes). The causes it found on main (clamp's int bound, multilabel_margin_loss's int64
# neutral, slice defaults, a symbolic norm order, scatter_reduce without self) are fixed.
PAD_BUGS: dict[str, str] = {}
# Ops whose pad rules keep every later call padded in every mode (a refusal here is a regression).
STAY_PADDED = ("cumsum", "softmax", "mean", "matmul", "stack")


def _params():
    for name in OPS:
        marks = [] if name in FAST_OPS else [pytest.mark.slow] if name in PADDING_OPS else [pytest.mark.sweep]
        if name in PAD_BUGS:
            marks.append(pytest.mark.xfail(reason=PAD_BUGS[name], strict=True))
        yield pytest.param(name, marks=marks, id=name)


pytestmark = pytest.mark.usefixtures("fresh_module_cache")


@pytest.mark.parametrize("name", list(_params()))
def test_padding_never_changes_results(name):
    with time_limit(pad_sweep.TIMEOUT_SECONDS):
        row = pad_sweep.check_op(OPS[name])
    if "skip" in row:
        pytest.skip(row["skip"])
    failed = {mode: f"{o['status']} at length {o.get('length')}: {o.get('detail', '')}"
              for mode, o in row["modes"].items() if o["status"] not in ("pass", "skip")}
    assert not failed, f"{row['shapes']} ({row['plan']}): {failed}"
    if name in STAY_PADDED:
        where = {mode: o["where"] for mode, o in row["modes"].items()}
        assert set(where.values()) == {"padded"}, (where, [o["unpadded"] for o in row["modes"].values()])


def test_named_ops_are_in_op_db():
    assert set(PADDING_OPS) <= set(OPS) and set(FAST_OPS) <= set(PADDING_OPS) and set(PAD_BUGS) <= set(OPS)


# -- the harness itself ----------------------------------------------------------------------------

def test_lengths_stay_inside_one_bucket_then_cross_it():
    for size in (2, 5, 10, 20):
        lengths = pad_sweep.lengths_for(size)
        buckets = [pad_sweep.BUCKET * -(-n // pad_sweep.BUCKET) for n in lengths]
        assert lengths[0] >= size and len(set(lengths)) == 4
        assert buckets[0] == buckets[1] == buckets[2] < buckets[3] and all(n < b for n, b in zip(lengths, buckets))


def test_resize_keeps_prefix_dtype_and_domain():
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(3, 5) + 2.0
    grown = pad_sweep.resize(x, 1, 9, generator)
    assert grown.shape == (3, 9) and torch.equal(grown[:, :5], x)
    assert grown.min() >= x.min() and grown.max() <= x.max() and grown[:, 5:].unique().numel() == 12
    index = torch.tensor([[0, 4, 2]])
    assert pad_sweep.resize(index, 1, 7, generator).tolist() == [[0, 4, 2, 0, 4, 2, 0]]
    assert pad_sweep.resize(x, 0, 2, generator).shape == (2, 5)


def test_resize_plans_change_shared_sizes_together_most_inclusive_first():
    leaves = [torch.zeros(5, 3), 1, torch.zeros(5, 2), torch.zeros(3, 5)]
    plans = pad_sweep.resize_plans(leaves, 0)
    assert list(plans.values()) == [{0: (0,), 2: (0,), 3: (1,)}, {0: (0,), 2: (0,)}, {0: (0,)}]
    # Plans that coincide are listed once.
    assert list(pad_sweep.resize_plans([torch.zeros(5, 3), torch.zeros(3)], 0).values()) == [{0: (0,)}]


def test_harness_reports_mismatch_and_crash_at_the_length_they_occur():
    index, raw, dim = pad_sweep.pick_sample(OPS["softmax"])
    case = opinfo.Case(OPS["softmax"], raw)
    sample = pad_sweep.ResizedSample(case, dim, pad_sweep.resize_plans(case.leaves, dim)["every dim of that size"])
    lengths = pad_sweep.lengths_for(raw.input.shape[dim])
    expected = pad_sweep.eager_references(sample, lengths)
    assert [run.outputs[0].shape[dim] for run in expected] == lengths
    for mode in pad_sweep.MODES:
        wrong = pad_sweep.run_mode(sample, lengths, expected, mode, backend=_off_by_one_backend)
        assert (wrong["status"], wrong["length"]) == ("mismatch", lengths[0])
        crash = pad_sweep.run_mode(sample, lengths, expected, mode, backend=_raising_backend)
        assert crash["status"] == "crash" and "boom" in crash["detail"]
        same = pad_sweep.run_mode(sample, lengths, expected, mode, backend="aot_eager")
        assert same["status"] == "pass" and pad_sweep.placement(same) == "no graph"
