"""Consecutive copies of one tile loop as one strided copy.

A tile loop's DMAs copy views of one shape whose offsets step by a constant per iteration: copies
k = 0..n-1 of `src + k * step_src` into `dst + k * step_dst`. Such a run is one copy between views
with a leading dim of n (strides step_dst, step_src). Applied again, a run of runs (the next loop
out) becomes one copy with two more dims, and so on.

The batched copy moves the same elements to the same places, so it gives the same bits, provided
no copy of a run reads what another one writes and no two write the same element: each copy's
source and destination are different tensors (outputs are fresh, and a replay of arguments that
share memory is kept only if it writes none of them), and the batched destination must address
each element once (checked from its strides).

A view here is (owner, sizes, strides, offset, whole), as sim/replay.py records them.
"""

from __future__ import annotations


def batched(copies: list) -> list:
    """`copies` [(dst view, src view)] with every run of a tile loop merged into one copy."""
    while True:
        merged = _merge_runs(copies)
        if len(merged) == len(copies):
            return merged
        copies = merged


def _merge_runs(copies: list) -> list:
    merged, start = [], 0
    while start < len(copies):
        end = _run_end(copies, start)
        merged.append(_merge(copies[start:end]) if end - start > 1 else copies[start])
        start = end
    return merged


def _run_end(copies: list, start: int) -> int:
    """The end of the longest run from `start` that merges into one copy."""
    dst, src = copies[start]
    if dst[0] == src[0] or dst[1] != src[1] or start + 1 == len(copies):
        return start + 1
    step_dst, step_src = copies[start + 1][0][3] - dst[3], copies[start + 1][1][3] - src[3]
    end = start + 1
    while end < len(copies):
        d, s = copies[end]
        k = end - start
        if d[:3] != dst[:3] or s[:3] != src[:3] or d[3] != dst[3] + k * step_dst or s[3] != src[3] + k * step_src:
            break
        end += 1
    if step_dst <= 0 or step_src < 0 or not each_element_once((end - start,) + dst[1], (step_dst,) + dst[2]):
        return start + 1
    return end


def _merge(run: list) -> tuple:
    (dst, src), n = run[0], len(run)
    step_dst, step_src = run[1][0][3] - dst[3], run[1][1][3] - src[3]
    return ((dst[0], (n,) + dst[1], (step_dst,) + dst[2], dst[3], False),
            (src[0], (n,) + src[1], (step_src,) + src[2], src[3], False))


def each_element_once(sizes: tuple, strides: tuple) -> bool:
    """Whether a view addresses no element twice: with its dims ordered by stride, each stride
    steps past everything the smaller ones span (a sufficient test; a view failing it is not merged)."""
    span = 0
    for size, stride in sorted((z for z in zip(sizes, strides) if z[0] > 1), key=lambda z: z[1]):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True
