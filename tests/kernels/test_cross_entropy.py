"""Cross-entropy kernels (nll_loss_forward / nll_loss_backward over log-probabilities), run in the
NKI interpreter against eager.

Graphs come from F.cross_entropy and its gradient (make_fx with the Neuron decompositions:
_log_softmax + nll_loss_forward, nll_loss_backward + _log_softmax_backward_data), so the kernels
see the same arguments a training step gives them. Tolerances as in test_norms.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from .harness import DTYPES, aten_graph, check_node

aten = torch.ops.aten

REDUCTIONS = ["none", "mean", "sum"]


def loss_and_grad(reduction, ignore_index, has_weight):
    """The loss and its input gradient for the cotangent `cot` (per row for reduction none)."""
    def fn(x, target, cot, *weight):
        def loss(t):
            return F.cross_entropy(t, target, weight=weight[0] if has_weight else None,
                                   reduction=reduction, ignore_index=ignore_index)
        value, vjp = torch.func.vjp(loss, x)
        return value, vjp(cot)[0]
    return fn


def check(shape, dtype, reduction, ignore_index=-100, has_weight=False, ignored_rows=slice(None, None, 3),
          x=None, target=None):
    torch.manual_seed(0)
    classes = shape[-1]
    x = torch.randn(shape, dtype=dtype) * 3 if x is None else x
    target = torch.randint(0, classes, shape[:-1]) if target is None else target
    if target.dim():
        target[ignored_rows] = ignore_index
    batched_none = reduction == "none" and len(shape) == 2
    cot = (torch.randn(shape[:1]) if batched_none else torch.tensor(1.5)).to(dtype)
    args = [x, target, cot] + ([torch.rand(classes, dtype=dtype) + 0.5] if has_weight else [])
    gm = aten_graph(loss_and_grad(reduction, ignore_index, has_weight), *args)
    check_node(gm, args, aten.nll_loss_forward.default)
    check_node(gm, args, aten.nll_loss_backward.default)
    return gm, args


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (128, 512), (200, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy(shape, dtype, reduction):
    check(shape, dtype, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_class_weights(reduction, dtype):
    check((130, 300), dtype, reduction, has_weight=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("has_weight", [False, True])
def test_single_sample(reduction, has_weight):
    """1-D input [C] with a 0-d target: scalar loss, total_weight = weight[target]."""
    check((10,), torch.float32, reduction, has_weight=has_weight)


@pytest.mark.parametrize("ignore_index", [0, 3, 1000])
def test_ignore_index_values(ignore_index):
    check((64, 40), torch.float32, "mean", ignore_index=ignore_index)


def test_every_row_ignored_gives_nan_mean():
    gm, args = check((5, 9), torch.float32, "mean", ignored_rows=slice(None))
    assert math.isnan(gm(*args)[0].item())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_32000(reduction, dtype):
    """A 32000-class vocabulary spans several column chunks (target found in one of them)."""
    check((4, 32000), dtype, reduction, has_weight=dtype == torch.float32)


def test_neg_inf_log_probs_at_other_classes():
    """Masked logits give -inf log-probs; picking the target must not turn them into NaN."""
    x = torch.randn(6, 20)
    x[:, 10:] = float("-inf")
    check((6, 20), torch.float32, "none", x=x, target=torch.randint(0, 10, (6,)), ignored_rows=slice(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_target_out_of_range_fails_the_forward_even_replayed(dtype):
    """Eager raises for a target outside [0, C) that is not ignore_index; the forward kernel fails its
    bounds check (its gather under oob_mode.error replays, sim/op_replay.py, with its validity as a
    guard: after replayed good calls a bad target still fails, and good calls go on)."""
    from neuron_inductor import sim
    from neuron_inductor.sim import op_replay, replay as sim_replay

    from .harness import call_kernel, kernel_for

    x = torch.randn(300, 50, dtype=dtype).log_softmax(-1)
    good = torch.randint(0, 50, (300,))
    good[::7] = -100
    gm = aten_graph(lambda t, y: aten.nll_loss_forward(t, y, None, 1, -100), x, good)
    _, spec, kernel = kernel_for(gm, aten.nll_loss_forward.default)
    kernel.replay = True  # as the toolchain builds generated kernels
    expected = aten.nll_loss_forward(x.float(), good, None, 1, -100)[0]
    for _ in range(3):
        torch.testing.assert_close(call_kernel(kernel, spec, [x, good])[0].float(), expected, rtol=1e-2, atol=1e-2)
    assert any(isinstance(p, op_replay.Plan) for p in sim_replay.plans(kernel.func))
    for bad_target in (50, -1):
        bad = good.clone()
        bad[201] = bad_target
        with pytest.raises(sim.NkiIndexError):
            call_kernel(kernel, spec, [x, bad])
    torch.testing.assert_close(call_kernel(kernel, spec, [x, good])[0].float(), expected, rtol=1e-2, atol=1e-2)
