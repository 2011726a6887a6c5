"""The rules of the nki.isa API reference (aws-neuron-sdk nki/api) the interpreter enforces, one test each,
and the one it must not invent (a non-fp32 activation bias)."""

import math
import warnings

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import rules

from .test_sim_rules import ps, rule_error, run, sb


def to_hbm(t):
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_tensor_scalar_on_gpsimd_only_for_rsqrt():
    rule_error(lambda: nisa.tensor_scalar(sb((128, 4)), sb((128, 4)), nl.multiply, 2.0, engine=nisa.engine.gpsimd),
               "nisa.tensor_scalar", "tensor_scalar on GpSimd only for rsqrt", "multiply")
    rule_error(lambda: nisa.tensor_scalar(sb((128, 4)), sb((128, 4)), nl.rsqrt, 0.0, op1=nl.maximum, operand1=1.0,
                                          engine=nisa.engine.gpsimd),
               "nisa.tensor_scalar", "only for rsqrt", "maximum")

    def rsqrt_on_gpsimd(x):
        t = nl.ndarray((128, 4), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.rsqrt, operand0=0.0, engine=nisa.engine.gpsimd)
        return to_hbm(t)

    x = torch.rand(128, 4) + 0.5
    torch.testing.assert_close(run(rsqrt_on_gpsimd, x), torch.rsqrt(x))


def test_unary_alu_operand_is_none_or_zero():
    rule_error(lambda: nisa.tensor_scalar(sb((128, 4)), sb((128, 4)), nl.abs, 1.0),
               "nisa.tensor_scalar", "operand0 is None or 0 for a unary operator", 1.0)


@pytest.mark.parametrize("name, make", [
    ("tensor_reduce", lambda d, s: nisa.tensor_reduce(dst=s((128, 1)), op=nl.add, data=d, axis=1)),
    ("activation", lambda d, s: nisa.activation(dst=s((128, 1024)), op=nl.exp, data=d)),
    ("activation_reduce", lambda d, s: nisa.activation_reduce(dst=s((128, 1024)), op=nl.exp, data=d,
                                                              reduce_op=nl.add, reduce_res=s((128, 1)))),
    ("tensor_copy", lambda d, s: nisa.tensor_copy(dst=s((128, 1024)), src=d)),
    ("tensor_scalar", lambda d, s: nisa.tensor_scalar(dst=s((128, 1024)), data=d, op0=nl.multiply, operand0=2.0)),
])
def test_non_matmul_psum_operand_within_one_bank(name, make):
    def four_banks():
        scores = ps((128, 2048))
        for bank in range(4):
            nisa.memset(scores[:, bank * 512:(bank + 1) * 512], 0.0)
        return scores

    def body():
        scores = four_banks()
        make(scores[:, 0:1024], lambda shape: nl.ndarray(shape, nl.float32, buffer=nl.sbuf))

    rule_error(body, f"nisa.{name}", "PSUM tile within one 2 KiB PSUM bank per partition", 4096)

    def per_bank():
        scores = four_banks()
        for bank in range(4):
            make(scores[:, bank * 512:(bank + 1) * 512], lambda shape: nl.ndarray(
                (shape[0], min(shape[1], 512)), nl.float32, buffer=nl.sbuf))

    run(per_bank)


def test_psum_write_by_vector_engine_within_one_bank():
    rule_error(lambda: nisa.tensor_copy(dst=ps((128, 1024)), src=sb((128, 1024))),
               "nisa.tensor_copy", "within one 2 KiB PSUM bank", 4096)
    rule_error(lambda: nisa.memset(ps((128, 600)), 0.0), "nisa.memset", "within one 2 KiB PSUM bank", 2400)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_no_64_bit_kernel_arguments(dtype):
    e = rule_error(lambda x: to_hbm(sb((4, 4))), "nki.jit", "no 64-bit dtypes", str(dtype).split(".")[-1],
                   torch.zeros(4, 4, dtype=dtype))
    assert "narrow it on the host" in str(e)


def test_no_64_bit_hbm_tensors():
    rule_error(lambda: nl.ndarray((4, 4), torch.int64, buffer=nl.shared_hbm), "nl.ndarray", "no 64-bit dtypes", "int64")


def test_hbm_tensors_at_least_1d():
    rule_error(lambda x: to_hbm(sb((1, 1))), "nki.jit", "HBM tensors are at least 1-D", [], torch.tensor(1.0))
    rule_error(lambda: nl.ndarray((), nl.float32, buffer=nl.shared_hbm), "nl.ndarray", "at least 1-D", [])

    def shape_one(x):
        t = nl.ndarray((1, 1), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        return to_hbm(t)

    assert run(shape_one, torch.tensor([3.0])).tolist() == [[3.0]]


def test_reduce_ops_are_alu_names():
    e = rule_error(lambda: nisa.tensor_reduce(dst=sb((128, 1)), op=nl.max, data=sb((128, 8)), axis=1),
                   "nisa.tensor_reduce", "not a reduction function", nl.max)
    assert "pass nl.maximum" in str(e)
    rule_error(lambda: nisa.activation_reduce(dst=sb((128, 8)), op=nl.exp, data=sb((128, 8)), reduce_op=nl.sum,
                                              reduce_res=sb((128, 1))),
               "nisa.activation_reduce", "reduce_op must be nl.add", nl.sum)


def test_tensor_scalar_arithmetic_is_fp32_on_int32():
    def body(x):
        t = nl.ndarray((1, 3), nl.int32)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1)
        return to_hbm(t)

    x = torch.tensor([[2 ** 24, 2 ** 24 + 2, 7]], dtype=torch.int32)
    # 2**24 + 1 is not an fp32 value: it rounds (to even) back to 2**24; 2**24 + 3 rounds to 2**24 + 4.
    assert run(body, x).tolist() == [[2 ** 24, 2 ** 24 + 4, 8]]


