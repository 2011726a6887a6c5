"""NKI dtypes, their torch storage, type promotion, and the casts the engines perform.

Engines compute in fp32 and cast the result to the destination dtype on write
(nki-reference.md §1): floats round to nearest even (torch's own conversion),
integers round half to even and saturate (the 0.6 simulator semantics), bools
store `value != 0`. float8_e4m3 (IEEE-style, max 240) shares its bit grid below 240
with torch.float8_e4m3fn, so it is stored as e4m3fn and saturated at ±240.

int64 and float64 are not NKI dtypes (nki.api.shared.rst, tbl-dtype): they are named here
only so that a torch tensor of either type is reported by name, as a kernel argument
(`rules.hbm_tensor`) or a tile (`rules.dtype_on_chip`), instead of failing a lookup.
"""

from __future__ import annotations

import os

import torch

from .errors import NkiError

FP32_STORAGE_ENV = "NEURON_INDUCTOR_SIM_FP32_STORAGE"


class NkiDtype:
    """An NKI element type: name, size on the device, torch storage dtype, kind."""

    __slots__ = ("name", "itemsize", "storage", "kind", "lo", "hi", "on_chip")

    def __init__(self, name, itemsize, storage, kind, lo=None, hi=None, on_chip=True):
        self.name = name
        self.itemsize = itemsize
        self.storage = storage
        self.kind = kind  # "float" | "int" | "bool"
        self.lo = lo
        self.hi = hi
        self.on_chip = on_chip

    def __repr__(self):
        return f"nl.{self.name}"

    def __str__(self):
        return self.name  # NKI 0.3+ dtypes are their names: str(nl.bfloat16) == "bfloat16"

    def __reduce__(self):
        return (by_name, (self.name,))


