"""Users' own NKI kernels in PyTorch models: `wrap_nki` calls a kernel, `nki_op` makes a custom op of
a function calling kernels, which `backend="neuron"` compiles as a kernel of the program.

Modules: wrap (wrap_nki: real, shape-only and compiled-program runs), op (nki_op, the registry,
declaration checks), sources (kernel source text, rebuilding a kernel for another nki), lowering
(the op's FX node as a kernel step).
"""

from .op import NkiOpError, kernels_hash, nki_op
from .wrap import wrap_nki

__all__ = ["NkiOpError", "kernels_hash", "nki_op", "wrap_nki"]
