"""nki.isa scans and fused reductions on VectorE: tensor_tensor_scan, tensor_scalar_reduce.

tensor_scalar_reduce accumulates into the Vector engine's reduce accumulators (one fp32 per
partition, per program), controlled by reduce_cmd: reset_reduce starts from the op's identity,
reduce continues, load_reduce starts from reduce_init.
"""

from __future__ import annotations

import torch

from . import context, isa, rules

_ARITH = frozenset({"arith"})


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """dst[:, i] = op1(op0(data0[:, i], dst[:, i-1]), data1[:, i]) with dst[:, -1] = initial, in fp32."""
    api = "nisa.tensor_tensor_scan"
    rules.alu_op(api, "op0", op0, _ARITH)
    rules.alu_op(api, "op1", op1, _ARITH)
    p, n = isa._check_elementwise(api, dst, ("data0", data0), ("data1", data1))
    rules.not_both_psum(api, data0, data1)
    rules.vector_operand(api, "initial", initial, p)
    a, b = isa._f32(data0), isa._f32(data1)
    state = isa._scalar(initial).reshape(-1).expand(p) if getattr(initial, "buffer", None) is not None \
        else isa.f32_immediate(initial).expand(p)
    out = torch.empty(p, n)
    for i in range(n):
        x = op0.fn(state, a[:, i]) if reverse0 else op0.fn(a[:, i], state)
        state = op1.fn(b[:, i], x) if reverse1 else op1.fn(x, b[:, i])
        out[:, i] = state
    isa._write(dst, out)
    if isa.ACTIVE:
        isa.record("vector", "tensor_tensor_scan", p * n, isa._bytes(dst, data0, data1), n, p,
                   (("dst", dst), ("data0", data0), ("data1", data1)))


_IDENTITY = {"add": 0.0, "sum": 0.0, "multiply": 1.0, "prod": 1.0, "maximum": float("-inf"), "max": float("-inf"),
             "minimum": float("inf"), "min": float("inf")}


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=isa.reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """dst = data <op0> operand0; reduce_res = reduce_op over the free dims (through the accumulators)."""
    api = "nisa.tensor_scalar_reduce"
    rules.alu_op(api, "op0", op0, _ARITH)
    name_of = getattr(reduce_op, "name", None)
    if name_of not in _IDENTITY:
        rules.fail(api, "reduce_op is add / multiply / max / min", reduce_op, f"reduce_op={reduce_op!r}")
    if reverse0:
        raise isa.NkiError(f"{api}: reverse0=True is documented as not supported yet")
    p, n = isa._check_elementwise(api, dst, ("data", data))
    rules.vector_operand(api, "operand0", operand0, p)
    values = op0.fn(isa._f32(data), isa._scalar(operand0))
    isa._write(dst, values)
    reduced = reduce_op.reduce(values, 1)
    acc = _accumulate(api, p, reduced, name_of, reduce_op, reduce_cmd, reduce_init)
    if reduce_res is not None:
        if rules.operand(api, "reduce_res", reduce_res) != (p, 1):
            rules.fail(api, "reduce_res is a [P, 1] tile", list(reduce_res.data.shape),
                       f"reduce_res has shape {list(reduce_res.data.shape)}, expected [{p}, 1]")
        isa._write(reduce_res, (-acc if reduce_res_negate else acc).reshape(p, 1).clone())
    if isa.ACTIVE:
        isa.record("vector", "tensor_scalar_reduce", p * n, isa._bytes(dst, data, operand0, reduce_res), n, p,
                   (("dst", dst), ("data", data), ("reduce_res", reduce_res)))


def _combine(name, a, b):
    if name in ("add", "sum"):
        return a + b
    if name in ("multiply", "prod"):
        return a * b
    return torch.maximum(a, b) if name in ("maximum", "max") else torch.minimum(a, b)


def _accumulate(api, p, reduced, name, reduce_op, cmd, reduce_init):
    program = context.current()
    acc = program.vector_acc
    if acc is None:
        acc = program.vector_acc = torch.full((rules.PMAX,), float("nan"))
    if cmd is isa.reduce_cmd.reset_reduce:
        acc[:p] = _IDENTITY[name]
    elif cmd is isa.reduce_cmd.load_reduce:
        if reduce_init is None:
            raise isa.NkiError(f"{api}: reduce_cmd=load_reduce needs reduce_init")
        acc[:p] = isa._scalar(reduce_init).reshape(-1).expand(p) if getattr(reduce_init, "buffer", None) is not None \
            else float(reduce_init)
    elif cmd is not isa.reduce_cmd.reduce:
        raise isa.NkiError(f"{api}: reduce_cmd={cmd} is not one of reset_reduce, reduce, load_reduce")
    if cmd is not isa.reduce_cmd.load_reduce and reduce_init is not None:
        raise isa.NkiError(f"{api}: reduce_init is only for reduce_cmd=load_reduce")
    acc[:p] = _combine(name, acc[:p], reduced)
    return acc[:p].clone()


