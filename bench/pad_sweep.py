"""Differential bucketing sweep: padding a dynamic dim to its bucket must never change results.

    python bench/pad_sweep.py                       # every op_db entry; writes pad_sweep.md
    python bench/pad_sweep.py --op cat --op roll    # some entries (OpInfo full names)
    python bench/pad_sweep.py --limit 50 --json r.json
    python bench/pad_sweep.py --tables-from r.json  # the tables of an earlier run (writes pad_sweep.md)
    python bench/pad_sweep.py --recheck r.json --json r2.json  # re-run the ops of r.json that did not
                                                    # pass padded in every mode, or were not reached

For each OpInfo of torch's `op_db`, the first fp32 sample whose input (its first tensor) has a dim
of size >= 2 becomes a function of that dim's length (bench/opinfo.py's `Case`). The sample is
resized along that dim to four lengths: three inside one bucket, strictly below its boundary (so
that every call carries padding, and Dynamo sees the length change and makes it dynamic), and one
just past the boundary (a new bucket, the most padding). With the bucket policy "8" and a sample
length of 5 these are 5, 6, 7 and 9 (buckets 8, 8, 8, 16). Every tensor argument that shares the
input's size along that dim is resized with it (all dims of that size in every tensor, else the
same dim in tensors of the input's rank, else the input alone: the first plan eager accepts at all
four lengths); a sample no plan fits is skipped. Resizing keeps the sample's values on the prefix
and extends integer / bool tensors by repeating them (indices stay in range) and floating tensors
with uniform draws inside the tensor's own range (no ties, same domain).

The function then runs under `torch.compile(backend="neuron", options={"buckets": "8",
"fallback": "allow"})` three ways: default (`dynamic=None`: the first call is Dynamo's static graph,
then automatic dynamic), `dynamic=False` (static graphs, padded through their symbolic form) and
`dynamic=True`, and each call is compared with eager at its length (forward, fp32, |compiled - eager|
<= atol * max(1, max|eager|) + rtol * |eager| with atol = rtol = 1e-5).

Outcomes of one op in one mode:
- pass, with where the calls after the first ran: `padded` (every compiled program of calls 2-4 ran
  padded to a bucket), `unpadded` (the pad-safety pass refused to pad a graph: it runs at exact
  shapes and names the op and reason, "runs UNPADDED"), `exact` (exact shapes for another reason:
  no bucketed symbol because Dynamo specialised the length, or static graphs whose structure changes
  with the length, e.g. the number of split outputs), or `no graph` (nothing was compiled);
- mismatch: values differ from eager, and the same mode with `buckets="off"` matches eager, so
  padding changed the result (must be 0);
- mismatch at exact shapes: values differ with `buckets="off"` as well: a kernel / lowering bug,
  not padding (bench/opinfo.py's domain), listed apart;
- crash: the neuron backend raised where `aot_eager` in the same mode runs (a Dynamo or
  AOTAutograd failure of aot_eager too makes the mode a skip);
- timeout / died: the op's worker went over --timeout seconds or died.
- skip (the whole op): no sample with a dim >= 2, no consistent resize, eager not reproducible.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

if not __package__:  # run as a script: import the sibling bench module through the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import opinfo  # noqa: E402

BUCKET = 8
OPTIONS = {"buckets": str(BUCKET), "fallback": "allow"}
MODES = {"default": {}, "dynamic=False": {"dynamic": False}, "dynamic=True": {"dynamic": True}}
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
SAMPLES_SEARCHED = 30  # samples of one op looked at for an input with a dim >= 2
TIMEOUT_SECONDS = 300
TABLE_FILE = Path(__file__).with_suffix(".md")
UNPADDED = re.compile(r"runs UNPADDED .*? could change results: (.*)$")


def lengths_for(size: int, bucket: int = BUCKET) -> list[int]:
    """Three lengths >= `size` strictly inside one bucket, then one just past its boundary."""
    boundary = bucket * math.ceil((size + 3) / bucket)
    return [boundary - 3, boundary - 2, boundary - 1, boundary + 1]


# -- resizing a sample along one dim -----------------------------------------------------------------

def resize(tensor: torch.Tensor, dim: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`tensor` at `length` along `dim`: its own values on the prefix; past it, repeats (integer and
    bool tensors) or uniform draws in the tensor's range (floating tensors)."""
    tensor = tensor.detach()
    size = tensor.shape[dim]
    if length <= size:
        return tensor.narrow(dim, 0, length).clone()
    extra_shape = list(tensor.shape)
    extra_shape[dim] = length - size
    if tensor.is_floating_point() or tensor.is_complex():
        real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        finite = real[real.isfinite()]
        low, high = (finite.min().item(), finite.max().item()) if finite.numel() else (-1.0, 1.0)
        shape = extra_shape + ([2] if tensor.is_complex() else [])
        draws = low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float64)
        extra = (torch.view_as_complex(draws.contiguous()) if tensor.is_complex() else draws).to(tensor.dtype)
    else:
        repeats = [1] * tensor.dim()
        repeats[dim] = math.ceil((length - size) / size)
        extra = tensor.repeat(repeats).narrow(dim, 0, length - size)
    return torch.cat([tensor, extra], dim)


