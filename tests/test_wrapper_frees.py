"""The host wrapper drops each graph value after the last step that reads it (codegen/wrapper.py)."""

from __future__ import annotations

import ast

import torch

from neuron_inductor.codegen.wrapper import _freeing
from neuron_inductor.observe import session
from neuron_inductor.testing import TinyLlama, TinyLlamaConfig


def _lifetimes(source: str) -> tuple[dict, dict, dict, set]:
    """Of the wrapper's `run`: per name the statement indices binding it, loading it, deleting it;
    and the names its return reads."""
    (function,) = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)]
    bound, loaded, deleted = {}, {}, {}
    for index, statement in enumerate(function.body):
        for node in ast.walk(statement):
            if isinstance(node, ast.Name):
                table = {ast.Store: bound, ast.Load: loaded, ast.Del: deleted}[type(node.ctx)]
                table.setdefault(node.id, []).append(index)
    returned = {node.id for node in ast.walk(function.body[-1]) if isinstance(node, ast.Name)}
    return bound, loaded, deleted, returned


def test_a_training_step_frees_every_value_after_its_last_use():
    """Forward and backward of a Llama: every value the graph does not return is deleted once, after
    its last read and never before it (a use after the del would be a NameError, a missing del keeps
    the buffer to the return), and the step still matches eager."""
    torch.manual_seed(0)
    config = TinyLlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48)
    model, reference = TinyLlama(config), TinyLlama(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    first = len(session.BUCKETS)
    loss = torch.compile(model, backend="neuron")(ids, ids)
    loss.backward()
    expected = reference(ids, ids)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    for param, ref_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-4, atol=1e-5)
    programs = session.BUCKETS[first:]
    assert len(programs) == 2, "a forward and a backward graph"
    for program in programs:
        bound, loaded, deleted, returned = _lifetimes(program.artifact.wrapper_source)
        values = {name for name in bound if name.startswith(("buf", "arg"))}
        assert len(values) > 10
        for name in sorted(values - returned):
            assert len(deleted.get(name, ())) == 1, f"{name} is not deleted once:\n{program.artifact.wrapper_source}"
            (gone,) = deleted[name]
            assert all(index < gone for index in loaded.get(name, ())), f"{name} is read after its del"
            assert max(bound[name]) < gone
            # (a step is one to three lines: the call, a write-back, a 0-d output's clone)
            assert gone <= max(loaded.get(name, bound[name])) + 3, f"{name} is deleted long after its last use"
        assert not values & returned & deleted.keys(), "a returned value was deleted"


def test_freeing_drops_unread_arguments_first_and_each_value_after_its_last_reader():
    lines = _freeing(step_lines=[["buf0 = k0(arg0)"], ["buf1 = k1(buf0, arg1)"], ["buf2 = k2(buf1)"]],
                     made=[{"buf0"}, {"buf1"}, {"buf2"}], read=[{"arg0"}, {"buf0", "arg1"}, {"buf1"}],
                     arguments={"arg0", "arg1", "arg2"}, returned={"buf2", "arg1"})
    assert lines == ["del arg2", "buf0 = k0(arg0)", "del arg0", "buf1 = k1(buf0, arg1)", "del buf0",
                     "buf2 = k2(buf1)", "del buf1"]
