"""nki.isa: the ISA instructions, executed eagerly on torch CPU storage.

Every instruction writes into `dst` (its first argument, positional or keyword),
checks the hardware rules of nki-reference.md §1/§2 first (rules.py), computes in fp32
(integer-only instructions exactly in int64) and casts into `dst.dtype` on write.
Operands are flattened per partition to [P, F]: shapes may differ as long as the
partition count and the elements per partition agree.

Engine attribution for traces: nc_matmul / nc_transpose -> "tensor" (nc_transpose on
VectorE when engine=vector or dst is not in PSUM); tensor_tensor / tensor_scalar /
scalar_tensor_tensor / tensor_reduce / tensor_copy / reciprocal / bn_stats / bn_aggr ->
"vector" unless `engine=` says otherwise (tensor_tensor on all-int32 operands and
nl.power -> "gpsimd", as the hardware does); activation -> "scalar";
iota / affine_select -> "gpsimd"; memset -> "gpsimd" by default ("vector" for PSUM,
which GpSimd cannot reach); dma_copy / dma_transpose -> "dma".

Interpreter choices where the docs are silent:
- nc_matmul accumulate=None (auto) adds where the PSUM element was written by any earlier
  instruction (matmul, copy, memset, ...) and overwrites elsewhere; accumulate=True into
  any never-written element is an error.
- activation with reduce_res and reduce_cmd=idle reads the ScalarE reduce registers
  unchanged (the documented semantics); reading registers no instruction has set raises.
- tensor_copy(dtype=...) (a §8 habit) rounds through `dtype` before casting to dst.
- dma_copy between integer dtypes converts exactly with saturation; other dtype changes go
  through fp32.
- tensor_scalar computes arithmetic operators in fp32 even on integer tiles (its docstring);
  tensor_tensor on int32 operands runs on GpSimd in exact integer arithmetic.
"""

from __future__ import annotations

from enum import Enum

import torch

from . import context, dtypes, indirect, rules
from . import tensor as tensors
from .errors import NkiError, NkiIndexError
from .indirect import IndirectView
from .registers import VirtualRegister, register_alloc, register_load, register_move, register_store  # noqa: F401
from .ops import ALU_KINDS, ALU_UNARY, OPS
from .tracing import ACTIVE, record

_F32 = torch.float32
_I64 = torch.int64
_SBUF = frozenset({"sbuf"})
_PSUM = frozenset({"psum"})


class engine(Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):
    error = 0
    skip = 1


class matmul_perf_mode(Enum):
    none = 0
    double_row = 1


