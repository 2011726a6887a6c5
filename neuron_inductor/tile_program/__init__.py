"""Tile programs: elementwise math as a small SSA program over on-chip tiles, and its kernel plan.

The pointwise family renders them as whole kernels; the matmul family applies one to each output
tile as an epilogue. The pieces, one module each:
- `ir`: the program (`PointwiseProgram` of `Instr`s: act / ts / tt / stt / recip / cast / iota,
  mirroring nisa.activation, tensor_scalar, tensor_tensor, scalar_tensor_tensor, reciprocal,
  tensor_copy, iota; `ProgramInput`s naming the HBM values it reads) and the on-chip dtype names;
- `builder`: `ProgramBuilder`, whose primitives fold immediates and whose composites hold the
  numerics ATen ops share (exact integral rounding, bit selects, argument reduction, erfc), and
  `build_program(nodes, outputs)`, which emits each node through its op's `register_pointwise` rule;
- `select`: `resolve_program(program, kinds, hoisted, store_dtypes)`, instruction selection for
  operand kinds ("tile" [P, F] / "col" [P, 1]) into dicts `codegen_templates/_pointwise_ops.py.j2`
  renders;
- `planner`: `plan_kernel(program, tile)`, the tiling of a whole pointwise kernel for a target's
  tile sizes, as template data.
"""

from .builder import ERFC_COEFFICIENTS, ProgramBuilder, build_program, constant_scalar, node_arguments
from .ir import SUPPORTED_DTYPES, Instr, PointwiseProgram, ProgramInput, Ref, is_imm, on_chip_name
from .planner import plan_kernel
from .select import ResolvedProgram, resolve_program

__all__ = [
    "ERFC_COEFFICIENTS", "SUPPORTED_DTYPES", "Instr", "PointwiseProgram", "ProgramBuilder", "ProgramInput",
    "Ref", "ResolvedProgram", "build_program", "constant_scalar", "is_imm", "node_arguments", "on_chip_name",
    "plan_kernel", "resolve_program",
]
