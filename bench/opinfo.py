"""Conformance sweep: the first sample of every OpInfo in torch's `op_db` through
`torch.compile(fn, backend=..., fullgraph=True)`, compared with eager PyTorch.

    python bench/opinfo.py                        # every op_db entry, both dtypes, both backends; writes opinfo.md
    python bench/opinfo.py --op add --op cumsum   # some entries (OpInfo full names: "div.floor_rounding")
    python bench/opinfo.py --limit 50             # the first 50 entries of op_db
    python bench/opinfo.py --json results.json    # also keep every record as JSON

Every OpInfo is checked twice: fp32 forward + backward (when the op supports autograd) and bf16
forward. Each check takes the op's first sample (drawn after `torch.manual_seed(0)`), wraps it as
`fn(*tensors)` calling the op with the sample's input, args and kwargs, and runs it eagerly (the
reference), under `backend="aot_eager"` (the baseline: its failures are Dynamo / AOTAutograd limits)
and under `backend="neuron"`. Backward passes use fixed random cotangents on every differentiable
output. Every run starts from `torch.manual_seed(0)`, so random ops (which the neuron backend leaves to
eager's RNG stream on purpose) are compared like any other (op_db's `wrapper_set_seed`, which Dynamo
cannot trace, becomes a plain call). Inputs an op mutates are compared too.

Outcomes of one check:
- pass: every output (and every input gradient, fp32) is close to eager's: the same structure, shapes
  and dtypes, and |compiled - eager| <= atol * max(1, max|eager|) + rtol * |eager| elementwise
  (NaN == NaN) with fp32 atol 1e-5, rtol 1e-4 and bf16 atol 2e-2, rtol 2e-2 (kernels accumulate in
  fp32 and round once where eager rounds after every op: about one bf16 ulp, 0.4-0.8%).
- fail, of one of these kinds:
  - mismatch: the backend returned values without any error, but they differ from eager (a *silent
    mismatch*: the important kind);
  - crash: the backend raised an exception that is not one of its documented errors (CLEAN_ERRORS);
  - error: the backend raised one of its documented errors (none is expected with default options);
  - timeout / died: the op's worker process went over --timeout seconds or died (a hard crash).
- skip: the op has no sample for the dtype (or does not support it), eager fails or is not
  reproducible under a fixed seed (uninitialised memory), or aot_eager fails (a Dynamo limit;
  the neuron backend is then not run for that dtype).

For each neuron pass the bench records where the op ran: `kernels` (every ATen op of the compiled
graphs ran in generated NKI kernels), `kernels+fallback` (some in kernels, some eagerly on the host),
`fallback` (no kernel; the compute ran on the host), or `views` (the compiled graphs only hold
views / metadata ops, which run on the host by design: nothing to put in a kernel). A kernel that broke
a hardware rule when the compiler checked it (the backend then runs its ops on the host and logs an error)
counts as a fallback and is listed.

Ops run in a pool of worker processes (--workers, default: CPU count); each op has a time limit, and
a worker that hangs or dies is replaced, so one hard crash costs one row.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.utils._pytree as pytree

SEED = 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("aot_eager", "neuron")
# Elementwise tolerances: |actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|.
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
TIMEOUT_SECONDS = 300
READY_TIMEOUT_SECONDS = 600  # a worker's start: importing op_db alone takes ~20 s on a busy machine
TABLE_FILE = Path(__file__).with_suffix(".md")
REPRO_DIR = Path("/tmp/opinfo_repros")  # the minimal repros KNOWN_ISSUES names, inlined into TABLE_FILE
# The backend's documented errors (a clean error, not a crash). None is expected with default options.
CLEAN_ERRORS = ("ConfigError", "FallbackError", "ToolchainUnavailable")

# Root causes found for neuron failures that aot_eager passes: OpInfo full name -> (dtype or "all",
# category, cause). Categories: (a) a lowering / kernel bug (silent mismatch), (b) a crash in the
# backend, (c) an unsupported case that should fall back visibly but does not. The minimal repros
# named in brackets were handed to the lead (/tmp/opinfo_repros/); tests/test_opinfo.py xfails
# exactly these checks, strictly, so a fix shows up as a test to update.
KNOWN_ISSUES: dict[str, tuple[str, str, str]] = {}

# Root causes of kernels that broke a hardware rule in passing ops (the backend ran their ops on the
# host instead): the rule as the interpreter names it -> cause.
RULE_VIOLATION_CAUSES: dict[str, str] = {}


def known_issue(name: str, dtype: str) -> tuple[str, str] | None:
    """(category, cause) of a known root cause for this op and dtype, if any."""
    entry = KNOWN_ISSUES.get(name)
    if entry is None or entry[0] not in ("all", dtype):
        return None
    return entry[1], entry[2]


# -- one sample as a function of its tensors -------------------------------------------------------

class Case:
    """An OpInfo sample as `fn(*tensors)`: the tensors are the sample's tensor leaves, every other
    argument is a constant of the function."""

    def __init__(self, op, sample) -> None:
        self.leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.function = op.op

    def fn(self, *tensors):
        supplied = iter(tensors)
        leaves = [next(supplied) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        sample_input, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.function(sample_input, *args, **kwargs)

    def fresh_inputs(self) -> list[torch.Tensor]:
        """Copies of the sample's tensors (one copy per distinct tensor, so aliasing is kept)."""
        copies: dict[int, torch.Tensor] = {}
        for leaf in self.leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) not in copies:
                copies[id(leaf)] = leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return [copies[id(leaf)] for leaf in self.leaves if isinstance(leaf, torch.Tensor)]