class nc_version(Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4

    # Kernels gate features with `nisa.get_nc_version() >= nisa.nc_version.gen3`.
    def __lt__(self, other):
        return self.value < _nc_version_value(other)

    def __le__(self, other):
        return self.value <= _nc_version_value(other)

    def __gt__(self, other):
        return self.value > _nc_version_value(other)

    def __ge__(self, other):
        return self.value >= _nc_version_value(other)


def _nc_version_value(other) -> int:
    if not isinstance(other, nc_version):
        raise TypeError(f"cannot order nisa.nc_version against {type(other).__name__}")
    return other.value


class dma_engine(Enum):
    dma = 1         # shared DMA queues (default)
    gpsimd_dma = 2  # GpSimd's internal DMA for SBUF-to-SBUF swaps between the two cores of LNC=2


# Deprecated aliases still found in kernels.
tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


def get_nc_version() -> nc_version:
    return nc_version(context.current().target.nc_version)


_ENGINE_NAMES = {None: None, engine.unknown: None, engine.tensor: "tensor", engine.vector: "vector",
                 engine.scalar: "scalar", engine.gpsimd: "gpsimd", engine.dma: "dma"}


def _engine(op, value):
    if value is engine.unknown:
        return None
    try:
        return _ENGINE_NAMES[value]
    except (KeyError, TypeError):
        raise NkiError(f"{op}: engine={value!r} is not an nisa.engine member") from None


# ---------------------------------------------------------------------------- operand access

def _flat(t) -> torch.Tensor:
    """The [P, F] storage view (or copy, for non-viewable strides) of a tile."""
    data = t.data
    if data.dim() == 2:
        return data
    if data.dim() < 2:
        return data.reshape(-1, 1)
    return data.reshape(data.shape[0], -1)


def _f32(t) -> torch.Tensor:
    data = _flat(t)
    return data if data.dtype is _F32 else data.to(_F32)


def _f32_reused(t) -> torch.Tensor:
    """_f32 for operands read many times (matmul tiles): the allocation is converted once per version."""
    data = t.data
    alloc = t.alloc
    storage = alloc.storage
    if data.dtype is _F32 or data.dtype is not storage.dtype or data.numel() * 8 < storage.numel() \
            or storage.storage_offset() or not storage.is_contiguous():  # address= tiles view a shared buffer
        return _f32(t)
    version = storage._version  # shared by every view: bumps on any in-place write
    if alloc.f32_version != version:
        alloc.f32 = storage.to(_F32)
        alloc.f32_version = version
    view = alloc.f32.as_strided(data.size(), data.stride(), data.storage_offset())
    return view if view.dim() == 2 else view.reshape(view.shape[0], -1)


def _i64(t) -> torch.Tensor:
    return _flat(t).to(_I64)


def _scalar(operand, integer=False):
    """A number or a [P, 1] tile as something that broadcasts against [P, F]."""
    if getattr(operand, "buffer", None) is None:
        return torch.scalar_tensor(operand, dtype=_I64) if integer else f32_immediate(operand)
    return _i64(operand) if integer else _f32(operand)


def f32_immediate(value) -> torch.Tensor:
    """A Python number as the fp32 immediate the engines see: rounded to nearest, so the
    library's -3.4028235e38 "minus infinity" fill (just past FLT_MAX in float64) becomes -FLT_MAX."""
    if -_F32_MAX <= value <= _F32_MAX:  # the common case: exactly representable range, one conversion
        return torch.scalar_tensor(value, dtype=_F32)
    return torch.scalar_tensor(value, dtype=torch.float64).to(_F32)


_F32_MAX = 3.4028234663852886e38


def _is_int(operand) -> bool:
    dtype = getattr(operand, "dtype", None)
    return dtype.kind == "int" if dtype is not None else isinstance(operand, int)


def _write(dst, values: torch.Tensor, wrap: bool = False) -> None:
    """Store engine results into dst: cast to dst.dtype (rounding / saturating), mark PSUM written."""
    if dst.alloc.readonly:
        raise NkiError("cannot write a read-only HBM view (a reshape torch could only copy)")
    data = dst.data
    dtype = dst.dtype
    if dtype in _NEEDS_CAST and not wrap:
        values = dtypes.cast_for_store(values, dtype, data.dtype)
    if values.shape != data.shape:
        values = values.reshape(data.shape)
    data.copy_(values)
    if dst.buffer is tensors.psum:
        tensors.mark_written(dst)


_NEEDS_CAST = frozenset(d for d in dtypes.ALL if d.kind != "float") | {dtypes.tfloat32, dtypes.float8_e4m3}


def _copy_exact(dst, src) -> None:
    """Bit-exact copy between tiles of the same dtype and storage."""
    if dst.alloc.readonly:
        raise NkiError("cannot write a read-only HBM view (a reshape torch could only copy)")
    values = src.data
    if src.alloc is dst.alloc:
        values = values.clone()  # overlapping views of one allocation
    if values.shape != dst.data.shape:
        values = values.reshape(dst.data.shape)
    dst.data.copy_(values)
    if dst.buffer is tensors.psum:
        tensors.mark_written(dst)


def _same_storage(a, b) -> bool:
    return a.dtype is b.dtype and a.data.dtype is b.data.dtype


def _bytes(*tiles) -> int:
    return sum(t.data.numel() * t.dtype.itemsize for t in tiles if getattr(t, "buffer", None) is not None)


def _check_elementwise(op, dst, *inputs):
    """dst and inputs: on-chip operands with equal partitions and elements per partition -> (P, F)."""
    p, n = rules.operand(op, "dst", dst)
    for role, t in inputs:
        pi, ni = rules.operand(op, role, t)
        if pi != p:
            rules.same_partitions(op, "dst", dst, role, t)
        if ni != n:
            rules.same_free_size(op, "dst", n, role, ni)
    return p, n


# ---------------------------------------------------------------------------- TensorE

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


# ---------------------------------------------------------------------------- Vector / GpSimd ALU

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
    rules.vector_operand(api, "operand0", operand0, p)
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


def bn_stats(dst, data, name=None):
    """Per partition: (count, mean, var*count) of the even elements, then of the odd ones."""
    api = "nisa.bn_stats"
    p, n = _check_statistics(api, dst, data, 6)
    rules.bn_stats_size(api, n)
    x = _f32(data)
    stats = [_count_mean_m2(x[:, 0::2]), _count_mean_m2(x[:, 1::2])]
    _write(dst, torch.cat([s for triple in stats for s in triple], dim=1))
    if ACTIVE:
        record("vector", "bn_stats", p * n, _bytes(dst, data), n, p, (("dst", dst), ("data", data)))


def _check_statistics(api, dst, data, outputs):
    """bn_stats / bn_aggr operands: same partitions, `outputs` elements per partition in dst -> (P, F)."""
    pd, nd = rules.operand(api, "dst", dst)
    p, n = rules.operand(api, "data", data)
    if pd != p:
        rules.same_partitions(api, "dst", dst, "data", data)
    if nd != outputs:
        rules.same_free_size(api, "dst", nd, f"{api.split('.')[-1]} output", outputs)
    return p, n


def _count_mean_m2(x):
    p, count = x.shape
    if count == 0:
        zero = torch.zeros(p, 1)
        return zero, zero, zero
    mean = x.mean(dim=1, keepdim=True)
    m2 = ((x - mean) ** 2).sum(dim=1, keepdim=True)
    return torch.full((p, 1), float(count)), mean, m2


def bn_aggr(dst, data, name=None):
    """Combine (count, mean, var*count) triples into (mean, variance) per partition."""
    api = "nisa.bn_aggr"
    p, n = _check_statistics(api, dst, data, 2)
    if n % 3:
        rules.fail(api, "bn_aggr input holds (count, mean, var*count) triples", n, f"{n} elements per partition")
    triples = _f32(data).reshape(-1, n // 3, 3)
    count, mean, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
    total = count.sum(dim=1, keepdim=True)
    grand = (count * mean).sum(dim=1, keepdim=True) / total
    var = (m2 + count * (mean - grand) ** 2).sum(dim=1, keepdim=True) / total
    _write(dst, torch.cat([grand, var], dim=1))
    if ACTIVE:
        record("vector", "bn_aggr", p * n, _bytes(dst, data), n, p, (("dst", dst), ("data", data)))


# ---------------------------------------------------------------------------- ScalarE

def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    """dst = op(data * scale + bias); optionally add-reduce into the ScalarE registers -> reduce_res."""
    api = "nisa.activation"
    rules.activation_op(api, op)
    _activation(api, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """activation with reduce_cmd=reset_reduce: reduce_res = sum over free dims of the result."""
    api = "nisa.activation_reduce"
    rules.activation_op(api, op)
    _activation(api, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd.reset_reduce)


def _activation(api, dst, op, data, bias, scale, reduce_op, reduce_res, cmd):
    """Shared by activation, activation_reduce and the nl-level unary ops (any unary NkiOp)."""
    p, n = _check_elementwise(api, dst, ("data", data))
    program = context.current()
    if bias is not None:
        if isinstance(bias, (int, float)) and program.target.nc_version < 3:
            rules.fail(api, "scalar bias needs NeuronCore-v3+", bias, f"bias={bias} on {program.target.name}")
        rules.vector_operand(api, "bias", bias, p, require_fp32=False)
        rules.activation_bias_dtype(api, bias)
    rules.vector_operand(api, "scale", scale, p)
    x = _f32(data)
    if getattr(scale, "buffer", None) is not None or scale != 1.0:
        x = x * _scalar(scale)
    if bias is not None:
        x = x + _scalar(bias)
    result = op.fn(x)
    if api != "nl.sin":  # nl.sin reduces its argument before the activation (nki.api.shared.rst note)
        invalid = rules.activation_range(api, op, x)
        if invalid is not None:
            result = result.masked_fill(invalid, float("nan"))  # the hardware's output is invalid there
    _write(dst, result)
    if cmd is not reduce_cmd.idle or reduce_res is not None:
        _reduce_registers(api, program, p, result, reduce_op, reduce_res, cmd)
    if ACTIVE:
        record("scalar", "activation", p * n, _bytes(dst, data, bias, scale), n, p,
               (("dst", dst), ("data", data), ("bias", bias), ("scale", scale), ("reduce_res", reduce_res)))


def _reduce_registers(api, program, p, result, reduce_op, reduce_res, cmd):
    regs = program.reduce_regs
    if regs is None:
        regs = program.reduce_regs = torch.zeros(rules.PMAX)
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        rules.add_reduce(api, reduce_op)
        total = result.sum(dim=1)
        if cmd is reduce_cmd.reduce:
            if not program.reduce_regs_written:
                rules.fail(api, "reduce_cmd=reduce accumulates onto registers set earlier", "reduce",
                           "no instruction has reset the ScalarE reduce registers")
            total = regs[:p] + total
        regs[:p] = total
        program.reduce_regs_written = True
    elif cmd is reduce_cmd.reset:
        regs.zero_()
        program.reduce_regs_written = True
    elif cmd is not reduce_cmd.idle:
        raise NkiError(f"{api}: reduce_cmd={cmd} is not modelled by the interpreter")
    if reduce_res is not None:
        if rules.operand(api, "reduce_res", reduce_res) != (p, 1):
            rules.fail(api, "reduce_res is a [P, 1] tile", list(reduce_res.data.shape),
                       f"reduce_res has shape {list(reduce_res.data.shape)}, expected [{p}, 1]")
        if not program.reduce_regs_written:
            rules.fail(api, "reduce_res reads registers a reduce_cmd has set", cmd.name,
                       "reduce_cmd=idle reads the ScalarE reduce registers, which no instruction has set; "
                       "pass reduce_cmd=nisa.reduce_cmd.reset_reduce or use nisa.activation_reduce")
        _write(reduce_res, regs[:p].reshape(p, 1).clone())


# ---------------------------------------------------------------------------- GpSimd / fills

def _affine_values(api, partitions, pattern, offset, channel_multiplier):
    """offset + p * channel_multiplier + sum(step * index) over a <= 4-d [[step, num], ...] pattern."""
    if len(pattern) > 4:
        rules.fail(api, "at most 4 free dims in an access pattern", len(pattern), f"pattern has {len(pattern)} dims")
    free = torch.zeros(1, dtype=_I64)
    for step, num in pattern:
        free = (free[:, None] + step * torch.arange(num, dtype=_I64)[None, :]).reshape(-1)
    rows = offset + channel_multiplier * torch.arange(partitions, dtype=_I64)[:, None]
    return rows + free[None, :]


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum(step_j * i_j), computed as int32."""
    api = "nisa.iota"
    p, n = rules.operand(api, "dst", dst, _SBUF)
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
    dst.data.fill_(scalar)
    if dst.buffer is tensors.psum:
        tensors.mark_written(dst)


# ---------------------------------------------------------------------------- DMA

def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    """Copy between HBM and SBUF (never PSUM); only element counts must match.

    An indirect side (`.ap(scalar_offset= / vector_offset=)`) makes it a gather or scatter
    (indirect.py); oob_mode says what out-of-bounds indices do.
    """
    api = "nisa.dma_copy"
    if isinstance(dst, IndirectView) or isinstance(src, IndirectView):
        indirect.dma(api, dst, src, oob_mode, lambda d, s: _dma_copy(api, "dma_copy", d, s, dge_mode))
        return
    _dma_copy(api, "dma_copy", dst, src, dge_mode)


_DMA_BUFFERS = frozenset({"sbuf", "shared_hbm", "private_hbm"})


def _dma_copy(api, op_name, dst, src, mode=dge_mode.unknown):
    for role, t in (("dst", dst), ("src", src)):
        buffer = getattr(t, "buffer", None)
        if buffer is None or buffer.name not in _DMA_BUFFERS:
            rules.on_chip(api, role, t, ("sbuf", "shared_hbm", "private_hbm"))
        if buffer.on_chip:
            rules.partition_limit(api, role, t)
            rules.dtype_on_chip(api, role, t.dtype)
    n = dst.data.numel()
    if n != src.data.numel():
        rules.element_count(api, n, src.data.numel())
    if mode is dge_mode.hwdge:
        rules.dma_dtypes(api, dst, src)
    if _same_storage(dst, src):
        _copy_exact(dst, src)
    elif dst.dtype.kind == "int" and src.dtype.kind == "int":
        _write(dst, src.data.to(_I64))
    else:
        _write(dst, src.data.to(_F32))
    if ACTIVE:
        nbytes = n * max(dst.dtype.itemsize, src.dtype.itemsize)
        p = dst.data.shape[0] if dst.buffer.on_chip else src.data.shape[0] if src.buffer.on_chip else 1
        record("dma", op_name, 0, nbytes, n // p, p, (("dst", dst), ("src", src)))


_DMA_TRANSPOSE_PERMS = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """dst = src permuted ([1, 0] for 2-D, [2, 1, 0] for 3-D, [3, 1, 2, 0] for 4-D) for 2-byte dtypes,
    HBM -> SBUF or SBUF -> SBUF; an indirect src (`.ap(vector_offset=)`) gathers its rows first."""
    api = "nisa.dma_transpose"
    rules.on_chip(api, "src", src, ("sbuf", "shared_hbm", "private_hbm"))
    rules.operand(api, "dst", dst, _SBUF)
    if dge_mode is globals()["dge_mode"].hwdge or isinstance(src, IndirectView):
        rules.two_byte_dtype(api, "src", src)  # documented for the hardware-DGE and indirect transposes only
    rules.same_dtype(api, "dst", dst, "src", src)
    ndim = len(src.shape)
    perm = _DMA_TRANSPOSE_PERMS.get(ndim)
    if perm is None or (axes is not None and tuple(axes) != perm):
        raise NkiError(f"{api}: {ndim}-d src with axes={axes}: the DMA transposes 2-d (1, 0), 3-d (2, 1, 0) and "
                       "4-d (3, 1, 2, 0) tiles")
    if isinstance(src, IndirectView):
        if dge_mode is globals()["dge_mode"].hwdge:
            raise NkiError(f"{api}: an indirect transpose runs on the software DGE (dge_mode swdge or unknown)")
        addr, valid = src.resolve(api)
        if valid is not None:
            raise NkiIndexError(f"{api}: an indirect index is out of bounds (dim of size {src.bound})")
        values = src.flat[addr]
    else:
        values = src.data
    values = values.permute(perm)
    expected = tuple(values.shape)
    if dst.data.shape[0] != expected[0] or dst.data.numel() != values.numel():
        rules.fail(api, "dst is src transposed", list(dst.data.shape),
                   f"dst has shape {list(dst.data.shape)}, expected {list(expected)}")
    if not isinstance(src, IndirectView) and src.alloc is dst.alloc:
        values = values.clone()
    a, b = values.shape[0], values.numel() // values.shape[0]
    if dst.dtype is src.dtype and dst.data.dtype is values.dtype:
        _write(dst, values, wrap=True)
    else:
        _write(dst, values.to(_F32))
    if ACTIVE:
        record("dma", "dma_transpose", 0, a * b * src.dtype.itemsize, b, a, (("dst", dst), ("src", src)))


# Instructions kept in their own modules (they use the helpers above); nki.isa exposes them all.
from .isa_cores import core_barrier, sendrecv  # noqa: E402,F401
from .isa_scan import tensor_scalar_reduce, tensor_tensor_scan  # noqa: E402,F401
from .isa_search import max8, nc_find_index8, nc_match_replace8, nonzero_with_count  # noqa: E402,F401
from .isa_gather import (local_gather, nc_n_gather, nc_stream_shuffle, tensor_copy_predicated,  # noqa: E402,F401
                         tensor_partition_reduce)
from .isa_dma_compute import dma_compute  # noqa: E402,F401
from .isa_scan import exponential, range_select, select_reduce, tensor_scalar_cumulative  # noqa: E402,F401
