"""nki.isa top-8 search and nonzero compaction: max8, nc_find_index8, nc_match_replace8, nonzero_with_count.

All read their inputs as fp32 per partition (free dims flattened) and cast results on write.
Top-8 instructions take 8..16384 elements per partition and produce exactly 8.
"""

from __future__ import annotations

import torch

from . import isa, rules

_TOP8_MIN, _TOP8_MAX = 8, 16384


def _top8_input(api, role, t):
    p, n = rules.operand(api, role, t)
    if not _TOP8_MIN <= n <= _TOP8_MAX:
        rules.fail(api, f"{_TOP8_MIN} <= {role} elements per partition <= {_TOP8_MAX}", n,
                   f"{role} has {n} elements per partition")
    return p, n


def _eight(api, role, t, p):
    pt, nt = rules.operand(api, role, t)
    if pt != p:
        rules.same_partitions(api, role, t, "data", t)
    if nt != 8:
        rules.fail(api, f"{role} has 8 elements per partition", nt, f"{role} has {nt} elements per partition")


def max8(dst, src, name=None):
    """dst[p, :8] = the 8 largest values of src[p] in descending order (VectorE)."""
    api = "nisa.max8"
    p, n = _top8_input(api, "src", src)
    _eight(api, "dst", dst, p)
    isa._write(dst, torch.topk(isa._f32(src), 8, dim=1).values)
    if isa.ACTIVE:
        isa.record("vector", "max8", p * n, isa._bytes(dst, src), n, p, (("dst", dst), ("src", src)))


def _matches(data, vals, reverse):
    """[P, 8] position of the match of each val (-1 if none): duplicated vals take successive occurrences.

    Ascending pairing (reverse=False): the k-th copy of a value among vals takes its k-th
    occurrence in data; reverse=True counts copies from the last slot.
    """
    equal = data[:, None, :] == vals[:, :, None]                     # [P, 8, N]
    same = vals[:, :, None] == vals[:, None, :]                      # [P, 8, 8]
    order = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1) if reverse else torch.tril(
        torch.ones(8, 8, dtype=torch.bool), -1)
    copy_rank = (same & order).sum(-1)                               # earlier (or later) equal slots
    occurrence = equal.long().cumsum(-1) - 1
    chosen = equal & (occurrence == copy_rank[:, :, None])
    found = chosen.any(-1)
    return torch.where(found, chosen.long().argmax(-1), torch.full_like(copy_rank, -1))


def _sentinel(dst):
    if dst.dtype.name not in ("uint16", "uint32"):
        rules.fail("nisa.nc_find_index8", "dst dtype is uint16 or uint32", dst.dtype.name,
                   f"index dst has dtype {dst.dtype.name}")
    return dst.dtype.hi


def nc_find_index8(dst, data, vals, name=None):
    """dst[p, j] = first index of vals[p, j] in data[p] (all-ones if absent)."""
    api = "nisa.nc_find_index8"
    p, n = _top8_input(api, "data", data)
    _eight(api, "vals", vals, p)
    _eight(api, "dst", dst, p)
    positions = _matches(isa._f32(data), isa._f32(vals), reverse=False)
    isa._write(dst, torch.where(positions >= 0, positions, _sentinel(dst)))
    if isa.ACTIVE:
        isa.record("vector", "nc_find_index8", p * n, isa._bytes(dst, data, vals), n, p,
                   (("dst", dst), ("data", data), ("vals", vals)))


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """dst = data with the first match of each of the 8 vals replaced by imm; dst_idx gets the positions."""
    api = "nisa.nc_match_replace8"
    p, n = _top8_input(api, "data", data)
    isa._check_elementwise(api, dst, ("data", data))
    _eight(api, "vals", vals, p)
    values = isa._f32(data)
    positions = _matches(values, isa._f32(vals), reverse=True)
    replaced = values.clone()
    hit = positions >= 0
    rows = torch.arange(p)[:, None].expand(p, 8)
    replaced[rows[hit], positions[hit]] = isa.f32_immediate(imm)
    if dst_idx is not None:
        _eight(api, "dst_idx", dst_idx, p)
        isa._write(dst_idx, torch.where(hit, positions, _sentinel(dst_idx)))
    isa._write(dst, replaced)
    if isa.ACTIVE:
        isa.record("vector", "nc_match_replace8", p * n, isa._bytes(dst, data, vals), n, p,
                   (("dst", dst), ("data", data), ("vals", vals)))


_GPSIMD_CORE_PARTITIONS = 16


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """Per GpSimd core (partitions 0, 16, ..., 112): indices of nonzeros + index_offset, padding, then the count."""
    api = "nisa.nonzero_with_count"
    target = isa.context.current().target
    if target.nc_version < 3:
        rules.fail(api, "nonzero_with_count needs NeuronCore-v3+", target.name, f"not available on {target.name}")
    p, n = rules.operand(api, "src", src, isa._SBUF)
    pd, nd = rules.operand(api, "dst", dst, isa._SBUF)
    if pd != p:
        rules.same_partitions(api, "dst", dst, "src", src)
    if nd != n + 1:
        rules.fail(api, "dst has one more element per partition than src", (nd, n),
                   f"dst has {nd} elements per partition, src {n}")
    if src.dtype.name not in ("float32", "int32") or dst.dtype.name != "int32":
        rules.fail(api, "src float32 / int32, dst int32", (src.dtype.name, dst.dtype.name),
                   f"src is {src.dtype.name}, dst is {dst.dtype.name}")
    first = src.start_partition()
    rows = [r for r in range(p) if (first + r) % _GPSIMD_CORE_PARTITIONS == 0]
    values = isa._flat(src)[rows]
    nonzero = values != 0
    count = nonzero.sum(1)
    # stable order of nonzero positions first, then padding
    order = torch.argsort((~nonzero).to(torch.int8), dim=1, stable=True)
    slot = torch.arange(n)[None, :]
    indices = torch.where(slot < count[:, None], order.to(torch.int64) + int(index_offset), int(padding_val))
    out = isa._flat(dst).to(torch.int64).clone()
    out[rows] = torch.cat([indices, count[:, None]], dim=1)
    isa._write(dst, out)
    if isa.ACTIVE:
        isa.record("gpsimd", "nonzero_with_count", p * n, isa._bytes(dst, src), n, p, (("dst", dst), ("src", src)))


