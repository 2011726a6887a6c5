"""Every nisa instruction against a torch reference, fp32 and bf16, at and below the tile limits.

References compute in fp32 from the same (already rounded) inputs and cast to the output
dtype, as the engines do, so results agree to fp32 rounding (bf16: exactly).
"""

import math

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import rules

from .helpers import TOL, nl_dtype, on_tiles

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(128, 512), (64, 96), (32, 4, 8)]


def close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected.to(dtype), **TOL[dtype], equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op, ref", [
    (nl.add, torch.add), (nl.subtract, torch.sub), (nl.multiply, torch.mul),
    (nl.maximum, torch.maximum), (nl.minimum, torch.minimum),
    (nl.greater, lambda a, b: (a > b).float()), (nl.equal, lambda a, b: (a == b).float()),
    (nl.logical_and, lambda a, b: ((a > 0) & (b > 0)).float()),
])
def test_tensor_tensor(op, ref, shape, dtype):
    a, b = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    if op is nl.logical_and:
        a, b = (a > 0).to(dtype), (b > 0).to(dtype)
    out = on_tiles(lambda d, x, y: nisa.tensor_tensor(dst=d, data1=x, data2=y, op=op), shape, nl_dtype(dtype), a, b)
    close(out, ref(a.float(), b.float()), dtype)


def test_tensor_tensor_free_shapes_may_differ():
    a, b = torch.randn(128, 64), torch.randn(128, 8, 8)
    out = on_tiles(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.add), (128, 4, 16), nl.float32, a, b)
    close(out, (a + b.reshape(128, 64)).reshape(128, 4, 16), torch.float32)


def test_tensor_tensor_int32_is_exact():
    a = torch.randint(-2**30, 2**30, (128, 64), dtype=torch.int32)
    b = torch.randint(-2**30, 2**30, (128, 64), dtype=torch.int32)
    out = on_tiles(lambda d, x, y: nisa.tensor_tensor(d, x, y, nl.add), (128, 64), nl.int32, a, b)
    expected = (a.long() + b.long()).clamp(-2**31, 2**31 - 1).int()
    assert torch.equal(out, expected)


def test_bitvec_ops():
    a = torch.randint(0, 2**20, (64, 32), dtype=torch.int32)
    b = torch.randint(0, 8, (64, 32), dtype=torch.int32)
    for op, ref in [(nl.bitwise_and, torch.bitwise_and), (nl.bitwise_xor, torch.bitwise_xor),
                    (nl.left_shift, torch.bitwise_left_shift), (nl.right_shift, torch.bitwise_right_shift)]:
        out = on_tiles(lambda d, x, y: nisa.tensor_tensor(d, x, y, op), (64, 32), nl.int32, a, b)
        assert torch.equal(out, ref(a, b)), op
    out = on_tiles(lambda d, x: nisa.tensor_scalar(d, x, nl.bitwise_and, 0xFF), (64, 32), nl.int32, a)
    assert torch.equal(out, a & 0xFF)


COMPARES = [(nl.equal, torch.eq), (nl.not_equal, torch.ne), (nl.greater, torch.gt), (nl.greater_equal, torch.ge),
            (nl.less, torch.lt), (nl.less_equal, torch.le)]


