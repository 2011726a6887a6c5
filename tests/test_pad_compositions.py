"""Padding must be invisible in compositions: small programs that place data by position along a
padded dim (cat / stack / split / narrow / index_select / gather / advanced indexing) and then reduce
(sum, mean, amax, softmax), mask (where, causal triu masks) or attend (scaled_dot_product_attention,
causal and not) give eager's results at lengths below a bucket boundary, at it and just above it.

Buckets are "8", so lengths 6, 7 (bucket 8, padded), 8 (no padding) and 9 (bucket 16, padded) cross
a boundary quickly. The graphs run through the real kernels (fallback "allow": ops without a kernel
run on the host). fp32, rtol = atol = 1e-5.

- KV-cache append patterns (Hugging Face's DynamicCache.update is `cat([past, new], dim=-2)`): the
  past dynamic, new of length 1 and of length k; several padded inputs; the padded input first,
  middle or last; cat along a dim that is not padded. Each runs with the length marked dynamic, under
  `dynamic=False` and under `dynamic=True`.
- Random programs (hypothesis): a placement, then a reduction / mask / attention; a few fixed
  examples by default, many under `--runslow`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

OPTIONS = {"buckets": "8", "fallback": "allow"}
LENGTHS = (5, 6, 8, 9)  # dynamic=False runs the first exactly; then below a boundary, at it, just above
BATCH, HEADS, FEATURES = 2, 2, 4


def _close(actual, expected) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


def _compile(fn, mode: str, cache_dir):
    torch._dynamo.reset()
    dynamic = {"marked": None, "dynamic=False": False, "dynamic=True": True}[mode]
    return torch.compile(fn, backend="neuron", dynamic=dynamic, options={**OPTIONS, "cache_dir": str(cache_dir)})


def _check(fn, make: Callable[[int, torch.Generator], dict], padded: dict[str, int], mode: str, lengths,
           cache_dir) -> None:
    """`fn(**make(n))` compiled equals eager at every length; `padded`: input -> its dim of length n
    (marked dynamic in mode "marked")."""
    compiled = _compile(fn, mode, cache_dir)
    for n in lengths:
        inputs = make(n, torch.Generator().manual_seed(n))
        if mode == "marked":
            for name, dim in padded.items():
                torch._dynamo.mark_dynamic(inputs[name], dim)
        expected = fn(**inputs)
        actual = compiled(**inputs)
        for got, want in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)):
            assert got.shape == want.shape, f"length {n}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            try:
                _close(got, want)
            except AssertionError as exc:
                raise AssertionError(f"length {n}: {exc}") from None


def _rand(generator, *shape):
    return torch.randn(*shape, generator=generator)


# -- KV-cache append and cat placements -------------------------------------------------------------

def _cache(n, g, new=1):
    """past keys / values [batch, heads, n, head dim], this step's keys / values and query."""
    shape = (BATCH, HEADS)
    return {"past_k": _rand(g, *shape, n, FEATURES), "past_v": _rand(g, *shape, n, FEATURES),
            "k": _rand(g, *shape, new, FEATURES), "v": _rand(g, *shape, new, FEATURES),
            "q": _rand(g, *shape, new, FEATURES)}


def _seqs(n, g):
    """x, y: [batch, n, features] (padded); a, b: [batch, 1 and 3, features] (static)."""
    return {"x": _rand(g, BATCH, n, FEATURES), "y": _rand(g, BATCH, n, FEATURES),
            "a": _rand(g, BATCH, 1, FEATURES), "b": _rand(g, BATCH, 3, FEATURES)}


@dataclass(frozen=True)
class Pattern:
    fn: Callable
    make: Callable
    padded: dict[str, int]


def _append(past_k, past_v, k, v, q):
    return torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)


def _decode(past_k, past_v, k, v, q):
    keys, values = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
    return F.scaled_dot_product_attention(q, keys, values), keys.sum(-2)


