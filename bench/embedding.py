"""Embedding forward + backward, one-hot matmuls against indirect DMA, by the Trn2 cost model.

    python bench/embedding.py                       # d=2048, S=2048, vocab 32000, bf16 (issue 15)
    python bench/embedding.py --vocab 128256 --dim 4096 --tokens 4096
    python bench/embedding.py --lnc 2               # split over the two cores of an LNC=2 logical core

Each kernel is generated for both row-op paths (lowering/row_path.py's `forced`), run in the NKI
interpreter under a trace (bench/kernels.py's run_case) and priced by the cost model. The floor is
the HBM traffic each op cannot avoid at the core's DMA bandwidth (the table's "roofline" column): the
rows it reads and the result it writes (a gather reads only the rows named; a scatter writes the
whole gradient table), divided over the cores at LNC 2. The last lines give the path the cost model
picks for each op, with both of its estimates. Results: bench/embedding.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from neuron_inductor import sim
from neuron_inductor.lowering import row_path
from neuron_inductor.lowering.context import LoweringContext

try:
    from bench.kernels import TARGET, BenchCase, _randn, format_table, run_case
except ImportError:  # run as a script: bench/ is on sys.path, the repo root is not
    from kernels import TARGET, BenchCase, _randn, format_table, run_case

aten = torch.ops.aten


def _ids(tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(vocab))


def cases(vocab: int, dim: int, tokens: int, dtype: torch.dtype) -> tuple[BenchCase, BenchCase]:
    def forward():
        return (lambda w, i: torch.nn.functional.embedding(i, w)), (_randn(vocab, dim, dtype=dtype), _ids(tokens, vocab))

    def backward():
        fn = lambda g, i: aten.embedding_dense_backward(g, i, vocab, -1, False)  # noqa: E731
        return fn, (_randn(1, tokens, dim, dtype=dtype), _ids(tokens, vocab))

    shape = f"{tokens} ids x {vocab}x{dim}"
    return (BenchCase("embedding_fwd", aten.embedding.default, forward, shape, dtype),
            BenchCase("embedding_bwd", aten.embedding_dense_backward.default, backward, shape, dtype))


def floor_us(mode: str, vocab: int, dim: int, tokens: int, itemsize: int, lnc: int = 1) -> float:
    target = sim.get_target(TARGET)
    moved = 2 * tokens * dim * itemsize if mode == "fwd" else (vocab + tokens) * dim * itemsize
    return (moved + 4 * tokens) / (target.dma_queues * target.dma_queue_bytes_per_s) / lnc * 1e6


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--paths", default="onehot,indirect", help="comma-separated row-op paths to run")
    parser.add_argument("--lnc", type=int, default=1, help="physical cores per logical core (1 or 2)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    totals, rows = {}, []
    for path in args.paths.split(","):
        with row_path.forced(path):
            for case in cases(args.vocab, args.dim, args.tokens, dtype):
                row = run_case(case, args.lnc)
                row.name = f"{case.name}_{path}"
                # (run_case's roofline counts the whole table as read; a gather reads only its rows)
                row.roofline_us = floor_us(case.name[-3:], args.vocab, args.dim, args.tokens, dtype.itemsize, args.lnc)
                rows.append(row)
                totals[path] = totals.get(path, 0.0) + row.estimate_us
                print(format_table([row]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    print()
    itemsize = dtype.itemsize
    for mode in ("fwd", "bwd"):
        floor = floor_us(mode, args.vocab, args.dim, args.tokens, itemsize, args.lnc)
        print(f"embedding_{mode} floor (HBM traffic it must move, per core): {floor:.1f}us")
    for path, total in totals.items():
        print(f"embedding fwd+bwd, {path}: {total:.1f}us")
    for mode in ("row_gather", "row_scatter"):
        op = row_path.RowOp(mode, 1, args.vocab, args.dim, args.tokens, itemsize, "bits16" if itemsize == 2 else "bits32",
                            LoweringContext.for_target(TARGET).tile)
        choice = row_path.choose(op, TARGET)
        print(f"{mode}: the cost model picks {choice.path} (one-hot {choice.seconds['onehot'] * 1e6:.1f}us, "
              f"indirect {choice.seconds['indirect'] * 1e6:.1f}us)")
    scatter = replace(op, programs=args.lnc)
    merges = {merge: row_path.estimate("indirect", replace(scatter, merge=merge)) * 1e6 for merge in row_path.MERGES}
    print(f"row_scatter's duplicate merge: {row_path.scatter_merge(scatter, TARGET)} "
          f"({', '.join(f'{m} {us:.1f}us' for m, us in merges.items())}; all only where its tiles fit: {scatter.merge_all_fits})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
