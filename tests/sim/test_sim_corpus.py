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


def _scatter_inputs(dtype, rows=48, hidden=40):
    values = torch.randn(2 * rows, hidden).to(dtype)
    destinations = torch.randperm(2 * rows).to(torch.int32)  # every row written once, by either core
    expected = torch.empty_like(values)
    expected[destinations.long()] = values
    return values, destinations, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("barrier", [False, True])
def test_cores_zeroing_then_scattering_interleave_as_on_hardware(kernels, dtype, barrier):
    """Both cores start together: both zero their halves before either scatters (no barrier needed when
    they run the same instruction stream), as hardware does; a run of program 0 to its end before
    program 1 starts would let core 1's zeroing wipe core 0's scatter into its half."""
    values, destinations, expected = _scatter_inputs(dtype)
    assert torch.equal(kernels.sharded_init_then_scatter[2](values, destinations, barrier=barrier), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_late_core_wipes_the_other_cores_scatter_without_a_barrier(kernels, dtype):
    values, destinations, expected = _scatter_inputs(dtype)
    rows = values.shape[0] // 2
    raced = kernels.sharded_init_then_scatter[2](values, destinations, late_core_loads=2)
    lost = destinations[:rows].long()  # core 0's rows that land in core 1's half were zeroed after they landed
    lost = lost[lost >= rows]
    assert 0 < len(lost) < rows
    wiped = expected.clone()
    wiped[lost] = 0
    assert torch.equal(raced, wiped)
    assert torch.equal(kernels.sharded_init_then_scatter[2](values, destinations, barrier=True, late_core_loads=2),
                       expected)


def test_one_core_per_logical_core_runs_the_programs_one_after_another(kernels, monkeypatch):
    """trn1 has no LNC: its cost model puts both programs on one core, and they run in sequence there
    (program 1's zeroing comes after program 0's scatter)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    values, destinations, expected = _scatter_inputs(torch.float32)
    rows = values.shape[0] // 2
    lost = destinations[:rows].long()
    expected[lost[lost >= rows]] = 0
    assert torch.equal(kernels.sharded_init_then_scatter[2](values, destinations), expected)
