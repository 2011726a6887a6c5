"""nki.isa enumerations (engine, reduce_cmd, dge_mode, oob_mode, matmul_perf_mode, nc_version,
dma_engine) and the engine= argument check shared by every instruction."""

from __future__ import annotations

from enum import Enum

from . import context
from .errors import NkiError


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


