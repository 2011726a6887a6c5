"""nki.language: buffers, dtypes, tile sizes, tensor creation, movement and the nl-level math.

nl-level tile functions allocate a fresh SBUF result and lower onto the ISA
instructions the compiler would emit (so they are checked and traced like hand-written
nisa code): binary ops -> tensor_tensor (tile, tile) or tensor_scalar (tile, number);
unary math -> a ScalarE activation; reductions -> tensor_reduce; softmax / rms_norm ->
the usual reduce / activation / reciprocal / tensor_scalar sequence.
Following NKI 0.3.0 on hardware: no tile-tile broadcasting, no divide / fmod / mod,
no power(tile, scalar), nl.matmul only with transpose_x=True, nl.store takes an SBUF value.
"""

from __future__ import annotations

import contextlib
import operator

import torch

from . import addressed, context, cores, dtypes, isa, isa_random, registers, replay, rules
from . import tensor as tensors
from .dtypes import (bfloat16, bool_, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn,  # noqa: F401
                     float8_e4m3fn_x4, float8_e5m2, float8_e5m2_x4, float8_e8m0fnu, float16, float32, int8,
                     int16, int32, tfloat32, uint8, uint16, uint32)
from .errors import NkiError
from .objects import NKIObject  # noqa: F401
from .registers import dynamic_range, fori_loop, while_loop  # noqa: F401
from .ops import ALU_KINDS, OPS, NkiOp
from .tensor import DynSlice, NkiTensor, ds  # noqa: F401

sbuf, psum, shared_hbm, private_hbm = tensors.sbuf, tensors.psum, tensors.shared_hbm, tensors.private_hbm
hbm = private_hbm  # as in the 0.3.0 stub


class _TileSize:
    """nl.tile_size. The alignments are undocumented (§7): 4-byte PSUM / 32-byte SBUF are assumptions."""

    pmax = 128
    psum_fmax = 512
    psum_bank_fmax = 512
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 32

    @property
    def total_available_sbuf_size(self) -> int:
        return context.current().target.sbuf_usable_bytes


tile_size = _TileSize()


# ---------------------------------------------------------------------------- creation

def _shape(shape) -> tuple:
    if isinstance(shape, int):
        return (shape,)
    return tuple(map(operator.index, shape))


def ndarray(shape, dtype, buffer=sbuf, name="", address=None) -> NkiTensor:
    """An uninitialised tensor (NaN / 4 filled, as in the real simulator); on-chip `address=` places it (addressed.py)."""
    shape = _shape(shape)
    dtype = dtypes.as_dtype(dtype)
    if not isinstance(buffer, tensors.Buffer):
        raise NkiError(f"nl.ndarray: buffer={buffer!r} must be nl.sbuf, nl.psum, nl.shared_hbm or nl.private_hbm")
    program = context.current()
    if not buffer.on_chip:
        rules.hbm_tensor("nl.ndarray", name or f"{buffer.name} tensor", shape, dtype)
    if buffer.on_chip:
        rules.dtype_on_chip("nl.ndarray", name or "tile", dtype)
        if shape and shape[0] > rules.PMAX:
            rules.fail("nl.ndarray", f"partition dim <= {rules.PMAX}", shape[0],
                       f"{buffer.name} tile {list(shape)} has partition dim {shape[0]}, over the {rules.PMAX}-partition limit")
        if address is not None:
            return addressed.allocate(shape, dtype, buffer, name, address)
        pool = program.sbuf if buffer is sbuf else program.psum
        return tensors.allocate(shape, dtype, buffer, name, pool)
    if address is not None:
        raise NkiError(f"nl.ndarray: address= places on-chip tiles; {buffer.name} tensors have no address")
    if buffer is shared_hbm:
        return _shared(program.shared_outputs, shape, dtype, name)
    return tensors.allocate(shape, dtype, buffer, name, None)


def is_hbm(buffer) -> bool:
    return buffer is shared_hbm or buffer is private_hbm


