"""Instruction selection: each tile-program instruction becomes the nisa call that fits its operands.

Inputs are bound to operand kinds ("tile" = a [P, F] tile, "col" = a [P, 1] column broadcast along
the free dim, fp32 or, for integer inputs, int32); e.g. tensor_tensor with a column becomes
tensor_scalar. Dead tiles are reused in place and the casts of the stores are planned. The result
is plain dicts that `codegen_templates/_pointwise_ops.py.j2` renders, one `instruction` call each.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import engines
from .ir import ITEMSIZE, NL_DTYPE, PointwiseProgram, Ref, is_imm

# Bit ops take integer column operands as they are (tensor_scalar wants fp32 columns otherwise).
_BITVEC = {"bitwise_and", "bitwise_or", "bitwise_xor"}


@dataclass
class ResolvedProgram:
    """Instructions (plain dicts for `_pointwise_ops.py.j2`) and the tile each result is stored from.

    Each instruction dict has `op` (the nisa call: activation, tensor_scalar, tensor_tensor,
    scalar_tensor_tensor, reciprocal, tensor_copy, iota, memset), `dst` (an operand),
    `alloc` (dtype expression when dst is a fresh tile, else None), `col` (dst is [P, 1]) and the
    op's fields; operands are dicts {var, col, hoisted, bits} or {imm} (a Python number, written out
    by the templates' `literal` filter). `stores[i]` is the operand holding result i in its store
    dtype, for every result.
    """

    instrs: list[dict]
    stores: list[dict]
    tile_bytes: int  # bytes per free element of every [P, F] tile allocated per iteration


class _Resolver:
    def __init__(self, program: PointwiseProgram, kinds: dict[str, str], hoisted: set[str]):
        self.program = program
        self.col = {name: kind == "col" for name, kind in kinds.items()}
        self.dtype = {inp.name: (inp.column_dtype if kinds[inp.name] == "col" else inp.tile_dtype)
                      for inp in program.inputs}
        self.var = {name: name for name in kinds}
        self.alloc_dtype = dict(self.dtype)  # dtype a tile variable was allocated with
        self.hoisted = set(hoisted)
        self.out: list[dict] = []
        self.tiles: dict[str, str] = {}  # [P, F] tile vars allocated per iteration -> dtype
        self.temp = 0

    def operand(self, ref: Ref, bits: bool = False) -> dict:
        if is_imm(ref):
            return {"imm": ref, "var": None, "col": True, "hoisted": False, "bits": False}
        var = self.var[ref]
        return {"imm": None, "var": var, "col": self.col[ref], "hoisted": var in self.hoisted,
                "bits": bits and self.alloc_dtype[var] != "int32"}

    def new_var(self, dtype: str, col: bool, reuse: str | None = None) -> tuple[str, str | None]:
        if reuse is not None:
            return reuse, None
        self.temp += 1
        var = f"v{self.temp}"
        self.alloc_dtype[var] = dtype
        if not col:
            self.tiles[var] = dtype
        return var, NL_DTYPE[dtype]

    def define(self, ref: str, dtype: str, col: bool, reuse: str | None = None) -> tuple[dict, str | None]:
        var, alloc = self.new_var(dtype, col, reuse)
        self.var[ref], self.dtype[ref], self.col[ref] = var, dtype, col
        return {"imm": None, "var": var, "col": col, "hoisted": False, "bits": False}, alloc

    def emit(self, op: str, dst: dict, alloc: str | None, bits: bool = False, **fields) -> None:
        dst = dict(dst, bits=bits and alloc != "nl.int32" and self.alloc_dtype[dst["var"]] != "int32")
        self.out.append({"op": op, "dst": dst, "alloc": alloc, "col": dst["col"], **fields})

    def float_col(self, ref: Ref) -> Ref:
        """A column operand for tensor_scalar must be fp32."""
        if is_imm(ref) or self.dtype[ref] == "float32":
            return ref
        name = f"{ref}_f32"
        if name not in self.var:
            dst, alloc = self.define(name, "float32", True)
            self.emit("tensor_copy", dst, alloc, src=self.operand(ref))
        return name


def resolve_program(program: PointwiseProgram, kinds: dict[str, str], hoisted: set[str],
                    store_dtypes: list[str], balance_imm_bias: bool | None = None) -> ResolvedProgram:
    """Bind inputs to operand kinds ("tile" / "col") and pick each instruction's nisa form.

    `hoisted` names input tiles loaded outside the iteration (never overwritten in place);
    `store_dtypes[i]` is the on-chip dtype result i must have for its store. Unless
    `balance_imm_bias` is None, VectorE ops move to ScalarE where that pays (engines.py; True: the
    target's activation takes a number as bias).
    """
    r = _Resolver(program, kinds, hoisted)
    instrs = program.instrs
    last_use: dict[str, int] = {}
    for i, instr in enumerate(instrs):
        for operand in instr.operands:
            if isinstance(operand, str):
                last_use[operand] = i
    result_refs = {ref for _, ref in program.results if isinstance(ref, str)}
    for ref in result_refs:
        last_use[ref] = max(last_use.get(ref, -1), len(instrs))
    # Results nothing else reads are computed straight into their store dtype.
    retarget: dict[str, str] = {}
    for (node, ref), dtype in zip(program.results, store_dtypes):
        producer = next((ins for ins in instrs if ins.out == ref), None)
        if producer is not None and not producer.bits and not any(ref in ins.operands for ins in instrs):
            retarget[ref] = dtype if retarget.get(ref, dtype) == dtype else producer.dtype

    def reusable(ref: Ref, i: int, dtype: str, col: bool) -> str | None:
        if is_imm(ref) or last_use.get(ref) != i or ref in result_refs:
            return None
        var = r.var[ref]
        if var in r.hoisted or r.col[ref] != col or r.alloc_dtype[var] != dtype:
            return None
        return var

    for i, ins in enumerate(instrs):
        dtype = retarget.get(ins.out, ins.dtype)
        alloc_dtype = "float32" if ins.bits else dtype
        ops = ins.operands
        if ins.kind == "iota":
            dst, alloc = r.define(ins.out, dtype, False)
            r.emit("iota", dst, alloc)
            continue
        x = ops[0]
        col = r.col[x] and all(is_imm(o) or o is None or r.col[o] for o in ops[1:])
        if ins.kind in ("tt", "stt"):
            other = ops[1] if ins.kind == "tt" else ops[2]
            if r.col[x] and not r.col[other]:
                if ins.kind == "tt":  # col op tile -> tensor_scalar on the tile, operand reversed
                    reuse = reusable(other, i, alloc_dtype, False)
                    dst, alloc = r.define(ins.out, alloc_dtype, False, reuse)
                    operand = x if ins.bits or ins.attr("op") in _BITVEC else r.float_col(x)
                    r.emit("tensor_scalar", dst, alloc, ins.bits, data=r.operand(other, ins.bits),
                           op0=ins.attr("op"), operand0=r.operand(operand, ins.bits),
                           rev0=True, op1=None, operand1=None, rev1=False)
                else:  # (col op0 a0) op1 tile -> a column temporary, then tensor_scalar
                    temp = f"{ins.out}_col"
                    tdst, talloc = r.define(temp, "float32", True)
                    r.emit("tensor_scalar", tdst, talloc, data=r.operand(x), op0=ins.attr("op0"),
                           operand0=r.operand(ops[1]), rev0=False, op1=None, operand1=None, rev1=False)
                    reuse = reusable(other, i, alloc_dtype, False)
                    dst, alloc = r.define(ins.out, alloc_dtype, False, reuse)
                    r.emit("tensor_scalar", dst, alloc, data=r.operand(other), op0=ins.attr("op1"),
                           operand0=r.operand(temp), rev0=True, op1=None, operand1=None, rev1=False)
                continue
            if not r.col[x] and r.col[other]:
                reuse = reusable(x, i, alloc_dtype, False)
                operand = other if ins.bits or (ins.kind == "tt" and ins.attr("op") in _BITVEC) else r.float_col(other)
                dst, alloc = r.define(ins.out, alloc_dtype, False, reuse)
                if ins.kind == "tt":
                    r.emit("tensor_scalar", dst, alloc, ins.bits, data=r.operand(x, ins.bits), op0=ins.attr("op"),
                           operand0=r.operand(operand, ins.bits), rev0=False, op1=None, operand1=None, rev1=False)
                else:
                    r.emit("tensor_scalar", dst, alloc, data=r.operand(x), op0=ins.attr("op0"),
                           operand0=r.operand(ops[1]), rev0=False, op1=ins.attr("op1"),
                           operand1=r.operand(operand), rev1=False)
                continue
        reuse = reusable(x, i, alloc_dtype, col)
        if reuse is None and ins.kind == "tt":
            reuse = reusable(ops[1], i, alloc_dtype, col)
        dst, alloc = r.define(ins.out, alloc_dtype, col, reuse)
        if ins.kind == "act":
            r.emit("activation", dst, alloc, func=ins.attr("func"), data=r.operand(x),
                   scale=r.operand(ops[1]), bias=None if ops[2] == 0 else r.operand(ops[2]))
        elif ins.kind == "ts":
            r.emit("tensor_scalar", dst, alloc, ins.bits, data=r.operand(x, ins.bits), op0=ins.attr("op0"),
                   operand0=r.operand(ops[1]), rev0=ins.attr("rev0"), op1=ins.attr("op1"),
                   operand1=None if ops[2] is None else r.operand(ops[2]), rev1=ins.attr("rev1"),
                   engine=ins.attr("engine"))
        elif ins.kind == "tt":
            r.emit("tensor_tensor", dst, alloc, ins.bits, data1=r.operand(x, ins.bits),
                   data2=r.operand(ops[1], ins.bits), op_name=ins.attr("op"))
        elif ins.kind == "stt":
            r.emit("scalar_tensor_tensor", dst, alloc, data=r.operand(x), op0=ins.attr("op0"),
                   operand0=r.operand(ops[1]), op1=ins.attr("op1"), operand1=r.operand(ops[2]))
        elif ins.kind == "recip":
            r.emit("reciprocal", dst, alloc, data=r.operand(x))
        elif ins.kind == "cast":
            r.emit("tensor_copy", dst, alloc, src=r.operand(x))
        else:
            raise AssertionError(f"unknown pointwise instruction kind {ins.kind}")

    stores = []
    for (node, ref), dtype in zip(program.results, store_dtypes):
        if is_imm(ref):
            dst, alloc = r.define(f"fill{len(stores)}", dtype, False)
            r.emit("memset", dst, alloc, value=int(ref) if dtype not in ("float32", "bfloat16", "float16")
                   else float(ref))
        elif r.col[ref]:  # a [P, 1] value stored as a [P, F] tile: broadcast along the free dim
            dst, alloc = r.define(f"bcast{len(stores)}", dtype, False)
            r.emit("memset", dst, alloc, value=0 if dtype not in ("float32", "bfloat16", "float16") else 0.0)
            r.emit("tensor_scalar", dst, None, data=dict(dst), op0="add", operand0=r.operand(r.float_col(ref)),
                   rev0=False, op1=None, operand1=None, rev1=False)
        elif r.dtype[ref] != dtype:
            dst, alloc = r.define(f"store{len(stores)}", dtype, False)
            r.emit("tensor_copy", dst, alloc, src=r.operand(ref))
        else:
            dst = r.operand(ref)
        stores.append(dst)
    tile_bytes = sum(ITEMSIZE[d] for d in r.tiles.values())
    tile_bytes += sum(ITEMSIZE[r.dtype[name]] for name, kind in kinds.items() if kind == "tile")
    instrs = r.out if balance_imm_bias is None else engines.balance(r.out, r.alloc_dtype, balance_imm_bias)
    return ResolvedProgram(instrs, stores, tile_bytes)
