"""The `neuron-inductor` console script: inspect the compile cache, dumps and kernels.

    neuron-inductor cache list | show KEY [--kernel NAME | --wrapper] | clear | explain [--last N]
    neuron-inductor report [DUMP_DIR] [--all-runs] [--json] [--perfetto FILE]
    neuron-inductor replay DUMP_DIR/KERNEL [--random] [--seed N] [--target trn1|trn2|trn3]

Usage errors exit with status 2 and say what is accepted; a failed check (a replay that does not
reproduce the saved result) exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from typing import Any, Callable

from . import config


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _options_epilog() -> str:
    rows = []
    for name, env, default, doc in config.describe_options():
        if env:
            rows.append(f"  {env} (options={{'{name}': ...}}, default {default!r})")
            rows.append(textwrap.indent(textwrap.fill(doc, 84), " " * 6))
    return "environment flags, each also settable as torch.compile(..., options={...}):\n" + "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# cache


def _open_cache(args: argparse.Namespace) -> Any:
    from .cache import get_cache

    options = config.resolve()
    folder = args.cache_dir or options.cache_dir
    cache = get_cache(folder, options.cache_secret)
    if cache.folder is None:
        raise CliError(f"the cache folder {folder or 'default'} cannot be used; pass --cache-dir or set "
                       "NEURON_INDUCTOR_CACHE_DIR to a writable folder")
    return cache


def _describe_parts(parts: dict[str, Any] | None) -> str:
    if parts is None:
        return "(unreadable header)"
    bucket = ",".join(f"{name}={value}" for name, value in parts.get("bucket", []))
    return f"{parts.get('kind', '?'):<9} graph {parts.get('graph', '?')}  {parts.get('mode', '?')} {bucket}".rstrip()


def _trust_mode(cache: Any) -> str:
    if cache.authenticated:
        return "authenticated: entries load only with a valid HMAC under NEURON_INDUCTOR_CACHE_SECRET"
    if cache.refusal:
        return f"NOT TRUSTED: {cache.refusal}; no entry is loaded from it"
    return "private: entries load only when only you (or root) can have written them"


def _trust_of(cache: Any, entry: dict[str, Any]) -> tuple[str, str]:
    """(trust, reason) of an entry: private / authenticated (loadable), refused, corrupt, memory."""
    if entry["parts"] is None:
        return "corrupt", "unreadable header"
    found = cache.check(entry["key"], entry["parts"])
    return ("memory", "") if found is None else (found.trust, found.reason)


def _cache_list(args: argparse.Namespace) -> int:
    cache = _open_cache(args)
    rows = []
    for entry in cache.entries():
        path = cache.path(entry["key"])
        stat = path.stat() if path.exists() else None
        rows.append((stat.st_mtime if stat else 0.0, stat.st_size if stat else 0, entry))
    rows.sort(key=lambda row: row[0])
    total = sum(size for _, size, _ in rows)
    print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'}, {total / 1024:.1f} KiB in {cache.folder}")
    for mtime, size, entry in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime)) if mtime else "-"
        trust, reason = _trust_of(cache, entry)
        print(f"  {entry['key']}  {when}  {size / 1024:7.1f} KiB  {trust:<13}  {_describe_parts(entry['parts'])}")
        if reason:
            print(f"      {trust}: {reason}")
    print(f"folder trust: {_trust_mode(cache)}")
    return 0


def _find_entry(cache: Any, prefix: str) -> dict[str, Any]:
    matches = [e for e in cache.entries() if e["key"].startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CliError(f"no cache entry with a key starting {prefix!r} in {cache.folder}; "
                       "`neuron-inductor cache list` shows the keys")
    listing = "\n  ".join(e["key"] for e in matches)
    raise CliError(f"{len(matches)} entries start with {prefix!r}; give more of the key:\n  {listing}")


def _cache_show(args: argparse.Namespace) -> int:
    from .cache import EntryCheck
    from .observe.cache_events import ordered_parts

    cache = _open_cache(args)
    entry = _find_entry(cache, args.key)
    found = cache.check(entry["key"], entry["parts"]) if entry["parts"] is not None else None
    if found is None and entry["key"] in cache.memory:
        found = EntryCheck(cache.memory[entry["key"]][1], "memory")
    if found is None or found.artifact is None:
        reason = f"{found.trust}: {found.reason}" if found else "unreadable header"
        raise CliError(f"cache entry {entry['key']} could not be read ({reason}); corrupt entries are discarded "
                       "on load")
    artifact = found.artifact
    if found.trust == "refused":
        print(f"note: entry {entry['key']} is refused for trust ({found.reason}): shown for inspection, its code "
              "is never run", file=sys.stderr)
    if args.wrapper:
        print(artifact.wrapper_source, end="")
        return 0
    if args.kernel:
        if args.kernel not in artifact.kernel_sources:
            raise CliError(f"entry {entry['key']} has no kernel {args.kernel!r}; its kernels: "
                           f"{', '.join(artifact.kernel_sources) or 'none'}")
        print(artifact.kernel_sources[args.kernel], end="")
        return 0
    meta = artifact.meta
    print(f"key {entry['key']} ({cache.path(entry['key'])})")
    print(f"trust: {found.trust}{f' ({found.reason}): its code is never run' if found.reason else ''}")
    print("key parts:")
    for name in ordered_parts(entry["parts"]):
        print(f"  {name:<16} {json.dumps(entry['parts'][name])}")
    print(f"bucket {meta.get('bucket', '?')}; compiled in {meta.get('compile_seconds', 0.0):.3f}s; "
          f"{meta.get('views', 0)} host view(s)")
    for kernel in meta["kernels"]:
        print(f"  kernel {kernel['name']:<16} {kernel['flops'] / 1e6:10.3f} MFLOP  {', '.join(kernel['ops'])}")
    for fallback in meta["fallbacks"]:
        print(f"  fallback {fallback['op']}: {fallback['reason']}")
    print("(--kernel NAME prints a kernel's NKI source, --wrapper the host wrapper)")
    return 0


def _cache_clear(args: argparse.Namespace) -> int:
    from .observe.cache_events import MISSES_FILE

    cache = _open_cache(args)
    count = len(cache.entries())
    cache.clear()
    (cache.folder / MISSES_FILE).unlink(missing_ok=True)
    print(f"removed {count} entr{'y' if count == 1 else 'ies'} from {cache.folder}")
    return 0


def _cache_explain(args: argparse.Namespace) -> int:
    from .observe.cache_events import read_misses

    cache = _open_cache(args)
    if cache.refusal:
        print(f"every entry in {cache.folder} is refused for trust: {cache.refusal} (the fix: keep the folder "
              "writable only by you, or set NEURON_INDUCTOR_CACHE_SECRET)")
    misses = read_misses(cache.folder)[-args.last:]
    if not misses:
        print(f"no cache misses recorded in {cache.folder} (processes that compile with this cache folder "
              "record their misses)")
        return 0
    print(f"the last {len(misses)} cache miss(es) in {cache.folder}, oldest first:")
    for miss in misses:
        print(f"  {miss['time']}  {miss['label']}  key {miss['key'][:12]}\n    {miss['message']}")
    return 0


# ---------------------------------------------------------------------------------------------
# report, replay


def _report(args: argparse.Namespace) -> int:
    from .observe.report import DumpError, dump_report

    folder = args.dump_dir or config.resolve().dump_dir
    if not folder:
        raise CliError("report needs a dump folder: pass DUMP_DIR or set NEURON_INDUCTOR_DUMP_DIR "
                       "(the folder a compiling process wrote with NEURON_INDUCTOR_DUMP_DIR)")
    try:
        result = dump_report(folder, all_runs=args.all_runs)
    except DumpError as exc:
        raise CliError(str(exc)) from None
    print(result.to_json() if args.json else result)
    if args.perfetto:
        print(f"wrote {result.write_perfetto(args.perfetto)} (open it in ui.perfetto.dev or chrome://tracing)",
              file=sys.stderr if args.json else sys.stdout)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .observe.replay import ReplayError, find_kernel, replay

    try:
        kernel_file = find_kernel(args.kernel)
    except ReplayError as exc:
        raise CliError(str(exc)) from None
    print(f"replaying {kernel_file}")
    result = replay(kernel_file, random=args.random, seed=args.seed, target=args.target)
    print(result.summary())
    return 1 if result.mismatch else 0


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuron-inductor", description="Inspect what neuron_inductor compiled: cache, dumps, kernels.",
        epilog=_options_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="{cache,report,replay}", required=True)

    cache = verbs.add_parser("cache", help="list, show, clear the compile cache; explain the last misses",
                             description="Inspect the compile cache (NEURON_INDUCTOR_CACHE_DIR, default "
                                         "~/.cache/neuron_inductor).")
    cache.add_argument("--cache-dir", metavar="DIR", help="the cache folder (default: $NEURON_INDUCTOR_CACHE_DIR)")
    actions = cache.add_subparsers(dest="action", metavar="{list,show,clear,explain}", required=True)
    actions.add_parser("list", help="every entry: key, age, size, trust, graph kind, bucket").set_defaults(
        handler=_cache_list)
    show = actions.add_parser("show", help="one entry's trust, key parts, kernels and fallbacks")
    show.add_argument("key", metavar="KEY", help="the entry's key, or a unique prefix of it")
    printed = show.add_mutually_exclusive_group()
    printed.add_argument("--kernel", metavar="NAME", help="print this kernel's NKI source")
    printed.add_argument("--wrapper", action="store_true", help="print the host wrapper source")
    show.set_defaults(handler=_cache_show)
    actions.add_parser("clear", help="remove every entry").set_defaults(handler=_cache_clear)
    explain = actions.add_parser("explain", help="for the last misses: the first key part that differs from "
                                                 "the nearest entry, or why the entry was refused for trust")
    explain.add_argument("--last", type=_positive_int, default=10, metavar="N", help="how many misses (default 10)")
    explain.set_defaults(handler=_cache_explain)

    report = verbs.add_parser("report", help="kernels, fallbacks, FLOPs in kernels, padding waste, estimated time",
                              description="Summarise a NEURON_INDUCTOR_DUMP_DIR folder (its newest run by default).")
    report.add_argument("dump_dir", nargs="?", metavar="DUMP_DIR",
                        help="a dump folder, one run or one graph bucket in it (default: $NEURON_INDUCTOR_DUMP_DIR)")
    report.add_argument("--all-runs", action="store_true", help="every run in the dump folder, not only the newest")
    report.add_argument("--json", action="store_true", help="print JSON instead of the table")
    report.add_argument("--perfetto", metavar="FILE", help="also write the kernels as a Chrome / Perfetto trace "
                                                           "(one slice per kernel launch, one track per engine)")
    report.set_defaults(handler=_report)

    replay = verbs.add_parser("replay", help="re-run one dumped kernel in the interpreter and print its estimate",
                              description="Re-run a dumped kernel on its saved inputs (or random ones) under the "
                                          "NKI interpreter and print the trace estimate.")
    replay.add_argument("kernel", metavar="DUMP_DIR/KERNEL",
                        help="a kernel file (.../kernels/k0_pointwise.py, '.py' optional) or DUMP_DIR/k0_pointwise")
    replay.add_argument("--random", action="store_true", help="use random inputs even if inputs were saved")
    replay.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    replay.add_argument("--target", choices=("trn1", "trn2", "trn3"), default="trn2",
                        help="hardware generation of the cost model (default trn2)")
    replay.set_defaults(handler=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (CliError, config.ConfigError) as exc:
        print(f"neuron-inductor {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
