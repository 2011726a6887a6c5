"""The op table: what happens to each ATen op, in one place.

- `LOWERINGS`: the kernel lowering of an op, called as `lowering(ctx, node)` with the graph's
  `LoweringContext` (lowering/context.py: the target and its tile sizes). Lowering modules register
  with `register_lowering` (pointwise ops with `lowering.pointwise.register_pointwise`);
  `load_lowerings()` imports the modules of `LOWERING_MODULES`.
- `VIEW_OPS`, `ALLOCATIONS`, `SIZE_OPS`, `RNG_WRAPPERS`, `COLLECTIVES`: host steps (no kernel).
- `FALLBACKS`: deliberate eager fallbacks, with the reason the user sees.
- `KEPT_WHOLE`: ops the decomposition table leaves whole because a lowering takes them.
- `PAD_RULES`: how `passes/pad_safety.py` makes an op safe on padded data (`@pad_rule(op)`); ops
  without one are judged row-local or refused there (`pad_safety.rule_for`).
`python -m neuron_inductor.support_table` writes the op -> lowering / pad rule / fallback table
to docs/supported_ops.md; tests/test_op_table.py checks the table is consistent and up to date.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from .context import LoweringContext
from .ir import KernelSpec

aten = torch.ops.aten

LoweringFn = Callable[[LoweringContext, fx.Node], KernelSpec]

# ATen op overload -> function building the KernelSpec for one node, for the context's target.
LOWERINGS: dict[torch._ops.OpOverload, LoweringFn] = {}

# Modules holding the lowerings, one kernel family each (imported by load_lowerings()).
LOWERING_MODULES = [
    "neuron_inductor.lowering.pointwise",
    "neuron_inductor.lowering.reduction",
    "neuron_inductor.lowering.matmul",
    "neuron_inductor.lowering.attention",
    "neuron_inductor.lowering.norms",
    "neuron_inductor.lowering.indexing",
    "neuron_inductor.lowering.copy",
    "neuron_inductor.lowering.convolution",
    "neuron_inductor.lowering.pooling",
    "neuron_inductor.lowering.lm_head_loss",
    "neuron_inductor.nki_ops.lowering",  # users' nki_op custom ops (each op adds its own entry when defined)
]

# Metadata-only ops: run on the host as torch views (no data moves; kernels read through strides).
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.permute.default, aten.transpose.int, aten.t.default,
    aten.expand.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.alias.default,
    aten.as_strided.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.diagonal.default, aten.detach.default, aten.lift_fresh_copy.default,
}

# Allocations of uninitialised memory: the host runtime reserves the buffer; no data moves, no math.
ALLOCATIONS = {
    aten.empty.memory_format, aten.empty_permuted.default, aten.empty_strided.default,
    aten.new_empty.default, aten.new_empty_strided.default,
}

# Size arithmetic and runtime shape checks (on SymInts, no tensor data): host scalar steps.
SIZE_OPS = {
    aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
    aten._assert_scalar.default, aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
}

# Functional collectives (torch.distributed._functional_collectives; DTensor and FSDP2 trace to them):
# communication steps of the program, run by the host through the op's process group (gloo on CPU,
# the device's collective backend on a Neuron host). Each returns a new tensor; `wait_tensor` marks
# where its result is needed (a no-op for a collective that already completed).
_c10d = torch.ops._c10d_functional
COLLECTIVES = {
    _c10d.all_reduce.default, _c10d.all_reduce_coalesced.default, _c10d.all_gather_into_tensor.default,
    _c10d.all_gather_into_tensor_coalesced.default, _c10d.reduce_scatter_tensor.default,
    _c10d.reduce_scatter_tensor_coalesced.default, _c10d.all_to_all_single.default, _c10d.broadcast.default,
    _c10d.wait_tensor.default,
}

# Wrappers the partitioner puts around a random op of a checkpointed region -> position of the
# wrapped op in their args (its own args follow it): the forward saves the generator state
# (run_and_save_rng_state returns it with the op's result), the backward's recompute restores it.
RNG_WRAPPERS = {torch.ops.higher_order.run_and_save_rng_state: 0, torch.ops.higher_order.run_with_rng_state: 1}

# Deliberate eager fallbacks, with the reason reported to the user.
FALLBACKS: dict[torch._ops.OpOverload, str] = {
    aten.native_dropout.default: "random numbers stay on the host so results follow eager's RNG stream",
    aten.bernoulli.p: "random numbers stay on the host so results follow eager's RNG stream",
    aten.rand.default: "random numbers stay on the host so results follow eager's RNG stream",
    aten.randn.default: "random numbers stay on the host so results follow eager's RNG stream",
    aten.rand_like.default: "random numbers stay on the host so results follow eager's RNG stream",
    aten.randn_like.default: "random numbers stay on the host so results follow eager's RNG stream",
    aten._local_scalar_dense.default: "reads a device value into Python (a host sync, not a kernel)",
}


# Ops the decomposition table keeps whole (decompositions.py removes them from the core table)
# because a kernel family lowers them directly: a dedicated kernel beats the decomposed pointwise
# soup (fewer HBM round trips, fused reductions). Every one must have a lowering.
KEPT_WHOLE = [
    aten._softmax_backward_data.default,  # lowering/norms.py
    aten._log_softmax_backward_data.default,  # lowering/norms.py
    aten.native_layer_norm_backward.default,  # lowering/norms.py
    aten._fused_rms_norm.default,  # lowering/norms.py
    aten.nll_loss_forward.default,  # lowering/norms.py (cross-entropy)
    aten.nll_loss_backward.default,  # lowering/norms.py (cross-entropy)
    aten.embedding_dense_backward.default,  # lowering/indexing.py
    aten.silu.default,  # lowering/pointwise.py (one ScalarE activation)
    aten.silu_backward.default,  # lowering/pointwise.py (ScalarE's silu_dx and one multiply)
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # lowering/attention.py
]
# Not in the core table at all, listed so the reader sees the whole picture: _softmax, _log_softmax,
# native_layer_norm, gelu, addmm, mm, bmm, embedding, and the SDPA backward stay whole by default.
# `linear` is not kept whole: it decomposes to addmm / mm of the transposed weight (a view), which
# the matmul family lowers reading the weight in place.


@dataclass(frozen=True)
class PadRule:
    """`rule(rewriter, node)` makes one op's node safe on padded data; `what` says how, briefly."""

    rule: Callable
    what: str


# ATen op (or higher-order op) -> its pad-safety rule (registered by passes/pad_rules.py and pad_position_rules.py).
PAD_RULES: dict = {}


def pad_rule(*ops, what: str) -> Callable[[Callable], Callable]:
    def decorate(rule: Callable) -> Callable:
        for op in ops:
            if op in PAD_RULES:
                raise RuntimeError(f"{op} already has a pad-safety rule ({PAD_RULES[op].rule.__name__})")
            PAD_RULES[op] = PadRule(rule, what)
        return rule

    return decorate


def register_lowering(*ops: torch._ops.OpOverload) -> Callable[[LoweringFn], LoweringFn]:
    def decorate(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            if op in LOWERINGS:
                raise RuntimeError(f"{op} already has a lowering ({LOWERINGS[op].__module__})")
            LOWERINGS[op] = fn
        return fn

    return decorate


_loaded = False


def load_lowerings() -> None:
    global _loaded
    if not _loaded:
        for module in LOWERING_MODULES:
            importlib.import_module(module)
        _loaded = True
