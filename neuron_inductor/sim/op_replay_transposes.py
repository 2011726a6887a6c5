"""Transposing copies between kept tiles of a replay, routed through a compact scratch.

The interpreter's tiles are partition-major with a wide free dim (a PSUM tile of 2 KiB banks is
[128, 1024] fp32: 4 KiB between partitions), so a transpose (nc_transpose, a DMA transpose) is a
copy_ whose source's innermost elements sit 4 KiB apart. torch walks such a copy in the
destination's order, and every read of a column falls in one cache set: about 5x slower than
copying the same bytes in two steps, source order into a contiguous scratch, then the scratch into
the destination (its strides are the tile's extent, not the bank's).

A copy moves each element as it is (or converts it, element by element, in the second step), so the
route changes no bit. Only copies between plan-time tensors are routed (the views and the scratch
are made once, when planning).
"""

from __future__ import annotations

import torch

from .op_replay_casts import byte_extent

_COPY = torch.ops.aten.copy_.default
MIN_ELEMENTS = 2048   # smaller copies: the extra call costs more than it saves
MIN_STRIDE_BYTES = 1024  # the source's step along the destination's innermost dim


def routed(calls: list, namespace: dict, ref_type) -> list:
    """`calls` with each transposing copy between plan-time tensors as two copies via a scratch."""
    out, count = [], 0
    for call in calls:
        pair = _transposing(call, namespace, ref_type)
        if pair is None:
            out.append(call)
            continue
        dst, src = pair
        order = sorted(range(src.dim()), key=lambda d: -src.stride(d))
        count += 1
        scratch = torch.empty([src.shape[d] for d in order], dtype=src.dtype)
        names = [f"pt{count}_{part}" for part in ("src", "scratch", "view")]
        namespace[names[0]] = src.permute(order)
        namespace[names[1]] = scratch
        namespace[names[2]] = scratch.permute([order.index(d) for d in range(src.dim())])
        make = type(call)
        out.append(make(_COPY, (ref_type(names[1]), ref_type(names[0])), {}, None, ()))
        out.append(make(_COPY, (call.args[0], ref_type(names[2])), {}, None, ()))
    return out


def _transposing(call, namespace: dict, ref_type):
    """(dst, src) of a copy_ worth routing, or None."""
    if call.func is not _COPY or len(call.args) != 2 or call.kwargs:
        return None
    refs = call.args
    if not all(isinstance(r, ref_type) and r.name[0] == "p" and r.name in namespace for r in refs):
        return None
    dst, src = (namespace[r.name] for r in refs)
    if dst.shape != src.shape or dst.numel() < MIN_ELEMENTS or dst.dim() < 2:
        return None
    inner = min(range(dst.dim()), key=lambda d: (dst.stride(d) if dst.shape[d] > 1 else 1 << 62))
    if src.stride(inner) * src.element_size() < MIN_STRIDE_BYTES or src.stride(inner) == min(src.stride()):
        return None
    (storage_d, lo_d, hi_d), (storage_s, lo_s, hi_s) = byte_extent(dst), byte_extent(src)
    if storage_d == storage_s and lo_d < hi_s and lo_s < hi_d:
        return None  # overlapping: the two steps would read what the first wrote
    return dst, src
