"""The remaining documented nki.isa / nki.language names: activate2, topk, sequence_bounds, abs_max / abs_min,
prelu, bypass, gather_flattened, no_reorder, MemoryRegion, get_nc_sub_version, NkiValidationError,
NkiInstruction, and the MX instructions (not modelled: a clear error). Against their docstrings, fp32 and bf16."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

from .helpers import TOL, on_tiles

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def trn3(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")


def close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected.to(dtype), **TOL[dtype])


# ---------------------------------------------------------------------------- activate2

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op0, op1, reverse0, expected", [
    ("multiply", "add", False, lambda x, a, b: x * a + b),
    ("multiply", "subtract", False, lambda x, a, b: x * a - b),
    ("multiply", "bypass", False, lambda x, a, b: x * a),
    ("add", "bypass", False, lambda x, a, b: x + a),
    ("subtract", "bypass", True, lambda x, a, b: a - x),
    ("bypass", "bypass", False, lambda x, a, b: x),
])
def test_activate2_tensor_scalar_stage_then_activation(dtype, op0, op1, reverse0, expected, trn3):
    x = torch.randn(64, 96).to(dtype)
    scale = torch.randn(64, 1)

    def body(dst, data, s):
        nisa.activate2(dst, nl.gelu, data, imm0=s, imm1=0.5, op0=getattr(nl, op0), op1=getattr(nl, op1),
                       reverse0=reverse0)

    out = on_tiles(body, (64, 96), sim.dtypes.of_torch(dtype), x, scale)
    ref = torch.nn.functional.gelu(expected(x.float(), scale, 0.5))
    close(out, ref, dtype)


def fold_in_order(values, identity, op):
    """accumulator = reduce_op(accumulator, dst[i]) element by element (the docstring's Behavior block)."""
    rows = []
    for row in values.tolist():
        acc = identity
        for y in row:
            acc = op(acc, y)
        rows.append(acc)
    return torch.tensor(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce_op, fold", [
    ("add", lambda v: v.sum(1)), ("maximum", lambda v: v.amax(1)), ("minimum", lambda v: v.amin(1)),
    ("abs_max", lambda v: fold_in_order(v, 0.0, lambda acc, y: acc if abs(acc) > abs(y) else y)),
    ("abs_min", lambda v: fold_in_order(v, float("inf"), lambda acc, y: acc if abs(acc) < abs(y) else y)),
])
def test_activate2_reduces_into_the_shared_accumulators(dtype, reduce_op, fold, trn3):
    x = torch.randn(32, 40).to(dtype)

    def body(dst, data):
        res = nl.ndarray((32, 1), nl.float32)
        nisa.activate2(dst, nl.copy, data, imm0=2.0, imm1=0.0, op0=nl.multiply, op1=nl.bypass,
                       reduce_op=getattr(nl, reduce_op), reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activate2(dst, nl.copy, data, imm0=2.0, imm1=0.0, op0=nl.multiply, op1=nl.bypass,
                       reduce_op=getattr(nl, reduce_op), reduce_res=res, reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.tensor_copy(dst=dst[:, 0:1], src=res)

    out = on_tiles(body, (32, 40), nl.float32, x)
    doubled = x.float() * 2
    both = torch.cat([doubled, doubled], dim=1)
    close(out[:, 1:], doubled[:, 1:], torch.float32)
    torch.testing.assert_close(out[:, 0], fold(both), rtol=1e-6, atol=1e-5)


def test_activate2_prelu_uses_relu_param(trn3):
    x = torch.randn(16, 32)
    slope = torch.linspace(0.1, 0.9, 16).reshape(16, 1)
    out = on_tiles(lambda d, a, s: nisa.activate2(d, nl.prelu, a, 1.0, 0.0, nl.multiply, nl.bypass, relu_param=s),
                   (16, 32), nl.float32, x, slope)
    torch.testing.assert_close(out, torch.where(x >= 0, x, x * slope))


def test_activate2_rules(trn3):
    x = torch.randn(4, 8)
    with pytest.raises(sim.NkiRuleError, match=r"\(op0, op1\)"):
        on_tiles(lambda d, a: nisa.activate2(d, nl.exp, a, 1.0, 1.0, nl.add, nl.multiply), (4, 8), nl.float32, x)
    with pytest.raises(sim.NkiRuleError, match="reverse"):
        on_tiles(lambda d, a: nisa.activate2(d, nl.exp, a, 1.0, 1.0, nl.bypass, nl.bypass, reverse0=True),
                 (4, 8), nl.float32, x)
    with pytest.raises(sim.NkiRuleError, match="activation function"):
        on_tiles(lambda d, a: nisa.activate2(d, nl.add, a, 1.0, 1.0, nl.bypass, nl.bypass), (4, 8), nl.float32, x)
    with pytest.raises(sim.NkiRuleError, match="reduce_op"):
        on_tiles(lambda d, a: nisa.activate2(d, nl.exp, a, 1.0, 1.0, nl.bypass, nl.bypass, reduce_op=nl.multiply,
                                             reduce_cmd=nisa.reduce_cmd.reset_reduce), (4, 8), nl.float32, x)


def test_activate2_poisons_out_of_range_inputs(trn3):
    out = on_tiles(lambda d, a: nisa.activate2(d, nl.log, a, 1.0, 0.0, nl.multiply, nl.bypass), (2, 2), nl.float32,
                   torch.tensor([[1.0, -1.0], [2.0, 0.0]]))
    assert torch.isnan(out[0, 1]) and torch.isnan(out[1, 1]) and out[1, 0] == torch.log(torch.tensor(2.0))


def test_activate2_is_trn3_only():
    with pytest.raises(sim.NkiRuleError, match="NeuronCore-v4"):
        on_tiles(lambda d, a: nisa.activate2(d, nl.exp, a, 1.0, 0.0, nl.bypass, nl.bypass), (4, 8), nl.float32,
                 torch.zeros(4, 8))


# ---------------------------------------------------------------------------- topk, sequence_bounds

def run_topk(src, n, k):
    p, x = src.shape

    @sim.jit
    def kernel(src_in):
        s = nl.ndarray((p, x), nl.bfloat16)
        nisa.dma_copy(dst=s, src=src_in)
        vals = nl.ndarray((p, k), nl.bfloat16)
        idx = nl.ndarray((p, k), nl.uint32)
        nisa.topk(val_dst=vals, idx_dst=idx, src=s, n=n)
        out_v = nl.ndarray((p, k), nl.bfloat16, buffer=nl.shared_hbm)
        out_i = nl.ndarray((p, k), nl.uint32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_v, src=vals)
        nisa.dma_copy(dst=out_i, src=idx)
        return out_v, out_i

    return kernel(src)


@pytest.mark.parametrize("p, n, k", [(16, 42, 8), (32, 256, 20), (64, 100, 1)])
def test_topk_reads_a_16_partition_snake(p, n, k):
    x = -(-n // 16)
    src = (torch.randperm(p * x) - p * x // 2).reshape(p, x).to(torch.bfloat16)  # distinct, exact in bf16
    vals, idx = run_topk(src, n, k)
    for g in range(p // 16):
        snake = src[16 * g:16 * g + 16].t().reshape(-1)[:n].float()  # element j: partition j % 16, column j // 16
        top = torch.topk(snake, k)
        expected_vals, order = top.values.flip(0), top.indices.flip(0)  # ascending
        for row in range(16 * g, 16 * g + 16):
            assert torch.equal(vals[row].float(), expected_vals)
            assert torch.equal(idx[row].to(torch.int64), order)


def test_topk_rules():
    with pytest.raises(sim.NkiRuleError, match="multiple of 16"):
        run_topk(torch.zeros(8, 4, dtype=torch.bfloat16), 32, 8)
    with pytest.raises(sim.NkiRuleError, match="K <= n"):
        run_topk(torch.zeros(16, 1, dtype=torch.bfloat16), 8, 9)
    with pytest.raises(sim.NkiRuleError, match="ceil"):
        run_topk(torch.zeros(16, 2, dtype=torch.bfloat16), 40, 8)


def numpy_sequence_bounds(seq):
    """The docstring's NumPy equivalent, transcribed."""
    n = len(seq)
    lo, hi = [0] * n, [0] * n
    lo[0] = 0 if seq[0] != 0 else n
    for i in range(1, n):
        lo[i] = n if seq[i] == 0 else lo[i - 1] if seq[i] == seq[i - 1] else i
    hi[-1] = n if seq[-1] != 0 else -1
    for i in range(n - 2, -1, -1):
        hi[i] = -1 if seq[i] == 0 else hi[i + 1] if seq[i] == seq[i + 1] else i + 1
    return torch.tensor([lo, hi], dtype=torch.float32)


@pytest.mark.parametrize("dtype", [nl.float32, nl.int32])
def test_sequence_bounds_matches_the_documented_numpy(dtype):
    seq = [1, 1, 1, 2, 2, 0, 0, 3, 1, 1, 0, 4]
    ids = torch.tensor([seq], dtype=torch.float32 if dtype is nl.float32 else torch.int32)
    out = on_tiles(lambda d, s: nisa.sequence_bounds(d, s), (1, 2, len(seq)), dtype, ids)
    assert torch.equal(out.float().reshape(2, -1), numpy_sequence_bounds(seq))


# ---------------------------------------------------------------------------- ALU ops, nl names

@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_max_abs_min_keep_the_signed_value_and_ties_return_y(dtype, trn3):
    x = torch.tensor([[-5.0, 1.0, 2.0, -0.5]]).to(dtype)
    y = torch.tensor([[3.0, -1.0, -4.0, 0.25]]).to(dtype)

    def body(dst, a, b):
        nisa.tensor_tensor(dst[:, 0:4], a, b, op=nl.abs_max)
        nisa.tensor_tensor(dst[:, 4:8], a, b, op=nl.abs_min)

    out = on_tiles(body, (1, 8), sim.dtypes.of_torch(dtype), x, y)
    assert out.float().tolist() == [[-5.0, -1.0, -4.0, -0.5, 3.0, -1.0, 2.0, 0.25]]


def test_abs_max_is_trn3_only():
    with pytest.raises(sim.NkiRuleError, match="abs_max needs NeuronCore-v4"):
        on_tiles(lambda d, a: nisa.tensor_tensor(d, a, a, op=nl.abs_max), (2, 2), nl.float32, torch.ones(2, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_flattened_picks_free_elements_per_partition(dtype):
    data = torch.randn(8, 4, 5).to(dtype)
    idx = torch.randint(0, 20, (8, 6), dtype=torch.int32)

    @sim.jit
    def kernel(d, i):
        out = nl.ndarray((8, 6), d.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.gather_flattened(nl.load(d), nl.load(i)))
        return out

    assert torch.equal(kernel(data, idx), torch.gather(data.reshape(8, 20), 1, idx.long()))


def test_no_reorder_runs_its_block_and_refuses_dynamic_loops():
    @sim.jit
    def kernel(x):
        with nl.no_reorder():
            t = nl.load(x)
            u = nl.add(t, 1.0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, u)
        return out

    assert torch.equal(kernel(torch.ones(4, 4)), torch.full((4, 4), 2.0))

    @sim.jit
    def looped(x):
        with nl.no_reorder():
            nl.fori_loop(0, 2, lambda i: None)
        return x

    with pytest.raises(sim.NkiError, match="no_reorder"):
        looped(torch.ones(1))


def test_memory_regions_dtype_alias_and_operator_tokens():
    assert isinstance(nl.sbuf, nl.MemoryRegion) and nl.MemoryRegion.shared_hbm is nl.shared_hbm
    assert list(nl.MemoryRegion) == [nl.sbuf, nl.psum, nl.private_hbm, nl.shared_hbm]
    assert nl.DType is str
    with pytest.raises(sim.NkiError, match="operator token"):
        nl.bypass(1.0)
    with pytest.raises(sim.NkiError, match="without documented semantics"):
        nl.average(1.0)


def test_sub_version_validation_error_and_instruction_handle():
    assert nisa.get_nc_sub_version() == 0
    assert issubclass(sim.NkiRuleError, nisa.NkiValidationError)
    a, b = nisa.NkiInstruction(), nisa.NkiInstruction()
    assert a.depends_on(b).depends_on(b) is a
    with pytest.raises(sim.NkiError, match="NkiInstruction"):
        a.depends_on(object())


def test_mx_instructions_name_themselves_as_not_modelled(trn3):
    with pytest.raises(NotImplementedError, match="nisa.nc_matmul_mx: MX"):
        nisa.nc_matmul_mx(None, None, None, None, None)
    with pytest.raises(NotImplementedError, match="nisa.quantize_mx: MX"):
        nisa.quantize_mx(None, None, None)


def test_mx_instructions_are_rule_errors_before_trn3():
    with pytest.raises(sim.NkiRuleError, match="NeuronCore-v4"):
        nisa.nc_matmul_mx(None, None, None, None, None)