@pytest.mark.parametrize("op, ref", COMPARES)
def test_compares_are_exact_ones_and_zeros(op, ref):
    """Comparisons write 1.0 / 0.0 straight into fp32 (ops._compare): NaN, infinities, signed zeros,
    a [P, 1] column broadcast along the free axis, int32 tiles compared exactly (not through fp32)."""
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 2.0])
    x = special.repeat(16).reshape(16, 8)
    col = special.roll(3).repeat(2).reshape(16, 1)
    out = on_tiles(lambda d, a, c: nisa.tensor_scalar(d, a, op, c), (16, 8), nl.float32, x, col)
    assert torch.equal(out, ref(x, col).float())
    out = on_tiles(lambda d, a, b, c: nisa.scalar_tensor_tensor(d, a, op, c, nl.multiply, b), (16, 8), nl.float32,
                   x, x.flip(1), col)
    expected = ref(x, col).float() * x.flip(1)
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.nan_to_num(), expected.nan_to_num())
    assert torch.equal(out.signbit(), expected.signbit())  # 0.0 * negative stays -0.0
    big = torch.tensor([[2**30 + 1, 2**30]], dtype=torch.int32).repeat(4, 1)
    out = on_tiles(lambda d, a, b: nisa.tensor_tensor(d, a, b, op), (4, 2), nl.int32, big, big.flip(1))
    assert torch.equal(out, ref(big, big.flip(1)).int())
    assert op(3, 3) == float(ref(torch.tensor(3), torch.tensor(3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(128, 512), (16, 24)])
def test_tensor_scalar_numbers_and_vectors(shape, dtype):
    x = torch.randn(shape).to(dtype)
    col = torch.randn(shape[0], 1)
    out = on_tiles(lambda d, t: nisa.tensor_scalar(d, t, nl.multiply, 3.0, op1=nl.add, operand1=-1.5),
                   shape, nl_dtype(dtype), x)
    close(out, x.float() * 3.0 - 1.5, dtype)
    out = on_tiles(lambda d, t, c: nisa.tensor_scalar(d, t, nl.subtract, c, reverse0=True, op1=nl.maximum,
                                                      operand1=0.0),
                   shape, nl_dtype(dtype), x, col)
    close(out, torch.maximum(col - x.float(), torch.tensor(0.0)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(128, 512), (8, 24)])
def test_scalar_tensor_tensor(shape, dtype):
    x, y, c = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), torch.randn(shape[0], 1)
    out = on_tiles(lambda d, a, b, v: nisa.scalar_tensor_tensor(dst=d, data=a, op0=nl.multiply, operand0=v,
                                                                 op1=nl.add, operand1=b),
                   shape, nl_dtype(dtype), x, y, c)
    close(out, x.float() * c + y.float(), dtype)
    out = on_tiles(lambda d, a, b: nisa.scalar_tensor_tensor(d, a, nl.add, 2.0, nl.subtract, b, reverse1=True),
                   shape, nl_dtype(dtype), x, y)
    close(out, y.float() - (x.float() + 2.0), dtype)


