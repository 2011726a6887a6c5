"""Which formulation a row op or a last-dim gather / scatter (lowering/indexing.py) takes:
one-hot matmuls (`gather_rows`) or lane masks (`gather_lanes`), against indirect DMA
(`gather_indirect`), decided here and nowhere else, by the cost model's estimate of each kernel.

A one-hot gather reads the whole table once per token tile and multiplies it on TensorE (fp32,
since it moves the table's bits), so its cost grows with rows x tokens; a one-hot scatter-add
builds a [tokens, rows] one-hot per tile; lane masks cost O(lanes) vector work per row. The
indirect kernels read or write only the rows / elements named, plus fixed per-tile work on the
ids (and, for a scatter, writing the zeros or base of the whole output, and for a row scatter a
[tokens, tokens] merge of duplicate rows). The others win only for tiny tables.

The estimate lists, per token tile, the instructions each template issues (their engines, free
sizes, dtypes and DMA bytes, as the interpreter would record them) and prices them with
`sim.cost_model.estimate`, so a change to the cost model moves the choice with it. It models the
dominant instructions, not every one: `tests/kernels/test_gather_indirect.py` checks it against the
traced estimate of the rendered kernels.

`forced(path)` overrides the choice inside a block (tests and bench/embedding.py run both paths).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

from .. import sim
from ..sim.cost_model import dma_transfer_seconds
from ..sim.tracing import Operand
from .context import TileSizes
from .reduction import EXACT_INT_LIMIT, FREE_MAX

# lanes per tile of gather_lanes: up to eight [rows, lanes] fp32 tiles are live at once
LANE_FMAX = FREE_MAX // 4

log = logging.getLogger(__name__)

PATHS = ("onehot", "indirect")
INT32_LIMIT = 2**31
# columns per indirect DMA of gather_indirect (one [tokens, columns] tile, 16 KiB of fp32 per partition)
INDIRECT_FMAX = FREE_MAX // 2
FAMILIES = {("onehot", "row"): "gather_rows", ("onehot", "lane"): "gather_lanes",
            ("indirect", "row"): "gather_indirect", ("indirect", "lane"): "gather_indirect"}

_forced: list[str] = []


@contextlib.contextmanager
def forced(path: str) -> Iterator[None]:
    """Make every row op inside the block take `path` ("onehot" or "indirect")."""
    if path not in PATHS:
        raise ValueError(f"row op path {path!r} is not one of {', '.join(PATHS)}")
    _forced.append(path)
    try:
        yield
    finally:
        _forced.pop()


@dataclass(frozen=True)
class RowOp:
    """What the estimates need of a row op (sizes in elements; the table is [outer, rows, inner])."""

    mode: str               # "row_gather" | "row_scatter" | "lane_gather" / "lane_scatter" (along the last dim)
    outer: int              # (lane_gather: the rows R of x [R, C])
    rows: int               # (lane_gather: the lanes C)
    inner: int              # (lane_gather: 1)
    tokens: int             # ids per outer index (lane_gather: the index width K)
    itemsize: int           # bytes of a table / values element
    table_kind: str         # gather_rows' TABLE_KINDS entry
    tile: TileSizes         # the target's tile sizes (LoweringContext.tile)
    accumulate: bool = True  # (lane_scatter: scatter_add)

    fill_chunk = INDIRECT_FMAX  # column chunk of gather_indirect's zero / base fill

    @property
    def partitions(self) -> int:
        return self.tile.partitions

    @property
    def psum_fmax(self) -> int:
        return self.tile.psum_fmax

    @property
    def onehot_chunk(self) -> int:
        """Column chunk of gather_rows: its matmuls write one PSUM bank."""
        return self.psum_fmax

    @property
    def indirect_chunk(self) -> int:
        """Column chunk of gather_indirect: a scatter-add merges duplicates by a matmul into one PSUM bank."""
        return self.psum_fmax if self.mode == "row_scatter" and self.accumulate else INDIRECT_FMAX

    @property
    def kind(self) -> str:
        """"row" (the table's rows) or "lane" (elements along the last dim)."""
        return self.mode.split("_")[0]

    def describe(self) -> str:
        return f"{self.mode} of {self.tokens} ids x [{self.outer}, {self.rows}, {self.inner}]"


@dataclass(frozen=True)
class Choice:
    path: str
    family: str
    seconds: dict           # estimated seconds per path
    reason: str


def choose(op: RowOp, target=None) -> Choice:
    """The cheaper path for `op` by the cost model (or the forced one), logged with both estimates."""
    seconds = {path: estimate(path, op, target) for path in PATHS}
    limit = INT32_LIMIT if op.mode.startswith("lane") else EXACT_INT_LIMIT
    if op.outer * op.rows >= limit:
        # gather_indirect computes row numbers (outer index * rows + id) in fp32 (int32 for lane gathers)
        path, reason = "onehot", f"{op.outer * op.rows} rows of the flattened table exceed its exact integers"
    elif _forced:
        path, reason = _forced[-1], "forced"
    else:
        path = min(PATHS, key=lambda p: (seconds[p], p != "indirect"))
        reason = "cost model"
    log.info("%s: %s (%s; one-hot %.1f us, indirect DMA %.1f us)", op.describe(), path, reason,
             seconds["onehot"] * 1e6, seconds["indirect"] * 1e6)
    return Choice(path, FAMILIES[path, op.kind], seconds, reason)


# ---- instruction lists -----------------------------------------------------------------------

_DTYPES = {1: "uint8", 2: "bfloat16", 4: "float32"}


def _op(engine: str, name: str, partitions: int, free: int, dtypes=("float32",), buffers=("sbuf",)) -> sim.Instruction:
    operands = tuple(Operand(role, (partitions, free), dtype, buffer)
                     for role, dtype, buffer in zip(("dst", "src", "moving"), dtypes * 3, buffers * 3))
    return sim.Instruction(engine, name, 0, 0, free, partitions, operands, "", 0)


def _vector(name, partitions, free, dtype="float32"):
    return _op("vector", name, partitions, free, (dtype,))


def _scalar(partitions, free):
    return _op("scalar", "activation", partitions, free)


def _matmul(partitions, stationary_free, moving_free, dtype="float32"):
    ins = _op("tensor", "nc_matmul", partitions, moving_free, (dtype,), ("psum", "sbuf", "sbuf"))
    ins.flops = 2 * partitions * stationary_free * moving_free
    return ins


def _dma(partitions, free, itemsize, name="dma_copy", hbm_side="shared_hbm"):
    ins = _op("dma", name, partitions, free, (_DTYPES.get(itemsize, "float32"),), ("sbuf", hbm_side))
    ins.bytes = partitions * free * itemsize
    return ins


def _ids(t: int, extra: int) -> list:
    """One token tile's row numbers: DMA, convert, wrap negatives (and `extra` [t, 1] ops)."""
    return [_dma(1, t, 4), _vector("tensor_copy", 1, t), _vector("tensor_scalar", 1, t),
            _vector("tensor_tensor", 1, t)] + [_vector("tensor_scalar", t, 1) for _ in range(extra)]


def _chunks(extent: int, chunk: int):
    """(chunk size, count) pairs of a walk of `extent` in chunks of `chunk` (a ragged last one)."""
    full, rest = divmod(extent, chunk)
    return [(chunk, full)] * bool(full) + [(rest, 1)] * bool(rest)


def _price(groups, target) -> float:
    """Seconds of the instruction lists `groups` = [(count, [instructions])], each repeated
    `count` times: the cost model's busy time per engine adds up; its fixed terms count once. A
    dma_compute reads the output the previous one wrote, so those form one dependency chain (each
    at its full DMA latency), the cost model's other bound."""
    resolved = sim.get_target(target)
    busy: dict = {}
    fixed = chain = 0.0
    for count, instructions in groups:
        if not count or not instructions:
            continue
        est = sim.estimate(instructions, resolved)
        for engine, seconds in est.engine_seconds.items():
            busy[engine] = busy.get(engine, 0.0) + count * seconds
        fixed = max(fixed, est.total_seconds - max(est.engine_seconds.values()))
        chain += count * sum(dma_transfer_seconds(ins, resolved) + resolved.dma_fixed_s
                             for ins in instructions if ins.op == "dma_compute")
    return max((max(busy.values()) if busy else 0.0) + fixed, chain + resolved.launch_fixed_s)


def _onehot_table_ops(kind: str, vc: int, t: int, cols: int, itemsize: int) -> list:
    """gather_rows' bits_matmul on one [vc, cols] table chunk for t tokens (fp32 one-hot, fp32 moving bits)."""
    load = _dma(vc, cols, itemsize)
    if kind == "bits32":
        return [load, _vector("tensor_scalar", vc, cols), _vector("tensor_scalar", vc, cols),
                _scalar(vc, cols), _scalar(vc, cols), _matmul(vc, t, cols), _matmul(vc, t, cols)]
    if kind == "bits16":
        return [load, _scalar(vc, cols), _matmul(vc, t, cols)]
    return [load, _matmul(vc, t, cols)]


def _onehot_join_ops(kind: str, t: int, cols: int) -> list:
    if kind == "bits32":
        return [_scalar(t, cols), _scalar(t, cols), _vector("tensor_scalar", t, cols), _vector("tensor_tensor", t, cols)]
    return [_scalar(t, cols)] if kind == "bits16" else [_vector("tensor_copy", t, cols)]


def _lane_masks(op: RowOp, target) -> float:
    """gather_lanes: per row tile and lane chunk, a mask and its bit moves per index column (a
    scatter also stores the chunk)."""
    groups = []
    chunks = _chunks(op.rows, LANE_FMAX)
    scatter = op.mode == "lane_scatter"
    for t, tiles in _chunks(op.outer, op.partitions):
        groups.append((tiles, [_dma(t, op.tokens, 4), _vector("tensor_copy", t, op.tokens)]
                       + ([] if scatter else [_vector("tensor_copy", t, op.tokens), _dma(t, op.tokens, op.itemsize)])))
        for cols, n in chunks:
            mix = [_dma(t, cols, op.itemsize)] + ([_vector("tensor_copy", t, cols)] if op.itemsize != 4 else [])
            if n > 1 or len(chunks) > 1:
                mix += [_vector("tensor_scalar", t, cols)]
            last = _op("gpsimd", "tensor_tensor", t, cols, ("int32",))
            if not scatter:
                last = _vector("tensor_reduce", t, cols)
            mix += [ins for _ in range(op.tokens) for ins in (
                _vector("tensor_scalar", t, cols), _op("gpsimd", "tensor_tensor", t, cols, ("int32",)), last)]
            if scatter:
                mix += [_vector("tensor_copy", t, cols), _dma(t, cols, op.itemsize)]
            groups.append((tiles * n, mix))
    return _price(groups, target)


def _lane_elements(op: RowOp, target) -> float:
    """gather_indirect's lane ops: one element-row DMA per index column and row tile (a scatter
    first copies its rows of x to the output)."""
    groups = []
    scatter = op.mode == "lane_scatter"
    for t, tiles in _chunks(op.outer, op.partitions):
        k = op.tokens
        mix = [_dma(t, k, 4), _vector("tensor_copy", t, k), _vector("tensor_scalar", t, k),
               _vector("tensor_scalar", t, k), _vector("tensor_tensor", t, k), _vector("tensor_copy", t, k),
               _vector("tensor_scalar", t, k), _op("gpsimd", "iota", t, 1), _op("gpsimd", "memset", t, k),
               _dma(t, k, op.itemsize)]
        if scatter:
            mix.append(_dma(t, op.rows, op.itemsize, hbm_side="shared_hbm"))
        element = _dma(t, 1, op.itemsize, "dma_compute" if scatter and op.accumulate else "dma_copy")
        if scatter and op.accumulate:
            element.bytes *= 3
        mix += [ins for _ in range(k) for ins in ([_op("gpsimd", "tensor_tensor", t, 1, ("int32",))] * 3 + [element])]
        groups.append((tiles, mix))
    return _price(groups, target)


def _row_onehot(op: RowOp, target) -> float:
    """gather_rows (codegen_templates/gather_rows.py.j2)."""
    groups = []
    vchunks = _chunks(op.rows, op.partitions)
    cchunks = _chunks(op.inner, op.onehot_chunk)
    vdtype = _DTYPES.get(op.itemsize, "float32")
    for t, tiles in _chunks(op.tokens, op.partitions):
        if op.mode == "row_gather":
            per_tile = _ids(t, 0) + [_matmul(1, op.partitions, t)]
            per_tile += [_vector("tensor_scalar", vc, t) for vc, n in vchunks for _ in range(n)]
            groups.append((tiles, per_tile))
            for cols, n in cchunks:
                table = [ins for vc, m in vchunks for _ in range(m) for ins in _onehot_table_ops(op.table_kind, vc, t, cols, op.itemsize)]
                store = _onehot_join_ops(op.table_kind, t, cols) + [_dma(t, cols, op.itemsize)]
                groups.append((tiles * n * op.outer, table + store))
        else:
            groups.append((tiles, _ids(t, 3) + [_matmul(1, t, 1)]))
            for vc, m in vchunks:
                for cols, n in cchunks:
                    # per (outer, row chunk, column chunk, token tile): one-hot, values load, matmul
                    mix = [_vector("tensor_scalar", t, vc), _dma(t, cols, op.itemsize), _matmul(t, vc, cols, vdtype)]
                    if not op.accumulate:
                        mix += [_matmul(t, vc, 1)]
                    groups.append((tiles * m * n * op.outer, mix))
    if op.mode == "row_scatter":
        for vc, m in vchunks:
            for cols, n in cchunks:
                store = [_vector("tensor_copy", vc, cols), _dma(vc, cols, op.itemsize)]
                if not op.accumulate:
                    store += _onehot_join_ops(op.table_kind, vc, cols) + [_dma(vc, cols, op.itemsize)]
                    store += [_vector("tensor_tensor", vc, cols)] * 2 + [_vector("tensor_scalar", vc, cols)]
                groups.append((m * n * op.outer, store))
    return _price(groups, target)


def _row_indirect(op: RowOp, target) -> float:
    """gather_indirect's row ops (codegen_templates/gather_indirect.py.j2)."""
    groups = []
    cchunks = _chunks(op.inner, op.indirect_chunk)
    vdtype = _DTYPES.get(op.itemsize, "float32")
    for t, tiles in _chunks(op.tokens, op.partitions):
        per_tile = _ids(t, 5) + [_matmul(1, t, 1), _vector("tensor_copy", t, 1)]
        if op.mode == "row_scatter":
            per_tile += [_matmul(1, t, t), _vector("tensor_scalar", t, t), _op("gpsimd", "affine_select", t, t),
                         _vector("tensor_reduce", t, t)]
        groups.append((tiles, per_tile))
        for cols, n in cchunks:
            if op.mode == "row_gather":
                mix = [_vector("tensor_scalar", t, 1), _op("gpsimd", "memset", t, cols),
                       _dma(t, cols, op.itemsize), _dma(t, cols, op.itemsize)]
            else:
                mix = [_vector("tensor_scalar", t, 1), _dma(t, cols, op.itemsize)]
                if op.accumulate:
                    rmw = _dma(t, cols, 4, "dma_compute")
                    rmw.bytes = t * cols * op.itemsize * 3
                    mix += [_matmul(t, t, cols, vdtype), _vector("tensor_copy", t, cols), rmw]
                else:
                    mix += [_dma(t, cols, op.itemsize)]
            groups.append((tiles * n * op.outer, mix))
    if op.mode == "row_scatter":
        for vc, m in _chunks(op.outer * op.rows, op.partitions):
            for cols, n in _chunks(op.inner, op.fill_chunk):
                groups.append((m * n, [_dma(vc, cols, op.itemsize, hbm_side="shared_hbm")]))
    return _price(groups, target)


# (path, row or lane op) -> the estimate of that kernel
_ESTIMATES = {("onehot", "row"): _row_onehot, ("onehot", "lane"): _lane_masks,
              ("indirect", "row"): _row_indirect, ("indirect", "lane"): _lane_elements}


def estimate(path: str, op: RowOp, target=None) -> float:
    """Estimated seconds of `op` on `path` by the cost model of `target` (default trn2)."""
    return _ESTIMATES[path, op.kind](op, target)
