"""How graph values cross into and out of kernels.

NKI has no 64-bit dtypes (nki.api.shared.rst, tbl-dtype) and HBM tensors are at least 1-D
(nki.language NkiTensor.__getitem__: "Result is at least 1D"). So the host narrows int64 values to
int32 before any kernel call (saturating, as a DMA into int32 tiles would) and passes 0-d values
as shape-[1] views; kernels return 0-d results as shape-[1] tensors, viewed as 0-d again on the host.
"""

from __future__ import annotations

import torch

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def kernel_shape(shape) -> tuple[int, ...]:
    """The HBM shape a kernel sees for a graph value of `shape`."""
    return tuple(int(s) for s in shape) or (1,)


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel sees for a graph value of `dtype`."""
    return torch.int32 if dtype == torch.int64 else dtype


def int32_argument(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor narrowed to int32, saturating."""
    return t.clamp(INT32_MIN, INT32_MAX).to(torch.int32)


def kernel_argument(t: torch.Tensor) -> torch.Tensor:
    """A graph value as a kernel argument (the wrapper writes the same conversions inline)."""
    if t.dtype == torch.int64:
        t = int32_argument(t)
    return t.reshape(1) if t.dim() == 0 else t