def resize_plans(leaves: list, dim: int) -> dict[str, dict[int, tuple[int, ...]]]:
    """Which dims of which tensor leaves change with the input's `dim` (leaf index -> dims), most
    inclusive first; identical plans are listed once."""
    tensors = {i: leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    first = min(tensors)
    size, rank = tensors[first].shape[dim], tensors[first].dim()
    candidates = {
        "every dim of that size": {i: tuple(d for d, s in enumerate(t.shape) if s == size) for i, t in tensors.items()},
        "that dim in tensors of the input's rank": {
            i: (dim,) for i, t in tensors.items() if t.dim() == rank and t.shape[dim] == size},
        "the input alone": {first: (dim,)},
    }
    plans: dict[str, dict[int, tuple[int, ...]]] = {}
    for name, plan in candidates.items():
        plan = {i: dims for i, dims in plan.items() if dims}
        if plan not in plans.values():
            plans[name] = plan
    return plans


class ResizedSample:
    """An OpInfo sample (`opinfo.Case`) whose input dim `dim` takes any length, by `plan`."""

    def __init__(self, case: opinfo.Case, dim: int, plan: dict[int, tuple[int, ...]]) -> None:
        self.case, self.dim, self.plan = case, dim, plan

    def at(self, length: int) -> opinfo.Case:
        """The case at `length`: the same function, resized tensors (aliases stay aliases)."""
        generator = torch.Generator().manual_seed(length)
        resized = copy.copy(self.case)
        resized.leaves = list(self.case.leaves)
        done: dict[int, torch.Tensor] = {}
        for index, dims in sorted(self.plan.items()):
            leaf = self.case.leaves[index]
            if id(leaf) not in done:
                tensor = leaf
                for d in dims:
                    tensor = resize(tensor, d, length, generator)
                done[id(leaf)] = tensor.requires_grad_(leaf.requires_grad)
            resized.leaves[index] = done[id(leaf)]
        return resized

    def describe(self, length: int) -> str:
        shapes = [tuple(leaf.shape) for leaf in self.at(length).leaves if isinstance(leaf, torch.Tensor)]
        return ", ".join(str(list(shape)) for shape in shapes)


def pick_sample(op) -> tuple[int, object, int] | None:
    """(index, sample, dim) of the op's first fp32 sample whose input has a dim of size >= 2."""
    torch.manual_seed(opinfo.SEED)
    for index, sample in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=False)):
        if index >= SAMPLES_SEARCHED:
            break
        first = next((leaf for leaf in opinfo.Case(op, sample).leaves if isinstance(leaf, torch.Tensor)), None)
        if first is not None:
            dim = next((d for d, size in enumerate(first.shape) if size >= 2), None)
            if dim is not None:
                return index, sample, dim
    return None


