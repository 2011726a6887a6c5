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

Instruction families live in their own modules (isa_tensor_engine, isa_alu, isa_activation, isa_dma,
isa_scan, isa_search, isa_gather, isa_cores, isa_dma_compute, isa_random, ...); this module is the
`nki.isa` namespace kernels see and re-exports the operand helpers the other sim modules use.
"""

from __future__ import annotations

from .registers import VirtualRegister, register_alloc, register_load, register_move, register_store  # noqa: F401
from . import context  # noqa: F401
from .errors import NkiError, NkiIndexError, NkiValidationError  # noqa: F401
from .ops import OPS  # noqa: F401
from .tracing import ACTIVE, record  # noqa: F401
from .isa_enums import (_engine, dge_mode, dma_engine, engine, get_nc_version, gpsimd_engine, matmul_perf_mode,  # noqa: F401
                        nc_version, oob_mode, reduce_cmd, scalar_engine, tensor_engine, unknown_engine, vector_engine)
from .isa_operands import (_PSUM, _SBUF, _bytes, _check_elementwise, _copy_exact, _f32, _flat, _i64,  # noqa: F401
                           _scalar, _write, f32_immediate)
from .isa_tensor_engine import nc_matmul, nc_transpose  # noqa: F401
from .isa_alu import (affine_select, fill, iota, memset, reciprocal, scalar_tensor_tensor, tensor_copy,  # noqa: F401
                      tensor_reduce, tensor_scalar, tensor_tensor)
from .isa_activation import _activation, activate2, activation, activation_reduce, bn_aggr, bn_stats  # noqa: F401
from .isa_dma import _dma_copy, dma_copy, dma_transpose  # noqa: F401
# The modules below read the names above through `isa.` (default arguments included), so they come last.
from .isa_cores import core_barrier, sendrecv  # noqa: F401
from .isa_scan import (exponential, range_select, select_reduce, tensor_scalar_cumulative,  # noqa: F401
                       tensor_scalar_reduce, tensor_tensor_scan)
from .isa_search import (max8, nc_find_index8, nc_match_replace8, nonzero_with_count, sequence_bounds,  # noqa: F401
                         topk)
from .isa_gather import (local_gather, nc_n_gather, nc_stream_shuffle, tensor_copy_predicated,  # noqa: F401
                         tensor_partition_reduce)
from .isa_dma_compute import dma_compute  # noqa: F401
from .isa_random import dropout, rand2, rand_get_state, rand_set_state, rng, set_rng_seed  # noqa: F401
from .isa_mx import NkiInstruction, get_nc_sub_version, nc_matmul_mx, quantize_mx  # noqa: F401
