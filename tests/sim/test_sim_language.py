"""nl-level API: creation, load/store, elementwise math, reductions, softmax, rms_norm, matmul helpers."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import language as nl


def run(body, *inputs):
    """body(*sbuf_tiles) -> SBUF (or PSUM) tile, stored to a shared_hbm output."""
    @sim.jit
    def kernel(*hbm):
        result = body(*[nl.load(x) for x in hbm])
        if result.buffer is nl.psum:
            result = nl.copy(result, dtype=result.dtype)
            staged = nl.ndarray(result.shape, result.dtype, buffer=nl.sbuf)
            sim.isa.tensor_copy(staged, result)
            result = staged
        out = nl.ndarray(result.shape, result.dtype, buffer=nl.shared_hbm)
        nl.store(out, result)
        return out

    return kernel(*inputs)


def test_creation_helpers():
    out = run(lambda: nl.add(nl.zeros((16, 8), nl.float32), nl.full((16, 8), 2.5, nl.float32)))
    assert torch.equal(out, torch.full((16, 8), 2.5))
    out = run(lambda: nl.ones((4, 4), nl.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), torch.ones(4, 4))
    out = run(lambda x: nl.zeros_like(x, dtype=nl.int32), torch.randn(8, 3))
    assert torch.equal(out, torch.zeros(8, 3, dtype=torch.int32))
    out = run(lambda: nl.shared_identity_matrix(8, dtype=nl.float32))
    assert torch.equal(out, torch.eye(8))


@pytest.mark.parametrize("op, ref", [(nl.add, torch.add), (nl.multiply, torch.mul), (nl.maximum, torch.maximum),
                                     (nl.subtract, torch.sub), (nl.less, lambda a, b: (a < b).float())])
def test_binary_tile_tile_and_tile_scalar(op, ref):
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    torch.testing.assert_close(run(lambda a, b: op(a, b), x, y), ref(x, y))
    torch.testing.assert_close(run(lambda a: op(a, 0.5), x), ref(x, torch.tensor(0.5)))
    torch.testing.assert_close(run(lambda a: op(0.5, a), x), ref(torch.tensor(0.5), x))


def test_promotion_and_dtype_argument():
    x = torch.randn(16, 16).bfloat16()
    y = torch.randn(16, 16)
    assert run(lambda a, b: nl.add(a, b), x, y).dtype == torch.float32        # (bf16, f32) -> f32
    assert run(lambda a: nl.multiply(a, 2), x).dtype == torch.bfloat16        # int scalar: float wins
    assert run(lambda a: nl.multiply(a, 1.5), x).dtype == torch.float32       # float scalar is weak f32
    assert run(lambda a: nl.multiply(a, 1.5, dtype=nl.bfloat16), x).dtype == torch.bfloat16
    assert sim.dtypes.promote(nl.int8, nl.uint8) is nl.int16
    assert sim.dtypes.promote(nl.int32, nl.uint32) is nl.float32
    assert sim.dtypes.promote(nl.float8_e4m3, nl.float8_e5m2) is nl.bfloat16
    assert sim.dtypes.promote(nl.float16, nl.bfloat16) is nl.float32
    assert sim.dtypes.promote(nl.float8_e4m3, nl.float16) is nl.float16


@pytest.mark.parametrize("op, ref", [(nl.exp, torch.exp), (nl.tanh, torch.tanh), (nl.negative, torch.neg),
                                     (nl.cos, torch.cos), (nl.floor, torch.floor), (nl.sigmoid, torch.sigmoid)])
def test_unary(op, ref):
    x = torch.randn(128, 64)
    torch.testing.assert_close(run(lambda a: op(a), x), ref(x))


def test_invert_and_logical_not():
    x = torch.randint(-100, 100, (8, 8), dtype=torch.int32)
    assert torch.equal(run(lambda a: nl.invert(a), x), ~x)
    f = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    assert torch.equal(run(lambda a: nl.logical_not(a), f), torch.tensor([[1.0, 0.0, 0.0, 1.0]]))


@pytest.mark.parametrize("op, ref", [(nl.sum, lambda x, a, k: x.sum(a, keepdim=k)),
                                     (nl.max, lambda x, a, k: x.amax(a, keepdim=k)),
                                     (nl.min, lambda x, a, k: x.amin(a, keepdim=k)),
                                     (nl.mean, lambda x, a, k: x.mean(a, keepdim=k)),
                                     (nl.var, lambda x, a, k: x.var(a, unbiased=False, keepdim=k))])
def test_reductions(op, ref):
    x = torch.randn(32, 4, 16)
    if op is not nl.var:
        torch.testing.assert_close(run(lambda a: op(a, axis=2), x), ref(x, 2, False), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(lambda a: op(a, axis=(1, 2), keepdims=True), x), ref(x, (1, 2), True),
                               rtol=1e-5, atol=1e-5)


def test_softmax_and_rms_norm():
    x = torch.randn(128, 200)
    torch.testing.assert_close(run(lambda a: nl.softmax(a, axis=-1), x), torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    w = torch.randn(1, 200)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(run(lambda a, b: nl.rms_norm(a, b, axis=-1, n=200), x, w), expected,
                               rtol=1e-5, atol=1e-5)


def test_where_and_broadcast():
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    cond = (x > 0).float()
    torch.testing.assert_close(run(lambda c, a, b: nl.where(c, a, b), cond, x, y), torch.where(x > 0, x, y))
    torch.testing.assert_close(run(lambda c, a: nl.where(c, a, -1.0), cond, x), torch.where(x > 0, x, -1.0))
    row = torch.randn(1, 8)
    torch.testing.assert_close(run(lambda r: nl.broadcast_to(r, (16, 8)), row), row.expand(16, 8))


def test_matmul_transpose_and_copy():
    a, b = torch.randn(128, 64).bfloat16(), torch.randn(128, 256).bfloat16()
    torch.testing.assert_close(run(lambda x, y: nl.matmul(x, y, transpose_x=True), a, b),
                               a.float().t() @ b.float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(run(lambda x: nl.transpose(x), a), a.t())
    x = torch.randn(32, 32)
    assert torch.equal(run(lambda t: nl.copy(t, dtype=nl.bfloat16), x), x.bfloat16())


def test_load_transpose2d_and_views():
    x = torch.randn(64, 128).bfloat16()

    @sim.jit
    def kernel(src):
        t = nl.load_transpose2d(src)
        out = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out

    assert torch.equal(kernel(x), x.t())


def test_scalar_only_math():
    assert nl.add(2, 3) == 5 and nl.maximum(1.5, -1.0) == 1.5 and nl.bitwise_and(6, 3) == 2
