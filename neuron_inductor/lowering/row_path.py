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

`forced(path)` overrides the choice inside a block (tests and bench/embedding.py run both paths);
`forced_merge(merge)` that of a row scatter-add's duplicate merge (`scatter_merge`: "tile" or "all",
gather_indirect.py.j2), and `fill_plan` lays out a row scatter's fill of its output.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, replace
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

MERGES = ("tile", "all")

_forced: list[str] = []
_forced_merge: list[str] = []


@contextlib.contextmanager
def _forcing(stack: list, value: str, allowed: tuple, what: str) -> Iterator[None]:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(allowed)}")
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def forced(path: str):
    """Make every row op inside the block take `path` ("onehot" or "indirect")."""
    return _forcing(_forced, path, PATHS, "row op path")


def forced_merge(merge: str):
    """Make every indirect row scatter-add inside the block merge its duplicates by `merge` ("tile"
    or "all") where that merge applies."""
    return _forcing(_forced_merge, merge, MERGES, "row scatter merge")


# bytes per partition of one fill DMA: a 32 KiB run reaches 99.2% of the DMA bandwidth by the cost
# model's size rule (b / (b + 256 B)), against 94% for a 4 KiB table row (the zeros tile is dead
# after the fill: its SBUF is free again when the merge's tiles need it, sim/liveness.py)
FILL_BYTES = 32 * 1024
# the "all" merge keeps every token's values on chip: at most this many bytes per partition, and
# at most this many tokens (its [tokens, tokens] id compares)
MERGE_ALL_BYTES = 64 * 1024
MERGE_ALL_TOKENS = 4096


@dataclass(frozen=True)
class FillPlan:
    """How gather_indirect writes a row scatter's whole output [rows, inner] (zeros or base) before
    its scatter: in blocks of `block_rows` whole rows, each block one [partitions, width] view of
    its contiguous elements (DMAs of up to `chunk` columns: long contiguous runs, whatever the
    row width), `full` such blocks and then `last_rows` rows (0: none) as [partitions,
    last_rows * inner // partitions] and a [1, rest] remainder. Under an LNC split each program
    writes a contiguous range of blocks and fills those rows."""

    block_rows: int
    width: int
    chunk: int
    full: int
    last_rows: int

    @property
    def blocks(self) -> int:
        return self.full + bool(self.last_rows)


