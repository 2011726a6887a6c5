"""Hardware numerics: fp32 compute, round-to-nearest-even casts, saturating integer casts, fp32 PSUM."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

from .helpers import on_tiles


def cast(values, dtype):
    """tensor_copy fp32 values into a `dtype` tile and read them back as Python numbers."""
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    out = on_tiles(lambda d, t: nisa.tensor_copy(d, t), tuple(x.shape), dtype, x)
    return (out.float() if out.is_floating_point() else out).reshape(-1).tolist()


def test_bf16_rounds_to_nearest_even():
    one_ulp = 2.0 ** -7  # bf16 spacing at 1.0
    ties = [1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2)]
    assert cast(ties, nl.bfloat16) == [1.0, 1 + 2 * one_ulp, -1.0]
    assert cast([1 + one_ulp * 0.51], nl.bfloat16) == [1 + one_ulp]


def test_float_to_int_rounds_half_even_and_saturates():
    assert cast([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999], nl.int32) == [0, 2, 2, 0, -2, 2]
    assert cast([1e10, -1e10, float("nan")], nl.int32) == [2**31 - 1, -2**31, 0]
    assert cast([300.0, -5.0, 254.5], nl.uint8) == [255, 0, 254]
    assert cast([200.0, -200.0], nl.int8) == [127, -128]


def test_fp8_saturation_and_rounding():
    assert cast([239.0, 300.0, -1000.0], nl.float8_e4m3) == [240.0, 240.0, -240.0]
    assert cast([300.0, 1000.0], nl.float8_e4m3fn) == [288.0, 448.0]
    assert cast([1e6], nl.float8_e5m2) == [float("inf")]
    assert cast([1.0625, 1.1875], nl.float8_e4m3fn) == [1.0, 1.25]  # ties to even (3 mantissa bits)


def test_tf32_and_bool():
    ulp = 2.0 ** -10
    assert cast([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 4], nl.tfloat32) == [1.0, 1 + 2 * ulp, 1.0]
    x = torch.tensor([[0.0, 2.0, -0.5]])
    out = on_tiles(lambda d, t: nisa.tensor_copy(d, t), (1, 3), nl.bool_, x)
    assert out.tolist() == [[False, True, True]]


def test_elementwise_computes_in_fp32_and_rounds_once():
    a = torch.tensor([[1.0, 256.0]]).bfloat16()
    b = torch.tensor([[2.0 ** -8, 1.0]]).bfloat16()

    def body(d, x, y):
        wide = nl.ndarray((1, 2), nl.float32)
        nisa.tensor_tensor(wide, x, y, nl.add)      # fp32 result keeps 1 + 2^-8 exactly
        nisa.tensor_tensor(d, wide, x, nl.subtract)

    out = on_tiles(body, (1, 2), nl.float32, a, b)
    assert out.tolist() == [[2.0 ** -8, 1.0]]


def test_matmul_accumulates_in_fp32_psum():
    k_tiles = 8
    ones = torch.ones(128 * k_tiles, 1).bfloat16()
    ints = torch.randint(0, 9, (128 * k_tiles, 512)).bfloat16()  # exact in bf16; sums exact in fp32, not bf16

    @sim.jit
    def kernel(s, m):
        acc = nl.ndarray((1, 512), nl.float32, buffer=nl.psum)
        for k in range(k_tiles):
            a = nl.load(s[k * 128:(k + 1) * 128, :])
            b = nl.load(m[k * 128:(k + 1) * 128, :])
            nisa.nc_matmul(acc, a, b, accumulate=k > 0)
        out = nl.ndarray((1, 512), nl.float32, buffer=nl.shared_hbm)
        staged = nl.ndarray((1, 512), nl.float32)
        nisa.tensor_copy(staged, acc)
        nl.store(out, staged)
        return out

    expected = ints.double().sum(0, keepdim=True)
    assert not torch.equal(expected.bfloat16().double(), expected)  # bf16 could not hold these sums
    assert torch.equal(kernel(ones, ints).double(), expected)


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16])
def test_integer_iota_into_float_tiles(dtype):
    out = on_tiles(lambda d: nisa.iota(d, [[1, 300]]), (1, 300), dtype)
    expected = torch.arange(300.0).reshape(1, 300).to(sim.dtypes.as_dtype(dtype).storage)
    assert torch.equal(out, expected)


def test_exp_gives_torch_exp_bits_on_every_kind_of_fp32_input():
    """ScalarE / VectorE exp skips libm's slow underflow path by a mask (sim/ops.py): the same bits as
    torch.exp on a sweep of fp32 bit patterns (every exponent, both signs, NaNs and infinities) and at
    the edge where exp underflows to zero."""
    from neuron_inductor.sim.ops import EXP_ZERO_BELOW, OPS
    pattern = torch.arange(0, 2 ** 32, 4099, dtype=torch.int64)
    x = torch.where(pattern >= 2 ** 31, pattern - 2 ** 32, pattern).to(torch.int32).view(torch.float32)
    edge = torch.tensor([EXP_ZERO_BELOW, -103.97210693359375, -103.97211456298828, -87.5, -3.4028235e38,
                         -float("inf"), float("inf"), float("nan"), -0.0, 0.0, 88.7, 88.8])
    for values in (x, edge, torch.linspace(-110, -100, 100_001)):
        assert torch.equal(OPS["exp"].fn(values).view(torch.int32), torch.exp(values).view(torch.int32))