def _int(name, bits, signed, storage, on_chip=True):
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return NkiDtype(name, bits // 8, storage, "int", lo, hi, on_chip)


bool_ = NkiDtype("bool_", 1, torch.bool, "bool")
int8 = _int("int8", 8, True, torch.int8)
int16 = _int("int16", 16, True, torch.int16)
int32 = _int("int32", 32, True, torch.int32)
uint8 = _int("uint8", 8, False, torch.uint8)
uint16 = _int("uint16", 16, False, torch.uint16)
# torch.uint32 lacks most kernels, so uint32 values live in int64 storage.
uint32 = _int("uint32", 32, False, torch.int64)
float16 = NkiDtype("float16", 2, torch.float16, "float")
bfloat16 = NkiDtype("bfloat16", 2, torch.bfloat16, "float")
tfloat32 = NkiDtype("tfloat32", 4, torch.float32, "float")
float32 = NkiDtype("float32", 4, torch.float32, "float")
float8_e4m3 = NkiDtype("float8_e4m3", 1, torch.float8_e4m3fn, "float")
float8_e4m3fn = NkiDtype("float8_e4m3fn", 1, torch.float8_e4m3fn, "float")
float8_e5m2 = NkiDtype("float8_e5m2", 1, torch.float8_e5m2, "float")
# Not NKI dtypes: known only to name them in rule errors.
int64 = _int("int64", 64, True, torch.int64, on_chip=False)
float64 = NkiDtype("float64", 8, torch.float64, "float", on_chip=False)

# MX (microscaling) types of NeuronCore-v4: packed fp8 / fp4 quads and the e8m0 scale. Kernels
# name them at import time; the interpreter stores their bytes (DMA moves them) but no engine
# computes on them (nc_matmul_mx / quantize_mx are not modelled): kind "mx".
float8_e5m2_x4 = NkiDtype("float8_e5m2_x4", 4, torch.int32, "mx")
float8_e4m3fn_x4 = NkiDtype("float8_e4m3fn_x4", 4, torch.int32, "mx")
float4_e2m1fn_x4 = NkiDtype("float4_e2m1fn_x4", 2, torch.int16, "mx")
float8_e8m0fnu = NkiDtype("float8_e8m0fnu", 1, torch.uint8, "mx")
MX = (float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4, float8_e8m0fnu)

ALL = (bool_, int8, int16, int32, uint8, uint16, uint32, float16, bfloat16, tfloat32, float32,
       float8_e4m3, float8_e4m3fn, float8_e5m2, int64, float64) + MX
_BY_NAME = {d.name: d for d in ALL}
_FROM_TORCH = {
    torch.bool: bool_, torch.int8: int8, torch.int16: int16, torch.int32: int32,
    torch.int64: int64, torch.uint8: uint8, torch.uint16: uint16, torch.uint32: uint32,
    torch.float16: float16, torch.bfloat16: bfloat16, torch.float32: float32,
    torch.float64: float64, torch.float8_e4m3fn: float8_e4m3fn, torch.float8_e5m2: float8_e5m2,
}
FP8 = (float8_e4m3, float8_e4m3fn, float8_e5m2)
_NARROW_FLOATS = (bfloat16,) + FP8  # numpy has no such types: the real simulator's fp32 mode


def by_name(name: str) -> NkiDtype:
    return _BY_NAME[name]


def as_dtype(value) -> NkiDtype:
    """NKI dtype of a dtype-like: an NkiDtype, a torch dtype, or a NumPy dtype / scalar type."""
    if isinstance(value, NkiDtype):
        return value
    if isinstance(value, torch.dtype):
        found = _FROM_TORCH.get(value)
    else:
        name = getattr(value, "name", None) or getattr(value, "__name__", None)
        found = _BY_NAME.get({"bool": "bool_"}.get(name, name)) if isinstance(name, str) else None
    if found is None:
        raise TypeError(f"not an NKI dtype: {value!r} (use nl.float32, nl.bfloat16, ...)")
    return found


def of_torch(dtype: torch.dtype) -> NkiDtype:
    return _FROM_TORCH[dtype]


def storage_for(dtype: NkiDtype, on_chip: bool) -> torch.dtype:
    """Torch dtype holding `dtype`; bf16/fp8 tiles may be kept as fp32 (see FP32_STORAGE_ENV)."""
    if on_chip and dtype in _NARROW_FLOATS and os.environ.get(FP32_STORAGE_ENV) == "1":
        return torch.float32
    return dtype.storage


def fill_value(dtype: NkiDtype):
    """What fresh memory holds, as in the real simulator: NaN for floats, 4 for integers."""
    return float("nan") if dtype.kind == "float" else (True if dtype.kind == "bool" else 4)


def round_tf32(values: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to tf32's 10-bit mantissa, nearest even (NaN/inf unchanged)."""
    bits = values.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(values), rounded, values)


def cast_for_store(values: torch.Tensor, dtype: NkiDtype, storage: torch.dtype) -> torch.Tensor:
    """Turn fp32 (or exact int64) engine results into what `copy_` must write for `dtype`.

    Floats need nothing (copy_ rounds to nearest even) except tf32 rounding and the
    e4m3 saturation; with fp32 storage nothing is rounded, like the real simulator's fp32 mode.
    """
    kind = dtype.kind
    if kind == "float":
        if dtype is tfloat32:
            return round_tf32(values.float())
        if dtype is float8_e4m3 and storage is not torch.float32:
            return values.clamp(-240.0, 240.0)
        return values
    if kind == "mx":
        raise NkiError(f"no engine writes {dtype.name} values in the interpreter (MX matmul / quantize_mx "
                       "are NeuronCore-v4 instructions it does not model); only DMA may move MX bytes")
    if kind == "int":
        if values.is_floating_point():
            values = values.double().round().nan_to_num(0.0)
        return values.clamp(dtype.lo, dtype.hi)
    return values != 0


def promote(a: NkiDtype, b: NkiDtype) -> NkiDtype:
    """Result dtype of an nl-level binary op (the table of nki-reference.md §1)."""
    if a is b:
        return a
    if a.kind == "float" and b.kind != "float":
        return a
    if b.kind == "float" and a.kind != "float":
        return b
    if a.kind == "float":
        pair = {a, b}
        if float32 in pair or tfloat32 in pair or pair == {float16, bfloat16}:
            return float32
        if float16 in pair:
            return float16
        return bfloat16  # fp8 with bf16, or e4m3 with e5m2
    if a.kind == "bool":
        return b
    if b.kind == "bool":
        return a
    if {a, b} == {int32, uint32}:
        return float32
    signed = a.lo < 0 or b.lo < 0
    size = max(a.itemsize, b.itemsize)
    if signed and (a.lo == 0 and a.itemsize == size or b.lo == 0 and b.itemsize == size):
        size *= 2  # an unsigned type needs a wider signed type to fit: (i8, u8) -> i16
    return {1: int8, 2: int16, 4: int32}[min(size, 4)] if signed else {1: uint8, 2: uint16, 4: uint32}[size]


def scalar_dtype(value) -> NkiDtype:
    """Python scalars act as weak int32 / float32 (nki-reference.md §1, promotion)."""
    if isinstance(value, bool):
        return bool_
    return int32 if isinstance(value, int) else float32
