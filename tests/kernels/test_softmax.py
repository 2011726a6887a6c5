"""softmax / log_softmax kernels, forward and backward, run in the NKI interpreter against eager.

Tolerances as in test_norms.py: fp32 rtol 1e-5 (atol scaled to the output's
magnitude), bf16 2e-2 of the magnitude. Rows of 32000 (an LM vocabulary) exceed one SBUF chunk
and exercise the two-pass (running max) path.
"""

from __future__ import annotations

import pytest
import torch

from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, DTYPES, ROW_SHAPES, aten_graph, assert_all_close, check_node, kernel_for, op_graph

aten = torch.ops.aten

FORWARD = {False: aten._softmax.default, True: aten._log_softmax.default}
BACKWARD = {False: aten._softmax_backward_data.default, True: aten._log_softmax_backward_data.default}


def softmax_both(log: bool, dim: int = -1):
    """Forward and the backward of sum(out * dy), whose ATen graph holds both kernels' ops."""
    def fn(x, dy):
        out = torch.log_softmax(x, dim) if log else torch.softmax(x, dim)
        return torch.func.vjp(lambda t: torch.log_softmax(t, dim) if log else torch.softmax(t, dim), x)[1](dy)[0], out
    return fn


def check(shape, dtype, log, dim=-1, scale=4.0):
    torch.manual_seed(0)
    x = (torch.randn(shape) * scale).to(dtype)
    dy = torch.randn(shape, dtype=dtype)
    gm = aten_graph(softmax_both(log, dim), x, dy)
    check_node(gm, [x, dy], FORWARD[log])
    check_node(gm, [x, dy], BACKWARD[log])


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True])
def test_softmax(shape, dtype, log):
    check(shape, dtype, log)


@pytest.mark.parametrize("log,dtype", [(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)])
def test_vocab_rows_take_two_passes(log, dtype):
    check((3, 32000), dtype, log, scale=8.0)


def test_vocab_1000():
    check((5, 1000), torch.float32, True, scale=8.0)


def test_reduction_over_trailing_size_one_dims():
    check((4, 9, 1, 1), torch.float32, False, dim=1)


def test_large_logits_do_not_overflow():
    """Without the max shift exp(100) overflows fp32 sums long before softmax saturates."""
    check((6, 700), torch.float32, False, scale=100.0)
    check((2, 32000), torch.float32, True, scale=100.0)


def test_half_to_float():
    """_softmax(fp16, dim, half_to_float=True) -> fp32 (CPU eager refuses it; the reference is the
    fp32 op on the upcast input, which is what the flag means)."""
    x = torch.randn(33, 130).half()
    for op in FORWARD.values():
        gm, args = op_graph(op, x, -1, True, meta=True)
        _, _, kernel = kernel_for(gm, op)
        assert_all_close([kernel(x)], [op(x.float(), -1, False)])


def test_backward_to_half_input_dtype():
    """The backward of a half_to_float forward: fp32 dy and y, input_dtype fp16 -> an fp16 gradient
    (the dtype the op's metadata gives; CPU eager ignores input_dtype, so the reference is its fp32
    result rounded to fp16)."""
    y = torch.softmax(torch.randn(40, 77), -1)
    dy = torch.randn(40, 77)
    for op in BACKWARD.values():
        out = y.log() if op is aten._log_softmax_backward_data.default else y
        gm, _ = op_graph(op, dy, out, -1, torch.float16, meta=True)
        _, _, kernel = kernel_for(gm, op)
        assert_all_close([kernel(dy, out)], [op(dy, out, -1, torch.float32).half()])


def test_strided_and_expanded_inputs():
    """Permuted and stride-0 views reach the kernel as strided HBM tensors (host views)."""
    def fn(a, b):
        return torch.softmax(a.permute(2, 0, 1), -1), torch.log_softmax(b.expand(3, 50, 64), -1)
    args = [torch.randn(7, 130, 5), torch.randn(1, 50, 64)]
    gm = aten_graph(fn, *args)
    for op in FORWARD.values():
        check_node(gm, args, op)


def test_non_innermost_dim_is_unsupported():
    gm = aten_graph(lambda x: torch.softmax(x, 0), torch.randn(4, 5))
    node = next(n for n in gm.graph.nodes if n.target is aten._softmax.default)
    with pytest.raises(Unsupported, match="not innermost"):
        LOWERINGS[aten._softmax.default](CTX, node)
