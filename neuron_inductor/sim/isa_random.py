"""nki.isa random numbers: rng, rand2, dropout, set_rng_seed, rand_set_state, rand_get_state.

The engines run XORWOW (Marsaglia 2003; named by the rand2 docstring): per compute lane,
5 state words and a Weyl counter, the 6 uint32 words rand_set_state / rand_get_state move for
GpSimd. VectorE keeps 24 words per lane (rand_set_state's count): the interpreter runs them as
4 XORWOW generators per lane, element i of a partition drawn from generator i % 4.

What cannot match the hardware: which generator feeds which element, how set_rng_seed expands
one 32-bit seed into lane states, and the state before any seed. The interpreter's choices
(splitmix32 expansion of (seed, lane, word), seed 0 at program start) make every stream
deterministic per seed and per program; the values are uniform 32-bit words, so tests can
check determinism and distribution, never hardware bit patterns.
"""

from __future__ import annotations

import torch

from . import context, rules
from .isa_enums import _engine, engine
from .isa_operands import _bytes, _scalar, _write
from .tracing import ACTIVE, record

_MASK = 0xFFFFFFFF
_WEYL = 362437
_WORDS = {"gpsimd": 6, "vector": 24}  # uint32 state words per lane (rand_set_state docstring)
_RNG_DTYPES = frozenset({"int8", "int16", "int32", "uint8", "uint16", "uint32"})


def _splitmix32(x: torch.Tensor) -> torch.Tensor:
    x = (x + 0x9E3779B9) & _MASK
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _MASK
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _MASK
    return x ^ (x >> 16)


def _seeded(seed: int, words: int) -> torch.Tensor:
    """[128, words] int64 lane states from one 32-bit seed; XORWOW needs x..v not all zero."""
    lane = torch.arange(rules.PMAX, dtype=torch.int64)[:, None]
    word = torch.arange(words, dtype=torch.int64)[None, :]
    state = _splitmix32((seed & _MASK) ^ _splitmix32(lane * 64 + word))
    return _nonzero(state)


def _nonzero(state: torch.Tensor) -> torch.Tensor:
    gens = state.reshape(rules.PMAX, -1, 6)
    dead = (gens[..., :5] == 0).all(-1)
    gens[..., 0] = torch.where(dead, torch.ones_like(gens[..., 0]), gens[..., 0])
    return state


def _states(name: str) -> torch.Tensor:
    program = context.current()
    if program.rng_state is None:
        program.rng_state = {}
    state = program.rng_state.get(name)
    if state is None:
        state = program.rng_state[name] = _seeded(0, _WORDS[name])
    return state


