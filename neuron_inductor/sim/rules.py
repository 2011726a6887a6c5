"""The hardware rules of nki-reference.md §2 (plus the per-op rules of §1), one function each.

Each check returns quietly or raises NkiRuleError naming the op, the rule and the
offending value, e.g. "nisa.nc_matmul: stationary partition dim 256 exceeds the
128-partition limit (rule: partition dim <= 128)". Checks read only shapes, dtypes
and buffers, so they cost a few hundred nanoseconds each.
"""

from __future__ import annotations

import os

import torch

from .errors import NkiCapacityError, NkiRuleError

PMAX = 128               # partitions (nl.tile_size.pmax)
STATIONARY_FMAX = 128    # nl.tile_size.gemm_stationary_fmax
TRANSPOSE_VECTOR_MAX = 32
BN_STATS_FMAX = 512
PSUM_BANK_BYTES = 2048   # nl.tile_size.psum_bank_fmax_bytes (512 fp32) on every target
STRICT_ENV = "NEURON_INDUCTOR_SIM_STRICT"
MATMUL_INPUT_DTYPES = frozenset({"float8_e4m3", "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16",
                                 "tfloat32", "float32"})


def fail(op: str, rule: str, value, message: str):
    raise NkiRuleError(op, rule, value, message)


def free_size(t) -> int:
    """Elements per partition of an on-chip view (free dims flattened)."""
    data = t.data
    n = 1
    for s in data.shape[1:]:
        n *= s
    return n


def on_chip(op, role, t, allowed=("sbuf", "psum")):
    """Operand buffers: `t` must be a tile in one of `allowed`."""
    buffer = getattr(t, "buffer", None)
    if buffer is None:
        fail(op, "operand is an NKI tensor", type(t).__name__, f"{role} must be an NKI tensor, got {type(t).__name__}")
    if buffer.name not in allowed:
        fail(op, f"{role} buffer in {' / '.join(allowed)}", buffer.name,
             f"{role} is in {buffer.name}, but {op.split('.')[-1]} takes it from {' or '.join(allowed)}")


def partition_limit(op, role, t):
    p = t.data.shape[0] if t.data.dim() else 1
    if p > PMAX:
        fail(op, f"partition dim <= {PMAX}", p, f"{role} partition dim {p} exceeds the {PMAX}-partition limit")


def tile(op, role, t, allowed=("sbuf", "psum")):
    """An on-chip operand: right buffer, partition dim within limits."""
    on_chip(op, role, t, allowed)
    partition_limit(op, role, t)


ON_CHIP = frozenset({"sbuf", "psum"})


def operand(op, role, t, allowed=ON_CHIP, psum_banks=1):
    """A compute-engine operand: buffer in `allowed`, partition dim <= 128, legal start partition,
    and a PSUM operand inside `psum_banks` banks per partition (one bank for every instruction but
    nc_matmul / nc_transpose on NeuronCore-v4: "For tiles in PSUM, the F dimension size must not
    exceed nki.language.tile_size.psum_bank_fmax", NKI docs, tiling-overview.rst, TC#2;
    None: the caller checks).

    Returns (partitions, elements per partition). The hot path of every instruction.
    """
    buffer = getattr(t, "buffer", None)
    if buffer is None or buffer.name not in allowed:
        on_chip(op, role, t, tuple(b for b in ("sbuf", "psum", "shared_hbm", "private_hbm") if b in allowed))
    if buffer.name == "psum" and psum_banks is not None:
        psum_bank(op, role, t, psum_banks)
    data = t.data
    p = data.shape[0] if data.dim() else 1
    if p > PMAX:
        partition_limit(op, role, t)
    if data.storage_offset():
        start_partition(op, role, t)
    n = data.numel() // p
    if data.dim() > MAX_FREE_DIMS + 1 or n > AP_MAX_SIZE or t.alloc.storage.numel() // p > AP_MAX_STRIDE:
        access_pattern(op, role, t)
    return p, n


MAX_FREE_DIMS = 4
AP_MAX_SIZE = 65535     # uint16 sizes
AP_MAX_STRIDE = 32767   # int16 element strides


