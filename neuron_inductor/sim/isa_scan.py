"""nki.isa scans and fused reductions on VectorE: tensor_tensor_scan, tensor_scalar_reduce,
select_reduce, range_select, exponential, tensor_scalar_cumulative.

All but tensor_tensor_scan share the Vector engine's reduce accumulators (one fp32 per
partition, per program), controlled by reduce_cmd: reset_reduce starts from the op's identity,
reduce continues, load_reduce starts from reduce_init (imm1 for tensor_scalar_cumulative).
"""

from __future__ import annotations

import torch

from . import context, isa, rules
from .ops import ALU_UNARY

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
    unary = getattr(op0, "name", None) in ALU_UNARY  # "Must be None or 0 when op0 is a unary operator (e.g., nl.abs)"
    if unary:
        rules.alu_unary_operand(api, "operand0", op0, operand0)
    else:
        rules.alu_op(api, "op0", op0, _ARITH)
    name_of = getattr(reduce_op, "name", None)
    if name_of not in _IDENTITY:
        rules.fail(api, "reduce_op is add / multiply / max / min", reduce_op, f"reduce_op={reduce_op!r}")
    if reverse0:
        raise isa.NkiError(f"{api}: reverse0=True is documented as not supported yet")
    p, n = isa._check_elementwise(api, dst, ("data", data))
    if unary:
        values = op0.fn(isa._f32(data))
    else:
        rules.vector_operand(api, "operand0", operand0, p)
        values = op0.fn(isa._f32(data), isa._scalar(operand0))
    isa._write(dst, values)
    reduced = reduce_op.reduce(values, 1)
    acc = _accumulate(api, p, reduced, name_of, reduce_op, reduce_cmd, reduce_init)
    if reduce_res is not None:
        if rules.operand(api, "reduce_res", reduce_res) != (p, 1):
            rules.fail(api, "reduce_res is a [P, 1] tile", list(reduce_res.data.shape),
                       f"reduce_res has shape {list(reduce_res.data.shape)}, expected [{p}, 1]")
        isa._write(reduce_res, (-acc if reduce_res_negate else acc).reshape(p, 1))
    if isa.ACTIVE:
        isa.record("vector", "tensor_scalar_reduce", p * n, isa._bytes(dst, data, operand0, reduce_res), n, p,
                   (("dst", dst), ("data", data), ("reduce_res", reduce_res)))


_EXTREMA = frozenset({"maximum", "max", "minimum", "min"})


def _combine(name, a, b):
    if name in ("add", "sum"):
        return a + b
    if name in ("multiply", "prod"):
        return a * b
    return torch.maximum(a, b) if name in ("maximum", "max") else torch.minimum(a, b)


def _accumulate(api, p, reduced, name, reduce_op, cmd, reduce_init):
    """Fold `reduced` [P] into the accumulators per reduce_cmd; returns a view of them (read it before
    the next instruction changes them)."""
    program = context.current()
    acc = program.vector_acc
    if acc is None:
        acc = program.vector_acc = torch.full((rules.PMAX,), float("nan"))
    if cmd not in (isa.reduce_cmd.reset_reduce, isa.reduce_cmd.load_reduce, isa.reduce_cmd.reduce):
        raise isa.NkiError(f"{api}: reduce_cmd={cmd} is not one of reset_reduce, reduce, load_reduce")
    if cmd is not isa.reduce_cmd.load_reduce and reduce_init is not None:
        raise isa.NkiError(f"{api}: reduce_init is only for reduce_cmd=load_reduce")
    if cmd is isa.reduce_cmd.reset_reduce and name in _EXTREMA:
        acc[:p] = reduced  # = its combine with the identity (+-inf), NaN and -0.0 included
        return acc[:p]
    if cmd is isa.reduce_cmd.reset_reduce:
        acc[:p] = _IDENTITY[name]
    elif cmd is isa.reduce_cmd.load_reduce:
        if reduce_init is None:
            raise isa.NkiError(f"{api}: reduce_cmd=load_reduce needs reduce_init")
        acc[:p] = isa._scalar(reduce_init).reshape(-1).expand(p) if getattr(reduce_init, "buffer", None) is not None \
            else float(reduce_init)
    acc[:p] = _combine(name, acc[:p], reduced)
    return acc[:p]


_FP32_MIN = -3.4028234663852886e38
# range_select's comparisons, as the boolean tests they are (the ops' fn gives 1.0 / 0.0 floats)
_COMPARE = {"equal": torch.eq, "less": torch.lt, "less_equal": torch.le, "greater": torch.gt,
            "greater_equal": torch.ge}


def _free_index(range_start, n: int) -> torch.Tensor:
    """[1, n] fp32: range_start + free index, added in fp32. For an integral start the sums are exact
    integers, which torch.arange makes from no tensor (a replay makes it once, not per call)."""
    start = float(range_start)
    if start.is_integer() and abs(start) + n < 2 ** 24:
        return torch.arange(start, start + n, dtype=torch.float32)[None, :]
    return (start + torch.arange(n, dtype=torch.float32))[None, :]


