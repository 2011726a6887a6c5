"""Transposing copies into or between kept tiles of a replay, routed through a compact scratch.

The interpreter's tiles are partition-major with a wide free dim (a PSUM tile of 2 KiB banks is
[128, 1024] fp32: 4 KiB between partitions), so a transpose (nc_transpose, a DMA transpose) is a
copy_ whose source's innermost elements sit 4 KiB apart. torch walks such a copy in the
destination's order, and every read of a column falls in one cache set: about 5x slower than
copying the same bytes in two steps, source order into a contiguous scratch, then the scratch into
the destination (its strides are the tile's extent, not the bank's).

The same holds for a transposing load out of an argument (`dma_transpose` of an HBM activation
[tokens, d] into a [d, tokens] panel: the rows of d = 1024 bf16 are 2 KiB apart, 2.5x slower
direct). An argument's rows are as far apart as the model's dims make them, and only a multiple
of 2 KiB puts a column's reads into few cache sets: other steps (5632 B for d = 2816) copy as fast
directly, so only those are routed.

A copy moves each element as it is (or converts it, element by element, in the second step), so the
route changes no bit. Only copies into a plan-time tensor are routed (the scratch is made once, when
planning), from another plan-time tensor or from a view of an argument whose layout the recording
fixed (its source-order view is made at run time, as the view it replaces was).
"""

from __future__ import annotations

import torch

from .op_replay_casts import byte_extent
from .op_replay_refs import Ref

_COPY = torch.ops.aten.copy_.default
_AS_STRIDED = torch.ops.aten.as_strided.default
MIN_ELEMENTS = 2048   # smaller copies: the extra call costs more than it saves
MIN_STRIDE_BYTES = 1024  # the source's step along the destination's innermost dim
ARGUMENT_ALIASING_BYTES = 2048  # an argument's step must be a multiple of this (see above)


def routed(calls: list, namespace: dict, layouts: dict) -> list:
    """`calls` with each transposing copy into a plan-time tensor as two copies via a scratch.
    `layouts`: the recording's {name: (root, shape, strides, offset, dtype)}; the source-order
    views of arguments made here are added to it."""
    out, count = [], 0
    for call in calls:
        src = _transposing(call, namespace, layouts)
        if src is None:
            out.append(call)
            continue
        order = sorted(range(src.dim()), key=lambda d: -src.stride(d))
        count += 1
        scratch = torch.empty([src.shape[d] for d in order], dtype=src.dtype)
        names = [f"pt{count}_{part}" for part in ("src", "scratch", "view")]
        namespace[names[1]] = scratch
        namespace[names[2]] = scratch.permute([order.index(d) for d in range(src.dim())])
        make = type(call)
        if src.is_meta:  # a view of an argument
            root, _, _, offset, dtype = layouts[call.args[1].name]
            names[0] = f"vt{count}"
            sizes, strides = tuple(src.shape[d] for d in order), tuple(src.stride(d) for d in order)
            layouts[names[0]] = (root, sizes, strides, offset, dtype)
            out.append(make(_AS_STRIDED, (Ref(root), sizes, strides, offset), {}, Ref(names[0]),
                            (names[0],)))
        else:
            namespace[names[0]] = src.permute(order)
        out.append(make(_COPY, (Ref(names[1]), Ref(names[0])), {}, None, ()))
        out.append(make(_COPY, (call.args[0], Ref(names[2])), {}, None, ()))
    return out


def _transposing(call, namespace: dict, layouts: dict):
    """The source of a copy_ worth routing (a meta tensor of its layout if it views an argument),
    or None."""
    if call.func is not _COPY or len(call.args) != 2 or call.kwargs:
        return None
    dst_ref, src_ref = call.args
    if not all(isinstance(r, Ref) for r in call.args) or not _kept(dst_ref, namespace):
        return None
    dst = namespace[dst_ref.name]
    src = namespace[src_ref.name] if _kept(src_ref, namespace) else _argument_view(src_ref.name, layouts)
    if src is None or dst.shape != src.shape or dst.numel() < MIN_ELEMENTS or dst.dim() < 2:
        return None
    inner = min(range(dst.dim()), key=lambda d: (dst.stride(d) if dst.shape[d] > 1 else 1 << 62))
    step = src.stride(inner) * src.element_size()
    if step < MIN_STRIDE_BYTES or src.stride(inner) == min(src.stride()):
        return None
    if src.is_meta:
        return src if step % ARGUMENT_ALIASING_BYTES == 0 else None  # (an argument is no kept tile)
    (storage_d, lo_d, hi_d), (storage_s, lo_s, hi_s) = byte_extent(dst), byte_extent(src)
    if storage_d == storage_s and lo_d < hi_s and lo_s < hi_d:
        return None  # overlapping: the two steps would read what the first wrote
    return src


def _kept(ref, namespace: dict) -> bool:
    return ref.name[0] == "p" and isinstance(namespace.get(ref.name), torch.Tensor)


def _argument_view(name: str, layouts: dict):
    """A meta tensor with the layout of `name`, an argument or a view of one made by one as_strided of
    it (same dtype), or None."""
    layout = layouts.get(name)
    if layout is None or layout[0][0] != "a" or layouts[layout[0]][4] is not layout[4]:
        return None
    _, shape, strides, _, dtype = layout
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")
