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
