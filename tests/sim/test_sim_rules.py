"""Every hardware rule: a violation raises NkiRuleError naming the op, the rule and the offending value."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl


def run(body, *inputs):
    """Run body(*hbm_inputs) as a kernel."""
    return sim.jit(body)(*inputs)


def rule_error(body, op, rule_part, value, *inputs):
    with pytest.raises(sim.NkiRuleError) as info:
        run(body, *inputs)
    error = info.value
    assert error.op == op, str(error)
    assert rule_part in error.rule, str(error)
    assert error.value == value, str(error)
    assert str(error).startswith(f"{op}: ") and f"(rule: {error.rule})" in str(error)
    return error


def sb(shape, dtype=nl.float32, value=1.0):
    t = nl.ndarray(shape, dtype, buffer=nl.sbuf)
    nisa.memset(t, value)
    return t


def ps(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.psum)


def test_partition_dim_limit_on_allocation():
    e = rule_error(lambda: nl.ndarray((256, 4), nl.float32, buffer=nl.sbuf), "nl.ndarray", "partition dim <= 128", 256)
    assert "partition dim 256" in str(e)


def test_matmul_stationary_free_limit():
    rule_error(lambda: nisa.nc_matmul(ps((128, 64)), sb((128, 256), nl.bfloat16), sb((128, 64), nl.bfloat16)),
               "nisa.nc_matmul", "stationary free size <= 128", 256)


def test_matmul_moving_free_limit():
    rule_error(lambda: nisa.nc_matmul(ps((128, 1024)), sb((128, 128), nl.bfloat16), sb((128, 1024), nl.bfloat16)),
               "nisa.nc_matmul", "moving free size <= 512", 1024)


def test_matmul_moving_limit_is_target_specific(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")

    def body():  # 1024 bf16 = 2 KiB: legal on v4, whose dst may span 8 banks
        d = ps((128, 1024))
        nisa.nc_matmul(d, sb((128, 128), nl.bfloat16), sb((128, 1024), nl.bfloat16))

    run(body)


def test_matmul_contraction_over_partitions():
    rule_error(lambda: nisa.nc_matmul(ps((128, 64)), sb((128, 128), nl.bfloat16), sb((64, 64), nl.bfloat16)),
               "nisa.nc_matmul", "contraction over the partition dim", (128, 64))


def test_matmul_dst_shape():
    rule_error(lambda: nisa.nc_matmul(ps((64, 64)), sb((128, 128), nl.bfloat16), sb((128, 64), nl.bfloat16)),
               "nisa.nc_matmul", "dst is [M, N]", [64, 64])


def test_matmul_operands_in_sbuf_result_in_psum():
    rule_error(lambda: nisa.nc_matmul(ps((128, 64)), ps((128, 128), nl.bfloat16), sb((128, 64), nl.bfloat16)),
               "nisa.nc_matmul", "stationary buffer in sbuf", "psum")
    rule_error(lambda: nisa.nc_matmul(sb((128, 64)), sb((128, 128), nl.bfloat16), sb((128, 64), nl.bfloat16)),
               "nisa.nc_matmul", "dst buffer in psum", "sbuf")


def test_matmul_psum_tile_within_one_bank():
    def body():
        d = ps((128, 1024))  # two banks
        nisa.nc_matmul(d[:, 256:768], sb((128, 128), nl.bfloat16), sb((128, 512), nl.bfloat16))

    e = rule_error(body, "nisa.nc_matmul", "within one 2 KiB PSUM bank", 2048)
    assert "crossing a bank boundary" in str(e)

    def inside_second_bank():
        d = ps((128, 1024))
        nisa.nc_matmul(d[:, 512:1024], sb((128, 128), nl.bfloat16), sb((128, 512), nl.bfloat16))

    run(inside_second_bank)


def test_matmul_dtype_rules():
    rule_error(lambda: nisa.nc_matmul(ps((128, 64)), sb((128, 128), nl.int32, 1), sb((128, 64), nl.int32, 1)),
               "nisa.nc_matmul", "matmul inputs are fp8 / bf16", "int32")
    rule_error(lambda: nisa.nc_matmul(ps((128, 64)), sb((128, 128)), sb((128, 64), nl.bfloat16)),
               "nisa.nc_matmul", "fp32 matmul inputs pair only with fp32", ("float32", "bfloat16"))
    rule_error(lambda: nisa.nc_matmul(ps((128, 64), nl.bfloat16), sb((128, 128), nl.bfloat16),
                                      sb((128, 64), nl.bfloat16)),
               "nisa.nc_matmul", "matmul dst dtype", "bfloat16")


def test_accumulate_true_into_unwritten_psum():
    rule_error(lambda: nisa.nc_matmul(ps((128, 64)), sb((128, 128), nl.bfloat16), sb((128, 64), nl.bfloat16),
                                      accumulate=True),
               "nisa.nc_matmul", "accumulate=True needs previously written PSUM", "accumulate=True")

    def partly_written():
        d = ps((128, 64))
        nisa.memset(d[:, 0:32], 0.0)
        nisa.nc_matmul(d, sb((128, 128), nl.bfloat16), sb((128, 64), nl.bfloat16), accumulate=True)

    rule_error(partly_written, "nisa.nc_matmul", "accumulate=True", "accumulate=True")


def test_dma_copy_never_touches_psum():
    rule_error(lambda: nisa.dma_copy(dst=ps((128, 64)), src=sb((128, 64))), "nisa.dma_copy", "dst buffer in", "psum")


def test_equal_partitions_and_elements_per_partition():
    rule_error(lambda: nisa.tensor_tensor(sb((128, 64)), sb((64, 128)), sb((128, 64)), nl.add),
               "nisa.tensor_tensor", "equal partition dims", (128, 64))
    rule_error(lambda: nisa.tensor_tensor(sb((128, 64)), sb((128, 64)), sb((128, 32)), nl.add),
               "nisa.tensor_tensor", "equal elements per partition", (64, 32))
    rule_error(lambda: nisa.dma_copy(dst=sb((128, 64)), src=sb((128, 32))),
               "nisa.dma_copy", "same number of elements", (8192, 4096))


def test_tensor_tensor_inputs_not_both_psum():
    def body():
        a, b = ps((128, 64)), ps((128, 64))
        nisa.memset(a, 1.0)
        nisa.memset(b, 1.0)
        nisa.tensor_tensor(sb((128, 64)), a, b, nl.add)

    rule_error(body, "nisa.tensor_tensor", "at most one input in PSUM", "psum")


def test_compute_operands_are_on_chip():
    rule_error(lambda x: nisa.tensor_tensor(sb((128, 4)), x, sb((128, 4)), nl.add),
               "nisa.tensor_tensor", "data1 buffer in sbuf / psum", "shared_hbm", torch.zeros(128, 4))


def test_gpsimd_cannot_access_psum():
    rule_error(lambda: nisa.memset(ps((128, 64)), 0.0, engine=nisa.engine.gpsimd),
               "nisa.memset", "GpSimd cannot access PSUM", "psum")
    rule_error(lambda: nisa.iota(ps((128, 64)), [[1, 64]]), "nisa.iota", "dst buffer in sbuf", "psum")


def test_no_divide_and_op_kinds():
    rule_error(lambda: nisa.tensor_tensor(sb((128, 4)), sb((128, 4)), sb((128, 4)), nl.divide),
               "nisa.tensor_tensor", "no divide", "divide")
    rule_error(lambda: nisa.tensor_tensor(sb((128, 4)), sb((128, 4)), sb((128, 4)), nl.exp),
               "nisa.tensor_tensor", "ALU operator", nl.exp)
    rule_error(lambda: nisa.activation(sb((128, 4)), nl.add, sb((128, 4))),
               "nisa.activation", "activation function", nl.add)
    rule_error(lambda: nisa.tensor_reduce(sb((128, 1)), nl.subtract, sb((128, 4)), axis=1),
               "nisa.tensor_reduce", "reduce op", nl.subtract)
    rule_error(lambda: nisa.tensor_scalar(sb((128, 4)), sb((128, 4)), nl.maximum, 1.0, engine=nisa.engine.scalar),
               "nisa.tensor_scalar", "only multiply / add", "maximum")


def test_dtype_rules():
    rule_error(lambda: nisa.tensor_tensor(sb((128, 4)), sb((128, 4)), sb((128, 4)), nl.bitwise_and),
               "nisa.tensor_tensor", "bitvec ops need integer dtypes", "float32")
    rule_error(lambda: nisa.tensor_scalar(sb((128, 4)), sb((128, 4)), nl.add, sb((128, 1), nl.bfloat16)),
               "nisa.tensor_scalar", "operand0 vector is float32", "bfloat16")
    rule_error(lambda: nl.ndarray((128, 4), torch.int64),
               "nl.ndarray", "no 64-bit dtypes", "int64")
    # 2-byte dtypes are documented for the hardware-DGE (and indirect) transposes; AWS's fp32 kernels use the default
    rule_error(lambda: nisa.dma_transpose(sb((64, 128)), sb((128, 64)), dge_mode=nisa.dge_mode.hwdge),
               "nisa.dma_transpose", "2-byte", "float32")
    rule_error(lambda: nisa.nc_transpose(ps((64, 128), nl.float32), sb((128, 64), nl.bfloat16)),
               "nisa.nc_transpose", "same dtype", ("float32", "bfloat16"))
    rule_error(lambda: nisa.memset(sb((128, 4), nl.int32, 0), 0.5), "nisa.memset", "value type matches", 0.5)
    rule_error(lambda: nisa.dma_copy(dst=sb((128, 4), nl.bfloat16), src=sb((128, 4)), dge_mode=nisa.dge_mode.hwdge),
               "nisa.dma_copy", "equal dtypes", ("bfloat16", "float32"))


def test_tensor_scalar_operand_shape():
    rule_error(lambda: nisa.tensor_scalar(sb((128, 4)), sb((128, 4)), nl.add, sb((128, 2))),
               "nisa.tensor_scalar", "[P, 1] vector", [128, 2])


def test_reduce_axes_trailing_free_only():
    rule_error(lambda: nisa.tensor_reduce(sb((1, 4)), nl.add, sb((128, 4)), axis=0),
               "nisa.tensor_reduce", "trailing contiguous free axes", (0,))
    rule_error(lambda: nisa.tensor_reduce(sb((128, 8)), nl.add, sb((128, 4, 8)), axis=1),
               "nisa.tensor_reduce", "trailing contiguous free axes", (1,))


def test_start_partition():
    rule_error(lambda: nisa.tensor_copy(sb((100, 4))[10:60], sb((100, 4))[0:50]),
               "nisa.tensor_copy", "start partition", 10)

    def legal():
        t = sb((128, 4))
        nisa.tensor_copy(t[64:128], t[0:64])
        nisa.tensor_copy(t[96:128], t[32:64])

    run(legal)


def test_transpose_limits():
    rule_error(lambda: nisa.nc_transpose(sb((64, 64)), sb((64, 64)), engine=nisa.engine.vector),
               "nisa.nc_transpose", "transpose on vector engine <= [32, 32]", (64, 64))


def test_bn_stats_free_limit():
    rule_error(lambda: nisa.bn_stats(sb((128, 6)), sb((128, 1024))), "nisa.bn_stats", "<= 512", 1024)


def test_reduce_registers_must_be_set_before_read():
    rule_error(lambda: nisa.activation(sb((128, 4)), nl.exp, sb((128, 4)), reduce_op=nl.add, reduce_res=sb((128, 1))),
               "nisa.activation", "reduce_res reads registers", "idle")


def test_nl_level_rules():
    rule_error(lambda: nl.add(sb((128, 4)), sb((128, 1))), "nl.add", "no tile-tile broadcasting", ((128, 4), (128, 1)))
    rule_error(lambda: nl.divide(sb((128, 4)), sb((128, 4))), "nl.divide", "no divide", "divide")
    rule_error(lambda: nl.matmul(sb((128, 128), nl.bfloat16), sb((128, 64), nl.bfloat16)),
               "nl.matmul", "transpose_x=True", False)
    rule_error(lambda: nl.power(sb((128, 4)), 2.0), "nl.power", "no power(tile, scalar)", 2.0)


def test_kernel_outputs_are_shared_hbm():
    rule_error(lambda: sb((128, 4)), "nki.jit", "kernel outputs are nl.shared_hbm", "sbuf")


def test_reshape_keeps_partition_dim():
    rule_error(lambda: sb((128, 4)).reshape(64, 8), "NkiTensor.reshape", "keeps the partition dim", (128, 64))


def test_out_of_range_indexing():
    with pytest.raises(sim.NkiIndexError):
        run(lambda: sb((128, 4))[0:128, 2:6])
    with pytest.raises(sim.NkiIndexError):
        run(lambda x: x[0:200], torch.zeros(128, 4))
    with pytest.raises(sim.NkiIndexError):
        run(lambda: sb((128, 4))[0:128:2])


def test_rule_errors_are_nki_errors():
    assert issubclass(sim.NkiCapacityError, sim.NkiRuleError)
    assert issubclass(sim.NkiRuleError, sim.NkiError)


def test_bitvec_scalar_operands_are_integers():
    rule_error(lambda: nisa.tensor_scalar(sb((128, 4), nl.int32, 0), sb((128, 4), nl.int32, 0), nl.bitwise_and, 0.5),
               "nisa.tensor_scalar", "bitvec ops need integer dtypes", (0.5, None))


def test_access_pattern_limits():
    rule_error(lambda: nisa.memset(nl.ndarray((2, 2, 2, 2, 2, 2), nl.float32), 0.0),
               "nisa.memset", "at most 4 free dims", 5)

    def long_free_dim():
        t = nl.ndarray((2, 70000), nl.bfloat16)
        nisa.memset(t, 0.0)

    rule_error(long_free_dim, "nisa.memset", "uint16", 70000)

    def wide_stride():
        t = nl.ndarray((2, 2, 40000), nl.bfloat16)
        nisa.memset(t[:, :, 0:8], 0.0)

    rule_error(wide_stride, "nisa.memset", "int16", 40000)