def eager_references(sample: ResizedSample, lengths: list[int]) -> list[opinfo.Run] | str:
    """Eager's result at every length, or why it cannot be the reference."""
    runs = []
    for length in lengths:
        case = sample.at(length)
        try:
            expected = opinfo.run_case(case, case.fn, backward=False)
            again = opinfo.run_case(case, case.fn, backward=False)
        except Exception as exc:
            return f"eager fails at length {length}: {type(exc).__name__}: {str(exc).strip()[:160]}"
        if not opinfo._same(expected, again):
            return f"eager differs between two runs from the same seed at length {length}"
        runs.append(expected)
    return runs


# -- one op under one compile mode -----------------------------------------------------------------

def run_mode(sample: ResizedSample, lengths: list[int], expected: list[opinfo.Run], mode: str,
             backend: str = "neuron", buckets: str = str(BUCKET)) -> dict:
    """Compile once, call at every length, compare each call with eager: {"status", ...}; for the
    neuron backend also the program signatures of every call and the pad-safety refusals."""
    from neuron_inductor import generalize
    from neuron_inductor.observe import session

    torch._dynamo.reset()
    generalize.reset()  # each mode starts as a new process would: no static-graph family from another mode
    options = {**OPTIONS, "buckets": buckets} if backend == "neuron" else None
    compiled = torch.compile(sample.case.fn, backend=backend, options=options, **MODES[mode])
    warnings = opinfo.LogMessages(logging.WARNING)
    logger = logging.getLogger("neuron_inductor")
    logger.addHandler(warnings)
    outcome: dict = {"status": "pass", "signatures": []}
    try:
        for length, want in zip(lengths, expected):
            before = len(session.BUCKETS)
            try:
                got = opinfo.run_case(sample.at(length), compiled, backward=False)
            except Exception as exc:
                root = opinfo._root_exception(exc)
                outcome.update(status="crash", length=length, raised_at=opinfo._raised_at(root),
                               detail=f"{type(root).__name__}: {str(root).strip()[:300]}")
                break
            outcome["signatures"].append([p.plan for p in session.BUCKETS[before:]])
            difference = opinfo.compare(got, want, torch.float32, TOLERANCE)
            if difference is not None:
                outcome.update(status="mismatch", length=length, detail=difference[:300])
                break
    finally:
        logger.removeHandler(warnings)
    outcome["unpadded"] = sorted({reason for message in warnings.messages if (found := UNPADDED.search(message))
                                  for reason in found.group(1).split("; ")})
    return outcome


def placement(outcome: dict) -> str:
    """Where the calls after the first ran (see the module doc): padded / unpadded / exact / no graph."""
    later = [s for call in outcome["signatures"][1:] for s in call]
    if outcome["unpadded"]:
        return "unpadded"
    if not later:
        return "no graph" if not any(outcome["signatures"]) else "padded"  # a reused first-call program
    return "exact" if any(s.startswith(("exact", "static")) for s in later) else "padded"


def check_mode(sample: ResizedSample, lengths: list[int], expected: list[opinfo.Run], mode: str) -> dict:
    outcome = run_mode(sample, lengths, expected, mode)
    if outcome["status"] == "pass":
        outcome["where"] = placement(outcome)
    elif outcome["status"] == "mismatch":
        exact = run_mode(sample, lengths, expected, mode, buckets="off")
        if exact["status"] != "pass":
            outcome.update(status="mismatch at exact shapes", exact_detail=exact.get("detail", ""))
    elif outcome["status"] == "crash":
        baseline = run_mode(sample, lengths, expected, mode, backend="aot_eager")
        if baseline["status"] != "pass":
            outcome.update(status="skip", skip=f"aot_eager fails too: {baseline.get('detail', '')[:200]}")
    return outcome