def fill_plan(rows: int, inner: int, partitions: int, itemsize: int, programs: int = 1) -> FillPlan:
    """Blocks of whole rows whose elements split evenly over the partitions, up to FILL_BYTES per
    partition; under a split, at least 4 blocks per program and as many for each where the rows allow."""
    unit = partitions // math.gcd(inner, partitions)  # rows whose elements fill every partition evenly
    unit_width = unit * inner // partitions
    limit = max(1, FILL_BYTES // itemsize)
    block_rows = unit * max(1, limit // unit_width)
    if programs > 1:
        # at least 4 blocks per program, their count a multiple of the programs (equal shares)
        blocks = programs * max(4, math.ceil(math.ceil(rows / block_rows) / programs))
        block_rows = min(block_rows, max(unit, math.ceil(rows / blocks / unit) * unit))
    width = block_rows * inner // partitions
    full, last_rows = divmod(rows, block_rows)
    widest = width if full else max(1, last_rows * inner // partitions, last_rows * inner % partitions)
    return FillPlan(block_rows, width, min(widest, limit), full, last_rows)  # (the zeros tile: the widest DMA)


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
    base: bool = False      # a scatter onto a base (index_put) rather than zeros
    programs: int = 1       # LNC programs the kernel splits over (a gather: token tiles; a scatter: output rows)
    merge: str = "tile"     # a row scatter-add's duplicate merge: "tile" (per token tile, then dma_compute
                            # adds) or "all" (over every token, then each row is written once by dma_copy)

    @property
    def fill(self) -> FillPlan:
        return fill_plan(self.outer * self.rows, self.inner, self.partitions, self.itemsize, self.programs)

    @property
    def merge_group(self) -> int:
        """Columns of the "all" merge's values on chip at a time: every token's, within
        MERGE_ALL_BYTES per partition, whole PSUM banks, at most one program's share."""
        bank = self.psum_fmax
        fitting = MERGE_ALL_BYTES // (math.ceil(self.tokens / self.partitions) * self.itemsize) // bank * bank
        return max(bank, min(fitting, math.ceil(self.inner / self.programs)))

    @property
    def merge_all_fits(self) -> bool:
        """Whether the "all" merge's on-chip tiles fit (one index tensor, outer == 1: lowering checks)."""
        group_bytes = math.ceil(self.tokens / self.partitions) * self.psum_fmax * self.itemsize
        return (self.accumulate and self.tokens <= MERGE_ALL_TOKENS and group_bytes <= MERGE_ALL_BYTES
                and self.inner >= self.programs)  # (each program merges its share of the columns)

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


def _fill_ops(op: RowOp) -> list:
    """(count, [instruction]) groups of the fill (FillPlan) on the core with the most blocks."""
    plan = op.fill
    p = op.partitions
    groups = [(1, [_op("gpsimd", "memset", p, plan.chunk)])]
    pieces = [(math.ceil(plan.blocks / op.programs) - bool(plan.last_rows), p, plan.width)]
    if plan.last_rows:
        elements = plan.last_rows * op.inner
        pieces += [(1, p, elements // p), (1, 1, elements % p)]
    for count, partitions, width in pieces:
        for cols, n in _chunks(width, plan.chunk):
            groups.append((count * n, [_dma(partitions, cols, op.itemsize, hbm_side="shared_hbm")]))
    return groups


def _merge_all_ops(op: RowOp) -> list:
    """The "all" merge: every token's ids on chip, per token tile a mask against every token (its
    earlier repeats write nothing); per column group, every token's values and per tile a the
    masks and merge matmuls with each tile from a on; under a split, this program's columns."""
    p, n, width = op.partitions, op.tokens, math.ceil(op.inner / op.programs)
    vdtype = _DTYPES.get(op.itemsize, "float32")
    tiles = _chunks(n, p)
    count = sum(c for _, c in tiles)
    groups = [(1, [_dma(1, n, 4), _vector("tensor_copy", 1, n), _vector("tensor_scalar", 1, n)])]
    for cols, m in _chunks(n, op.psum_fmax):
        groups.append((m, [_matmul(1, p, cols), _vector("tensor_copy", p, cols)]))
    for a in range(count):
        t = min(p, n - a * p)
        upto = a * p + t
        groups.append((1, [_matmul(1, t, 1), _vector("tensor_copy", t, 1)] + [_vector("tensor_scalar", t, 1)] * 6
                       + [_vector("tensor_scalar", t, upto), _op("gpsimd", "affine_select", t, upto),
                          _vector("tensor_reduce", t, upto)]))
    for gw, repeats in _chunks(width, op.merge_group):
        for t, m in tiles:
            groups.append((m * repeats, [_dma(t, gw, op.itemsize)]))
        for a in range(count):
            t = min(p, n - a * p)
            later = count - a
            mix = [_vector("tensor_scalar", p, t, vdtype)] * later
            for cols, c in _chunks(gw, op.psum_fmax):
                mix += ([_matmul(p, t, cols, vdtype)] * later + [_vector("tensor_copy", t, cols)]) * c
            if op.base:  # the sum added to the base row: read, add, write
                rmw = _dma(t, gw, 4, "dma_compute")
                rmw.bytes, rmw.dma_run_bytes = t * gw * op.itemsize * 3, gw * op.itemsize
                mix.append(rmw)
            else:
                mix.append(_dma(t, gw, op.itemsize))
            groups.append((repeats, mix))
    return groups


def _row_indirect(op: RowOp, target) -> float:
    """gather_indirect's row ops (codegen_templates/gather_indirect.py.j2)."""
    if op.mode == "row_scatter" and op.merge == "all":
        return _price(_fill_ops(op) + _merge_all_ops(op), target)
    groups = []
    cchunks = _chunks(op.inner, op.indirect_chunk)
    vdtype = _DTYPES.get(op.itemsize, "float32")
    for t, tiles in _chunks(op.tokens, op.partitions):
        if op.mode == "row_gather":
            tiles = math.ceil(tiles / op.programs)  # the token tiles are dealt out
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
                    rmw.bytes, rmw.dma_run_bytes = t * cols * op.itemsize * 3, cols * op.itemsize
                    mix += [_matmul(t, t, cols, vdtype), _vector("tensor_copy", t, cols), rmw]
                else:
                    mix += [_dma(t, cols, op.itemsize)]
            groups.append((tiles * n * op.outer, mix))
    if op.mode == "row_scatter":
        groups += _fill_ops(op)
    return _price(groups, target)


def scatter_merge(op: RowOp, target=None) -> str:
    """The cheaper duplicate merge of a row scatter-add with one index tensor and outer == 1 ("all"
    only where its tiles fit on chip), by the cost model."""
    if not op.merge_all_fits:
        return "tile"
    if _forced_merge:
        return _forced_merge[-1]
    seconds = {merge: _row_indirect(replace(op, merge=merge), target) for merge in MERGES}
    return min(seconds, key=seconds.get)


# (path, row or lane op) -> the estimate of that kernel
_ESTIMATES = {("onehot", "row"): _row_onehot, ("onehot", "lane"): _lane_masks,
              ("indirect", "row"): _row_indirect, ("indirect", "lane"): _lane_elements}


def estimate(path: str, op: RowOp, target=None) -> float:
    """Estimated seconds of `op` on `path` by the cost model of `target` (default trn2)."""
    return _ESTIMATES[path, op.kind](op, target)
