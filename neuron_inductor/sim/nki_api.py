"""The top-level `nki` module as kernels see it under `as_nki()`: jit, simulate, language, isa."""

from . import isa, language  # noqa: F401
from .launch import jit, simulate  # noqa: F401
from .tensor import NkiTensor  # noqa: F401