def check_op(op, variant: str = "float32", on_stage=opinfo._no_stage) -> dict:
    """One row: {"skip": reason}, or the sample, dim, lengths, resize plan and each mode's outcome."""
    if op.has_nondeterministic_output:
        return {"skip": "nondeterministic output (uninitialised memory)"}
    if torch.float32 not in op.supported_dtypes("cpu"):
        return {"skip": "no float32 support on CPU"}
    on_stage("eager")
    try:
        picked = pick_sample(op)
    except Exception as exc:
        return {"skip": f"sample_inputs fails: {type(exc).__name__}: {str(exc)[:160]}"}
    if picked is None:
        return {"skip": f"no sample (of the first {SAMPLES_SEARCHED}) has an input dim of size >= 2"}
    index, raw, dim = picked
    case = opinfo.Case(op, raw)
    size = next(leaf for leaf in case.leaves if isinstance(leaf, torch.Tensor)).shape[dim]
    lengths = lengths_for(size)
    refusals = []
    for plan_name, plan in resize_plans(case.leaves, dim).items():
        sample = ResizedSample(case, dim, plan)
        expected = eager_references(sample, lengths)
        if isinstance(expected, str):
            refusals.append(f"{plan_name}: {expected}")
            continue
        row = {"sample": index, "dim": dim, "lengths": lengths, "plan": plan_name,
               "shapes": sample.describe(lengths[0]), "modes": {}}
        for mode in MODES:
            on_stage(mode)
            row["modes"][mode] = check_mode(sample, lengths, expected, mode)
        return row
    return {"skip": "no consistent resize: " + " | ".join(refusals)[:400]}


# -- worker processes and the report ---------------------------------------------------------------

def lost_row(kind: str, stage: str, detail: str) -> dict:
    """The row of an op whose worker hung or died (in `stage`: "eager" or a mode)."""
    return {"lost": kind, "stage": stage, "detail": detail}


def status(row: dict, mode: str) -> str:
    """The outcome of one mode: pass / mismatch / mismatch at exact shapes / crash / timeout / died / skip."""
    if "lost" in row:
        return row["lost"] if row["stage"] in (mode, "eager") else "skip"
    if "skip" in row:
        return "skip"
    return row["modes"][mode]["status"]


def row_summary(row: dict) -> str:
    if "skip" in row:
        return f"skip: {row['skip'][:120]}"
    if "lost" in row:
        return f"{row['lost']} in {row['stage']}: {row['detail'][:120]}"
    parts = []
    for mode, outcome in row["modes"].items():
        text = outcome["status"] + (f" ({outcome['where']})" if outcome["status"] == "pass" else "")
        if outcome["status"] not in ("pass",):
            text += f" at {outcome.get('length')}: {outcome.get('detail', outcome.get('skip', ''))[:100]}"
        parts.append(f"{mode} {text}")
    return f"[{row['shapes']}] " + "; ".join(parts)


COLUMNS = ("pass", "padded", "unpadded", "exact", "no graph", "mismatch", "mismatch at exact shapes", "crash",
           "timeout / died", "skip")


def mode_counts(records: list[dict], mode: str) -> Counter:
    tally: Counter = Counter()
    for record in records:
        result = status(record["row"], mode)
        tally["timeout / died" if result in ("timeout", "died") else result] += 1
        if result == "pass":
            tally[record["row"]["modes"][mode]["where"]] += 1
    return tally


def summary_table(records: list[dict]) -> str:
    lines = ["| mode | ops | pass | padded | unpadded (pad-safety) | exact (other) | no graph | "
             "mismatch (padding) | mismatch at exact shapes too | crash | timeout / died | skip |",
             "|---|" + "---|" * 11]
    for mode in MODES:
        c = mode_counts(records, mode)
        lines.append(f"| {mode} | {len(records)} | " + " | ".join(str(c[k]) for k in COLUMNS) + " |")
    return "\n".join(lines)