def access_pattern(op, role, t):
    """On-chip access patterns: <= 4 free dims, uint16 sizes, int16 element strides (§2)."""
    data = t.data
    free_dims = data.dim() - 1
    if free_dims > MAX_FREE_DIMS:
        fail(op, f"at most {MAX_FREE_DIMS} free dims in an access pattern", free_dims,
             f"{role} view {list(data.shape)} has {free_dims} free dims")
    for size, stride in zip(data.shape[1:], data.stride()[1:]):
        if size > AP_MAX_SIZE:
            fail(op, f"access-pattern sizes <= {AP_MAX_SIZE} (uint16)", size, f"{role} has a free dim of size {size}")
        if size > 1 and stride > AP_MAX_STRIDE:
            fail(op, f"access-pattern strides <= {AP_MAX_STRIDE} elements (int16)", stride,
                 f"{role} has a free-dim stride of {stride} elements")


def legal_start_partitions(count):
    """Compute engines start at partition 0 (>64 partitions), 0/64 (33-64) or 0/32/64/96 (<=32)."""
    return (0,) if count > 64 else (0, 64) if count > 32 else (0, 32, 64, 96)


def start_partition(op, role, t):
    if t.data.storage_offset() == 0:
        return
    start = t.start_partition()
    count = t.data.shape[0]
    if start not in legal_start_partitions(count):
        fail(op, "start partition 0 (>64 parts), 0/64 (33-64), 0/32/64/96 (<=32)", start,
             f"{role} spans {count} partitions starting at partition {start}")


def same_partitions(op, role_a, a, role_b, b):
    pa, pb = a.data.shape[0], b.data.shape[0]
    if pa != pb:
        fail(op, "operands have equal partition dims", (pa, pb),
             f"{role_a} has {pa} partitions but {role_b} has {pb}")


def same_free_size(op, role_a, na, role_b, nb):
    if na != nb:
        fail(op, "equal elements per partition", (na, nb),
             f"{role_a} has {na} elements per partition but {role_b} has {nb}")


def not_both_psum(op, a, b):
    if a.buffer.name == "psum" and b.buffer.name == "psum":
        fail(op, "at most one input in PSUM", "psum", "both inputs are in PSUM")


def gpsimd_no_psum(op, engine, *tensors):
    if engine != "gpsimd":
        return
    for t in tensors:
        if getattr(t, "buffer", None) is not None and t.buffer.name == "psum":
            fail(op, "GpSimd cannot access PSUM", "psum", "an operand is in PSUM but the instruction runs on GpSimd")


def dtype_on_chip(op, role, dtype):
    if not dtype.on_chip:
        fail(op, "no 64-bit dtypes (NKI dtype table)", dtype.name,
             f"{role} has dtype {dtype.name}; NKI has no 64-bit types (use int32 / float32)")


def integer_dtypes(op, op_name, *tensors):
    for t in tensors:
        if t.dtype.kind != "int":
            fail(op, "bitvec ops need integer dtypes", t.dtype.name, f"{op_name} needs integer operands, got {t.dtype.name}")


def alu_op(op, role, nki_op, kinds):
    kind = getattr(nki_op, "kind", None)
    if kind not in kinds:
        fail(op, "op is an ALU operator (nl.add, nl.multiply, ...)", nki_op, f"{role}={nki_op!r} is not an ALU operator")
    if nki_op.unsupported:
        fail(op, f"no {nki_op.name} on the hardware", nki_op.name, nki_op.unsupported)
    if nki_op.min_nc_version > 2:
        target_version(op, nki_op.name, nki_op.min_nc_version)


def target_version(op, what, needed):
    """Instructions and operators documented as "Available only on NeuronCore-v<needed> and newer"."""
    from . import context  # lazily: context imports memory, which imports rules

    target = context.current().target
    if target.nc_version < needed:
        fail(op, f"{what} needs NeuronCore-v{needed}+", target.name, f"{what} is not available on {target.name}")


def activation_op(op, nki_op):
    if not getattr(nki_op, "activation", False):
        fail(op, "op is a ScalarE activation function", nki_op, f"{nki_op!r} is not an activation function")


def reduce_op(op, nki_op):
    """Reduction operators are ALU operators with 'Legal Reduction op = Y' (nki.api.shared.rst,
    tbl-aluop): nl.maximum / nl.add, never the nl.max / nl.sum reduction functions."""
    if getattr(nki_op, "kind", None) == "reduce":
        alu = REDUCTION_ALU_NAMES.get(nki_op.name)
        hint = f"; pass nl.{alu}" if alu else ""
        fail(op, "reduce op is an ALU operator (nl.add, nl.maximum, ...), not a reduction function", nki_op,
             f"op={nki_op!r} is the nl-level reduction function{hint}")
    if getattr(nki_op, "reduce", None) is None:
        fail(op, "reduce op is add/multiply/maximum/minimum/logical_and/logical_or", nki_op, f"{nki_op!r} cannot reduce")