def _draw(name: str, p: int, n: int) -> torch.Tensor:
    """[p, n] uniform uint32 words (as int64) from the lanes' XORWOW generators; advances them."""
    state = _states(name)
    gens = state[:p].reshape(p, -1, 6)  # [p, g, 6] view into the program's state
    g = gens.shape[1]
    steps = -(-n // g)
    x, y, z, w, v, d = (gens[..., i].clone() for i in range(6))
    out = torch.empty(p, steps, g, dtype=torch.int64)
    for s in range(steps):
        t = x ^ (x >> 2)
        x, y, z, w = y, z, w, v
        v = (v ^ ((v << 4) & _MASK)) ^ (t ^ ((t << 1) & _MASK))
        d = (d + _WEYL) & _MASK
        out[:, s] = (v + d) & _MASK
    for i, word in enumerate((x, y, z, w, v, d)):
        gens[..., i] = word
    return out.reshape(p, steps * g)[:, :n]


def _uniform01(words: torch.Tensor) -> torch.Tensor:
    """fp32 in [0, 1) from the top 24 bits (exact in fp32)."""
    return (words >> 8).to(torch.float32) * (1.0 / (1 << 24))


def rng(dst, engine=engine.vector, name=None):
    """dst = 32 random bits per element, truncated to dst's integer dtype (its least significant bits)."""
    api = "nisa.rng"
    chosen = _engine(api, engine) or "vector"
    if chosen not in ("vector", "gpsimd"):
        rules.fail(api, "rng runs on the Vector or GpSimd engine", chosen, f"engine={chosen}")
    if chosen == "gpsimd":
        rules.target_version(api, "rng on GpSimd", 3)
    p, n = rules.operand(api, "dst", dst)
    rules.gpsimd_no_psum(api, chosen, dst)
    if dst.dtype.name not in _RNG_DTYPES:
        rules.fail(api, "dst is int8 / int16 / int32 / uint8 / uint16 / uint32", dst.dtype.name,
                   f"dst has dtype {dst.dtype.name}")
    bits = 8 * dst.dtype.itemsize
    words = _draw(chosen, p, n) & ((1 << bits) - 1)
    if dst.dtype.lo < 0:  # signed: the low bits reinterpreted as two's complement
        words = torch.where(words >= 1 << (bits - 1), words - (1 << bits), words)
    _write(dst, words)
    if ACTIVE:
        record(chosen, "rng", p * n, _bytes(dst), n, p, (("dst", dst),))


def rand2(dst, min, max, name=None):  # noqa: A002 (the documented parameter names)
    """dst = uniform fp32 values in [min, max) per element (VectorE, NeuronCore-v4+)."""
    api = "nisa.rand2"
    rules.target_version(api, "rand2", 4)
    p, n = rules.operand(api, "dst", dst)
    rules.vector_operand(api, "min", min, p)
    rules.vector_operand(api, "max", max, p)
    low, high = _scalar(min), _scalar(max)
    if bool((low >= high).any()):
        rules.fail(api, "min < max", (min, max), "rand2 needs min < max")
    _write(dst, low + _uniform01(_draw("vector", p, n)) * (high - low))
    if ACTIVE:
        record("vector", "rand2", p * n, _bytes(dst), n, p, (("dst", dst),))


def dropout(dst, data, prob, name=None):
    """dst = data where a uniform draw >= prob, else 0 (prob: a number or a [P, 1] tile; VectorE)."""
    api = "nisa.dropout"
    p, n = rules.operand(api, "dst", dst)
    pd, nd = rules.operand(api, "data", data)
    if pd != p:
        rules.same_partitions(api, "dst", dst, "data", data)
    if nd != n:
        rules.same_free_size(api, "dst", n, "data", nd)
    rules.same_dtype(api, "dst", dst, "data", data)
    rules.vector_operand(api, "prob", prob, p, require_fp32=data.dtype.kind == "int")
    if getattr(prob, "buffer", None) is not None and prob.dtype.kind != "float":
        rules.fail(api, "prob has a float dtype", prob.dtype.name, f"prob has dtype {prob.dtype.name}")
    keep = _uniform01(_draw("vector", p, n)) >= _scalar(prob)
    values = data.data.reshape(p, n)
    _write(dst, torch.where(keep, values, torch.zeros((), dtype=values.dtype)), wrap=True)
    if ACTIVE:
        record("vector", "dropout", p * n, _bytes(dst, data), n, p, (("dst", dst), ("data", data)))


def set_rng_seed(src_seeds, name=None):
    """Seed the Vector engine's generators from one 32-bit value in a [1, 1] SBUF/PSUM tile."""
    api = "nisa.set_rng_seed"
    rules.operand(api, "src_seeds", src_seeds)
    if list(src_seeds.data.shape) != [1, 1]:
        rules.fail(api, "src_seeds is a [1, 1] tile", list(src_seeds.data.shape),
                   f"src_seeds has shape {list(src_seeds.data.shape)}")
    if src_seeds.dtype.itemsize != 4:
        rules.fail(api, "src_seeds is a 32-bit value", src_seeds.dtype.name, f"src_seeds has dtype {src_seeds.dtype.name}")
    seed = int(src_seeds.data.reshape(-1)[0].to(torch.float64).item()) if src_seeds.dtype.kind == "float" \
        else int(src_seeds.data.reshape(-1)[0].item())
    _states("vector").copy_(_seeded(seed, _WORDS["vector"]))
    if ACTIVE:
        record("vector", "set_rng_seed", 1, _bytes(src_seeds), 1, 1, (("src_seeds", src_seeds),))


def _state_engine(api, engine_arg, tile, role, reading):
    chosen = _engine(api, engine_arg) or "gpsimd"
    if chosen not in _WORDS:
        rules.fail(api, "the PRNG state lives in the GpSimd or Vector engine", chosen, f"engine={chosen}")
    rules.target_version(api, f"{api.split('.')[-1]} on {chosen}", 4 if chosen == "vector" else 3)
    allowed = ("sbuf", "psum") if reading and chosen == "vector" else ("sbuf",)
    rules.on_chip(api, role, tile, allowed)
    p, n = rules.operand(api, role, tile)
    if tile.dtype.name != "uint32":
        rules.fail(api, f"{role} is uint32", tile.dtype.name, f"{role} has dtype {tile.dtype.name}")
    if n != _WORDS[chosen]:
        rules.fail(api, f"{_WORDS[chosen]} XORWOW state words per lane on {chosen}", n,
                   f"{role} has {n} elements per partition")
    return chosen, p, n


def rand_set_state(src_seeds, engine=engine.gpsimd, name=None):
    """Load each lane's PRNG state from the matching partition of a uint32 SBUF tile."""
    api = "nisa.rand_set_state"
    chosen, p, n = _state_engine(api, engine, src_seeds, "src_seeds", reading=False)
    state = _states(chosen)
    state[:p] = src_seeds.data.reshape(p, n).to(torch.int64) & _MASK
    _nonzero(state)
    if ACTIVE:
        record(chosen, "rand_set_state", p * n, _bytes(src_seeds), n, p, (("src_seeds", src_seeds),))


def rand_get_state(dst, engine=engine.gpsimd, name=None):
    """Store each lane's PRNG state into the matching partition of a uint32 tile."""
    api = "nisa.rand_get_state"
    chosen, p, n = _state_engine(api, engine, dst, "dst", reading=True)
    _write(dst, _states(chosen)[:p].clone(), wrap=True)
    if ACTIVE:
        record(chosen, "rand_get_state", p * n, _bytes(dst), n, p, (("dst", dst),))


def uniform(dst) -> None:
    """nl.rand: dst = uniform [0, 1) values from the Vector engine's generators."""
    p, n = rules.operand("nl.rand", "dst", dst)
    _write(dst, _uniform01(_draw("vector", p, n)))
    if ACTIVE:
        record("vector", "rand", p * n, _bytes(dst), n, p, (("dst", dst),))
