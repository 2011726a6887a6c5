"""Balancing a resolved pointwise program between VectorE and ScalarE.

Instruction selection puts every ALU op on VectorE and only activation functions on ScalarE, so a
chain of tensor_tensor / tensor_scalar ops (the decomposed SiLU backward: grad * s * (1 + x * (1 - s))) is
VectorE-bound while ScalarE idles. ScalarE's `activation(op=nl.copy, data, scale, bias)` computes
copy(data * scale + bias) in fp32 (nki.isa.activation), the same arithmetic as these
VectorE forms:

- tensor_copy(src)                               -> activation(copy, src)
- tensor_scalar(x, multiply, a[, add, b])        -> activation(copy, x, scale=a[, bias=b])
- tensor_scalar(x, add, b) / (x, subtract, -b)   -> activation(copy, x, bias=b)
- tensor_scalar(x, subtract, b, reverse0) = b - x -> activation(copy, x, scale=-1, bias=b)

`balance` moves such ops, in program order, while that lowers the busier engine's per-element
cycles (the cost model's rules: VectorE N per one-input op and 2N per two-input op, ScalarE N per
activation). A bias that is a number needs NeuronCore-v3+ (`TileSizes.scalar_imm_bias`); a [P, 1]
column works everywhere. Float tiles only: integer and bit-level ops stay on VectorE.
"""

from __future__ import annotations

_VECTOR_CYCLES = {"tensor_tensor": 2, "scalar_tensor_tensor": 2, "tensor_scalar": 1, "tensor_copy": 1,
                  "reciprocal": 8, "memset": 1}
_FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})


def _imm(value) -> dict:
    return {"imm": value, "var": None, "col": True, "hoisted": False, "bits": False}


def _negated(operand: dict) -> dict | None:
    return _imm(-operand["imm"]) if operand["imm"] is not None else None


def _affine(ins: dict) -> tuple[dict, dict | None] | None:
    """(scale, bias) with which activation(copy) computes the tensor_scalar `ins`, or None."""
    op0, op1, a, b = ins["op0"], ins["op1"], ins["operand0"], ins["operand1"]
    if op0 == "multiply" and op1 is None:
        return a, None
    if op0 == "multiply" and op1 == "add":
        return a, b
    if op1 is not None:
        return None
    if op0 == "add":
        return _imm(1.0), a
    if op0 == "subtract" and not ins["rev0"]:
        bias = _negated(a)
        return None if bias is None else (_imm(1.0), bias)
    if op0 == "subtract":
        return _imm(-1.0), a
    return None


def _as_activation(ins: dict, dtypes: dict, imm_bias: bool) -> dict | None:
    """`ins` as an activation(copy) instruction, or None when it has no such form."""
    if ins["dst"]["bits"] or dtypes.get(ins["dst"]["var"]) not in _FLOAT_DTYPES or ins.get("engine"):
        return None
    if ins["op"] == "tensor_copy":
        data, scale, bias = ins["src"], _imm(1.0), None
    elif ins["op"] == "tensor_scalar":
        affine = _affine(ins)
        if affine is None:
            return None
        data, (scale, bias) = ins["data"], affine
    else:
        return None
    if data["imm"] is not None or data["bits"] or dtypes.get(data["var"]) not in _FLOAT_DTYPES:
        return None
    if bias is not None and bias["imm"] is not None and not imm_bias:
        return None
    if bias is not None and bias["imm"] == 0:
        bias = None
    return {"op": "activation", "dst": ins["dst"], "alloc": ins["alloc"], "col": ins["col"], "func": "copy",
            "data": data, "scale": scale, "bias": bias}


def balance(instrs: list[dict], dtypes: dict[str, str], imm_bias: bool) -> list[dict]:
    """`instrs` with VectorE ops moved to ScalarE where that shortens the busier engine; `dtypes`
    maps each tile variable to the dtype it was allocated with."""
    vector = sum(_VECTOR_CYCLES.get(ins["op"], 0) for ins in instrs if not ins["col"])
    scalar = sum(1 for ins in instrs if ins["op"] == "activation" and not ins["col"])
    out = []
    for ins in instrs:
        moved = None
        if not ins["col"] and scalar + 1 < vector:
            moved = _as_activation(ins, dtypes, imm_bias)
        if moved is not None:
            vector -= _VECTOR_CYCLES[ins["op"]]
            scalar += 1
        out.append(moved or ins)
    return out