def _prefill_chunk(past_k, past_v, k, v, q):
    """k new queries against past + new keys, each new query sees the past and the new keys up to it."""
    keys, values = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
    new, total = q.shape[-2], keys.shape[-2]
    blocked = torch.ones(new, total, dtype=torch.bool).triu(total - new + 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=~blocked)


CACHE_PADDED = {"past_k": 2, "past_v": 2}
SEQS_PADDED = {"x": 1, "y": 1}
PATTERNS = {
    "kv_append_one": Pattern(_append, _cache, CACHE_PADDED),
    "kv_append_k": Pattern(_append, lambda n, g: _cache(n, g, new=3), CACHE_PADDED),
    "kv_decode_step_sdpa": Pattern(_decode, _cache, CACHE_PADDED),
    "kv_prefill_chunk_masked_sdpa": Pattern(_prefill_chunk, lambda n, g: _cache(n, g, new=3), CACHE_PADDED),
    "padded_first": Pattern(lambda x, y, a, b: (torch.cat([x, a, b], 1), torch.cat([x, a, b], 1).mean(1)), _seqs,
                            {"x": 1}),
    "padded_middle": Pattern(lambda x, y, a, b: (torch.cat([a, x, b], 1), torch.cat([a, x, b], 1).amax(1)), _seqs,
                             {"x": 1}),
    "padded_last": Pattern(lambda x, y, a, b: (torch.cat([a, b, x], 1), torch.cat([a, b, x], 1).softmax(1)), _seqs,
                           {"x": 1}),
    "two_padded": Pattern(lambda x, y, a, b: torch.cat([x, y], 1).cumsum(1), _seqs, SEQS_PADDED),
    "two_padded_around_static": Pattern(lambda x, y, a, b: torch.cat([x, b, y], 1), _seqs, SEQS_PADDED),
    "cat_on_unpadded_dim": Pattern(lambda x, y, a, b: torch.cat([x, y], 2).softmax(1), _seqs, SEQS_PADDED),
    "stack_then_reduce": Pattern(lambda x, y, a, b: torch.stack([x, y], 1).sum(2), _seqs, SEQS_PADDED),
}
MODES = ("marked", "dynamic=False", "dynamic=True")
FAST = {"kv_append_one", "kv_decode_step_sdpa", "padded_last", "cat_on_unpadded_dim"}


def _pattern_params():
    for name in PATTERNS:
        for mode in MODES:
            marks = [] if name in FAST and mode == "marked" else [pytest.mark.slow]
            yield pytest.param(name, mode, marks=marks, id=f"{name}-{mode}")


@pytest.mark.parametrize("name,mode", list(_pattern_params()))
def test_cat_placements_equal_eager(name, mode, tmp_path):
    pattern = PATTERNS[name]
    _check(pattern.fn, pattern.make, pattern.padded, mode, LENGTHS, tmp_path)


# -- random programs ----------------------------------------------------------------------------------

def _programs_inputs(n, g):
    inputs = _seqs(n, g)
    inputs["index"] = torch.randint(0, n, (BATCH, n, FEATURES), generator=g)
    inputs["order"] = torch.randperm(n, generator=g)
    return inputs


PADDED_INPUTS = {"x": 1, "y": 1, "index": 1, "order": 0}

