"""The tile program's data: SSA instructions over on-chip tiles, the inputs they read, and dtype names.

A program is layout-free: it says what each value is computed from, never how tiles are shaped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.fx as fx

Ref = Union[str, float, int]  # an SSA value name, or an immediate


def is_imm(value) -> bool:
    return not isinstance(value, str)


@dataclass(frozen=True)
class Instr:
    """One primitive instruction of a pointwise program.

    kind and operands:
      act    (data, scale, bias)   func(data * scale + bias); attrs: func (nl name)
      ts     (data, a0, a1)        (data op0 a0) op1 a1, a0 / a1 immediates; attrs: op0, op1, rev0, rev1
      tt     (x, y)                x op y; attrs: op
      stt    (data, a0, y)         (data op0 a0) op1 y, a0 immediate; attrs: op0, op1
      recip  (x,)                  1 / x
      cast   (x,)                  x converted to `dtype` (float -> int rounds half to even)
      iota   ()                    the flat element index of a 1-D iteration (int32)
    `bits` marks bit-level ops: float32 operands and results are read / written as int32 views.
    `dtype` is the on-chip dtype name of the result tile.
    """

    out: str
    kind: str
    operands: tuple
    dtype: str = "float32"
    attrs: tuple = ()
    bits: bool = False

    def attr(self, name: str, default=None):
        return dict(self.attrs).get(name, default)


@dataclass(frozen=True)
class ProgramInput:
    name: str                # SSA value it binds
    value: fx.Node           # the graph value read from HBM
    shape: tuple[int, ...]   # and its shape and strides in the program's dims
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def arg_shape(self) -> tuple[int, ...]:
        """The shape of the kernel argument (`shape` restates it in the program's dims, which may
        differ by size-1 dims: lowering/unit_views.py)."""
        return tuple(int(s) for s in self.value.meta["val"].shape)

    @property
    def tile_dtype(self) -> str:
        return on_chip_name(self.dtype)

    @property
    def column_dtype(self) -> str:
        """The dtype of the [P, 1] column a broadcast input is read into: int32 for integers (bit
        selects and exact integer math need integer operands), fp32 for the rest."""
        return "int32" if self.tile_dtype in ("int32", "int16", "int8") else "float32"


@dataclass
class PointwiseProgram:
    shape: tuple[int, ...]
    inputs: list[ProgramInput]
    instrs: list[Instr]
    results: list[tuple[fx.Node, Ref]]


def on_chip_name(dtype: torch.dtype) -> str:
    """The dtype name of the on-chip tile holding a value of `dtype` (int64 -> int32, bool -> uint8)."""
    if dtype.is_floating_point:
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return "uint8" if dtype in (torch.bool, torch.uint8) else "int8" if dtype == torch.int8 else (
        "int16" if dtype == torch.int16 else "int32")


SUPPORTED_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
                    torch.int8, torch.uint8, torch.bool}

# nl dtype expressions of the on-chip dtype names, and their sizes in bytes.
NL_DTYPE = {"float32": "nl.float32", "bfloat16": "nl.bfloat16", "float16": "nl.float16", "int32": "nl.int32",
            "int16": "nl.int16", "int8": "nl.int8", "uint8": "nl.uint8"}
ITEMSIZE = {"float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "int16": 2, "int8": 1, "uint8": 1}