def padded_share(records: list[dict]) -> str:
    """Of the ops that pass in every mode, the share whose later calls all ran padded in every mode."""
    passing = [r for r in records if all(status(r["row"], mode) == "pass" for mode in MODES)]
    padded = [r for r in passing if all(r["row"]["modes"][mode]["where"] == "padded" for mode in MODES)]
    share = 100 * len(padded) / len(passing) if passing else 0.0
    return (f"{len(padded)} of the {len(passing)} ops that pass in all three modes stay padded in all three "
            f"({share:.0f}%).")


def unpadded_table(records: list[dict]) -> str:
    """Exact-shape runs by op: the op pad-safety named -> the OpInfos (any mode) it made run unpadded."""
    by_reason: dict[str, set] = {}
    for record in records:
        for outcome in record["row"].get("modes", {}).values():
            for reason in outcome.get("unpadded", ()):
                by_reason.setdefault(reason, set()).add(record["op"])
    by_op: dict[str, dict[str, set]] = {}
    for reason, ops in by_reason.items():
        by_op.setdefault(reason.split(":", 1)[0], {})[reason] = ops
    lines = ["| op run at exact shapes | OpInfos | reasons given |", "|---|---|---|"]
    for op, reasons in sorted(by_op.items(), key=lambda item: -len(set().union(*item[1].values()))):
        names = sorted(set().union(*reasons.values()))
        why = "; ".join(sorted({r.split(":", 1)[-1].strip() for r in reasons}))[:200].replace("|", "/")
        lines.append(f"| {op} | {len(names)}: {', '.join(names[:10])}{' ...' if len(names) > 10 else ''} | {why} |")
    return "\n".join(lines)


def failures_table(records: list[dict]) -> str:
    lines = ["| op | mode | outcome | length | shapes at the first length (plan) | detail |", "|---|---|---|---|---|---|"]
    for record in records:
        row = record["row"]
        for mode in MODES:
            result = status(row, mode)
            if result in ("pass", "skip"):
                continue
            outcome = row["modes"][mode] if "modes" in row else {"detail": row["detail"]}
            detail = f"{outcome.get('detail', '')} {outcome.get('raised_at', '')}".replace("|", "\\|")
            lines.append(f"| {record['op']} | {mode} | {result} | {outcome.get('length', '')} | "
                         f"{row.get('shapes', '')} ({row.get('plan', '')}) | {' '.join(detail.split())[:220]} |")
    return "\n".join(lines)


def skip_table(records: list[dict]) -> str:
    reasons: Counter = Counter()
    for record in records:
        row = record["row"]
        if "skip" in row:
            reasons[row["skip"].split(":")[0]] += 1
        for mode, outcome in row.get("modes", {}).items():
            if outcome["status"] == "skip":
                reasons[f"{mode}: {outcome['skip'].split(':')[0]}"] += 1
    lines = ["| skip reason | ops |", "|---|---|"]
    lines += [f"| {reason} | {n} |" for reason, n in reasons.most_common()]
    return "\n".join(lines)


def markdown(run: dict) -> str:
    """The report of a run: {"records", "seconds", "commit"} and, for a re-check, "rechecked" (the ops
    re-run at "commit") and "base_commit" (where every other record comes from)."""
    records = run["records"]
    definitions = __doc__.split("\n\n", 2)[2].strip()
    origin = f"commit {run['commit']}, {run['seconds'] / 60:.0f} min"
    if run.get("not_reached"):
        origin += (f"; {len(run['not_reached'])} more ops were not reached within the time limit: "
                   f"{', '.join(run['not_reached'])}")
    if run.get("rechecked"):
        origin = (f"the {len(run['rechecked'])} ops that did not pass padded in every mode at commit "
                  f"{run['base_commit']} re-checked at {origin}; the other records are from {run['base_commit']}")
    return "\n\n".join([
        "# Differential bucketing sweep (bench/pad_sweep.py)",
        f"{len(records)} OpInfos of torch {torch.__version__}'s op_db ({origin}).",
        definitions,
        "## Summary", summary_table(records), padded_share(records),
        "## Mismatches, crashes, timeouts", failures_table(records),
        "## Exact-shape runs by op (pad-safety refusals)", unpadded_table(records),
        "## Skips", skip_table(records),
    ]) + "\n"