def _same_view(a, b) -> bool:
    """Whether two operands are the same elements of the same tile, in the same dtype."""
    return (a.alloc is b.alloc and a.dtype is b.dtype and a.data.storage_offset() == b.data.storage_offset()
            and a.data.shape == b.data.shape and a.data.stride() == b.data.stride())


def _max_accumulate(api, p, values, reduce_op, cmd, reduce_res):
    """Max-reduce `values` [P, F] through the accumulators per reduce_cmd and write reduce_res if given."""
    if getattr(reduce_op, "name", None) not in ("maximum", "max"):
        rules.fail(api, "reduce_op is nl.maximum", reduce_op, f"reduce_op={reduce_op!r}")
    if cmd is isa.reduce_cmd.idle:
        if reduce_res is not None:
            raise isa.NkiError(f"{api}: reduce_res with reduce_cmd=idle; pass reset_reduce or reduce")
        return
    if cmd not in (isa.reduce_cmd.reset_reduce, isa.reduce_cmd.reduce):
        raise isa.NkiError(f"{api}: reduce_cmd={cmd} is not one of idle, reset_reduce, reduce")
    acc = _accumulate(api, p, values.amax(1), "maximum", reduce_op, cmd, None)
    if reduce_res is not None:
        if rules.operand(api, "reduce_res", reduce_res) != (p, 1) or reduce_res.dtype.kind != "float":
            rules.fail(api, "reduce_res is a float [P, 1] tile", list(reduce_res.data.shape),
                       f"reduce_res is {list(reduce_res.data.shape)} {reduce_res.dtype.name}")
        isa._write(reduce_res, acc.reshape(p, 1))


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=isa.reduce_cmd.idle,
                  reduce_op=None, reverse_pred=False, name=None):
    """dst = where(predicate, on_true, on_false) (VectorE), optionally max-reduced per partition."""
    api = "nisa.select_reduce"
    p, n = isa._check_elementwise(api, dst, ("predicate", predicate), ("on_true", on_true))
    rules.not_both_psum(api, on_true, predicate)
    if predicate.dtype.name not in ("int8", "uint8", "int16", "uint16"):
        rules.fail(api, "predicate is int8 / uint8 / int16 / uint16", predicate.dtype.name,
                   f"predicate has dtype {predicate.dtype.name}")
    if on_true.dtype.name in ("tfloat32", "int32", "uint32"):
        rules.fail(api, "on_true is not tfloat32 / int32 / uint32", on_true.dtype.name, f"on_true is {on_true.dtype.name}")
    rules.vector_operand(api, "on_false", on_false, p)
    take = isa._i64(predicate) != 0
    if reverse_pred:
        take = ~take
    values = torch.where(take, isa._f32(on_true), isa._scalar(on_false))
    isa._write(dst, values)
    _max_accumulate(api, p, values, isa.OPS["maximum"] if reduce_op is None else reduce_op, reduce_cmd, reduce_res)
    if isa.ACTIVE:
        isa.record("vector", "select_reduce", p * n, isa._bytes(dst, predicate, on_true), n, p,
                   (("dst", dst), ("predicate", predicate), ("on_true", on_true)))


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=isa.reduce_cmd.reset_reduce,
                 reduce_res=None, reduce_op=None, range_start=0, on_false_value=_FP32_MIN, name=None):
    """dst[p, i] = on_true_tile[p, i] where comp_op0(range_start + i, bound0[p]) and comp_op1(.., bound1[p]),
    else on_false_value (FP32_MIN); the result is max-reduced through the accumulators."""
    api = "nisa.range_select"
    target = context.current().target
    if target.nc_version < 3:
        rules.fail(api, "range_select needs NeuronCore-v3+", target.name, f"not available on {target.name}")
    for role, op in (("comp_op0", comp_op0), ("comp_op1", comp_op1)):
        if getattr(op, "name", None) not in _COMPARE:
            rules.fail(api, f"{role} is equal / less / less_equal / greater / greater_equal", op, f"{role}={op!r}")
    p, n = isa._check_elementwise(api, dst, ("on_true_tile", on_true_tile))
    if on_true_tile.dtype.kind != "float":
        rules.fail(api, "on_true_tile has a float dtype", on_true_tile.dtype.name, f"on_true_tile is {on_true_tile.dtype.name}")
    rules.vector_operand(api, "bound0", bound0, p)
    rules.vector_operand(api, "bound1", bound1, p)
    if isa.f32_immediate(on_false_value).item() != _FP32_MIN:
        rules.fail(api, "on_false_value is FP32_MIN (-3.4028235e+38)", on_false_value, f"on_false_value={on_false_value}")
    index = _free_index(range_start, n)
    keep = _COMPARE[comp_op0.name](index, isa._f32(bound0))
    if comp_op1 is not comp_op0 or not _same_view(bound0, bound1):  # the one test twice (a one-sided range): once
        keep &= _COMPARE[comp_op1.name](index, isa._f32(bound1))
    values = torch.where(keep, isa._f32(on_true_tile), isa.f32_immediate(on_false_value))
    isa._write(dst, values)
    _max_accumulate(api, p, values, isa.OPS["maximum"] if reduce_op is None else reduce_op, reduce_cmd, reduce_res)
    if isa.ACTIVE:
        isa.record("vector", "range_select", p * n, isa._bytes(dst, on_true_tile), n, p,
                   (("dst", dst), ("on_true_tile", on_true_tile)))


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=isa.reduce_cmd.idle, reduce_init=0.0, name=None):
    """dst = exp(src - max_value) on VectorE (NeuronCore-v4+), summed into the accumulators per reduce_cmd."""
    api = "nisa.exponential"
    target = context.current().target
    if target.nc_version < 4:
        rules.fail(api, "exponential needs NeuronCore-v4+", target.name, f"not available on {target.name}")
    p, n = isa._check_elementwise(api, dst, ("src", src))
    rules.vector_operand(api, "max_value", max_value, p)
    values = isa.OPS["exp"].fn(isa._f32(src) - isa._scalar(max_value))
    isa._write(dst, values)
    if reduce_cmd is not isa.reduce_cmd.idle:
        init = None if reduce_cmd is not isa.reduce_cmd.load_reduce else reduce_init
        if init is None and getattr(reduce_init, "buffer", None) is None and float(reduce_init) != 0.0:
            raise isa.NkiError(f"{api}: reduce_init is only for reduce_cmd=load_reduce")
        acc = _accumulate(api, p, values.sum(1), "add", None, reduce_cmd, init)
        if reduce_res is not None:
            if rules.operand(api, "reduce_res", reduce_res) != (p, 1):
                rules.fail(api, "reduce_res is a [P, 1] tile", list(reduce_res.data.shape),
                           f"reduce_res has shape {list(reduce_res.data.shape)}, expected [{p}, 1]")
            isa._write(reduce_res, acc.reshape(p, 1))
    elif reduce_res is not None:
        raise isa.NkiError(f"{api}: reduce_res with reduce_cmd=idle; pass reset_reduce, reduce or load_reduce")
    if isa.ACTIVE:
        isa.record("vector", "exponential", p * n, isa._bytes(dst, src), n, p, (("dst", dst), ("src", src)))