ACTIVATIONS = [
    (nl.copy, lambda x: x), (nl.exp, torch.exp), (nl.tanh, torch.tanh), (nl.sigmoid, torch.sigmoid),
    (nl.relu, torch.relu), (nl.gelu, torch.nn.functional.gelu), (nl.silu, torch.nn.functional.silu),
    (nl.square, torch.square), (nl.abs, torch.abs), (nl.sign, torch.sign), (nl.erf, torch.erf),
    (nl.softplus, torch.nn.functional.softplus), (nl.mish, torch.nn.functional.mish),
    (nl.gelu_apprx_tanh, lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    (nl.gelu_apprx_sigmoid, lambda x: x * torch.sigmoid(1.702 * x)),
    (nl.sin, torch.sin), (nl.arctan, torch.atan),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, ref", ACTIVATIONS, ids=[op.name for op, _ in ACTIVATIONS])
def test_activation_functions(op, ref, dtype):
    x = torch.randn(128, 512)
    if op.name in rules.ACTIVATION_RANGES:  # sin, arctan: inside their valid input range
        x = x.clamp(-1.5, 1.5)
    x = x.to(dtype)
    out = on_tiles(lambda d, t: nisa.activation(dst=d, op=op, data=t), (128, 512), nl_dtype(dtype), x)
    close(out, ref(x.float()), dtype)


@pytest.mark.parametrize("op, ref, lo", [(nl.log, torch.log, 0.1), (nl.sqrt, torch.sqrt, 0.0),
                                         (nl.rsqrt, torch.rsqrt, 0.1), (nl.reciprocal, torch.reciprocal, 0.1)])
def test_activation_positive_domain(op, ref, lo):
    x = torch.rand(64, 64) * 10 + lo
    out = on_tiles(lambda d, t: nisa.activation(d, op, t), (64, 64), nl.float32, x)
    close(out, ref(x), torch.float32)


def test_activation_derivatives():
    x = torch.randn(32, 128, requires_grad=True)
    for op, fn in [(nl.gelu_dx, torch.nn.functional.gelu), (nl.silu_dx, torch.nn.functional.silu),
                   (nl.erf_dx, torch.erf)]:
        (grad,) = torch.autograd.grad(fn(x).sum(), x)
        out = on_tiles(lambda d, t: nisa.activation(d, op, t), (32, 128), nl.float32, x.detach())
        torch.testing.assert_close(out, grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_scale_bias_and_reduce(dtype):
    x = torch.randn(128, 256).to(dtype)
    scale, bias = torch.rand(128, 1) + 0.5, torch.randn(128, 1)

    def body(d, t, s, b):
        sums = nl.ndarray((128, 1), nl.float32)
        nisa.activation(dst=d, op=nl.exp, data=t, bias=b, scale=s, reduce_op=nl.add, reduce_res=sums,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_copy(dst=d[:, 0:1], src=sums)

    out = on_tiles(body, (128, 256), nl_dtype(dtype), x, scale, bias)
    expected = torch.exp(x.float() * scale + bias)
    close(out[:, 1:], expected[:, 1:], dtype)
    torch.testing.assert_close(out[:, 0:1].float(), expected.sum(1, keepdim=True).to(dtype).float(), rtol=0, atol=0)


def test_activation_reduce_accumulates_across_instructions():
    x = torch.randn(64, 100)

    def body(d, t):
        scratch = nl.ndarray((64, 50), nl.float32)
        nisa.activation(scratch, nl.copy, t[:, 0:50], reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(scratch, nl.copy, t[:, 50:100], reduce_op=nl.add, reduce_res=d,
                        reduce_cmd=nisa.reduce_cmd.reduce)

    out = on_tiles(body, (64, 1), nl.float32, x)
    torch.testing.assert_close(out, x.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    out = on_tiles(lambda d, t: nisa.activation_reduce(nl.ndarray((64, 100), nl.float32), nl.square, t, nl.add, d),
                   (64, 1), nl.float32, x)
    torch.testing.assert_close(out, (x * x).sum(1, keepdim=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, ref", [(nl.add, lambda x, d: x.sum(d)), (nl.maximum, lambda x, d: x.amax(d)),
                                     (nl.minimum, lambda x, d: x.amin(d)),
                                     (nl.multiply, lambda x, d: x.prod(d))])
def test_tensor_reduce(op, ref, dtype):
    x = (torch.rand(128, 512) + 0.5).to(dtype) if op is nl.multiply else torch.randn(128, 512).to(dtype)
    if op is nl.multiply:
        x = x[:, :16].contiguous()
    out = on_tiles(lambda d, t: nisa.tensor_reduce(dst=d, op=op, data=t, axis=1), (x.shape[0], 1),
                   nl_dtype(dtype), x)
    torch.testing.assert_close(out.float(), ref(x.float(), 1).unsqueeze(1).to(dtype).float(), rtol=1e-5, atol=1e-5)


def test_tensor_reduce_trailing_axes_negate_keepdims():
    x = torch.randn(32, 4, 8, 16)
    out = on_tiles(lambda d, t: nisa.tensor_reduce(d, nl.add, t, axis=(2, 3), negate=True, keepdims=True),
                   (32, 4, 1, 1), nl.float32, x)
    torch.testing.assert_close(out, -x.sum((2, 3), keepdim=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int32)])
def test_tensor_copy(src_dtype, dst_dtype):
    x = (torch.randn(128, 512) * 100).to(src_dtype)
    out = on_tiles(lambda d, t: nisa.tensor_copy(dst=d, src=t), (128, 512), nl_dtype(dst_dtype), x)
    expected = x.float().round().to(dst_dtype) if dst_dtype == torch.int32 else x.float().to(dst_dtype)
    assert torch.equal(out, expected)


def test_tensor_copy_dtype_keyword_rounds_through():
    x = torch.randn(64, 64)
    out = on_tiles(lambda d, t: nisa.tensor_copy(dst=d, src=t, dtype=nl.bfloat16), (64, 64), nl.float32, x)
    assert torch.equal(out, x.bfloat16().float())


def test_tensor_copy_from_psum_and_engines():
    x = torch.randn(128, 128)

    def body(d, t):
        p = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=t, engine=nisa.engine.scalar)
        nisa.tensor_copy(dst=d, src=p)

    assert torch.equal(on_tiles(body, (128, 128), nl.float32, x), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reciprocal(dtype):
    x = (torch.rand(128, 512) + 0.1).to(dtype)
    out = on_tiles(lambda d, t: nisa.reciprocal(dst=d, data=t), (128, 512), nl_dtype(dtype), x)
    close(out, 1.0 / x.float(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, m, n", [(128, 128, 512), (64, 32, 100), (1, 1, 1)])
def test_nc_matmul(k, m, n, dtype):
    s, mv = torch.randn(k, m).to(dtype), torch.randn(k, n).to(dtype)
    out = on_tiles(lambda d, a, b: nisa.nc_matmul(dst=d, stationary=a, moving=b), (m, n), nl.float32, s, mv,
                   out_buffer=nl.psum)
    torch.testing.assert_close(out, s.float().t() @ mv.float(), rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulate_modes():
    a, b = torch.randn(128, 64), torch.randn(128, 256)
    ref = a.t() @ b

    def run(mode_sequence):
        def body(d, s, m):
            for mode in mode_sequence:
                nisa.nc_matmul(d, s, m, accumulate=mode)
        return on_tiles(body, (64, 256), nl.float32, a, b, out_buffer=nl.psum)

    torch.testing.assert_close(run([None, None, None]), 3 * ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(run([False, True]), 2 * ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(run([None, True, False]), ref, rtol=1e-5, atol=1e-4)


def test_nc_matmul_auto_accumulate_is_per_element():
    a, b = torch.randn(128, 64), torch.randn(128, 256)

    def body(d, s, m):
        nisa.nc_matmul(d[:, 0:128], s, m[:, 0:128])  # first half written once
        nisa.nc_matmul(d, s, m)                       # auto: adds on the first half, overwrites the second

    out = on_tiles(body, (64, 256), nl.float32, a, b, out_buffer=nl.psum)
    ref = a.t() @ b
    torch.testing.assert_close(out[:, :128], 2 * ref[:, :128], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[:, 128:], ref[:, 128:], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p, f", [(128, 128), (64, 32)])
def test_nc_transpose_tensor_engine(p, f, dtype):
    x = torch.randn(p, f).to(dtype)
    out = on_tiles(lambda d, t: nisa.nc_transpose(dst=d, data=t), (f, p), nl_dtype(dtype), x, out_buffer=nl.psum)
    assert torch.equal(out, x.t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p, f", [(32, 32), (32, 16), (4, 8)])
def test_nc_transpose_vector_engine(p, f, dtype):
    x = torch.randn(p, f).to(dtype)
    out = on_tiles(lambda d, t: nisa.nc_transpose(d, t, engine=nisa.engine.vector), (f, p), nl_dtype(dtype), x)
    assert torch.equal(out, x.t())


def test_iota():
    out = on_tiles(lambda d: nisa.iota(d, [[1, 4], [10, 3]], offset=5, channel_multiplier=100), (8, 12), nl.int32)
    p = torch.arange(8)[:, None] * 100
    free = (torch.arange(4)[:, None] + 10 * torch.arange(3)[None, :]).reshape(-1)
    assert torch.equal(out, (5 + p + free).int())
    out = on_tiles(lambda d: nisa.iota(d, [[1, 16]]), (4, 16), nl.float32)
    assert torch.equal(out, torch.arange(16.0).expand(4, 16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset, multiplier, pattern", [
    (-7, 3, [[-2, 16], [5, 4]]),                # negative steps and offset: exact in fp32
    (2 ** 24 - 40, 1, [[1, 64]]),               # crosses 2**24: the int32 values rounded once to fp32
    (2 ** 31 - 100, 1, [[1, 128]]),             # past int32: the engine's wrapped int32 values
    (-(2 ** 23), -(2 ** 16), [[2 ** 10, 8]]),   # within 2**24 by a hair at the last partition
])
def test_iota_into_float_tiles_is_the_int32_result_rounded(offset, multiplier, pattern, dtype):
    """A float iota is made in fp32 directly when every value and partial sum is an exact fp32
    integer (isa_alu._exact_in_f32), through int32 otherwise; both must give the int32 values rounded."""
    n = 1
    for _, num in pattern:
        n *= num
    free = torch.zeros(1, dtype=torch.int64)
    for step, num in pattern:
        free = (free[:, None] + step * torch.arange(num)[None, :]).reshape(-1)
    expected = (offset + multiplier * torch.arange(128)[:, None] + free[None, :]).to(torch.int32).float()
    out = on_tiles(lambda d: nisa.iota(d, pattern, offset=offset, channel_multiplier=multiplier), (128, n),
                   nl_dtype(dtype))
    assert torch.equal(out, expected.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p, n", [(128, 512), (64, 64)])
def test_affine_select_causal_mask(p, n, dtype):
    x = torch.randn(p, n).to(dtype)
    out = on_tiles(lambda d, t: nisa.affine_select(dst=d, pattern=[[-1, n]], channel_multiplier=1, on_true_tile=t,
                                                   on_false_value=-1e9, cmp_op=nl.greater_equal),
                   (p, n), nl_dtype(dtype), x)
    keep = torch.arange(p)[:, None] >= torch.arange(n)[None, :]
    close(out, torch.where(keep, x.float(), torch.tensor(-1e9)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_memset(dtype):
    value = 7 if dtype == torch.int32 else 1.3
    out = on_tiles(lambda d: nisa.memset(dst=d, value=value), (128, 64), nl_dtype(dtype))
    assert torch.equal(out, torch.full((128, 64), value).to(dtype))


def test_dma_copy_from_strided_hbm_view():
    x = torch.randn(4, 128, 32)
    view = x[1:3].permute(1, 0, 2)  # [128, 2, 32], non-contiguous
    out = on_tiles(lambda d, t: nisa.tensor_copy(d, t), (128, 2, 32), nl.bfloat16, view)
    assert torch.equal(out, view.bfloat16())


def test_dma_copy_hbm_to_sbuf_with_cast():
    x = torch.randn(128, 64)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 64), nl.bfloat16)
        nisa.dma_copy(dst=t, src=src)
        out = nl.ndarray((64, 128), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)  # only element counts must match
        return out

    assert torch.equal(kernel(x), x.bfloat16().float().reshape(64, 128))


def test_dma_copy_int32_hbm_to_int16_tile_saturates():
    ids = torch.tensor([[0, 5, 2**20, -2**20]] * 4, dtype=torch.int32)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((4, 4), nl.int16)
        nisa.dma_copy(dst=t, src=src)
        out = nl.ndarray((4, 4), nl.int16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = kernel(ids)
    assert out.dtype == torch.int16
    assert out[0].tolist() == [0, 5, 2**15 - 1, -2**15]


def test_dma_transpose():
    x = torch.randn(64, 128).bfloat16()

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 64), nl.bfloat16)
        nisa.dma_transpose(dst=t, src=src)
        out = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    assert torch.equal(kernel(x), x.t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [512, 7, 1])
def test_bn_stats_and_aggr(n, dtype):
    x = (torch.randn(128, n) * 3 + 1).to(dtype)

    def body(d, t):
        stats = nl.ndarray((128, 6), nl.float32)
        nisa.bn_stats(dst=stats, data=t)
        nisa.bn_aggr(dst=d, data=stats)

    out = on_tiles(body, (128, 2), nl.float32, x)
    xf = x.float()
    torch.testing.assert_close(out[:, 0], xf.mean(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 1], xf.var(1, unbiased=False), rtol=1e-4, atol=1e-5)


def test_bn_stats_layout_and_multi_chunk_aggregation():
    x = torch.randn(16, 1024)

    def body(d, t):
        stats = nl.ndarray((16, 12), nl.float32)
        nisa.bn_stats(stats[:, 0:6], t[:, 0:512])
        nisa.bn_stats(stats[:, 6:12], t[:, 512:1024])
        nisa.bn_aggr(d[:, 0:2], stats)
        nisa.tensor_copy(d[:, 2:8], stats[:, 0:6])

    out = on_tiles(body, (16, 8), nl.float32, x)
    torch.testing.assert_close(out[:, 0], x.mean(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 1], x.var(1, unbiased=False), rtol=1e-4, atol=1e-5)
    even = x[:, 0:512:2]
    torch.testing.assert_close(out[:, 2], torch.full((16,), 256.0))
    torch.testing.assert_close(out[:, 3], even.mean(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 4], even.var(1, unbiased=False) * 256, rtol=1e-4, atol=1e-4)


def test_math_constants_used_by_docs():
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_fmax == 512
    assert nl.tile_size.gemm_stationary_fmax == 128 and nl.tile_size.gemm_moving_fmax == 512
    assert nl.tile_size.total_available_sbuf_size == sim.get_target("trn2").sbuf_usable_bytes
    assert nisa.get_nc_version() is nisa.nc_version.gen3
    assert math.isclose(sim.get_target("trn2").bf16_flops, 79e12)
