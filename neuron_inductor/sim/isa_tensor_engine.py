"""nki.isa TensorE instructions: nc_matmul (fp32 PSUM accumulation) and nc_transpose."""

from __future__ import annotations

import torch

from . import context, dtypes, rules
from . import tensor as tensors
from .errors import NkiError
from .isa_enums import _engine, engine, matmul_perf_mode
from .isa_operands import (_F32, _PSUM, _SBUF, _bytes, _f32, _f32_reused, _flat, _same_storage, _write)
from .tracing import ACTIVE, record


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    """dst[M, N] (PSUM) = stationary[K, M].T @ moving[K, N], fp32 accumulation.

    accumulate: False overwrites, True adds (dst must be fully written), None adds where
    dst was written before and overwrites elsewhere.
    """
    op = "nisa.nc_matmul"
    target = context.current().target
    k, m = rules.operand(op, "stationary", stationary, _SBUF)
    k2, n = rules.operand(op, "moving", moving, _SBUF)
    dst_p, dst_n = rules.operand(op, "dst", dst, _PSUM, psum_banks=None)
    rules.matmul(op, stationary, moving, target, k, m, k2, n, dst_p, dst_n)
    rules.psum_bank(op, "dst", dst, target.matmul_dst_banks)
    if dst.dtype is not dtypes.float32:
        allowed = {"float32", "bfloat16"} if target.nc_version >= 4 else {"float32"}
        rules.matmul_dst_dtype(op, dst, target, allowed | ({stationary.dtype.name} if is_transpose else set()))
    if perf_mode is not matmul_perf_mode.none and perf_mode is not None:
        raise NkiError(f"{op}: perf_mode={perf_mode} is not modelled by the interpreter")
    if tile_position or tile_size:
        _check_tile_position(op, k, m, tile_position, tile_size)

    _accumulate_matmul(op, dst, _f32_reused(stationary).t(), _f32_reused(moving), accumulate)
    if ACTIVE:
        record("tensor", "nc_matmul", 2 * k * m * n, _bytes(stationary, moving, dst), n, k,
               (("dst", dst), ("stationary", stationary), ("moving", moving)))


def _check_tile_position(op, k, m, tile_position, tile_size):
    if len(tile_position) != 2 or len(tile_size) != 2:
        raise NkiError(f"{op}: tile_position and tile_size are (row, column) pairs, got {tile_position}, {tile_size}")
    rows, cols = tile_size
    if k > rows or m > cols or tile_position[0] + rows > rules.PMAX or tile_position[1] + cols > rules.PMAX:
        rules.fail(op, "stationary fits its PE tile inside the 128x128 array", (tile_position, tile_size),
                   f"stationary [{k}, {m}] in PE tile at {tuple(tile_position)} of size {tuple(tile_size)}")


def _accumulate_matmul(op, dst, lhs, rhs, accumulate):
    """dst (PSUM) = lhs @ rhs, or += where the accumulate mode and written state say so."""
    state, mask = (tensors.UNWRITTEN, None) if accumulate is False else tensors.written_state(dst)
    if accumulate is True:
        rules.accumulate_into_written(op, state == tensors.WRITTEN)
    data = dst.data
    in_place = data.dtype is _F32 and dst.dtype is dtypes.float32 and data.dim() == 2
    if state == tensors.WRITTEN and in_place:
        data.addmm_(lhs, rhs)  # fp32 accumulation straight into PSUM
        return
    if state == tensors.UNWRITTEN and in_place and not dst.alloc.readonly and 0 not in data.stride() \
            and not (lhs.requires_grad or rhs.requires_grad or data.requires_grad):
        # straight into PSUM (a zero-step dst pattern, or operands autograd follows: through _write):
        # the GEMM writes the bank view (its row stride as BLAS's ldc), saving a temporary and its
        # copy (~10% of a small matmul)
        if not dst.alloc.placed:
            tensors.place(dst)
        torch.mm(lhs, rhs, out=data)
        tensors.mark_written(dst)
        return
    result = torch.mm(lhs, rhs)
    if state == tensors.UNWRITTEN:
        _write(dst, result)
    elif state == tensors.WRITTEN:
        _write(dst, _f32(dst) + result)
    else:
        _write(dst, torch.where(mask.reshape(result.shape), _f32(dst) + result, result))


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst[F, P] = data[P, F].T (free dims flattened); TensorE writes PSUM, VectorE handles <= 32x32."""
    op = "nisa.nc_transpose"
    chosen = _engine(op, engine)
    if chosen is None:
        chosen = "tensor" if getattr(dst, "buffer", None) is tensors.psum else "vector"
    on_tensor_engine = chosen == "tensor"
    p, f = rules.operand(op, "data", data, _SBUF if on_tensor_engine else rules.ON_CHIP)
    banks = context.current().target.matmul_dst_banks if on_tensor_engine else 1
    dst_p, dst_f = rules.operand(op, "dst", dst, _PSUM if on_tensor_engine else rules.ON_CHIP, banks)
    rules.transpose_limit(op, chosen, p, f)
    if dst_p != f or dst_f != p:
        rules.fail(op, "dst is [data free, data partitions]", list(dst.data.shape),
                   f"dst has shape {list(dst.data.shape)}, expected [{f}, {p}]")
    rules.same_dtype(op, "dst", dst, "data", data)
    values = _flat(data).t()
    if data.alloc is dst.alloc:
        values = values.clone()  # in-place transpose of one allocation
    if _same_storage(dst, data):
        _write(dst, values, wrap=True)  # same dtype: bit-exact
    else:
        _write(dst, values.to(_F32))
    if ACTIVE:
        record(chosen, "nc_transpose", p * f, _bytes(data, dst), p if on_tensor_engine else f, p,
               (("dst", dst), ("data", data)))