# Placements: [batch, n, features] inputs -> [batch, m, f], m some length derived from n.
PLACEMENTS = {
    "cat(x, a)": lambda i: torch.cat([i["x"], i["a"]], 1),
    "cat(b, x, a)": lambda i: torch.cat([i["b"], i["x"], i["a"]], 1),
    "cat(a, x)": lambda i: torch.cat([i["a"], i["x"]], 1),
    "cat(x, y)": lambda i: torch.cat([i["x"], i["y"]], 1),
    "cat(x, y, dim=2)": lambda i: torch.cat([i["x"], i["y"]], 2),
    "stack(x, y, dim=2).flatten(2)": lambda i: torch.stack([i["x"], i["y"]], 2).flatten(2),
    "stack(x, y, dim=1).flatten(1, 2)": lambda i: torch.stack([i["x"], i["y"]], 1).flatten(1, 2),
    "split(x, [n-2, 2])[1]": lambda i: i["x"].split([i["x"].shape[1] - 2, 2], 1)[1],
    "cat(split(x, [n-2, 2])[::-1])": lambda i: torch.cat(i["x"].split([i["x"].shape[1] - 2, 2], 1)[::-1], 1),
    "narrow(x, 1, 1, n-1)": lambda i: i["x"].narrow(1, 1, i["x"].shape[1] - 1),
    "narrow(x, 1, n-3, 3)": lambda i: i["x"].narrow(1, i["x"].shape[1] - 3, 3),
    "index_select(x, reversed positions)": lambda i: i["x"].index_select(1, torch.arange(i["x"].shape[1] - 1, -1, -1)),
    "gather(x, index)": lambda i: i["x"].gather(1, i["index"]),
    "x[:, order]": lambda i: i["x"][:, i["order"]],
    "x[:, [0, -1]]": lambda i: i["x"][:, torch.tensor([0, -1])],
    "x": lambda i: i["x"],
}


def _causal_scores(t):
    m = t.shape[1]
    scores = t @ t.transpose(1, 2) / math.sqrt(t.shape[-1])
    blocked = torch.ones(m, m, dtype=torch.bool).triu(1)
    return scores.masked_fill(blocked, -math.inf).softmax(-1) @ t


# Reductions, masks and attention over [batch, m, f].
FINISHERS = {
    "sum(1)": lambda t: t.sum(1),
    "mean(1)": lambda t: t.mean(1),
    "amax(1)": lambda t: t.amax(1),
    "softmax(1)": lambda t: t.softmax(1),
    "sum(-1)": lambda t: t.sum(-1),
    "where(t > 0, t, t / 2).sum(1)": lambda t: torch.where(t > 0, t, t / 2).sum(1),
    "causal triu mask": _causal_scores,
    "sdpa": lambda t: F.scaled_dot_product_attention(t[:, None], t[:, None], t[:, None])[:, 0],
    "sdpa causal": lambda t: F.scaled_dot_product_attention(t[:, None], t[:, None], t[:, None], is_causal=True)[:, 0],
    "sdpa last query": lambda t: F.scaled_dot_product_attention(t[:, None, -1:], t[:, None], t[:, None])[:, 0],
    "identity": lambda t: t,
}

def _program(placement: str, finisher: str):
    place, finish = PLACEMENTS[placement], FINISHERS[finisher]

    def program(**inputs):
        return finish(place(inputs))

    return program


PROGRAMS = st.tuples(st.sampled_from(sorted(PLACEMENTS)), st.sampled_from(sorted(FINISHERS)))
AROUND_BOUNDARIES = st.lists(st.sampled_from([6, 7, 8, 9, 15, 16, 17]), min_size=3, max_size=3, unique=True)


def _check_program(spec, lengths, cache_dir) -> None:
    _check(_program(*spec), _programs_inputs, PADDED_INPUTS, "marked", sorted(lengths), cache_dir)


# No shrinking: a program is two steps already, and each shrink step compiles anew.
QUICK = dict(deadline=None, phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
             suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=4, derandomize=True, **QUICK)
@given(spec=PROGRAMS, lengths=AROUND_BOUNDARIES)
# found by the slow tier: causal attention over x and y's rows stacked into one padded sequence
@example(spec=("stack(x, y, dim=1).flatten(1, 2)", "sdpa causal"), lengths=[6, 16, 9])
def test_random_program_equals_eager(spec, lengths, tmp_path):
    _check_program(spec, lengths, tmp_path)


@pytest.mark.slow
@settings(max_examples=60, **QUICK)
@given(spec=PROGRAMS, lengths=AROUND_BOUNDARIES)
def test_many_random_programs_equal_eager(spec, lengths, tmp_path):
    _check_program(spec, lengths, tmp_path)
