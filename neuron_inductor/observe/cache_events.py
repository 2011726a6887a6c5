"""Cache hits and misses, explained: which key part made a lookup miss.

After each program the runtime compiled or loaded, `note_lookup` reads the compile cache's
counters to tell a memory hit, a disk hit and a miss apart, logs it, and explains a miss: the
nearest existing entry (the one sharing the most key parts) and the first part, in `PART_ORDER`,
whose value differs — or, when the key's entry was on disk but refused for trust, why. Misses
are also appended to `<cache folder>/recent_misses.jsonl` (the last `KEEP_MISSES`; only in a
folder this process writes entries to), so `neuron-inductor cache explain` can show them from
another process.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from pathlib import Path
from typing import Any

from .logs import log

MISSES_FILE = "recent_misses.jsonl"
KEEP_MISSES = 32

# Key parts from the most to the least specific to one graph: the first that differs explains a miss.
PART_ORDER = ("graph", "kind", "dtypes", "mode", "bucket", "config", "templates", "code", "neuron_inductor", "torch")
MEANING = {
    "graph": "another graph (its traced code or its inputs' shapes / dtypes differ)",
    "kind": "another graph kind (forward / backward / inference)",
    "dtypes": "input dtypes differ",
    "mode": "padding mode differs (padded bucket vs exact shapes)",
    "bucket": "bucket sizes differ",
    "config": "code-generating options differ (toolchain, target, fallback, buckets)",
    "templates": "kernel templates changed",
    "code": "neuron_inductor's source changed",
    "neuron_inductor": "neuron_inductor version differs",
    "torch": "torch version differs",
}


def ordered_parts(parts: dict[str, Any]) -> list[str]:
    return [p for p in PART_ORDER if p in parts] + sorted(set(parts) - set(PART_ORDER))


def explain(parts: dict[str, Any], entries: list[dict[str, Any]], own_key: str | None = None) -> dict[str, Any]:
    """The nearest entry to `parts` among `entries` and the first part that differs from it."""
    candidates = [e for e in entries if e["key"] != own_key and isinstance(e.get("parts"), dict)]
    if not candidates:
        return {"nearest": None, "part": None, "message": "the cache held no other entry"}
    names = ordered_parts(parts)

    def closeness(entry):
        same = [entry["parts"].get(name) == parts[name] for name in names]
        return sum(same), same  # most equal parts first, then equal earlier (more specific) parts

    nearest = max(candidates, key=closeness)
    part = next(name for name in names if nearest["parts"].get(name) != parts[name])
    mine, theirs = parts[part], nearest["parts"].get(part)
    return {
        "nearest": nearest["key"], "part": part, "here": mine, "there": theirs,
        "message": f"nearest entry {nearest['key'][:12]} differs first in '{part}', {MEANING.get(part, part)}: "
                   f"{json.dumps(mine)} here, {json.dumps(theirs)} there",
    }


def record_miss(folder: Path | None, miss: dict[str, Any]) -> None:
    """Append a miss to the cache folder's record, keeping the last KEEP_MISSES."""
    if folder is None:
        return
    path = folder / MISSES_FILE
    temporary = path.with_name(f".{MISSES_FILE}.{time.time_ns()}")
    try:
        lines = path.read_text().splitlines() if path.is_file() else []
        lines = (lines + [json.dumps(miss, default=str)])[-KEEP_MISSES:]
        temporary.write_text("\n".join(lines) + "\n")
        temporary.replace(path)
    except OSError as exc:
        log.debug("neuron_inductor: could not record the cache miss in %s (%s)", path, exc)
        with contextlib.suppress(OSError):
            temporary.unlink()  # a full disk leaves a partial file behind


def read_misses(folder: Path) -> list[dict[str, Any]]:
    path = folder / MISSES_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Counters of each cache's stats object as last seen (weak: reset_stats() replaces the object).
_seen: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()
_EVENTS = ("memory_hits", "disk_hits", "misses")


def note_lookup(cache: Any, label: str) -> dict[str, Any] | None:
    """What the last lookup of `cache` was — {"event": "memory hit" | "disk hit" | "miss", ...} with
    the explanation of a miss — logged; None if the cache was not consulted since the last call."""
    stats = cache.stats
    before = _seen.get(stats, {})
    now = {event: stats.counts.get(event, 0) for event in _EVENTS}
    _seen[stats] = now
    changed = [event for event in _EVENTS if now[event] > before.get(event, 0)]
    if not changed:
        return None
    if changed[-1] != "misses":
        event = changed[-1].replace("_hits", " hit")
        log.info("neuron_inductor: %s: cache %s", label, event)
        return {"event": event}
    latest = stats.recent_misses[-1]
    if "refused" in latest:
        why = {"refused": latest["refused"],
               "message": f"its entry was refused for trust ({latest['refused']}): rebuilt, its code not run"}
    else:
        why = explain(latest["parts"], cache.entries(), own_key=latest["key"])
    miss = {"event": "miss", "time": time.strftime("%Y-%m-%d %H:%M:%S"), "label": label, "key": latest["key"],
            "parts": latest["parts"], **why}
    log.info("neuron_inductor: %s: cache miss (key %s): %s", label, latest["key"][:12], miss["message"])
    record_miss(cache.folder if cache.writable else None, miss)  # nothing is written into a folder we do not trust
    return miss