def test_tensor_tensor_int32_stays_exact_on_gpsimd():
    def body(x):
        t = nl.ndarray((1, 2), nl.int32)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.add)
        return to_hbm(t)

    x = torch.tensor([[2 ** 24 + 1, 3]], dtype=torch.int32)
    assert run(body, x).tolist() == [[2 ** 25 + 2, 6]]


RANGES = [  # op, a valid input at each end of the documented range, an invalid input just outside
    (nl.log, torch.log, (2.0 ** -64, 2.0 ** 64), (2.0 ** -65, 2.0 ** 65, 0.0, -1.0, math.inf)),
    (nl.sqrt, torch.sqrt, (2.0 ** -116, 2.0 ** 118), (2.0 ** -117, 2.0 ** 119, 0.0, -1.0)),
    (nl.rsqrt, torch.rsqrt, (2.0 ** -87, 2.0 ** 97), (2.0 ** -88, 2.0 ** 98, 0.0)),
    (nl.reciprocal, torch.reciprocal, (2.0 ** -42, -2.0 ** 42), (2.0 ** -43, -2.0 ** 43, 0.0)),
    (nl.sin, torch.sin, (-3.14159, 3.14159), (4.0, -9.0)),
    (nl.arctan, torch.atan, (-1.5, 1.5), (2.0,)),
]


def activation_of(op, values):
    def body(x):
        t = nl.ndarray((1, len(values)), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        nisa.activation(dst=t, op=op, data=t)
        return to_hbm(t)

    return run(body, torch.tensor([values], dtype=torch.float32))[0]


@pytest.mark.parametrize("op, ref, valid, invalid", RANGES, ids=[r[0].name for r in RANGES])
def test_activation_out_of_range_poisons_with_nan(op, ref, valid, invalid):
    out = activation_of(op, list(valid) + list(invalid))
    torch.testing.assert_close(out[:len(valid)], ref(torch.tensor(valid)))
    assert out[len(valid):].isnan().all(), out


@pytest.mark.parametrize("op, ref, valid, invalid", RANGES, ids=[r[0].name for r in RANGES])
def test_activation_out_of_range_raises_in_strict_mode(op, ref, valid, invalid, monkeypatch):
    monkeypatch.setenv(rules.STRICT_ENV, "1")
    activation_of(op, list(valid))
    with pytest.raises(sim.NkiRuleError) as info:
        activation_of(op, [valid[0], invalid[0]])
    assert info.value.op == "nisa.activation" and "valid range" in info.value.rule
    assert info.value.value == pytest.approx(invalid[0])


def test_strict_mode_reads_an_input_that_requires_grad_without_warning(monkeypatch):
    """A kernel called on a requires-grad tensor: the message's value is read detached (no
    'Converting a tensor with requires_grad=True to a scalar' warning)."""
    monkeypatch.setenv(rules.STRICT_ENV, "1")

    def body(x):
        t = nl.ndarray((1, 2), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        nisa.activation(dst=t, op=nl.log, data=t)
        return to_hbm(t)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(sim.NkiRuleError) as info:
            run(body, torch.tensor([[1.0, -5.0]], requires_grad=True))
    assert info.value.value == -5.0


def test_activation_range_applies_after_scale_and_bias():
    def body(x):
        t = nl.ndarray((1, 2), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        nisa.activation(dst=t, op=nl.log, data=t, scale=0.0, bias=1.0)  # log(0 * x + 1) = 0: in range
        return to_hbm(t)

    assert run(body, torch.tensor([[0.0, -5.0]])).tolist() == [[0.0, 0.0]]


def test_nl_sin_reduces_its_argument():
    def body(x):
        t = nl.ndarray((1, 1), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        return to_hbm(nl.sin(t))

    torch.testing.assert_close(run(body, torch.tensor([[9.0]])), torch.sin(torch.tensor([[9.0]])))


def test_activation_bias_any_dtype_but_tfloat32():
    def bf16_bias(x, b):  # as rmsnorm_quant does
        t = nl.ndarray((128, 8), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        bias = nl.ndarray((128, 1), nl.bfloat16)
        nisa.dma_copy(dst=bias, src=b)
        nisa.activation(dst=t, op=nl.copy, data=t, bias=bias)
        return to_hbm(t)

    x, b = torch.randn(128, 8), torch.randn(128, 1).bfloat16()
    torch.testing.assert_close(run(bf16_bias, x, b), x + b.float())
    rule_error(lambda: nisa.activation(dst=sb((128, 8)), op=nl.copy, data=sb((128, 8)), bias=sb((128, 1), nl.tfloat32)),
               "nisa.activation", "bias dtype is not tfloat32", "tfloat32")
    rule_error(lambda: nisa.activation(dst=sb((128, 8)), op=nl.copy, data=sb((128, 8)), scale=sb((128, 1), nl.bfloat16)),
               "nisa.activation", "scale vector is float32", "bfloat16")
