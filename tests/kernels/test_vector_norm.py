"""linalg_vector_norm kernels (reduction family), run in the NKI interpreter against eager PyTorch.

The kernels transform each element in fp32 (x*x, |x|, |x|**p, x != 0), reduce like sum / amax /
amin and raise the result to 1/p. fp32 results are compared within rtol 1e-5 scaled to the
magnitudes (sums of up to 9000 terms: 1e-5 * sqrt(n) for p-sums); bf16 ones against an fp32
reference rounded to bf16, within 2e-2 (one or two bf16 ulps).
"""

from __future__ import annotations

import math

import pytest
import torch

from neuron_inductor import config
from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, DTYPES, aten_graph, assert_close, run_lowered

aten = torch.ops.aten
INF = math.inf

# (shape, dims): reduced dims trailing ("free" layout), leading ("partition"), every dim ("full"),
# sizes that are and are not multiples of 128 / the 512-column PSUM bank, size-1 dims, a 0-d tensor.
CASES = [((4, 5), (-1,)), ((300, 70), (0,)), ((5, 130, 7), (0, 2)), ((257, 3), None), ((3, 9000), (1,)),
         ((130, 600), (0,)), ((4, 1, 6), (1, 2)), ((1, 1), None), ((), None)]
ORDERS = [2, 1, INF, -INF, 0, 3, 0.5, -1.5]


def reference(x, order, dims, keepdim=False, dtype=None):
    return torch.linalg.vector_norm(x.float(), order, dims, keepdim).to(dtype or x.dtype)


def tolerance(x, dims, order) -> float:
    """fp32 rtol: rounding grows with the square root of the number of summed terms."""
    count = x.numel() if dims is None else math.prod(x.shape[d] for d in dims)
    return 1e-5 * max(count, 1) ** 0.5 * (1 if abs(order) in (0, 1, 2, INF) else 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ORDERS, ids=str)
@pytest.mark.parametrize("shape,dims", CASES, ids=str)
def test_vector_norm(shape, dims, order, dtype):
    x = torch.randn(shape, dtype=dtype)
    keepdim = len(shape) == 3
    fn = lambda t: torch.linalg.vector_norm(t, order, dims, keepdim)  # noqa: E731
    (out,), _, _ = run_lowered(fn, [x], aten.linalg_vector_norm.default)
    assert_close(out, reference(x, order, dims, keepdim), fp32_rtol=tolerance(x, dims, order))


@pytest.mark.parametrize("order", [2, 1, INF, -INF, 0, -1.5], ids=str)
def test_vector_norm_of_zeros_infinities_and_nans(order):
    """Rows: all zeros (sqrt / power of 0, 0**-1.5 = inf), one zero among others, +-inf, a NaN."""
    x = torch.randn(6, 300)
    x[0] = 0.0
    x[1, 17] = 0.0
    x[2, 5] = INF
    x[3, 299] = -INF
    x[4, 100] = math.nan
    x[5, 7], x[5, 8] = INF, math.nan
    for dims in [(1,), (0,)]:
        fn = lambda t: torch.linalg.vector_norm(t, order, dims)  # noqa: E731
        (out,), (ref,), _ = run_lowered(fn, [x], aten.linalg_vector_norm.default)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
        assert_close(out, ref, fp32_rtol=1e-4)


def test_vector_norm_dtype_argument_and_strided_input():
    x = torch.randn(7, 300, 5).bfloat16()
    fn = lambda t: torch.linalg.vector_norm(t.permute(2, 0, 1), 2, (0, 2), dtype=torch.float32)  # noqa: E731
    (out,), (ref,), inputs = run_lowered(fn, [x], aten.linalg_vector_norm.default)
    assert not inputs[0].is_contiguous() and out.dtype == torch.float32
    assert_close(out, ref)


@pytest.mark.parametrize("fn,x,reason", [
    (lambda t: torch.linalg.vector_norm(t), torch.randn(4, 5, dtype=torch.float64), "float64"),
    (lambda t: torch.linalg.vector_norm(t, dim=0), torch.randn(0, 5), "empty"),
    (lambda t: torch.linalg.vector_norm(t, dim=1), torch.randn(3, 5, dtype=torch.complex64), "complex64"),
])
def test_vector_norm_unsupported_cases_raise(fn, x, reason):
    gm = aten_graph(fn, x)
    node = next(n for n in gm.graph.nodes if n.target is aten.linalg_vector_norm.default)
    with pytest.raises(Unsupported, match=reason):
        LOWERINGS[node.target](CTX, node)


@pytest.mark.parametrize("dtype", DTYPES)
def test_normalize_and_cosine_similarity_forward_backward_compiled(dtype, tmp_path):
    """F.normalize and cosine_similarity through the backend with every op in a kernel: the
    backward graphs (divisions by the norm, where(norm == 0), sums) are pointwise and sum kernels."""
    def fn(a, b):
        return torch.nn.functional.normalize(a, dim=-1) * 2 + torch.nn.functional.cosine_similarity(a, b).unsqueeze(-1)

    a, b = torch.randn(130, 70, dtype=dtype), torch.randn(130, 70, dtype=dtype)
    a[3] = 0.0  # a zero row: normalize clamps the norm, its gradient takes the where(norm == 0) branch
    grad = torch.randn(130, 70, dtype=dtype)
    compiled_inputs = [t.clone().requires_grad_() for t in (a, b)]
    eager_inputs = [t.float().clone().requires_grad_() for t in (a, b)]
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error", cache_dir=str(tmp_path)):
            out = torch.compile(fn, backend="neuron")(*compiled_inputs)
            out.backward(grad)
    finally:
        torch._dynamo.reset()
    ref = fn(*eager_inputs)
    ref.backward(grad.float())
    bf16_rtol = 3e-2  # the backward chains several bf16-rounded kernels
    assert_close(out, ref.detach().to(dtype), fp32_rtol=1e-5, bf16_rtol=bf16_rtol)
    for compiled, eager in zip(compiled_inputs, eager_inputs):
        assert_close(compiled.grad, eager.grad.to(dtype), fp32_rtol=1e-4, bf16_rtol=bf16_rtol)