@dataclass
class Run:
    outputs: list  # flattened outputs (tensors detached) followed by the inputs after the call
    grads: list  # gradient of each input that requires grad (None where unused)


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def run_case(case: Case, fn, backward: bool) -> Run:
    """Call `fn` on fresh inputs from the fixed seed; with `backward`, differentiate every floating
    output with fixed random cotangents."""
    torch.manual_seed(SEED)
    inputs = case.fresh_inputs()
    result = fn(*inputs)
    outputs = pytree.tree_leaves(result)
    grads = []
    if backward:
        wrt = [t for t in inputs if t.requires_grad]
        differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if wrt and differentiable:
            generator = torch.Generator().manual_seed(SEED + 1)
            cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in differentiable]
            grads = list(torch.autograd.grad(differentiable, wrt, cotangents, allow_unused=True))
    return Run([_detached(o) for o in outputs] + [t.detach() for t in inputs],
               [_detached(g) for g in grads])


def compare(actual: Run, expected: Run, dtype: torch.dtype, tolerance: dict | None = None) -> str | None:
    """None when `actual` matches `expected` within `tolerance` ({"atol", "rtol"}; default
    TOLERANCES[dtype]), else what differs (one line)."""
    tolerance = tolerance or TOLERANCES[dtype]
    for part in ("outputs", "grads"):
        got, want = getattr(actual, part), getattr(expected, part)
        if len(got) != len(want):
            return f"{part}: {len(got)} values, eager has {len(want)}"
        for index, (a, e) in enumerate(zip(got, want)):
            inexact = isinstance(e, torch.Tensor) and (e.is_floating_point() or e.is_complex())
            if inexact and isinstance(a, torch.Tensor):
                scale = max(1.0, e.abs().nan_to_num(0, 0, 0).max().item()) if e.numel() else 1.0
                atol = tolerance["atol"] * scale
            else:
                atol = tolerance["atol"]
            try:
                torch.testing.assert_close(a, e, rtol=tolerance["rtol"], atol=atol, equal_nan=True,
                                           check_stride=False, check_device=False)
            except AssertionError as exc:
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                detail = "; ".join(line for line in lines if "difference" in line or "mismatch" in line.lower())
                return f"{part}[{index}]: {detail or lines[0]}"
    return None


# -- checking one op under one backend --------------------------------------------------------------

def _root_exception(exc: BaseException) -> BaseException:
    """The backend's own exception inside Dynamo's BackendCompilerFailed wrapper."""
    while getattr(exc, "inner_exception", None) is not None:
        exc = exc.inner_exception
    return exc


