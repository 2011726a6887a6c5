"""The top-level `nki` module as kernels see it under `as_nki()`: jit, simulate, language, isa."""

from . import isa, language  # noqa: F401
from .jit import jit, simulate  # noqa: F401
from .tensor import NkiTensor  # noqa: F401