REDUCTION_ALU_NAMES = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum", "all": "logical_and"}


def add_reduce(op, nki_op):
    """nisa.activation: "reduce_op must be nl.add" (nki.isa.activation docstring)."""
    if getattr(nki_op, "name", None) != "add":
        fail(op, "reduce_op must be nl.add", nki_op, f"ScalarE reduce registers only add, got {nki_op!r}")


def same_op_family(op, op0, op1):
    if op1 is not None and (op0.kind == "bitvec") != (op1.kind == "bitvec"):
        fail(op, "op0 and op1 both bitvec or both arithmetic", (op0, op1), f"cannot mix {op0!r} with {op1!r}")


def scalar_engine_ops(op, op0, op1):
    """ScalarE runs tensor_scalar only for multiply/add combinations (trn2)."""
    for o in (op0, op1):
        if o is not None and o.name not in ("multiply", "add"):
            fail(op, "tensor_scalar on ScalarE takes only multiply / add", o.name,
                 f"{o!r} cannot run on the Scalar engine")


def gpsimd_tensor_scalar(op, op0, op1):
    """tensor_scalar engine=gpsimd is "only allowed for rsqrt" (nki.isa.tensor_scalar docstring)."""
    for o in (op0, op1):
        if o is not None and o.name != "rsqrt":
            fail(op, "tensor_scalar on GpSimd only for rsqrt", o.name,
                 f"{o!r} cannot run on the GpSimd engine (use engine=nisa.engine.vector or leave it unknown)")


def alu_unary_operand(op, role, nki_op, operand):
    """Unary ALU operators take operand None or 0 (nki.isa.tensor_scalar docstring)."""
    if operand is not None and not (isinstance(operand, (int, float)) and operand == 0):
        fail(op, f"{role} is None or 0 for a unary operator", operand,
             f"{nki_op!r} is unary; {role} must be None or 0, got {operand!r}")


def vector_operand(op, role, operand, partitions, require_fp32=True):
    """A scalar operand: a Python number or a [P, 1] tile (fp32 for arithmetic) broadcast along the free dims."""
    if isinstance(operand, (int, float)):
        return
    if getattr(operand, "buffer", None) is None:
        fail(op, f"{role} is a number or a [P, 1] tile", type(operand).__name__,
             f"{role} must be a Python number or a [P, 1] tile, got {type(operand).__name__}")
    tile(op, role, operand)
    shape = operand.data.shape
    if shape[0] != partitions or free_size(operand) != 1:
        fail(op, f"{role} is a [P, 1] vector", list(shape),
             f"{role} has shape {list(shape)}; a vector operand must be [{partitions}, 1]")
    if require_fp32 and operand.dtype.name != "float32":
        fail(op, f"{role} vector is float32", operand.dtype.name, f"{role} has dtype {operand.dtype.name}, not float32")


def activation_bias_dtype(op, bias):
    """"the bias parameter can be any supported dtype except tfloat32" (nki.isa.activation docstring)."""
    if getattr(bias, "buffer", None) is not None and bias.dtype.name == "tfloat32":
        fail(op, "bias dtype is not tfloat32", "tfloat32", "bias has dtype tfloat32")


# Valid input ranges of the ScalarE activation functions (nki.api.shared.rst, tbl-act-func):
# op name -> (low, high, symmetric). Outside them "the Scalar Engine will generate invalid output".
ACTIVATION_RANGES = {
    "log": (2.0 ** -64, 2.0 ** 64, False),
    "sqrt": (2.0 ** -116, 2.0 ** 118, False),
    "rsqrt": (2.0 ** -87, 2.0 ** 97, False),
    "reciprocal": (2.0 ** -42, 2.0 ** 42, True),
    "sin": (-3.141592653589793, 3.141592653589793, False),
    "arctan": (-1.5707963267948966, 1.5707963267948966, False),
}


def _range_text(lo, hi, symmetric) -> str:
    return f"+-[{lo!r}, {hi!r}]" if symmetric else f"[{lo!r}, {hi!r}]"