def clean(row: dict) -> bool:
    """Passed in every mode with every later call padded (nothing to re-check after a fix)."""
    return "modes" in row and all(o["status"] == "pass" and o["where"] == "padded" for o in row["modes"].values())


def commit() -> str:
    """The checked-out commit of this repo (with "+changes" when the tree differs from it)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def sweep(names: list[str], workers: int, timeout: float, log_dir: Path, minutes: float | None = None) -> list[dict]:
    """One record per op, in `names` order; with `minutes`, ops not started by then are left out."""
    rows = opinfo.run_pool([(name, "float32") for name in names], workers, timeout, log_dir, script=__file__,
                           lost_row=lost_row, describe=row_summary,
                           stop_after=minutes * 60 if minutes is not None else None)
    return [{"op": name, "row": rows[name, "float32"]} for name in names if (name, "float32") in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", help="OpInfo full name to check (repeatable); default: all")
    parser.add_argument("--limit", type=int, help="check only the first N ops")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_SECONDS, help="seconds per op")
    parser.add_argument("--json", type=Path, help="also write every record to this JSON file")
    parser.add_argument("--minutes", type=float, help="start no op after this many minutes (in --op order); "
                                                      "the report names the ops not reached")
    parser.add_argument("--tables-from", type=Path, help="print and write the tables of an earlier --json run")
    parser.add_argument("--recheck", type=Path, help="re-run the ops of an earlier --json run that did not pass "
                                                     "padded in every mode; the report merges both runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        opinfo.worker_main(check_op, log_level=logging.WARNING)
        return
    if args.tables_from:
        TABLE_FILE.write_text(markdown(json.loads(args.tables_from.read_text())))
        print(TABLE_FILE.read_text())
        return
    known = list(opinfo.op_by_name())
    unknown = sorted(set(args.op or ()) - set(known))
    if unknown:
        parser.error(f"not in op_db: {', '.join(unknown)} (use OpInfo full names, e.g. div.floor_rounding)")
    base = json.loads(args.recheck.read_text()) if args.recheck else None
    if base is not None:
        names = ([r["op"] for r in base["records"] if "skip" not in r["row"] and not clean(r["row"])]
                 + base.get("not_reached", []))
    else:
        names = (args.op or known)[:args.limit]
    log_dir = Path(tempfile.mkdtemp(prefix="pad_sweep_"))
    print(f"worker logs and compile cache: {log_dir}", flush=True)
    start = time.perf_counter()
    records = sweep(names, args.workers, args.timeout, log_dir, args.minutes)
    run = {"records": records, "seconds": time.perf_counter() - start, "commit": commit(),
           "not_reached": [name for name in names if name not in {r["op"] for r in records}]}
    print(f"{len(records)} ops in {run['seconds'] / 60:.1f} min")
    if base is not None:
        rechecked = {r["op"]: r for r in records}
        first_runs = [r for r in records if r["op"] in base.get("not_reached", [])]
        run = {**run, "records": [rechecked.get(r["op"], r) for r in base["records"]] + first_runs, "rechecked": names,
               "base_commit": base["commit"]}
    for table in (summary_table(run["records"]), padded_share(run["records"]), failures_table(run["records"]),
                  unpadded_table(run["records"])):
        print(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    if base is not None or (args.op is None and args.limit is None) or args.minutes is not None:
        TABLE_FILE.write_text(markdown(run))


if __name__ == "__main__":
    main()