_SNAKE = 16  # topk reads its input as a 16-partition snake


def topk(val_dst, idx_dst, src, n, name=None):
    """Per group of 16 partitions, the K largest of the n bf16 values of its snake (element j at
    partition j % 16, column j // 16), ascending, with their 0-based snake indices (GpSimd).

    Every partition of a group receives the group's K results: the docstring gives the outputs
    [par_dim, K] for a 16-partition snake and leaves the row placement open. Equal values keep
    snake order (the lower index first).
    """
    api = "nisa.topk"
    p, x = rules.operand(api, "src", src, isa._SBUF)
    pv, k = rules.operand(api, "val_dst", val_dst, isa._SBUF)
    pi, ki = rules.operand(api, "idx_dst", idx_dst, isa._SBUF)
    if src.dtype.name != "bfloat16" or val_dst.dtype.name != "bfloat16":
        rules.fail(api, "src and val_dst are bfloat16", (src.dtype.name, val_dst.dtype.name),
                   f"src is {src.dtype.name}, val_dst is {val_dst.dtype.name}")
    if idx_dst.dtype.name != "uint32":
        rules.fail(api, "idx_dst is uint32", idx_dst.dtype.name, f"idx_dst has dtype {idx_dst.dtype.name}")
    if p % _SNAKE:
        rules.fail(api, "partition dim is a multiple of 16", p, f"src has {p} partitions")
    if pv != p or pi != p or ki != k:
        rules.fail(api, "val_dst and idx_dst are [par_dim, K]", (list(val_dst.data.shape), list(idx_dst.data.shape)),
                   f"val_dst {list(val_dst.data.shape)} and idx_dst {list(idx_dst.data.shape)} for src with {p} partitions")
    n = int(n)
    if not 8 <= n < 65536:
        rules.fail(api, "8 <= n < 65536", n, f"n={n}")
    if not 1 <= k < 32768 or k > n:
        rules.fail(api, "1 <= K < 32768 and K <= n", k, f"K={k} with n={n}")
    if x < -(-n // _SNAKE):
        rules.fail(api, "src free dim >= ceil(n / 16)", x, f"src has {x} columns for n={n}")
    groups = p // _SNAKE
    snake = isa._f32(src)[:, :x].reshape(groups, _SNAKE, x).transpose(1, 2).reshape(groups, _SNAKE * x)[:, :n]
    order = torch.sort(snake, dim=1, descending=True, stable=True).indices[:, :k].flip(1)  # ascending
    values = snake.gather(1, order)
    isa._write(val_dst, values.repeat_interleave(_SNAKE, dim=0))
    isa._write(idx_dst, order.repeat_interleave(_SNAKE, dim=0), wrap=True)
    if isa.ACTIVE:
        isa.record("gpsimd", "topk", p * (4 * n + k), isa._bytes(val_dst, idx_dst, src), 4 * n + k, p,
                   (("val_dst", val_dst), ("idx_dst", idx_dst), ("src", src)))


def sequence_bounds(dst, segment_ids, name=None):
    """dst[0, 0, i] / dst[0, 1, i] = start / end (exclusive) index of the segment holding element i of a
    [1, N] tile of segment ids; padding (id 0) gets start N and end -1 (GpSimd; fp32 or int32)."""
    api = "nisa.sequence_bounds"
    p, n = rules.operand(api, "segment_ids", segment_ids, isa._SBUF)
    pd, nd = rules.operand(api, "dst", dst, isa._SBUF)
    for role, t in (("segment_ids", segment_ids), ("dst", dst)):
        if t.dtype.name not in ("float32", "int32"):
            rules.fail(api, f"{role} is float32 or int32", t.dtype.name, f"{role} has dtype {t.dtype.name}")
    if p != 1 or pd != 1 or nd != 2 * n:
        rules.fail(api, "segment_ids is [1, N] and dst [1, 2, N]", (list(segment_ids.data.shape), list(dst.data.shape)),
                   f"segment_ids {list(segment_ids.data.shape)}, dst {list(dst.data.shape)}")
    ids = isa._f32(segment_ids).reshape(n)
    if bool((ids < 0).any()):
        rules.fail(api, "segment ids are non-negative", float(ids.min()), "a segment id is negative")
    index = torch.arange(n, dtype=torch.float32)
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = ids[1:] != ids[:-1]
    run = new_run.long().cumsum(0) - 1                         # run number of every element
    starts = index[new_run]                                    # first index of each run
    ends = torch.cat([starts[1:], torch.tensor([float(n)])])   # one past its last index
    padding = ids == 0
    start = torch.where(padding, torch.tensor(float(n)), starts[run])
    end = torch.where(padding, torch.tensor(-1.0), ends[run])
    isa._write(dst, torch.stack([start, end]).reshape(1, 2 * n))
    if isa.ACTIVE:
        isa.record("gpsimd", "sequence_bounds", n, isa._bytes(dst, segment_ids), n, 1,
                   (("dst", dst), ("segment_ids", segment_ids)))
