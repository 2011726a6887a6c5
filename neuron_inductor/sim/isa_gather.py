"""nki.isa data movement inside SBUF: nc_stream_shuffle, local_gather, nc_n_gather,
tensor_partition_reduce, tensor_copy_predicated. All move values bit-exactly (no dtype casts)
except tensor_partition_reduce, which computes in fp32 (int64 for integer bitvec ops)."""

from __future__ import annotations

import torch

from . import isa, rules

_QUADRANT = 32
_KEEP = 255  # shuffle_mask value: leave the output partition unmodified
_GPSIMD_CORE = 16


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """In every 32-partition quadrant, dst[i] = src[shuffle_mask[i]] (255: dst[i] unchanged)."""
    api = "nisa.nc_stream_shuffle"
    ps, ns = rules.operand(api, "src", src)
    pd, nd = rules.operand(api, "dst", dst)
    rules.same_dtype(api, "dst", dst, "src", src)
    rules.same_free_size(api, "dst", nd, "src", ns)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != _QUADRANT or any(not (0 <= m < _QUADRANT or m == _KEEP) for m in mask):
        rules.fail(api, "shuffle_mask is 32 source partitions in [0, 32) or 255", mask, f"shuffle_mask={mask}")
    active = -(-max(ps, pd) // _QUADRANT) * _QUADRANT
    legal = rules.legal_start_partitions(active)
    for role, t in (("src", src), ("dst", dst)):
        if t.start_partition() not in legal:
            rules.fail(api, f"start partition in {legal} for {active} active partitions", t.start_partition(),
                       f"{role} starts at partition {t.start_partition()}")
    values = isa._flat(src).clone()
    out = isa._flat(dst).clone()
    for row in range(pd):
        source = mask[row % _QUADRANT]
        if source == _KEEP:
            continue
        source += row - row % _QUADRANT
        if source >= ps:
            rules.fail(api, "shuffle sources lie inside src", source, f"dst partition {row} reads src partition {source}")
        out[row] = values[source]
    isa._write(dst, out, wrap=True)
    if isa.ACTIVE:
        isa.record("vector", "nc_stream_shuffle", pd * nd, isa._bytes(dst, src), nd, pd, (("dst", dst), ("src", src)))


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Per GpSimd core (16 partitions): its uint16 indices (flattened partition-major) are element offsets;
    every partition of the core reads num_elem_per_idx elements at each offset of its own data."""
    api = "nisa.local_gather"
    p, n = rules.operand(api, "src_buffer", src_buffer, isa._SBUF)
    pi, ni = rules.operand(api, "index", index, isa._SBUF)
    pd, nd = rules.operand(api, "dst", dst, isa._SBUF)
    if pi != p or p % _GPSIMD_CORE:
        rules.fail(api, "src_buffer and index have the same partitions, a multiple of 16", (p, pi),
                   f"src_buffer has {p} partitions, index {pi}")
    if index.dtype.name != "uint16":
        rules.fail(api, "index is uint16", index.dtype.name, f"index has dtype {index.dtype.name}")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        rules.fail(api, "num_elem_per_idx in 1, 2, 4, 8, 16, 32", num_elem_per_idx, f"num_elem_per_idx={num_elem_per_idx}")
    per_core = _GPSIMD_CORE * ni
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < valid <= min(per_core, 4096):
        rules.fail(api, "num_valid_indices <= indices per core (and <= 4096)", valid, f"num_valid_indices={valid}")
    rules.same_dtype(api, "dst", dst, "src_buffer", src_buffer)
    if pd != p or nd != valid * num_elem_per_idx:
        rules.fail(api, "dst is [P, num_valid_indices * num_elem_per_idx]", (pd, nd),
                   f"dst has {pd} x {nd}, expected {p} x {valid * num_elem_per_idx}")
    data, offsets = isa._flat(src_buffer), isa._i64(index)
    span = torch.arange(num_elem_per_idx)
    out = torch.empty((p, nd), dtype=data.dtype)
    for core in range(p // _GPSIMD_CORE):
        rows = slice(core * _GPSIMD_CORE, (core + 1) * _GPSIMD_CORE)
        starts = offsets[rows].t().reshape(-1)[:valid]  # partition dim first
        columns = (starts[:, None] + span[None, :]).reshape(-1)
        if int(columns.max()) >= n:
            raise isa.NkiError(f"{api}: index {int(columns.max())} is outside the {n} elements per partition "
                               "(undefined on the hardware)")
        out[rows] = data[rows][:, columns]
    isa._write(dst, out, wrap=True)
    if isa.ACTIVE:
        isa.record("gpsimd", "local_gather", p * nd, isa._bytes(dst, src_buffer, index), nd, p,
                   (("dst", dst), ("src_buffer", src_buffer), ("index", index)))


def nc_n_gather(dst, data, indices, name=None):
    """dst[p, j] = data[p, indices[p, j]] over the flattened free dims of data (uint32 indices)."""
    api = "nisa.nc_n_gather"
    p, n = rules.operand(api, "data", data, isa._SBUF)
    isa._check_elementwise(api, dst, ("indices", indices))
    rules.operand(api, "dst", dst, isa._SBUF)
    rules.operand(api, "indices", indices, isa._SBUF)
    if rules.operand(api, "dst", dst)[0] != p:
        rules.same_partitions(api, "dst", dst, "data", data)
    rules.same_dtype(api, "dst", dst, "data", data)
    if indices.dtype.name != "uint32":
        rules.fail(api, "indices are uint32", indices.dtype.name, f"indices have dtype {indices.dtype.name}")
    where = isa._i64(indices)
    if bool(((where < 0) | (where >= n)).any()):
        rules.fail(api, "indices in [0, elements per partition of data)", int(where.max()),
                   f"an index is outside [0, {n})")
    isa._write(dst, torch.gather(isa._flat(data), 1, where), wrap=True)
    if isa.ACTIVE:
        nd = where.shape[1]
        isa.record("gpsimd", "nc_n_gather", p * nd, isa._bytes(dst, data, indices), nd, p,
                   (("dst", dst), ("data", data), ("indices", indices)))


_PARTITION_REDUCE = {"add": lambda x: x.sum(0), "maximum": lambda x: x.amax(0), "max": lambda x: x.amax(0),
                     "minimum": lambda x: x.amin(0), "min": lambda x: x.amin(0)}
_PARTITION_BITVEC = {"bitwise_or": torch.bitwise_or, "bitwise_and": torch.bitwise_and}


def tensor_partition_reduce(dst, op, data, name=None):
    """dst[1, F] = op-reduction of data over its partitions (GpSimd)."""
    api = "nisa.tensor_partition_reduce"
    p, n = rules.operand(api, "data", data, isa._SBUF)
    pd, nd = rules.operand(api, "dst", dst, isa._SBUF)
    if pd != 1 or nd != n:
        rules.fail(api, "dst is [1, data free size]", (pd, nd), f"dst has {pd} x {nd}, expected 1 x {n}")
    name_of = getattr(op, "name", None)
    if name_of in _PARTITION_BITVEC:
        rules.integer_dtypes(api, name_of, dst, data)
        values = isa._i64(data)
        result = values[0]
        for row in values[1:]:
            result = _PARTITION_BITVEC[name_of](result, row)
        isa._write(dst, result.reshape(1, n), wrap=True)
    elif name_of in _PARTITION_REDUCE:
        isa._write(dst, _PARTITION_REDUCE[name_of](isa._f32(data)).reshape(1, n))
    else:
        rules.fail(api, "op is add / maximum / minimum / bitwise_or / bitwise_and", op, f"op={op!r}")
    if isa.ACTIVE:
        isa.record("gpsimd", "tensor_partition_reduce", p * n, isa._bytes(dst, data), n, p, (("dst", dst), ("data", data)))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """dst = src where predicate != 0 (== 0 with reverse_pred); elsewhere dst is unchanged (VectorE)."""
    api = "nisa.tensor_copy_predicated"
    tiles = [("predicate", predicate)] + ([("src", src)] if getattr(src, "buffer", None) is not None else [])
    p, n = isa._check_elementwise(api, dst, *tiles)
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        rules.fail(api, "predicate is uint8 / uint16 / uint32", predicate.dtype.name,
                   f"predicate has dtype {predicate.dtype.name}")
    if len(tiles) == 2:
        rules.not_both_psum(api, src, predicate)
        rules.same_dtype(api, "dst", dst, "src", src)
        values = isa._flat(src)
    else:
        values = isa.f32_immediate(src)
    take = isa._i64(predicate) != 0
    if reverse_pred:
        take = ~take
    current = isa._flat(dst)
    if len(tiles) == 2:
        isa._write(dst, torch.where(take, values, current), wrap=True)
    else:
        isa._write(dst, torch.where(take, values, current.to(torch.float32)))
    if isa.ACTIVE:
        isa.record("vector", "tensor_copy_predicated", p * n, isa._bytes(dst, src, predicate), n, p,
                   (("dst", dst), ("predicate", predicate)))
