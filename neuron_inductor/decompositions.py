"""The Neuron decomposition table, in one place.

Start from PyTorch's core ATen decompositions, remove the ops we lower whole (a dedicated kernel
beats the decomposed pointwise soup: fewer HBM round trips, fused reductions), and add overrides.
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, register_decomposition

aten = torch.ops.aten

# Ops kept whole because a kernel family lowers them directly.
KEPT_WHOLE = [
    aten._softmax_backward_data.default,  # lowering/norms.py
    aten._log_softmax_backward_data.default,  # lowering/norms.py
    aten.native_layer_norm_backward.default,  # lowering/norms.py
    aten._fused_rms_norm.default,  # lowering/norms.py
    aten.nll_loss_forward.default,  # lowering/norms.py (cross-entropy)
    aten.nll_loss_backward.default,  # lowering/norms.py (cross-entropy)
    aten.embedding_dense_backward.default,  # lowering/indexing.py
    aten.silu.default,  # lowering/pointwise.py (one ScalarE activation)
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # lowering/attention.py
    aten.linear.default,  # addmm / mm with the transposed weight as a view
]
# Not in the core table at all, listed so the reader sees the whole picture: _softmax, _log_softmax,
# native_layer_norm, gelu, addmm, mm, bmm, embedding, and the SDPA backward stay whole by default.

OVERRIDES: dict = {}


def _override(op):
    return register_decomposition(op, OVERRIDES)


@functools.lru_cache(maxsize=None)
def neuron_decompositions() -> dict:
    table = dict(core_aten_decompositions())
    for op in KEPT_WHOLE:
        table.pop(op, None)
    table.update(OVERRIDES)
    return table
