"""Random-number instructions (rng, rand2, dropout, set_rng_seed, rand_set_state / rand_get_state, nl.rand,
nl.random_seed, nl.dropout): documented dtypes, engines and targets, determinism per seed, and the statistics
of the streams. Hardware bit patterns are not reproduced (isa_random.py says why), so no test compares them."""

import math

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

from .helpers import on_tiles

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def trn3(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")


def seeded_words(seed, shape=(128, 512), engine=nisa.engine.vector):
    @sim.jit
    def kernel(seed_in):
        s = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=s, src=seed_in)
        nisa.set_rng_seed(s)
        bits = nl.ndarray(shape, nl.uint32)
        nisa.rng(bits, engine=engine)
        out = nl.ndarray(shape, nl.uint32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=bits)
        return out

    return kernel(torch.tensor([[seed]], dtype=torch.int32))


def test_rng_is_deterministic_per_seed_and_differs_between_seeds():
    a, b, c = seeded_words(7), seeded_words(7), seeded_words(8)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.99


def test_rng_words_are_uniform_32_bit_values():
    words = seeded_words(123).to(torch.int64).reshape(-1)
    assert int(words.min()) >= 0 and int(words.max()) < 2 ** 32
    n = words.numel()
    # every bit is set about half the time: 4-sigma bounds for 65536 draws
    for bit in (0, 1, 15, 16, 31):
        ones = ((words >> bit) & 1).sum().item()
        assert abs(ones - n / 2) < 4 * math.sqrt(n / 4), bit
    # 16 equal-width bins: chi-square with 15 degrees of freedom, far below its 0.1% tail (37.7)
    counts = torch.bincount(words >> 28, minlength=16).float()
    chi2 = ((counts - n / 16) ** 2 / (n / 16)).sum().item()
    assert chi2 < 37.7
    # neighbouring elements are uncorrelated
    u = words.double() / 2 ** 32
    corr = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(corr) < 4 / math.sqrt(n)


@pytest.mark.parametrize("name, lo, hi", [("int8", -128, 127), ("uint8", 0, 255), ("int16", -2 ** 15, 2 ** 15 - 1),
                                          ("uint16", 0, 2 ** 16 - 1), ("int32", -2 ** 31, 2 ** 31 - 1)])
def test_rng_truncates_to_the_least_significant_bits(name, lo, hi):
    dtype = getattr(nl, name)
    out = on_tiles(lambda d: nisa.rng(d), (128, 256), dtype)
    values = out.to(torch.int64)
    assert lo <= int(values.min()) and int(values.max()) <= hi
    assert int(values.min()) < lo + (hi - lo) // 8 and int(values.max()) > hi - (hi - lo) // 8  # spans the range
    full = on_tiles(lambda d: nisa.rng(d), (128, 256), nl.uint32).to(torch.int64)
    bits = 8 * dtype.itemsize
    low = full & ((1 << bits) - 1)
    if lo < 0:
        low = torch.where(low >= 1 << (bits - 1), low - (1 << bits), low)
    assert torch.equal(values, low)  # same stream (each launch starts from seed 0), fewer bits


def test_rng_refuses_float_dst_and_gpsimd_psum():
    with pytest.raises(sim.NkiRuleError, match="int8 / int16 / int32"):
        on_tiles(lambda d: nisa.rng(d), (4, 4), nl.float32)
    with pytest.raises(sim.NkiRuleError, match="PSUM|psum"):
        on_tiles(lambda d: nisa.rng(d, engine=nisa.engine.gpsimd), (4, 4), nl.int32, out_buffer=nl.psum)