_CUMULATIVE = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": float("-inf"), "minimum": float("inf")}
_CUMULATIVE_DTYPES = frozenset({"bfloat16", "float16", "float32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2",
                                "uint8", "uint16", "int8", "int16"})


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=isa.reduce_cmd.reset_reduce, name=None):
    """reg = op1(op0(src[:, i], imm0), reg); dst[:, i] = reg, along the free dims (VectorE accumulators)."""
    api = "nisa.tensor_scalar_cumulative"
    rules.alu_op(api, "op0", op0, _ARITH)
    if getattr(op1, "name", None) not in _CUMULATIVE:
        rules.fail(api, "op1 is add / subtract / multiply / maximum / minimum", op1, f"op1={op1!r}")
    p, n = isa._check_elementwise(api, dst, ("src", src))
    for role, t in (("src", src), ("dst", dst)):
        if t.dtype.name not in _CUMULATIVE_DTYPES:
            rules.fail(api, "dtypes bf16 / fp16 / fp32 / fp8 / (u)int8 / (u)int16", t.dtype.name, f"{role} is {t.dtype.name}")
    rules.vector_operand(api, "imm0", imm0, p)
    program = context.current()
    if program.vector_acc is None:
        program.vector_acc = torch.full((rules.PMAX,), float("nan"))
    if reduce_cmd is isa.reduce_cmd.reset_reduce:
        reg = torch.full((p,), _CUMULATIVE[op1.name])
    elif reduce_cmd is isa.reduce_cmd.load_reduce:
        if imm1 is None:
            raise isa.NkiError(f"{api}: reduce_cmd=load_reduce needs imm1")
        rules.vector_operand(api, "imm1", imm1, p)
        reg = isa._scalar(imm1).reshape(-1).expand(p).clone()
    elif reduce_cmd is isa.reduce_cmd.reduce:
        reg = program.vector_acc[:p].clone()
    else:
        raise isa.NkiError(f"{api}: reduce_cmd={reduce_cmd} is not one of reset_reduce, reduce, load_reduce")
    scaled = op0.fn(isa._f32(src), isa._scalar(imm0))
    out = torch.empty(p, n)
    for i in range(n):
        reg = op1.fn(scaled[:, i], reg)
        out[:, i] = reg
    program.vector_acc[:p] = reg
    isa._write(dst, out)
    if isa.ACTIVE:
        isa.record("vector", "tensor_scalar_cumulative", p * n, isa._bytes(dst, src), n, p, (("dst", dst), ("src", src)))
