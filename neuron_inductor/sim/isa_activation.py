"""nki.isa statistics and ScalarE instructions: bn_stats, bn_aggr, activation, activation_reduce
(with the ScalarE reduce registers)."""

from __future__ import annotations

import torch

from . import context, isa_enums, rules
from .errors import NkiError
from .isa_enums import reduce_cmd
from .isa_operands import _bytes, _check_elementwise, _f32, _scalar, _write
from .tracing import ACTIVE, record


def bn_stats(dst, data, name=None):
    """Per partition: (count, mean, var*count) of the even elements, then of the odd ones."""
    api = "nisa.bn_stats"
    p, n = _check_statistics(api, dst, data, 6)
    rules.bn_stats_size(api, n)
    x = _f32(data)
    stats = [_count_mean_m2(x[:, 0::2]), _count_mean_m2(x[:, 1::2])]
    _write(dst, torch.cat([s for triple in stats for s in triple], dim=1))
    if ACTIVE:
        record("vector", "bn_stats", p * n, _bytes(dst, data), n, p, (("dst", dst), ("data", data)))


def _check_statistics(api, dst, data, outputs):
    """bn_stats / bn_aggr operands: same partitions, `outputs` elements per partition in dst -> (P, F)."""
    pd, nd = rules.operand(api, "dst", dst)
    p, n = rules.operand(api, "data", data)
    if pd != p:
        rules.same_partitions(api, "dst", dst, "data", data)
    if nd != outputs:
        rules.same_free_size(api, "dst", nd, f"{api.split('.')[-1]} output", outputs)
    return p, n


def _count_mean_m2(x):
    p, count = x.shape
    if count == 0:
        zero = torch.zeros(p, 1)
        return zero, zero, zero
    mean = x.mean(dim=1, keepdim=True)
    m2 = ((x - mean) ** 2).sum(dim=1, keepdim=True)
    return torch.full((p, 1), float(count)), mean, m2