def _raised_at(exc: BaseException) -> str:
    """The innermost frame of the traceback inside neuron_inductor (its source, kernels or wrapper)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "neuron_inductor" in f.filename or "codegen_templates" in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return ""
    filename = frame.filename.split("/neuron_inductor/", 1)[-1]  # package-relative when it is ours
    return f"{filename}:{frame.lineno} ({frame.name})"


class LogMessages(logging.Handler):
    """The messages of records at `level` and above (attached to the neuron_inductor logger: ERROR
    for a kernel that broke a hardware rule and fell back, WARNING for pad-safety's "runs UNPADDED")."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _placement(programs: list[dict], rule_errors: list[str]) -> dict:
    """Where the neuron backend ran the op: kernel families, host fallbacks (op: reason)."""
    families = Counter(k["family"] for p in programs for k in p.artifact.meta["kernels"])
    fallbacks = sorted({f"{f['op']}: {f['reason']}" for p in programs for f in p.artifact.meta["fallbacks"]})
    fallbacks += [f"logged error: {message}" for message in rule_errors]
    if not programs:
        where = "no graph"
    elif families and fallbacks:
        where = "kernels+fallback"
    elif families:
        where = "kernels"
    elif fallbacks:
        where = "fallback"
    else:
        where = "views"
    return {"where": where, "kernels": dict(families), "fallbacks": fallbacks}


def check_backend(case: Case, backend: str | Callable, expected: Run, dtype: torch.dtype, backward: bool) -> dict:
    """Compile and run the case under one backend: {"status", "kind", "detail", ...}."""
    from neuron_inductor.observe import session

    torch._dynamo.reset()
    first_program = len(session.BUCKETS)
    errors = LogMessages(logging.ERROR)
    logging.getLogger("neuron_inductor").addHandler(errors)
    start = time.perf_counter()
    try:
        actual = run_case(case, torch.compile(case.fn, backend=backend, fullgraph=True), backward)
    except Exception as exc:  # the record says what broke; the sweep goes on
        root = _root_exception(exc)
        name = type(root).__name__
        kind = "error" if backend == "neuron" and name in CLEAN_ERRORS else "crash"
        outcome = {"status": "fail", "kind": kind, "detail": f"{name}: {str(root).strip()[:400]}",
                   "raised_at": _raised_at(root)}
    else:
        mismatch = compare(actual, expected, dtype)
        outcome = ({"status": "pass"} if mismatch is None
                   else {"status": "fail", "kind": "mismatch", "detail": mismatch[:400]})
    finally:
        logging.getLogger("neuron_inductor").removeHandler(errors)
    outcome["seconds"] = round(time.perf_counter() - start, 2)
    if backend == "neuron":
        outcome.update(_placement(session.BUCKETS[first_program:], errors.messages))
    return outcome


def _first_sample(op, dtype: torch.dtype, requires_grad: bool):
    torch.manual_seed(SEED)
    return next(iter(op.sample_inputs("cpu", dtype, requires_grad=requires_grad)), None)


def _same(a: Run, b: Run) -> bool:
    try:
        torch.testing.assert_close((a.outputs, a.grads), (b.outputs, b.grads), rtol=0, atol=0, equal_nan=True)
    except AssertionError:
        return False
    return True


def _no_stage(stage: str) -> None:
    pass


def check_op(op, dtype: torch.dtype, on_stage=_no_stage) -> dict:
    """One row of the sweep: {"skip": reason} or the aot_eager and neuron outcomes (and the skip
    reason when aot_eager fails). `on_stage` hears "eager" / "aot_eager" / "neuron" as each starts."""
    if op.has_nondeterministic_output:
        return {"skip": "nondeterministic output (OpInfo.has_nondeterministic_output: uninitialised memory)"}
    if dtype not in op.supported_dtypes("cpu"):
        return {"skip": f"no {dtype} support on CPU"}
    backward = dtype == torch.float32 and op.supports_autograd
    on_stage("eager")
    try:
        sample = _first_sample(op, dtype, backward)
    except Exception as exc:
        return {"skip": f"sample_inputs fails: {type(exc).__name__}: {str(exc)[:200]}"}
    if sample is None:
        return {"skip": f"no {dtype} sample"}
    case = Case(op, sample)
    try:
        expected = run_case(case, case.fn, backward)
        again = run_case(case, case.fn, backward)
    except Exception as exc:
        return {"skip": f"eager fails: {type(exc).__name__}: {str(exc).strip()[:200]}"}
    if not _same(expected, again):
        return {"skip": "eager differs between two runs from the same seed"}
    row: dict = {"backward": backward}
    on_stage("aot_eager")
    row["aot_eager"] = check_backend(case, "aot_eager", expected, dtype, backward)
    if row["aot_eager"]["status"] != "pass":
        row["skip"] = "aot_eager fails (Dynamo limit)"
        return row
    on_stage("neuron")
    row["neuron"] = check_backend(case, "neuron", expected, dtype, backward)
    return row


def _call(function, *args, **kwargs):
    return function(*args, **kwargs)


def op_by_name() -> dict:
    """op_db by OpInfo full name. Random ops in op_db call `wrapper_set_seed`, which reseeds inside the
    op under `freeze_rng_state` (Dynamo cannot trace that); it becomes a plain call here, because every
    run of this sweep seeds the global generator itself before calling the op."""
    from torch.testing._internal import common_methods_invocations

    common_methods_invocations.wrapper_set_seed = _call
    return {op.full_name: op for op in common_methods_invocations.op_db}


# -- worker processes -------------------------------------------------------------------------------

STAGE_MARK = "@opinfo-stage "


def worker_main(check: Callable[[object, str, Callable[[str], None]], dict] | None = None,
                log_level: int = logging.ERROR) -> None:
    """Read "op<TAB>variant" lines on stdin, answer one JSON row per line: `check(opinfo, variant,
    on_stage)`, by default `check_op` with the variant as dtype name. Everything else this process
    prints (Dynamo, warnings, C-level output) goes to stderr (the worker log), so stdout carries only
    rows; stage marks in the log tell where a hung or dead check was. The backend logs at `log_level`
    and above (the default keeps only errors: fallbacks are in the rows)."""
    check = check or (lambda op, dtype, on_stage: check_op(op, DTYPES[dtype], on_stage))
    rows = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.getLogger("neuron_inductor").setLevel(log_level)
    ops = op_by_name()
    rows.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        name, dtype = line.rstrip("\n").split("\t")

        def mark(stage: str) -> None:
            print(f"{STAGE_MARK}{name} {dtype} {stage}", file=sys.stderr, flush=True)

        try:
            row = check(ops[name], dtype, mark)
        except Exception as exc:  # a bug of this bench, reported in the row rather than lost
            row = {"skip": f"bench error: {type(exc).__name__}: {exc}"}
        rows.write(json.dumps(row) + "\n")


def _lost_row(kind: str, stage: str, detail: str) -> dict:
    """The row of a check whose worker hung or died in `stage` (the checks before it passed)."""
    lost = {"status": "fail", "kind": kind, "detail": detail}
    if stage == "neuron":
        return {"aot_eager": {"status": "pass"}, "neuron": lost}
    if stage == "aot_eager":
        return {"aot_eager": lost, "skip": "aot_eager fails (Dynamo limit)"}
    return {"skip": f"eager {kind}: {detail}"}


class Worker:
    """One `script --worker` subprocess (this file's by default); `check(name, variant)` returns its
    row, or `lost_row(kind, stage, detail)` for a timeout / death."""

    def __init__(self, log_path: Path, env: dict[str, str], script: str = __file__,
                 lost_row: Callable[[str, str, str], dict] = _lost_row) -> None:
        self.log_path = log_path
        self.env = env
        self.script, self.lost_row = script, lost_row
        self._start()

    def _start(self) -> None:
        self.log = open(self.log_path, "a")
        self.process = subprocess.Popen([sys.executable, self.script, "--worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=self.env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.process, self.lines), daemon=True).start()
        self.ready = False

    @staticmethod
    def _read(process: subprocess.Popen, lines: queue.Queue) -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)  # end of output: the process exited

    def _next_row(self, timeout: float) -> dict | None:
        """The next JSON line; None when the process exited; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError from None
            if line is None:
                return None
            if line.startswith("{"):
                return json.loads(line)

    def _last_stage(self) -> str:
        marks = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.startswith(STAGE_MARK)]
        return marks[-1].rsplit(" ", 1)[-1] if marks else "eager"

    def _restart(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()
        self._start()

    def check(self, name: str, dtype: str, timeout: float) -> dict:
        if not self.ready:
            if self._next_row(READY_TIMEOUT_SECONDS) is None:
                raise RuntimeError(f"a worker failed to start; see {self.log_path}")
            self.ready = True
        self.process.stdin.write(f"{name}\t{dtype}\n")
        self.process.stdin.flush()
        try:
            row = self._next_row(timeout)
        except TimeoutError:
            stage = self._last_stage()
            self._restart()
            return self.lost_row("timeout", stage, f"over {timeout:.0f} s in {stage} (worker log {self.log_path})")
        if row is None:
            code = self.process.wait()
            stage = self._last_stage()
            self._restart()
            return self.lost_row("died", stage, f"worker exited with code {code} in {stage} (log {self.log_path})")
        return row

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.log.close()


def run_pool(tasks: list[tuple[str, str]], workers: int, timeout: float, log_dir: Path, script: str = __file__,
             lost_row: Callable[[str, str, str], dict] = _lost_row,
             describe: Callable[[dict], str] | None = None,
             stop_after: float | None = None) -> dict[tuple[str, str], dict]:
    """Run every (name, variant) task in a pool of `script --worker` processes that share one compile
    cache under `log_dir`; one progress line per task (`describe(row)`, default `row_summary`).
    Returns the row of each task; with `stop_after` (seconds), tasks not started by then are left out."""
    deadline = time.monotonic() + stop_after if stop_after is not None else None
    describe = describe or row_summary
    workers = max(1, min(workers, len(tasks)))
    env = {**os.environ, "NEURON_INDUCTOR_CACHE_DIR": str(log_dir / "cache"), "PYTHONUNBUFFERED": "1"}
    pending: queue.Queue = queue.Queue()
    for task in tasks:
        pending.put(task)
    rows: dict[tuple[str, str], dict] = {}
    lock = threading.Lock()

    def serve(slot: int) -> None:
        worker = Worker(log_dir / f"worker{slot}.log", env, script, lost_row)
        try:
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    return
                try:
                    name, variant = pending.get_nowait()
                except queue.Empty:
                    return
                row = worker.check(name, variant, timeout)
                with lock:
                    rows[name, variant] = row
                    print(f"[{len(rows)}/{len(tasks)}] {name} {variant}: {describe(row)}", flush=True)
        finally:
            worker.close()

    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(serve, slot) for slot in range(workers)]:
            future.result()
    return rows


def sweep(names: list[str], workers: int, timeout: float, log_dir: Path) -> list[dict]:
    """Check every op in both dtypes in a pool of worker processes; one progress line per check.
    Returns one record per op: {"op": name, "float32": row, "bfloat16": row}."""
    rows = run_pool([(name, dtype) for name in names for dtype in DTYPES], workers, timeout, log_dir)
    return [{"op": name, **{dtype: rows[name, dtype] for dtype in DTYPES}} for name in names]


# -- the report -------------------------------------------------------------------------------------

def status(row: dict, backend: str) -> str:
    """pass / fail / skip of one backend in one row (neuron counts as skipped whenever the row is)."""
    if backend not in row or (backend == "neuron" and "skip" in row):
        return "skip"
    return row[backend]["status"]


def row_summary(row: dict) -> str:
    """One line: what each backend did, or the skip reason."""
    parts = []
    for backend in BACKENDS:
        result = status(row, backend)
        if result == "pass" and backend == "neuron":
            result = f"pass ({row['neuron']['where']})"
        elif result == "fail":
            result = f"{row[backend]['kind']}: {row[backend]['detail'][:120]}"
        parts.append(f"{backend} {result}")
    if "skip" in row:
        parts.append(f"skip: {row['skip'][:120]}")
    return "; ".join(parts)


def neuron_failures(records: list[dict]) -> list[tuple[str, str, dict]]:
    """(op, dtype, neuron outcome) for every neuron failure where aot_eager passed (or did not run)."""
    found = []
    for record in records:
        for dtype in DTYPES:
            row = record.get(dtype, {})
            if status(row, "neuron") == "fail":
                found.append((record["op"], dtype, row["neuron"]))
    return found


def counts(records: list[dict], dtype: str, backend: str) -> Counter:
    tally: Counter = Counter()
    for record in records:
        row = record.get(dtype, {})
        result = status(row, backend)
        tally[result] += 1
        if result == "fail":
            tally[row[backend]["kind"]] += 1
    return tally


def summary_table(records: list[dict]) -> str:
    lines = ["| dtype | backend | pass | fail | mismatch (silent) | crash | error | timeout / died | skip |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dtype in DTYPES:
        for backend in BACKENDS:
            c = counts(records, dtype, backend)
            label = f"{dtype} {'fwd+bwd' if dtype == 'float32' else 'fwd'}"
            lines.append(f"| {label} | {backend} | {c['pass']} | {c['fail']} | {c['mismatch']} | {c['crash']} | "
                         f"{c['error']} | {c['timeout'] + c['died']} | {c['skip']} |")
    return "\n".join(lines)


def placement_table(records: list[dict]) -> str:
    lines = ["| dtype | neuron passes | kernels only | kernels + fallback | fallback only | views only | no graph |",
             "|---|---|---|---|---|---|---|"]
    for dtype in DTYPES:
        places = Counter(r[dtype]["neuron"]["where"] for r in records if status(r.get(dtype, {}), "neuron") == "pass")
        total = sum(places.values())

        def cell(key: str) -> str:
            return f"{places[key]} ({100 * places[key] / total:.0f}%)" if total else "0"

        lines.append(f"| {dtype} | {total} | {cell('kernels')} | {cell('kernels+fallback')} | {cell('fallback')} | "
                     f"{cell('views')} | {cell('no graph')} |")
    return "\n".join(lines)


def failures_table(records: list[dict]) -> str:
    lines = ["| op | dtype | kind | error | raised at | root cause |", "|---|---|---|---|---|---|"]
    for name, dtype, outcome in neuron_failures(records):
        issue = known_issue(name, dtype)
        cause = f"({issue[0]}) {issue[1]}" if issue else "not analysed"
        detail = outcome["detail"].replace("|", "\\|").replace("\n", " ")[:160]
        lines.append(f"| {name} | {dtype} | {outcome['kind']} | {detail} | {outcome.get('raised_at', '')} | {cause} |")
    return "\n".join(lines)


def _passing_fallbacks(records: list[dict]):
    """(op, dtype, fallback reason) of every host fallback in a neuron pass."""
    for record in records:
        for dtype in DTYPES:
            row = record.get(dtype, {})
            if status(row, "neuron") == "pass":
                for reason in row["neuron"]["fallbacks"]:
                    yield record["op"], dtype, reason


def fallback_table(records: list[dict]) -> str:
    """Host fallbacks among neuron passes: reason -> ops."""
    by_reason: dict[str, set] = {}
    for op, _, reason in _passing_fallbacks(records):
        by_reason.setdefault(reason, set()).add(op)
    lines = ["| fallback (op: reason) | OpInfos |", "|---|---|"]
    for reason, ops in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"| {reason.replace('|', '/')[:200]} | {len(ops)}: {', '.join(sorted(ops)[:12])}"
                     f"{' ...' if len(ops) > 12 else ''} |")
    return "\n".join(lines)


def skip_table(records: list[dict]) -> str:
    reasons: Counter = Counter()
    for record in records:
        for dtype in DTYPES:
            reason = record.get(dtype, {}).get("skip")
            if reason:
                reasons[(dtype, reason.split(":")[0])] += 1
    lines = ["| dtype | skip reason | ops |", "|---|---|---|"]
    lines += [f"| {dtype} | {reason} | {n} |" for (dtype, reason), n in sorted(reasons.items(), key=lambda i: -i[1])]
    return "\n".join(lines)


def _repro_files(cause: str) -> list[str]:
    """The repro file names a cause cites in brackets ("[a.py, b.py]")."""
    cited = cause[cause.rfind("[") + 1:cause.rfind("]")] if "[" in cause else ""
    return [name.strip() for name in cited.split(",") if name.strip().endswith(".py")]


def _cause_section(title: str, cause: str, example: str) -> str:
    """A root cause: what is wrong, an exact error and the minimal repro (inlined from REPRO_DIR)."""
    text = [f"### {title}", cause, example]
    for file in _repro_files(cause):
        path = REPRO_DIR / file
        body = path.read_text().strip() if path.exists() else f"(not found under {REPRO_DIR})"
        text.append(f"`{file}`:\n\n```python\n{body}\n```")
    return "\n\n".join(text)


def root_causes(records: list[dict]) -> str:
    """Each known root cause behind this sweep's neuron failures: the ops, the exact error of one of
    them and the minimal repro."""
    by_cause: dict[tuple[str, str], list[tuple[str, str, dict]]] = {}
    for name, dtype, outcome in neuron_failures(records):
        issue = known_issue(name, dtype)
        if issue is not None:
            by_cause.setdefault(issue, []).append((name, dtype, outcome))
    sections = []
    for (category, cause), failures in by_cause.items():
        name, dtype, outcome = failures[0]
        error = f"Exact error ({name}, {dtype}): `{' '.join(outcome['detail'].split())[:300]}`"
        if outcome.get("raised_at"):
            error += f" at `{outcome['raised_at']}`"
        sections.append(_cause_section(f"({category}) {', '.join(sorted({f[0] for f in failures}))}", cause, error))
    return "\n\n".join(sections) or "None."


def rule_violations(records: list[dict]) -> str:
    """Kernels of passing ops that broke a hardware rule: the backend recovered by running their ops
    on the host, but each is a kernel bug (and a missed kernel). Known causes follow the table."""
    found: dict[str, set] = {}
    for op, dtype, fallback in _passing_fallbacks(records):
        if fallback.startswith("logged error:"):
            found.setdefault(fallback.split("rule: ", 1)[-1], set()).add(f"{op} ({dtype})")
    lines = ["| error logged by the backend | OpInfos |", "|---|---|"]
    lines += [f"| {message.replace('|', '/')[:200]} | {', '.join(sorted(ops))} |"
              for message, ops in sorted(found.items())]
    sections = ["\n".join(lines)]
    for rule, cause in RULE_VIOLATION_CAUSES.items():
        examples = [message for message in found if rule in message]
        if examples:
            sections.append(_cause_section(f"(a) {rule}", cause, f"Exact error: `{examples[0]}`"))
    return "\n\n".join(sections)


def markdown(records: list[dict], seconds: float) -> str:
    definitions = __doc__.split("\n\n", 2)[2].strip()
    return "\n\n".join([
        "# OpInfo conformance sweep (bench/opinfo.py)",
        f"{len(records)} OpInfos of torch {torch.__version__}'s op_db, {seconds / 60:.0f} min.",
        definitions,
        "## Summary", summary_table(records),
        "## Where neuron passes ran", placement_table(records),
        "## Neuron failures (aot_eager passes)", failures_table(records),
        "## Root causes", root_causes(records),
        "## Kernels that broke a hardware rule (recovered on the host)", rule_violations(records),
        "## Host fallbacks among neuron passes", fallback_table(records),
        "## Skips", skip_table(records),
    ]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", help="OpInfo full name to check (repeatable); default: all")
    parser.add_argument("--limit", type=int, help="check only the first N ops")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_SECONDS, help="seconds per op and dtype")
    parser.add_argument("--json", type=Path, help="also write every record to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return
    known = list(op_by_name())
    unknown = sorted(set(args.op or ()) - set(known))
    if unknown:
        parser.error(f"not in op_db: {', '.join(unknown)} (use OpInfo full names, e.g. div.floor_rounding)")
    names = (args.op or known)[:args.limit]
    log_dir = Path(tempfile.mkdtemp(prefix="opinfo_"))
    print(f"worker logs and compile cache: {log_dir}", flush=True)
    start = time.perf_counter()
    records = sweep(names, max(1, min(args.workers, len(names))), args.timeout, log_dir)
    seconds = time.perf_counter() - start
    for table in (summary_table(records), placement_table(records), failures_table(records)):
        print(table + "\n")
    print(f"{len(records)} ops in {seconds / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    if args.op is None and args.limit is None:
        TABLE_FILE.write_text(markdown(records, seconds))


if __name__ == "__main__":
    main()
