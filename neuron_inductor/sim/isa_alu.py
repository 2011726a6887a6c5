"""nki.isa Vector / GpSimd ALU instructions: tensor_tensor, tensor_scalar, scalar_tensor_tensor,
tensor_reduce, tensor_copy, reciprocal, and the GpSimd pattern fills iota, affine_select, memset."""

from __future__ import annotations

import torch

from . import dtypes, rules
from . import tensor as tensors
from .isa_enums import _engine, engine
from .isa_operands import (_F32, _I64, _NEEDS_CAST, _SBUF, _bytes, _check_elementwise, _copy_exact, _f32, _i64,
                           _is_int, _same_storage, _scalar, _write, f32_immediate)
from .ops import ALU_KINDS, ALU_UNARY, OPS
from .tracing import ACTIVE, record


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = data1 <op> data2, elementwise."""
    api = "nisa.tensor_tensor"
    rules.alu_op(api, "op", op, ALU_KINDS)
    p, n = _check_elementwise(api, dst, ("data1", data1), ("data2", data2))
    rules.not_both_psum(api, data1, data2)
    integer = dst.dtype.kind == "int" and data1.dtype.kind == "int" and data2.dtype.kind == "int"
    if op.kind == "bitvec":
        rules.integer_dtypes(api, op.name, dst, data1, data2)
    chosen = _engine(api, engine)
    if chosen is None:
        all_int32 = dst.dtype is data1.dtype is data2.dtype is dtypes.int32
        chosen = "gpsimd" if all_int32 or op.name == "power" else "vector"
    rules.gpsimd_no_psum(api, chosen, dst, data1, data2)

    if integer and op.int_fn is not None:
        _write(dst, op.int_fn(_i64(data1), _i64(data2)), wrap=op.kind == "bitvec")
    else:
        _write(dst, op.fn(_f32(data1), _f32(data2)))
    if ACTIVE:
        record(chosen, "tensor_tensor", p * n, _bytes(dst, data1, data2), n, p,
               (("dst", dst), ("data1", data1), ("data2", data2)))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """dst = (data <op0> operand0) <op1> operand1; operands are numbers or fp32 [P, 1] tiles."""
    api = "nisa.tensor_scalar"
    _scalar_op(api, "op0", op0, operand0)
    if op1 is not None:
        _scalar_op(api, "op1", op1, operand1)
    rules.same_op_family(api, op0, op1)
    p, n = _check_elementwise(api, dst, ("data", data))
    bitvec = op0.kind == "bitvec"
    for role, o, a in (("operand0", op0, operand0), ("operand1", op1, operand1)):
        if o is not None and o.name not in ALU_UNARY:
            rules.vector_operand(api, role, a, p, require_fp32=not bitvec)
    chosen = _engine(api, engine) or "vector"
    if bitvec:
        rules.integer_dtypes(api, op0.name, dst, data)
        if chosen != "vector":
            rules.fail(api, "bitvec tensor_scalar runs on the Vector engine", chosen, f"engine={chosen}")
    if chosen == "scalar":
        rules.scalar_engine_ops(api, op0, op1)
    elif chosen == "gpsimd":
        rules.gpsimd_tensor_scalar(api, op0, op1)
    rules.gpsimd_no_psum(api, chosen, dst, data, operand0, operand1)

    # Arithmetic operators cast data to float32 and compute in float32, integer tiles included
    # (nki.isa.tensor_scalar docstring); only bitvec operators see the integer bits.
    integer = bitvec and _is_int(operand0) and (op1 is None or _is_int(operand1))
    if bitvec and not integer:
        rules.fail(api, "bitvec ops need integer dtypes", (operand0, operand1), "bitvec operands must be integers")
    values = _apply_scalar_ops(data, op0, operand0, reverse0, op1, operand1, reverse1, integer)
    _write(dst, values, wrap=bitvec)
    if ACTIVE:
        record(chosen, "tensor_scalar", p * n, _bytes(dst, data, operand0, operand1), n, p,
               (("dst", dst), ("data", data), ("operand0", operand0), ("operand1", operand1)))


def _scalar_op(api, role, nki_op, operand):
    """tensor_scalar operators: binary ALU operators, or the unary ALU operators with operand None / 0."""
    if getattr(nki_op, "name", None) in ALU_UNARY:
        rules.alu_unary_operand(api, role.replace("op", "operand"), nki_op, operand)
    else:
        rules.alu_op(api, role, nki_op, ALU_KINDS)


def _apply_scalar_ops(data, op0, operand0, reverse0, op1, operand1, reverse1, integer):
    x = _i64(data) if integer else _f32(data)
    x = _apply_scalar_op(x, op0, operand0, reverse0, integer)
    if op1 is not None:
        x = _apply_scalar_op(x, op1, operand1, reverse1, integer)
    return x


def _apply_scalar_op(x, nki_op, operand, reverse, integer):
    if nki_op.name in ALU_UNARY:
        return nki_op.fn(x)
    fn = nki_op.int_fn if integer else nki_op.fn
    a = _scalar(operand, integer)
    return fn(a, x) if reverse else fn(x, a)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """dst = (data <op0> operand0) <op1> operand1, operand0 a number / [P, 1] tile, operand1 a tile."""
    api = "nisa.scalar_tensor_tensor"
    rules.alu_op(api, "op0", op0, ALU_KINDS - {"bitvec"})
    rules.alu_op(api, "op1", op1, ALU_KINDS - {"bitvec"})
    p, n = _check_elementwise(api, dst, ("data", data), ("operand1", operand1))
    rules.not_both_psum(api, data, operand1)
    # "All input tiles can be any supported NKI data type" (unlike tensor_scalar's fp32 operands)
    rules.vector_operand(api, "operand0", operand0, p, require_fp32=False)
    x = _apply_scalar_ops(data, op0, operand0, reverse0, None, None, False, False)
    y = _f32(operand1)
    _write(dst, op1.fn(y, x) if reverse1 else op1.fn(x, y))
    if ACTIVE:
        record("vector", "scalar_tensor_tensor", 2 * p * n, _bytes(dst, data, operand0, operand1), n, p,
               (("dst", dst), ("data", data), ("operand0", operand0), ("operand1", operand1)))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """dst = op-reduction of data over `axis` (trailing contiguous free axes), times -1 if negate."""
    api = "nisa.tensor_reduce"
    rules.reduce_op(api, op)
    pd, nd = rules.operand(api, "dst", dst)
    p, n = rules.operand(api, "data", data)
    shape = data.data.shape
    first = rules.reduce_axes(api, axis, len(shape))
    if pd != p:
        rules.same_partitions(api, "dst", dst, "data", data)
    reduced = 1
    for s in shape[first:]:
        reduced *= s
    kept_free = n // reduced
    if nd != kept_free:
        rules.same_free_size(api, "dst", nd, "reduced data", kept_free)
    integer = data.dtype.kind == "int" and dst.dtype.kind == "int"
    values = data.data
    if len(shape) != first + 1:
        values = values.reshape(*shape[:first], reduced)
    result = op.reduce(values.to(_I64 if integer else _F32), -1)
    if negate:
        result = -result
    _write(dst, result if first == 1 else result.reshape(p, kept_free))
    if ACTIVE:
        record("vector", "tensor_reduce", p * n, _bytes(dst, data), n, p, (("dst", dst), ("data", data)))


def tensor_copy(dst, src, engine=engine.unknown, dtype=None, name=None):
    """dst = src (bit-exact for equal dtypes, else via fp32); `dtype=` rounds through that dtype first."""
    api = "nisa.tensor_copy"
    p, n = _check_elementwise(api, dst, ("src", src))
    chosen = _engine(api, engine) or "vector"
    rules.gpsimd_no_psum(api, chosen, dst, src)
    through = None if dtype is None else dtypes.as_dtype(dtype)
    if through is None and _same_storage(dst, src):
        _copy_exact(dst, src)
    elif dst.dtype.kind == "int" and src.dtype.kind == "int" and through is None:
        _write(dst, _i64(src))
    else:
        values = _f32(src)
        if through is not None and through is not dst.dtype:
            values = _round_through(values, through)
        _write(dst, values)
    if ACTIVE:
        record(chosen, "tensor_copy", p * n, _bytes(dst, src), n, p, (("dst", dst), ("src", src)))


def _round_through(values, dtype):
    storage = dtype.storage
    return dtypes.cast_for_store(values, dtype, storage).to(storage).to(_F32)


def reciprocal(dst, data, name=None):
    """dst = 1 / data on VectorE."""
    api = "nisa.reciprocal"
    p, n = _check_elementwise(api, dst, ("data", data))
    _write(dst, torch.reciprocal(_f32(data)))
    if ACTIVE:
        record("vector", "reciprocal", p * n, _bytes(dst, data), n, p, (("dst", dst), ("data", data)))


# ---------------------------------------------------------------------------- GpSimd / fills

def _affine_values(api, partitions, pattern, offset, channel_multiplier, dtype=_I64):
    """offset + p * channel_multiplier + sum(step * index) over a <= 4-d [[step, num], ...] pattern."""
    if len(pattern) > 4:
        rules.fail(api, "at most 4 free dims in an access pattern", len(pattern), f"pattern has {len(pattern)} dims")
    free = torch.zeros(1, dtype=dtype)
    for step, num in pattern:
        free = (free[:, None] + step * torch.arange(num, dtype=dtype)[None, :]).reshape(-1)
    rows = offset + channel_multiplier * torch.arange(partitions, dtype=dtype)[:, None]
    return rows + free[None, :]


# fp32 holds every integer of magnitude below 2**24 exactly
_F32_EXACT_INTEGERS = 2 ** 24


def _exact_in_f32(partitions, pattern, offset, channel_multiplier) -> bool:
    """Whether every value and partial sum of an integer affine pattern stays below 2**24 in magnitude
    (and inside int32, so the engine's int32 result is the exact integer)."""
    terms = [offset, channel_multiplier] + [v for entry in pattern for v in entry]
    if not all(type(v) is int for v in terms):
        return False
    bound = abs(offset) + abs(channel_multiplier) * (partitions - 1) + sum(abs(step) * (num - 1) for step, num in pattern)
    return bound < _F32_EXACT_INTEGERS


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum(step_j * i_j), computed as int32."""
    api = "nisa.iota"
    p, n = rules.operand(api, "dst", dst, _SBUF)
    if dst.dtype.kind != "int" and len(pattern) <= 4 and _exact_in_f32(p, pattern, offset, channel_multiplier):
        # the same integers made in fp32 directly: no int64 sums and two casts of the whole tile
        values = _affine_values(api, p, pattern, offset, channel_multiplier, _F32)
        rules.same_free_size(api, "dst", n, "pattern", values.shape[1])
        _write(dst, values)
    else:
        values = _affine_values(api, p, pattern, offset, channel_multiplier)
        rules.same_free_size(api, "dst", n, "pattern", values.shape[1])
        values = values.to(torch.int32)  # the engine produces int32
        _write(dst, values.to(_I64) if dst.dtype.kind == "int" else values.to(_F32))
    if ACTIVE:
        record("gpsimd", "iota", p * n, _bytes(dst), n, p, (("dst", dst),))


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None):
    """dst = on_true_tile where cmp_op(affine value, 0), else on_false_value (causal masks)."""
    api = "nisa.affine_select"
    cmp_op = OPS["equal"] if cmp_op is None else cmp_op
    rules.alu_op(api, "cmp_op", cmp_op, {"compare"})
    rules.on_chip(api, "dst", dst, ("sbuf",))
    p, n = _check_elementwise(api, dst, ("on_true_tile", on_true_tile))
    rules.gpsimd_no_psum(api, "gpsimd", on_true_tile)
    values = _affine_values(api, p, pattern, offset, channel_multiplier)
    rules.same_free_size(api, "dst", n, "pattern", values.shape[1])
    keep = cmp_op.fn(values.to(_F32), torch.scalar_tensor(0.0)) != 0
    _write(dst, torch.where(keep, _f32(on_true_tile), f32_immediate(on_false_value)))
    if ACTIVE:
        record("gpsimd", "affine_select", p * n, _bytes(dst, on_true_tile), n, p,
               (("dst", dst), ("on_true_tile", on_true_tile)))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill dst with `value` (GpSimd by default, VectorE for PSUM)."""
    api = "nisa.memset"
    p, n = rules.operand(api, "dst", dst)
    chosen = _engine(api, engine) or ("vector" if dst.buffer is tensors.psum else "gpsimd")
    rules.gpsimd_no_psum(api, chosen, dst)
    rules.memset_value(api, value, dst.dtype)
    fill(dst, value)
    if ACTIVE:
        record(chosen, "memset", p * n, _bytes(dst), n, p, (("dst", dst),))


def fill(dst, value) -> None:
    """Set every element of dst to `value` cast to dst.dtype (no rules, no trace)."""
    scalar = torch.scalar_tensor(value, dtype=torch.float64) if dst.dtype.kind == "int" else f32_immediate(value)
    if dst.dtype in _NEEDS_CAST:
        scalar = dtypes.cast_for_store(scalar, dst.dtype, dst.data.dtype)
    if not dst.alloc.placed:
        tensors.place(dst)
    dst.data.fill_(scalar)
    if dst.buffer is tensors.psum:
        tensors.mark_written(dst)