def bn_aggr(dst, data, name=None):
    """Combine (count, mean, var*count) triples into (mean, variance) per partition."""
    api = "nisa.bn_aggr"
    p, n = _check_statistics(api, dst, data, 2)
    if n % 3:
        rules.fail(api, "bn_aggr input holds (count, mean, var*count) triples", n, f"{n} elements per partition")
    triples = _f32(data).reshape(-1, n // 3, 3)
    count, mean, m2 = triples[..., 0], triples[..., 1], triples[..., 2]
    total = count.sum(dim=1, keepdim=True)
    grand = (count * mean).sum(dim=1, keepdim=True) / total
    var = (m2 + count * (mean - grand) ** 2).sum(dim=1, keepdim=True) / total
    _write(dst, torch.cat([grand, var], dim=1))
    if ACTIVE:
        record("vector", "bn_aggr", p * n, _bytes(dst, data), n, p, (("dst", dst), ("data", data)))


# ---------------------------------------------------------------------------- ScalarE

def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    """dst = op(data * scale + bias); optionally add-reduce into the ScalarE registers -> reduce_res."""
    api = "nisa.activation"
    rules.activation_op(api, op)
    _activation(api, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """activation with reduce_cmd=reset_reduce: reduce_res = sum over free dims of the result."""
    api = "nisa.activation_reduce"
    rules.activation_op(api, op)
    _activation(api, dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd.reset_reduce)


def _activation(api, dst, op, data, bias, scale, reduce_op, reduce_res, cmd):
    """Shared by activation, activation_reduce and the nl-level unary ops (any unary NkiOp)."""
    p, n = _check_elementwise(api, dst, ("data", data))
    program = context.current()
    if bias is not None:
        if isinstance(bias, (int, float)) and program.target.nc_version < 3:
            rules.fail(api, "scalar bias needs NeuronCore-v3+", bias, f"bias={bias} on {program.target.name}")
        rules.vector_operand(api, "bias", bias, p, require_fp32=False)
        rules.activation_bias_dtype(api, bias)
    rules.vector_operand(api, "scale", scale, p)
    x = _f32(data)
    if getattr(scale, "buffer", None) is not None or scale != 1.0:
        x = x * _scalar(scale)
    if bias is not None:
        x = x + _scalar(bias)
    result = op.fn(x)
    if api != "nl.sin":  # nl.sin reduces its argument before the activation (nki.api.shared.rst note)
        invalid = rules.activation_range(api, op, x)
        if invalid is not None:
            result = result.masked_fill(invalid, float("nan"))  # the hardware's output is invalid there
    _write(dst, result)
    if cmd is not reduce_cmd.idle or reduce_res is not None:
        _reduce_registers(api, program, p, result, reduce_op, reduce_res, cmd)
    if ACTIVE:
        record("scalar", "activation", p * n, _bytes(dst, data, bias, scale), n, p,
               (("dst", dst), ("data", data), ("bias", bias), ("scale", scale), ("reduce_res", reduce_res)))


def _registers(program) -> torch.Tensor:
    """The program's ScalarE reduce registers (one per partition), made on first use."""
    if program.reduce_regs is None:
        program.reduce_regs = torch.zeros(rules.PMAX)
    return program.reduce_regs


def _reduce_registers(api, program, p, result, reduce_op, reduce_res, cmd):
    regs = _registers(program)
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        rules.add_reduce(api, reduce_op)
        total = result.sum(dim=1)
        if cmd is reduce_cmd.reduce:
            if not program.reduce_regs_written:
                rules.fail(api, "reduce_cmd=reduce accumulates onto registers set earlier", "reduce",
                           "no instruction has reset the ScalarE reduce registers")
            total = regs[:p] + total
        regs[:p] = total
        program.reduce_regs_written = True
    elif cmd is reduce_cmd.reset:
        regs.zero_()
        program.reduce_regs_written = True
    elif cmd is not reduce_cmd.idle:
        raise NkiError(f"{api}: reduce_cmd={cmd} is not modelled by the interpreter")
    if reduce_res is not None:
        _read_registers(api, program, p, reduce_res, cmd)


def _read_registers(api, program, p, reduce_res, cmd):
    if rules.operand(api, "reduce_res", reduce_res) != (p, 1):
        rules.fail(api, "reduce_res is a [P, 1] tile", list(reduce_res.data.shape),
                   f"reduce_res has shape {list(reduce_res.data.shape)}, expected [{p}, 1]")
    if not program.reduce_regs_written:
        rules.fail(api, "reduce_res reads registers a reduce_cmd has set", cmd.name,
                   "reduce_cmd=idle reads the ScalarE reduce registers, which no instruction has set; "
                   "pass reduce_cmd=nisa.reduce_cmd.reset_reduce or use nisa.activation_reduce")
    _write(reduce_res, program.reduce_regs[:p].reshape(p, 1))  # copied into reduce_res


# activate2's tensor-scalar stage: the six documented (op0, op1) pairs.
_ACTIVATE2_PAIRS = frozenset({("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"),
                              ("add", "bypass"), ("subtract", "bypass"), ("bypass", "bypass")})
# Accumulator identities and per-row reductions of activate2's reduce_op.
_REDUCE_IDENTITY = {"add": 0.0, "maximum": float("-inf"), "minimum": float("inf"), "abs_max": 0.0,
                    "abs_min": float("inf")}


def activate2(dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False, reduce_op=None,
              reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None):
    """dst = op((data <op0> imm0) <op1> imm1) on ScalarE (NeuronCore-v4+); reduce_op folds the results
    into the ScalarE accumulators activation shares, reduce_res reads them out."""
    api = "nisa.activate2"
    rules.target_version(api, "activate2", 4)
    rules.activation_op(api, op)
    pair = (getattr(op0, "name", None), getattr(op1, "name", None))
    if pair not in _ACTIVATE2_PAIRS:
        rules.fail(api, "(op0, op1) is (multiply, add), (multiply, subtract), (multiply | add | subtract, bypass) "
                   "or (bypass, bypass)", pair, f"op0={op0!r}, op1={op1!r}")
    if reverse0 and pair[0] == "bypass" or reverse1 and pair[1] == "bypass":
        rules.fail(api, "reverse0 / reverse1 need op0 / op1 set", (reverse0, reverse1), "reverse of a bypass stage")
    p, n = _check_elementwise(api, dst, ("data", data))
    for role, value in (("imm0", imm0), ("imm1", imm1), ("relu_param", relu_param)):
        rules.vector_operand(api, role, value, p, require_fp32=False)
    if getattr(imm0, "buffer", None) is not None and getattr(imm1, "buffer", None) is not None:
        rules.same_dtype(api, "imm0", imm0, "imm1", imm1)
    x = _f32(data)
    for nki_op, imm, reverse in ((op0, imm0, reverse0), (op1, imm1, reverse1)):
        if nki_op.name != "bypass":
            x = nki_op.fn(_scalar(imm), x) if reverse else nki_op.fn(x, _scalar(imm))
    result = op.fn(x)
    if op.name == "prelu":
        result = torch.where(x >= 0, x, x * _scalar(relu_param))
    invalid = rules.activation_range(api, op, x)
    if invalid is not None:
        result = result.masked_fill(invalid, float("nan"))  # the hardware's output is invalid there
    _write(dst, result)
    program = context.current()
    if reduce_cmd is not isa_enums.reduce_cmd.idle or reduce_res is not None:
        _accumulate(api, program, p, result, reduce_op, reduce_res, reduce_cmd)
    if ACTIVE:
        record("scalar", "activate2", p * n, _bytes(dst, data, imm0, imm1), n, p,
               (("dst", dst), ("data", data), ("imm0", imm0), ("imm1", imm1), ("reduce_res", reduce_res)))


def _accumulate(api, program, p, result, reduce_op, reduce_res, cmd):
    """activate2's reduce_cmd on the shared ScalarE accumulators, with any of its five reduce ops."""
    regs = _registers(program)
    if cmd is not reduce_cmd.idle:
        name = getattr(reduce_op, "name", None)
        if name not in _REDUCE_IDENTITY:
            rules.fail(api, "reduce_op is add / maximum / minimum / abs_max / abs_min", reduce_op,
                       f"reduce_op={reduce_op!r}")
        if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
            regs[:p] = _REDUCE_IDENTITY[name]
        elif cmd is reduce_cmd.reduce and not program.reduce_regs_written:
            rules.fail(api, "reduce_cmd=reduce accumulates onto registers set earlier", "reduce",
                       "no instruction has reset the ScalarE reduce registers")
        elif cmd is reduce_cmd.load_reduce:
            raise NkiError(f"{api}: reduce_cmd=load_reduce is not documented for activate2")
        if cmd is not reduce_cmd.reset:
            regs[:p] = _fold(name, regs[:p], result)
        program.reduce_regs_written = True
    if reduce_res is not None:
        _read_registers(api, program, p, reduce_res, cmd)


def _fold(name, acc, values):
    """acc[p] = reduce_op(acc[p], values[p, 0], values[p, 1], ...) in order (ties keep the later value)."""
    if name == "add":
        return acc + values.sum(dim=1)
    if name == "maximum":
        return torch.maximum(acc, values.amax(dim=1))
    if name == "minimum":
        return torch.minimum(acc, values.amin(dim=1))
    both = torch.cat([acc[:, None], values], dim=1)
    magnitude = both.abs()
    extreme = magnitude.amax(dim=1, keepdim=True) if name == "abs_max" else magnitude.amin(dim=1, keepdim=True)
    last = (magnitude == extreme).long().cumsum(dim=1).argmax(dim=1)  # the last position reaching it
    return both.gather(1, last[:, None]).reshape(-1)
