"""`nki.isa.constants`: the enums of nki.isa, importable on their own (`from nki.isa.constants import oob_mode`)."""

from .isa import (  # noqa: F401
    dge_mode,
    dma_engine,
    engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
)
