"""A CPU interpreter for NKI 0.3+ kernels (`nki`, `nki.language`, `nki.isa`) on torch tensors.

Kernels written for real NKI run unchanged::

    from neuron_inductor import sim
    kernels = sim.load_kernels(source, "k0.py")     # exec under as_nki(), {name: kernel}
    out = kernels["k0_pointwise"](x, y)             # torch CPU tensors in, torch tensors out

    with sim.as_nki():                              # `import nki` etc. resolve to the interpreter
        import my_kernels
    with sim.trace() as t:                          # record every ISA instruction
        out = my_kernels.matmul(a, b)
    t.estimate("trn2").total_seconds                # cost-model device time for one NeuronCore
    with sim.shapes_only():                         # shape logic only, on meta tensors (no math)
        out = my_kernels.matmul(a.to("meta"), b.to("meta"))

    python -m neuron_inductor.sim SCRIPT.py ARGS    # run a script written for real NKI

What it enforces: the hardware rules of nki-reference.md §2 and of the nki.isa API reference
(NkiRuleError naming op, rule and value; rules.py cites the documentation of each), live
SBUF / PSUM bytes per partition (NkiCapacityError), NaN-filled fresh memory (integers 4),
accumulate=True only into written PSUM. Kernel arguments and HBM tensors are at least 1-D and
of a dtype in the NKI table (no int64 / float64: narrow on the host). Activation functions
with a limited valid input range (log, sqrt, rsqrt, reciprocal, sin, arctan) give NaN outside
it, as the hardware's output is invalid there ($NEURON_INDUCTOR_SIM_STRICT=1 raises instead).
Numerics: fp32 compute (tensor_scalar arithmetic included, on integer tiles too),
round-to-nearest-even casts into bf16 / fp8 storage, saturating integer casts, fp32 PSUM
accumulation.

Environment:
  NEURON_INDUCTOR_SIM_FP32_STORAGE=1   store bf16 / fp8 tiles as unrounded fp32 (the real
                                       simulator's NKI_PRECISE_FP=0 mode); default: real dtypes
  NEURON_PLATFORM_TARGET_OVERRIDE      trn1|gen2, trn2|gen3, trn3|gen4 (default trn2): limits,
                                       capacities and the cost model's default target
                                       (`nki.jit(platform_target=...)` overrides it per kernel)
  NEURON_INDUCTOR_SIM_STRICT=1         an activation input outside its valid range raises
                                       NkiRuleError (default: the output there is NaN)
  NEURON_INDUCTOR_SIM_THREADS=N        torch intra-op threads while a kernel runs (default 1:
                                       tile ops are too small to gain; 0 keeps torch's setting)

Modules: dtypes, tensor (NkiTensor), views (NkiTensor view methods), indirect (indirect DMA
views), addressed (address= tiles), memory (capacity), rules (checks), ops (math operators),
isa (the nki.isa namespace; instructions by family in isa_tensor_engine, isa_alu,
isa_activation, isa_dma, isa_scan, isa_search, isa_gather, isa_cores, isa_dma_compute, isa_random,
isa_mx; shared pieces in isa_enums, isa_operands), isa_constants, registers (virtual registers, dynamic loops), objects
(NKIObject), typing_api (nki.typing), language (nki.language), launch (nki.jit), cores (SPMD /
LNC programs and their sync points), tracing, cost_model, targets (hardware constants), shim
(as_nki, load_kernels), __main__ (script runner). README "Interpreter fidelity" lists coverage.
"""

from . import isa, language
from .cost_model import Estimate, estimate
from .errors import NkiCapacityError, NkiError, NkiIndexError, NkiRuleError
from .launch import Kernel, jit, simulate
from .shim import as_nki, load_kernels
from .targets import TARGETS, Target, get_target
from .tensor import NkiTensor, shapes_only
from .tracing import Instruction, Trace, trace

__all__ = [
    "Estimate", "Instruction", "Kernel", "NkiCapacityError", "NkiError", "NkiIndexError", "NkiRuleError",
    "NkiTensor", "TARGETS", "Target", "Trace", "as_nki", "estimate", "get_target", "isa", "jit", "language",
    "load_kernels", "shapes_only", "simulate", "trace",
]
