"""The op table (lowering/registry.py) is consistent, and docs/supported_ops.md is generated from it."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_inductor import support_table
from neuron_inductor.decompositions import neuron_decompositions
from neuron_inductor.lowering import registry
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.graph import lower_graph
from neuron_inductor.passes import pad_rules, pad_safety

aten = torch.ops.aten


def test_every_kept_whole_op_has_a_lowering():
    registry.load_lowerings()
    assert [op for op in registry.KEPT_WHOLE if op not in registry.LOWERINGS] == []


def test_kept_whole_ops_are_not_decomposed():
    table = neuron_decompositions()
    assert [op for op in registry.KEPT_WHOLE if op in table] == []


def test_deliberate_fallbacks_have_no_lowering_and_are_not_host_steps():
    registry.load_lowerings()
    host = registry.VIEW_OPS | registry.ALLOCATIONS | registry.SIZE_OPS | registry.COLLECTIVES
    assert set(registry.FALLBACKS) & set(registry.LOWERINGS) == set()
    assert set(registry.FALLBACKS) & host == set()


def test_pad_rules_win_over_the_row_local_default():
    # slice is a view (row-local) but counts negative bounds from the real end: its own rule applies
    assert pad_safety.rule_for(aten.slice.Tensor) is registry.PAD_RULES[aten.slice.Tensor].rule
    assert pad_safety.rule_for(aten.add.Tensor) is pad_rules.row_local_or_deny
    assert pad_safety.rule_for(aten.randn.default) is pad_rules.random_op


def test_linear_decomposes_to_a_lowered_matmul_even_when_traced_before_dispatch():
    # linear was once listed as kept whole with no lowering: a pre-dispatch trace kept it and fell back
    def f(x, w, b):
        return torch.nn.functional.linear(x, w, b)

    gm = make_fx(f, decomposition_table=neuron_decompositions(), pre_dispatch=True, tracing_mode="fake")(
        torch.randn(4, 8), torch.randn(3, 8), torch.randn(3))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.linear.default not in targets and aten.addmm.default in targets
    lowered = lower_graph(gm, LoweringContext.for_target("trn2"))
    assert lowered.fallbacks == [] and [k.family for k in lowered.kernels] == ["matmul"]


def test_the_support_table_in_docs_is_up_to_date():
    assert support_table.main(["--check"]) == 0, "run: python -m neuron_inductor.support_table"


def test_the_support_table_lists_every_lowering_and_fallback():
    text = support_table.render()
    for op in [aten.mm.default, aten.add.Tensor, aten.native_dropout.default, aten._fused_rms_norm.default]:
        assert f"| `{op}` |" in text
    assert "| `aten.native_dropout.default` |  |  |" in text and "eager's RNG stream" in text
