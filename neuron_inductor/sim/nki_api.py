"""The top-level `nki` module as kernels see it under `as_nki()`: jit, simulate, language, isa, collectives, dtype,
typing."""

from . import dtypes as dtype  # noqa: F401  (`nki.dtype`: the dtype names, also used as an annotation)
from . import collectives, isa, language  # noqa: F401
from . import typing_api as typing  # noqa: F401
from .launch import jit, simulate  # noqa: F401
from .tensor import NkiTensor  # noqa: F401