def is_on_chip(buffer) -> bool:
    return buffer is sbuf or buffer is psum


def is_psum(buffer) -> bool:
    return buffer is psum


def is_sbuf(buffer) -> bool:
    return buffer is sbuf


def _shared(outputs, shape, dtype, name) -> NkiTensor:
    """The k-th shared_hbm allocation of every SPMD program is the same tensor."""
    if outputs.cursor < len(outputs.tensors):
        t = outputs.tensors[outputs.cursor]
        if t.shape != shape or t.dtype is not dtype:
            raise NkiError(f"nl.ndarray: SPMD programs allocate shared_hbm tensors differently "
                           f"({list(t.shape)} {t.dtype!r} vs {list(shape)} {dtype!r})")
    else:
        t = tensors.allocate(shape, dtype, shared_hbm, name, None)
        outputs.tensors.append(t)
        replay.note_output(t)
    outputs.cursor += 1
    return t


def full(shape, fill_value, dtype, buffer=sbuf, name="") -> NkiTensor:
    t = ndarray(shape, dtype, buffer, name)
    if buffer.on_chip:
        isa.memset(t, fill_value)
    else:
        isa.fill(t, fill_value)
    return t


def zeros(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def zeros_like(a, dtype=None, buffer=sbuf, name="") -> NkiTensor:
    return zeros(a.shape, dtype or a.dtype, buffer, name)


def empty_like(a, dtype=None, buffer=sbuf, name="") -> NkiTensor:
    return ndarray(a.shape, dtype or a.dtype, buffer, name)


def shared_identity_matrix(n, dtype=uint8, name="") -> NkiTensor:
    """An [n, n] identity in SBUF (a constant the runtime loads: traced as one DMA)."""
    t = ndarray((n, n), dtype, sbuf, name)
    isa.fill(t, 0)
    t.data.diagonal().fill_(1)
    _trace_constant_load(t)
    return t


def shared_constant(constant) -> NkiTensor:
    """A read-only shared_hbm tensor holding `constant` (a NumPy array or the path of a .npy file).

    The data is part of the compiled kernel, loaded once at model load: both cores of an LNC=2
    launch read the same values, and kernels cannot write it.
    """
    if isinstance(constant, (str, bytes)) or hasattr(constant, "__fspath__"):
        import numpy  # only .npy constants need NumPy

        constant = numpy.load(constant)
    if not _is_numpy_array(constant):
        raise NkiError(f"nl.shared_constant: expects a NumPy array or a .npy path, got {type(constant).__name__}")
    dtype = dtypes.as_dtype(constant.dtype)
    if dtype.kind not in ("float", "int", "mx") or not dtype.on_chip:
        raise NkiError(f"nl.shared_constant: unsupported element type {dtype.name}")
    values = torch.from_numpy(constant.copy()) if dtype.storage.itemsize == constant.dtype.itemsize and \
        constant.dtype.kind in "fiu" and dtype.name == constant.dtype.name else \
        torch.from_numpy(constant.astype("float32")).to(dtype.storage)
    return NkiTensor(values, dtype, shared_hbm, tensors.Allocation(values, readonly=True), "shared_constant")


def _is_numpy_array(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _trace_constant_load(t):
    if isa.ACTIVE:
        isa.record("dma", "load", 0, t.data.numel() * t.dtype.itemsize, rules.free_size(t), t.data.shape[0],
                   (("dst", t),))


# ---------------------------------------------------------------------------- movement

def load(src, dtype=None, name="") -> NkiTensor:
    """HBM -> a new SBUF tile of src's shape."""
    rules.on_chip("nl.load", "src", src, ("shared_hbm", "private_hbm"))
    cores.step()
    t = ndarray(src.shape, dtype or src.dtype, sbuf, name)
    isa._dma_copy("nl.load", "load", t, src)
    return t


def store(dst, value) -> None:
    """SBUF value -> HBM dst."""
    rules.on_chip("nl.store", "dst", dst, ("shared_hbm", "private_hbm"))
    rules.on_chip("nl.store", "value", value, ("sbuf",))
    cores.step()
    isa._dma_copy("nl.store", "store", dst, value)


def load_transpose2d(src, dtype=None, name="") -> NkiTensor:
    """HBM [A, B] -> a new SBUF tile [B, A] (a DMA transpose)."""
    a, b = src.shape
    t = ndarray((b, a), dtype or src.dtype, sbuf, name)
    isa.dma_transpose(t, src)
    return t


# ---------------------------------------------------------------------------- SPMD, debugging, loops

def program_id(axis=0) -> int:
    return context.current().program_id[axis]


def num_programs(axes=0):
    grid = context.current().grid
    if axes is None:
        total = 1
        for g in grid:
            total *= g
        return total
    if isinstance(axes, (tuple, list)):
        return tuple(grid[a] for a in axes)
    return grid[axes]


def program_ndim() -> int:
    return len(context.current().grid)


def device_print(prefix, x) -> None:
    print(prefix, x.data.float() if isinstance(x, NkiTensor) else x)


def affine_range(*args, **kwargs):
    """All NKI loop kinds unroll to a plain Python range (0.3.0 semantics)."""
    return range(*args)


sequential_range = static_range = affine_range


# ---------------------------------------------------------------------------- elementwise math

def _is_tile(x) -> bool:
    return isinstance(x, NkiTensor)


def _dtype_of(x):
    return x.dtype if _is_tile(x) else dtypes.scalar_dtype(x)


def _binary(op: NkiOp, x, y, dtype=None):
    api = f"nl.{op.name}"
    rules.alu_op(api, "op", op, ALU_KINDS)
    if not _is_tile(x) and not _is_tile(y):
        exact = op.int_fn is not None and isinstance(x, int) and isinstance(y, int)
        fn, dtype = (op.int_fn, torch.int64) if exact else (op.fn, torch.float32)
        return fn(torch.scalar_tensor(x, dtype=dtype), torch.scalar_tensor(y, dtype=dtype)).item()
    out = dtypes.as_dtype(dtype) if dtype is not None else dtypes.promote(_dtype_of(x), _dtype_of(y))
    if _is_tile(x) and _is_tile(y):
        if x.shape != y.shape:
            rules.fail(api, "no tile-tile broadcasting in NKI 0.3 (use nisa.tensor_scalar)", (x.shape, y.shape),
                       f"operand shapes {list(x.shape)} and {list(y.shape)} differ")
        dst = ndarray(x.shape, out, sbuf)
        isa.tensor_tensor(dst, x, y, op)
        return dst
    if op.name == "power":
        rules.fail(api, "no power(tile, scalar) in NKI 0.3", y, "power with a scalar operand is unsupported")
    tile, scalar, reverse = (x, y, False) if _is_tile(x) else (y, x, True)
    dst = ndarray(tile.shape, out, sbuf)
    isa.tensor_scalar(dst, tile, op, scalar, reverse0=reverse)
    return dst


def _unary(op: NkiOp, x, dtype=None):
    """Unary math on ScalarE into a new SBUF tile (nl.copy: into x's buffer, through fp32)."""
    float_default = x.dtype if x.dtype.kind == "float" else float32
    out = dtypes.as_dtype(dtype) if dtype is not None else float_default
    dst = ndarray(x.shape, out, x.buffer if op.name == "copy" else sbuf)
    isa._activation(f"nl.{op.name}", dst, op, x, None, 1.0, None, None, isa.reduce_cmd.idle)
    return dst


def _invert(op: NkiOp, x, dtype=None):
    dst = ndarray(x.shape, dtypes.as_dtype(dtype) if dtype is not None else x.dtype, sbuf)
    isa.tensor_scalar(dst, x, OPS["bitwise_xor"], -1)  # ~x == x ^ all-ones
    return dst


# ---------------------------------------------------------------------------- reductions

def _reduced_shape(api, x, axis, keepdims):
    shape = x.shape
    first = rules.reduce_axes(api, axis, len(shape))
    axes = tuple(range(first, len(shape)))
    kept = shape[:first]
    return axes, kept + (1,) * len(axes) if keepdims else kept


def _reduce(op: NkiOp, x, axis, dtype=None, keepdims=False):
    api = f"nl.{op.name}"
    axes, out_shape = _reduced_shape(api, x, axis, keepdims)
    out = dtypes.as_dtype(dtype) if dtype is not None else x.dtype
    if op.name == "mean":
        count = 1
        for a in axes:
            count *= x.shape[a]
        total = ndarray(out_shape, float32, sbuf)
        isa.tensor_reduce(total, OPS["add"], x, axes)
        dst = ndarray(out_shape, out, sbuf)
        isa.tensor_scalar(dst, total, OPS["multiply"], 1.0 / count)
        return dst
    if op.name == "var":
        return _var(api, x, axes, out_shape, out)
    dst = ndarray(out_shape, out, sbuf)
    isa.tensor_reduce(dst, OPS[rules.REDUCTION_ALU_NAMES[op.name]], x, axes)
    return dst


def _var(api, x, axes, out_shape, out):
    """Population variance over all free dims: mean, subtract, square, mean."""
    if axes[0] != 1:
        raise NkiError(f"{api}: the interpreter computes variance over all free dims only")
    p, n = x.shape[0], rules.free_size(x)
    mean = _reduce(OPS["mean"], x, axes, dtype=float32, keepdims=True)
    centred = ndarray(x.shape, float32, sbuf)
    isa.tensor_scalar(centred, x, OPS["subtract"], mean.reshape(p, 1))
    squared = ndarray(x.shape, float32, sbuf)
    isa.tensor_tensor(squared, centred, centred, OPS["multiply"])
    total = ndarray(out_shape, float32, sbuf)
    isa.tensor_reduce(total, OPS["add"], squared, axes)
    dst = ndarray(out_shape, out, sbuf)
    isa.tensor_scalar(dst, total, OPS["multiply"], 1.0 / n)
    return dst


def softmax(x, axis=-1, dtype=None) -> NkiTensor:
    """exp(x - max) / sum over the free dim of a [P, F] tile."""
    if x.ndim != 2 or axis not in (-1, 1):
        raise NkiError("nl.softmax: the interpreter handles [P, F] tiles with axis=-1")
    p = x.shape[0]
    row_max = ndarray((p, 1), float32, sbuf)
    isa.tensor_reduce(row_max, OPS["maximum"], x, 1)
    neg_max = ndarray((p, 1), float32, sbuf)
    isa.tensor_scalar(neg_max, row_max, OPS["multiply"], -1.0)
    exps = ndarray(x.shape, float32, sbuf)
    sums = ndarray((p, 1), float32, sbuf)
    isa.activation(exps, OPS["exp"], x, bias=neg_max, reduce_op=OPS["add"], reduce_res=sums,
                   reduce_cmd=isa.reduce_cmd.reset_reduce)
    inv = ndarray((p, 1), float32, sbuf)
    isa.reciprocal(inv, sums)
    dst = ndarray(x.shape, dtype or x.dtype, sbuf)
    isa.tensor_scalar(dst, exps, OPS["multiply"], inv)
    return dst


def rms_norm(x, w, axis, n, epsilon=1e-6, dtype=None, compute_dtype=None) -> NkiTensor:
    """x * rsqrt(sum(x^2) / n + epsilon) * w over the free dim of a [P, F] tile; w is [P, F] or [1, F]."""
    if x.ndim != 2 or axis not in (-1, 1):
        raise NkiError("nl.rms_norm: the interpreter handles [P, F] tiles with axis=-1")
    p = x.shape[0]
    squares = ndarray(x.shape, float32, sbuf)
    sums = ndarray((p, 1), float32, sbuf)
    isa.activation_reduce(squares, OPS["square"], x, OPS["add"], sums)
    inv_rms = ndarray((p, 1), float32, sbuf)
    isa.tensor_scalar(inv_rms, sums, OPS["multiply"], 1.0 / n, op1=OPS["add"], operand1=epsilon)
    isa.activation(inv_rms, OPS["rsqrt"], inv_rms)
    normed = ndarray(x.shape, float32, sbuf)
    isa.tensor_scalar(normed, x, OPS["multiply"], inv_rms)
    if w.shape != x.shape:
        w = broadcast_to(w, x.shape)
    dst = ndarray(x.shape, dtype or x.dtype, sbuf)
    isa.tensor_tensor(dst, normed, w, OPS["multiply"])
    return dst


# ---------------------------------------------------------------------------- selection and shapes

def where(condition, x, y, dtype=None) -> NkiTensor:
    """x where condition (a 1.0 / 0.0 tile) is nonzero, else y; x, y tiles or numbers (VectorE select)."""
    api = "nl.where"
    out = dtypes.as_dtype(dtype) if dtype is not None else dtypes.promote(_dtype_of(x), _dtype_of(y))
    dst = ndarray(condition.shape, out, sbuf)
    operands = [("condition", condition)] + [(r, v) for r, v in (("x", x), ("y", y)) if _is_tile(v)]
    p, n = isa._check_elementwise(api, dst, *operands)
    values = torch.where(isa._f32(condition) != 0, isa._scalar(x), isa._scalar(y))
    isa._write(dst, values.expand(p, n))
    if isa.ACTIVE:
        isa.record("vector", "select", p * n, isa._bytes(dst, condition, x, y), n, p, [("dst", dst)] + operands)
    return dst


def expand_dims(x, axis) -> NkiTensor:
    if x.buffer.on_chip and axis == 0:
        rules.fail("nl.expand_dims", "on-chip tiles keep dim 0 as the partition dim", axis, "axis=0 on a tile")
    return NkiTensor(x.data.unsqueeze(axis), x.dtype, x.buffer, x.alloc, x.name)


def broadcast_to(x, shape) -> NkiTensor:
    """A new SBUF tile holding x broadcast to `shape` (traced as one VectorE copy)."""
    shape = _shape(shape)
    dst = ndarray(shape, x.dtype, sbuf)
    try:
        values = x.data.expand(shape)
    except RuntimeError:
        raise NkiError(f"nl.broadcast_to: cannot broadcast {list(x.shape)} to {list(shape)}") from None
    tensors.place(dst)
    dst.data.copy_(values)
    if isa.ACTIVE:
        p, n = shape[0], rules.free_size(dst)
        isa.record("vector", "tensor_copy", p * n, isa._bytes(dst, x), n, p, (("dst", dst), ("src", x)))
    return dst


def matmul(x, y, transpose_x=False) -> NkiTensor:
    """x.T @ y into a new fp32 PSUM tile (x [K, M], y [K, N]); 0.3.0 supports only transpose_x=True."""
    if not transpose_x:
        rules.fail("nl.matmul", "transpose_x=True (NKI 0.3.0 known issue)", transpose_x,
                   "transpose_x=False does not work in NKI 0.3.0; pass x as [K, M] with transpose_x=True")
    dst = ndarray((rules.free_size(x), rules.free_size(y)), float32, psum)
    isa.nc_matmul(dst, x, y)
    return dst


def transpose(x, dtype=None) -> NkiTensor:
    """x.T into a new PSUM tile (TensorE)."""
    dst = ndarray((rules.free_size(x), x.shape[0]), dtype or x.dtype, psum)
    isa.nc_transpose(dst, x, engine=isa.engine.tensor)
    return dst


# ---------------------------------------------------------------------------- random numbers, gathers, scheduling

def rand(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    """A new on-chip tile of uniform [0, 1) values from the Vector engine's generator (isa_random.py)."""
    if not getattr(buffer, "on_chip", False):
        raise NkiError("nl.rand: the interpreter generates random tiles in SBUF or PSUM only; "
                       "generate in SBUF and dma_copy to HBM")
    t = ndarray(shape, dtype, buffer, name)
    isa_random.uniform(t)
    return t


def random_seed(seed) -> None:
    """Seed nl.rand / nl.dropout (the Vector engine's generator) from a [1, 1] 32-bit tile."""
    isa.set_rng_seed(seed)


def dropout(x, rate, dtype=None) -> NkiTensor:
    """x with each element zeroed with probability `rate` (a number or a [P, 1] tile), on VectorE."""
    dst = ndarray(x.shape, x.dtype, sbuf)
    isa.dropout(dst, x, rate)
    if dtype is None or dtypes.as_dtype(dtype) is x.dtype:
        return dst
    out = ndarray(x.shape, dtype, sbuf)
    isa.tensor_copy(out, dst)
    return out


def gather_flattened(data, indices, axis=0, dtype=None) -> NkiTensor:
    """out[p, j...] = data[p, indices[p, j...]] over the flattened free dims of data (GpSimd)."""
    api = "nl.gather_flattened"
    if axis != 0:
        raise NkiError(f"{api}: axis={axis} is not modelled (the docstring's semantics are for the default axis=0)")
    p, n = rules.operand(api, "data", data)
    pi, ni = rules.operand(api, "indices", indices)
    if pi != p:
        rules.same_partitions(api, "data", data, "indices", indices)
    if indices.dtype.kind != "int":
        rules.fail(api, "indices have an integer dtype", indices.dtype.name, f"indices have dtype {indices.dtype.name}")
    where = isa._i64(indices)
    if bool(((where < 0) | (where >= n)).any()):
        rules.fail(api, "indices in [0, elements per partition of data)", int(where.max()), f"an index is outside [0, {n})")
    dst = ndarray(indices.shape, dtype or data.dtype, sbuf)
    isa._write(dst, torch.gather(isa._f32(data), 1, where))
    if isa.ACTIVE:
        isa.record("gpsimd", "gather_flattened", p * ni, isa._bytes(dst, data, indices), ni, p,
                   (("dst", dst), ("data", data), ("indices", indices)))
    return dst


@contextlib.contextmanager
def no_reorder():
    """Program order inside the block: the interpreter always runs in program order; dynamic loops are refused."""
    registers.NO_REORDER_DEPTH[0] += 1
    try:
        yield
    finally:
        registers.NO_REORDER_DEPTH[0] -= 1


class _MemoryRegionType(type):
    def __instancecheck__(cls, value):
        return isinstance(value, tensors.Buffer)

    def __iter__(cls):
        return iter((sbuf, psum, private_hbm, shared_hbm))


class MemoryRegion(metaclass=_MemoryRegionType):
    """Memory region constants: nl.sbuf, nl.psum, nl.private_hbm (alias nl.hbm), nl.shared_hbm are its members."""

    sbuf, psum, private_hbm, shared_hbm = sbuf, psum, private_hbm, shared_hbm


DType = str  # the stub's alias: dtypes are named by string in annotations


def _operator_token(op: NkiOp, *args, **kwargs):
    if op.kind == "bypass":
        raise NkiError("nl.bypass is an operator token (op0= / op1= of nisa.activate2), not a tile function")
    raise NkiError(f"nl.{op.name} is declared by nki.language without documented semantics; "
                   "the interpreter does not guess them")


# ---------------------------------------------------------------------------- op objects as nl functions

_CALLS = {"arith": _binary, "compare": _binary, "logical": _binary, "bitvec": _binary,
          "bitvec_unary": _invert, "unary": _unary, "reduce": _reduce, "bypass": _operator_token,
          "undocumented": _operator_token}
for _op in OPS.values():
    _op.call = _CALLS[_op.kind]
    globals()[_op.name] = _op
del _op