def activation_range(op, nki_op, x: torch.Tensor):
    """Out-of-range activation inputs: a mask of the elements, or None when all are valid (NaN counts as valid:
    it propagates anyway). With $NEURON_INDUCTOR_SIM_STRICT=1 an out-of-range input raises instead."""
    bounds = ACTIVATION_RANGES.get(nki_op.name)
    if bounds is None:
        return None
    lo, hi, symmetric = bounds
    magnitude = x.abs() if symmetric else x
    bad = (magnitude < lo) | (magnitude > hi)
    if not bool(bad.any()):
        return None
    if os.environ.get(STRICT_ENV) == "1":
        value = float(x[bad][0].detach())  # (tiles of a requires-grad argument require grad)
        fail(op, f"{nki_op!r} input within its valid range {_range_text(lo, hi, symmetric)}", value,
             f"{nki_op!r} got input {value!r} (scale and bias applied); the Scalar Engine output is invalid there")
    return bad


def hbm_tensor(op, role, shape, dtype):
    """HBM tensors are at least 1-D (nki.language NkiTensor.__getitem__: "Result is at least 1D") and,
    like every NKI tensor, of a dtype in the NKI dtype table (nki.api.shared.rst tbl-dtype: no 64-bit types)."""
    if len(shape) == 0:
        fail(op, "HBM tensors are at least 1-D", list(shape),
             f"{role} is 0-d; pass a shape-[1] tensor (view it as a scalar on the host)")
    if dtype.itemsize == 8:
        fail(op, "no 64-bit dtypes (NKI dtype table)", dtype.name,
             f"{role} has dtype {dtype.name}; narrow it on the host (int64 -> int32, float64 -> float32)")


def matmul(op, stationary, moving, target, k, m, k2, n, dst_p, dst_n):
    """nc_matmul: stationary [K<=128, M<=128], moving [K<=128, N<=512], dst [M, N] in PSUM."""
    if k != k2:
        fail(op, "contraction over the partition dim of both operands", (k, k2),
             f"stationary has {k} partitions but moving has {k2}")
    if m > STATIONARY_FMAX:
        fail(op, f"stationary free size <= {STATIONARY_FMAX}", m,
             f"stationary free size {m} exceeds gemm_stationary_fmax {STATIONARY_FMAX}")
    if target.moving_fmax_bytes:
        if n * moving.dtype.itemsize > target.moving_fmax_bytes:
            fail(op, f"moving free bytes <= {target.moving_fmax_bytes}", n,
                 f"moving free size {n} x {moving.dtype.itemsize} B exceeds {target.moving_fmax_bytes} B")
    elif n > target.moving_fmax:
        fail(op, f"moving free size <= {target.moving_fmax}", n,
             f"moving free size {n} exceeds gemm_moving_fmax {target.moving_fmax}")
    if dst_p != m or dst_n != n:
        fail(op, "dst is [M, N] = [stationary free, moving free]", [dst_p, dst_n],
             f"dst has {dst_p} partitions x {dst_n} elements, expected {m} x {n}")
    names = (stationary.dtype.name, moving.dtype.name)
    for role, name in zip(("stationary", "moving"), names):
        if name not in MATMUL_INPUT_DTYPES:
            fail(op, "matmul inputs are fp8 / bf16 / fp16 / tf32 / fp32", name, f"{role} has dtype {name}")
    if "float32" in names and not all(name in ("float32", "tfloat32") for name in names):
        fail(op, "fp32 matmul inputs pair only with fp32 / tf32", names, f"stationary {names[0]} with moving {names[1]}")


def matmul_dst_dtype(op, dst, target, allowed_names):
    if dst.dtype.name not in allowed_names:
        fail(op, f"matmul dst dtype in {sorted(allowed_names)} on {target.name}", dst.dtype.name,
             f"dst has dtype {dst.dtype.name}")


def psum_bank(op, role, t, banks: int):
    """A PSUM operand stays inside `banks` 2 KiB PSUM banks of each partition.

    PSUM allocations are taken to start on a bank boundary.
    """
    data = t.data
    storage = t.alloc.storage
    itemsize = t.dtype.itemsize
    partition_elems = storage.stride(0) if storage.dim() > 1 else 1
    bank = PSUM_BANK_BYTES * banks
    if partition_elems * itemsize <= bank:
        return  # the whole allocation fits one bank
    first = data.storage_offset() % partition_elems if data.storage_offset() else 0
    last = first + sum((s - 1) * st for s, st in zip(data.shape[1:], data.stride()[1:]))
    first_byte, last_byte = first * itemsize, (last + 1) * itemsize - 1
    if first_byte // bank != last_byte // bank:
        span = last_byte - first_byte + 1
        where = "one 2 KiB PSUM bank" if banks == 1 else f"{banks} PSUM banks ({bank} B)"
        fail(op, f"PSUM tile within {where} per partition", span,
             f"{role} spans bytes {first_byte}..{last_byte} of each partition, crossing a bank boundary "
             f"({span} B; nl.tile_size.psum_fmax = 512 fp32)")