def test_gpsimd_and_vector_keep_separate_states():
    assert not torch.equal(seeded_words(5, (16, 64), nisa.engine.gpsimd), seeded_words(5, (16, 64)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rand2_is_uniform_between_per_partition_bounds(dtype, trn3):
    lo = torch.linspace(-3, 1, 128).reshape(128, 1)
    hi = lo + torch.linspace(0.5, 4, 128).reshape(128, 1)
    out = on_tiles(lambda d, a, b: nisa.rand2(d, a, b), (128, 1024), sim.dtypes.of_torch(dtype), lo, hi).float()
    assert bool((out >= lo.to(dtype).float() - 1e-6).all()) and bool((out <= hi.to(dtype).float() + 1e-6).all())
    u = (out - lo) / (hi - lo)
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005


def test_rand2_needs_trn3_and_min_below_max(trn3):
    with pytest.raises(sim.NkiRuleError, match="min < max"):
        on_tiles(lambda d: nisa.rand2(d, 1.0, 1.0), (4, 4), nl.float32)


def test_rand2_is_refused_before_trn3():
    with pytest.raises(sim.NkiRuleError, match="NeuronCore-v4"):
        on_tiles(lambda d: nisa.rand2(d, 0.0, 1.0), (4, 4), nl.float32)


@pytest.mark.parametrize("dtype", DTYPES + [torch.int32])
def test_dropout_keeps_or_zeroes_with_the_given_probability(dtype):
    x = (torch.arange(128 * 512).reshape(128, 512) % 7 + 1).to(dtype)
    prob = torch.linspace(0, 1, 128).reshape(128, 1)
    out = on_tiles(lambda d, a, p: nisa.dropout(d, a, p), (128, 512), sim.dtypes.of_torch(dtype), x, prob)
    kept = out != 0
    assert torch.equal(out[kept], x[kept])  # survivors keep their exact value
    dropped = 1 - kept.float().mean(1)
    assert dropped[0] == 0 and dropped[-1] == 1  # prob 0 keeps all, prob 1 drops all
    assert (dropped - prob[:, 0]).abs().max() < 4 * math.sqrt(0.25 / 512)


def test_dropout_scalar_probability_and_dtype_rules():
    x = torch.ones(64, 256)
    out = on_tiles(lambda d, a: nisa.dropout(d, a, 0.25), (64, 256), nl.float32, x)
    assert abs((out == 0).float().mean().item() - 0.25) < 0.02
    with pytest.raises(sim.NkiRuleError, match="dtype"):
        on_tiles(lambda d, a: nisa.dropout(d, a, 0.5), (4, 4), nl.bfloat16, torch.ones(4, 4))


def test_rand_get_state_round_trips_rand_set_state_and_replays_the_stream(trn3):
    seeds = torch.randint(1, 2 ** 31, (32, 6), dtype=torch.int64)

    @sim.jit
    def kernel(seeds_in):
        s = nl.ndarray((32, 6), nl.uint32)
        nisa.dma_copy(dst=s, src=seeds_in)
        nisa.rand_set_state(s)
        back = nl.ndarray((32, 6), nl.uint32)
        nisa.rand_get_state(back)
        first = nl.ndarray((32, 16), nl.uint32)
        nisa.rng(first, engine=nisa.engine.gpsimd)
        nisa.rand_set_state(s)  # the same state again: the same stream
        second = nl.ndarray((32, 16), nl.uint32)
        nisa.rng(second, engine=nisa.engine.gpsimd)
        outs = []
        for t in (back, first, second):
            o = nl.ndarray(t.shape, nl.uint32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=t)
            outs.append(o)
        return tuple(outs)

    back, first, second = kernel(seeds.to(torch.uint32) if hasattr(torch, "uint32") else seeds)
    assert torch.equal(back.to(torch.int64), seeds)
    assert torch.equal(first, second)


def test_rand_state_rules(trn3):
    with pytest.raises(sim.NkiRuleError, match="6 XORWOW state words"):
        on_tiles(lambda d: nisa.rand_get_state(d), (4, 5), nl.uint32)
    with pytest.raises(sim.NkiRuleError, match="uint32"):
        on_tiles(lambda d: nisa.rand_get_state(d), (4, 6), nl.int32)
    on_tiles(lambda d: nisa.rand_get_state(d, engine=nisa.engine.vector), (4, 24), nl.uint32)


def test_vector_rand_state_needs_trn3():
    with pytest.raises(sim.NkiRuleError, match="NeuronCore-v4"):
        on_tiles(lambda d: nisa.rand_get_state(d, engine=nisa.engine.vector), (4, 24), nl.uint32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nl_rand_random_seed_and_dropout(dtype):
    ndt = sim.dtypes.of_torch(dtype)

    @sim.jit
    def kernel(seed_in, x):
        s = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=s, src=seed_in)
        nl.random_seed(s)
        a = nl.rand((128, 256), dtype=ndt)
        xt = nl.load(x)
        d = nl.dropout(xt, 0.5)
        out_a = nl.ndarray((128, 256), ndt, buffer=nl.shared_hbm)
        out_d = nl.ndarray((128, 256), ndt, buffer=nl.shared_hbm)
        nl.store(out_a, a)
        nl.store(out_d, d)
        return out_a, out_d

    seed = torch.tensor([[42]], dtype=torch.int32)
    x = torch.full((128, 256), 3.0).to(dtype)
    a1, d1 = kernel(seed, x)
    a2, d2 = kernel(seed, x)
    assert torch.equal(a1, a2) and torch.equal(d1, d2)
    assert float(a1.min()) >= 0 and float(a1.max()) <= 1 and abs(a1.float().mean().item() - 0.5) < 0.01
    assert set(d1.unique().tolist()) == {0.0, 3.0} and abs((d1 == 0).float().mean().item() - 0.5) < 0.02
