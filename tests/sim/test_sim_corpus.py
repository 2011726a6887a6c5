"""Our library-style kernels (tests/sim/nki_kernels/library_style.py) against torch, fp32 and bf16, LNC 1 and 2."""

import importlib.util
import pathlib

import pytest
import torch

from neuron_inductor import sim

SOURCE = pathlib.Path(__file__).parent / "nki_kernels" / "library_style.py"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    spec = importlib.util.spec_from_file_location("library_style", SOURCE)
    module = importlib.util.module_from_spec(spec)
    with sim.as_nki():
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lnc, tokens", [(1, 200), (2, 300), (2, 5)])
def test_embedding_lookup(kernels, dtype, lnc, tokens):
    table = torch.randn(1000, 96).to(dtype)
    ids = torch.randint(0, 1000, (tokens,), dtype=torch.int32)
    ids[::7] = 1000  # padding ids: out of range, skipped
    launch = kernels.embedding_lookup[lnc] if lnc > 1 else kernels.embedding_lookup
    out = launch(ids, table)
    valid = ids < 1000
    expected = torch.zeros(tokens, 96, dtype=dtype)
    expected[valid] = table[ids[valid].long()]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lnc, n, k, m", [(1, 256, 128, 512), (2, 300, 64, 96), (2, 100, 128, 256)])
def test_rmsnorm_matmul(kernels, dtype, lnc, n, k, m):
    x, gamma, w = torch.randn(n, k).to(dtype), (1 + 0.1 * torch.randn(k)).to(dtype), (0.1 * torch.randn(k, m)).to(dtype)
    launch = kernels.rmsnorm_matmul[lnc] if lnc > 1 else kernels.rmsnorm_matmul
    out = launch(x, gamma, w)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.square().mean(1, keepdim=True) + 1e-6) * gamma.float()).to(dtype).float()
    expected = normed @ w.float()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype is torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), **tol)


@pytest.mark.parametrize("tokens, experts", [(256, 64), (16, 8), (64, 300)])
def test_router_top8_lnc2(kernels, tokens, experts):
    logits = torch.randn(tokens, experts)
    values, ids, probs = kernels.router_top8[2](logits)
    expected_values, expected_ids = logits.topk(8, dim=1)
    assert torch.equal(values, expected_values)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(probs, torch.softmax(expected_values, dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles, cols", [(2, 1000), (1, 512), (3, 7)])
def test_running_sum_over_a_runtime_tile_count(kernels, dtype, tiles, cols):
    x = torch.randn(4 * 128, cols).to(dtype)
    out = kernels.running_sum(x, torch.tensor([[tiles]], dtype=torch.int32))
    rows = tiles * 128
    expected = x[:rows].float().cumsum(1).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype is torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[:rows].float(), expected.float(), **tol)
    assert out[rows:].float().isnan().all()  # rows past the runtime count are never written