def reduce_axes(op, axis, ndim) -> int:
    """tensor_reduce / nl reductions: trailing contiguous free axes only, never axis 0. -> first axis."""
    if axis == ndim - 1 or axis == -1:
        if ndim > 1:
            return ndim - 1
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    norm = sorted(a + ndim if a < 0 else a for a in axes)
    if not norm or norm[0] < 1 or norm != list(range(norm[0], ndim)):
        fail(op, "reduce over trailing contiguous free axes, never axis 0", axes,
             f"axis={axes} for a {ndim}-d tile")
    return norm[0]


def accumulate_into_written(op, fully_written: bool):
    if not fully_written:
        fail(op, "accumulate=True needs previously written PSUM", "accumulate=True",
             "accumulate=True adds into PSUM that no instruction has written (undefined on the hardware)")


def memset_value(op, value, dtype):
    if dtype.kind == "int" and isinstance(value, float) and not value.is_integer():
        fail(op, "memset value type matches dst dtype", value, f"value {value} does not fit integer dtype {dtype.name}")


def element_count(op, dst_n, src_n):
    if dst_n != src_n:
        fail(op, "dst and src hold the same number of elements", (dst_n, src_n),
             f"dst has {dst_n} elements but src has {src_n}")


def dma_dtypes(op, dst, src):
    """Hardware-DGE DMAs do not cast."""
    if dst.dtype is not src.dtype:
        fail(op, "hardware DGE copies need equal dtypes", (dst.dtype.name, src.dtype.name),
             f"hwdge cannot cast {src.dtype.name} to {dst.dtype.name}")


def two_byte_dtype(op, role, t):
    if t.dtype.itemsize != 2:
        fail(op, "dma_transpose moves 2-byte dtypes", t.dtype.name, f"{role} has dtype {t.dtype.name}")


def same_dtype(op, role_a, a, role_b, b):
    if a.dtype is not b.dtype:
        fail(op, f"{role_a} and {role_b} have the same dtype", (a.dtype.name, b.dtype.name),
             f"{role_a} is {a.dtype.name} but {role_b} is {b.dtype.name}")


def transpose_limit(op, engine, p, f):
    limit = PMAX if engine == "tensor" else TRANSPOSE_VECTOR_MAX
    if p > limit or f > limit:
        fail(op, f"transpose on {engine} engine <= [{limit}, {limit}]", (p, f),
             f"data [{p}, {f}] exceeds the [{limit}, {limit}] {engine}-engine transpose")


def bn_stats_size(op, n):
    if n > BN_STATS_FMAX:
        fail(op, f"bn_stats free size <= {BN_STATS_FMAX}", n, f"data has {n} elements per partition")


def reshape_keeps_partitions(old, new):
    if old != new:
        fail("NkiTensor.reshape", "on-chip reshape keeps the partition dim", (old, new),
             f"partition dim {old} would become {new}")


def kernel_output(t):
    if t.buffer.name != "shared_hbm":
        fail("nki.jit", "kernel outputs are nl.shared_hbm tensors", t.buffer.name,
             f"the kernel returned a tensor in {t.buffer.name}")


def capacity(pool, nbytes, partitions, what):
    """No start partition a new tile may take has `nbytes` free per partition on all its partitions."""
    held = pool.held_at_starts(partitions)
    live = min(held.values()) + nbytes
    if live > pool.capacity:
        name = pool.buffer_name.upper()
        ranges = ", ".join(f"at partitions {start}-{start + partitions - 1}: {top} B held" for start, top in held.items())
        raise NkiCapacityError(
            "nl.ndarray", f"live {name} bytes per partition <= {pool.capacity} on {pool.target_name}", live,
            f"allocating {what} ({nbytes} B/partition on {partitions} partitions, at its first write) brings live "
            f"{name} to {live} B/partition wherever it may start ({ranges}), "
            f"over the {pool.capacity} B/partition available on {pool.target_name}")
