"""Group norm forward kernel (native_group_norm), run in the NKI interpreter against eager.

Each case traces the op into a graph, lowers it, runs its kernel on the graph's eager values and
compares the output, mean and rstd. Tolerances: fp32 rtol 1e-5 scaled to each output's magnitude,
bf16 2e-2 (about two ulps; eager bf16 computes in fp32 as the kernel does). The backward needs no
kernel of its own: native_group_norm_backward arrives decomposed into reductions and pointwise
ops, checked by the compiled test below.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, DTYPES, compiled_forward_backward, aten_graph, assert_close, check_node, last_node

aten = torch.ops.aten
GROUP_NORM = aten.native_group_norm.default

# (shape, groups): rows (N * G) below and above the 128 partitions, a row tile straddling samples
# (groups not dividing 128), rows over a 512-column stats group and over one column chunk (two
# passes, chunks cutting channels), one group (layer-norm-like), one channel per group, no
# spatial dims, size-1 dims. Fewer than 64 rows split into sub-rows (by 2, 4, 12 and 5 here)
# whose statistics the kernel combines.
CASES = [((2, 6, 4, 5), 3), ((3, 96, 8, 8), 48), ((2, 320, 16, 16), 32), ((4, 8, 130, 100), 2),
         ((2, 12, 7), 1), ((2, 12, 5), 12), ((5, 20), 4), ((1, 1, 1, 1), 1)]


def group_norm_case(shape, groups, dtype, param_dtype=None, has_weight=True, has_bias=True, eps=1e-5):
    torch.manual_seed(0)
    channels, param_dtype = shape[1], param_dtype or dtype
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    w = torch.randn(channels, dtype=param_dtype) if has_weight else None
    b = torch.randn(channels, dtype=param_dtype) if has_bias else None
    spatial = math.prod(shape[2:])

    def fn(x, w, b):
        return GROUP_NORM(x, w, b, shape[0], channels, spatial, groups, eps)
    return aten_graph(fn, x, w, b), [x, w, b]


@pytest.mark.parametrize("dtype,param_dtype", [(d, d) for d in DTYPES] + [(torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape,groups", CASES)
def test_group_norm(shape, groups, dtype, param_dtype):
    gm, args = group_norm_case(shape, groups, dtype, param_dtype)
    check_node(gm, args, GROUP_NORM)


@pytest.mark.parametrize("has_weight,has_bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_optional_affine(dtype, has_weight, has_bias):
    gm, args = group_norm_case((3, 96, 5, 5), 48, dtype, has_weight=has_weight, has_bias=has_bias)
    check_node(gm, args, GROUP_NORM)


@pytest.mark.parametrize("eps", [1e-12, 0.5])
def test_group_norm_eps(eps):
    gm, args = group_norm_case((2, 6, 4, 5), 3, torch.float32, eps=eps)
    check_node(gm, args, GROUP_NORM)


def test_group_norm_strided_input():
    """A channels-last input: the kernel's [N * G, C / G * S] view reads through a copy."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 7, 12).movedim(-1, 1)
    w, b = torch.randn(12), torch.randn(12)
    gm = aten_graph(lambda x, w, b: GROUP_NORM(x, w, b, 2, 12, 35, 4, 1e-5), x, w, b)
    check_node(gm, [x, w, b], GROUP_NORM)


def test_group_norm_unsupported():
    gm, _ = group_norm_case((2, 4, 3), 2, torch.float64)
    with pytest.raises(Unsupported, match="dtype"):
        LOWERINGS[GROUP_NORM](CTX, last_node(gm, GROUP_NORM))
    gm, _ = group_norm_case((0, 4, 3), 2, torch.float32)
    with pytest.raises(Unsupported, match="empty"):
        LOWERINGS[GROUP_NORM](CTX, last_node(gm, GROUP_NORM))
    gm, _ = group_norm_case((64, 4099, 10), 1, torch.float32)  # 4099 channels: no split
    with pytest.raises(Unsupported, match="affine instructions"):
        LOWERINGS[GROUP_NORM](CTX, last_node(gm, GROUP_NORM))


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_block_compiled(dtype, tmp_path):
    """GroupNorm -> SiLU (a diffusion UNet's resnet-block norm) through the backend with every op
    in a kernel (fallback=error), forward and backward against eager."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(8, 64).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 64, 9, 9).to(dtype)
    grad = torch.randn(2, 64, 9, 9).to(dtype)

    def block(x):
        return nn.functional.silu(norm(x))

    eager_x = x.clone().requires_grad_()
    out, x_grad = compiled_forward_backward(block, x, grad, tmp_path)
    compiled_grads = [p.grad.clone() for p in norm.parameters()]
    norm.zero_grad()
    ref = block(eager_x)
    ref.backward(grad)
    tols = {"fp32_rtol": 1e-4, "bf16_rtol": 3e-2}  # the backward chains several kernels
    assert_close(out, ref.detach(), **tols)
    assert_close(x_grad, eager_x.grad, **tols)
    for compiled, param in zip(compiled_grads, norm.parameters()):
        assert_close(compiled, param.grad, **tols)
