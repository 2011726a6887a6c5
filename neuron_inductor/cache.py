"""The compile cache: a memory tier and a disk tier of `CompiledArtifact`s, keyed by shape signature.

Key = sha256 over the key *parts* (kept next to each entry so a miss can be explained): graph
structure hash, graph kind, bucket signature, padding mode, input dtypes, config hash, template
source hashes, a hash of the package's own Python source, and package / torch versions.

Disk entries live in `NEURON_INDUCTOR_CACHE_DIR` (default `$XDG_CACHE_HOME/neuron_inductor` or
`~/.cache/neuron_inductor`), one file per key: a JSON header line (format, key parts, sha256 and
length of the body, and with a secret its HMAC) and the JSON body (kernel sources, wrapper source,
constant names, meta). An entry is code, so it is loaded only when `cache_trust` says it may be
run (private or authenticated); a refused entry is reported and rebuilt, never run. A missing
cache folder is created for this user only (0700, entries 0600); with a secret, subfolders and
entries take the cache folder's permissions so that a group can share it. Writes go to a temp
file in the same folder and are renamed into place (atomic on POSIX). A per-key `fcntl.flock`
lock file (Linux / POSIX only) lets concurrent processes — e.g. torchrun ranks — compile a key
once: take the lock, look again, compile, write, release. A truncated or corrupt entry is
reported, deleted and rebuilt; it is never trusted. If the folder cannot be written, the cache
warns once and keeps new entries in memory only (a read-only folder's existing entries are still
used).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from . import __version__
from . import cache_trust as trust
from .compiler import UNCHECKED, CompiledArtifact

log = logging.getLogger("neuron_inductor")

FORMAT = 1
SUFFIX = ".nicache"


class CorruptEntry(Exception):
    """A disk entry failed its checks (truncated, bad checksum, bad JSON, wrong key)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "neuron_inductor"


# The package source that shapes generated artifacts (observability, CLI and interpreter code do not).
CODEGEN_SOURCES = ("lowering", "codegen", "passes", "compiler.py", "decompositions.py", "bucketing.py", "generalize.py",
                   "runtime.py")


@functools.lru_cache(maxsize=None)
def source_hash(names: tuple[str, ...] = CODEGEN_SOURCES) -> str:
    """Hash of the package's Python source under `names` (files or folders; default: the
    code-generating source, so a changed lowering must not hit stale entries)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for name in names for p in ([root / name] if name.endswith(".py")
                                                     else (root / name).rglob("*.py"))):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def package_source_hash() -> str:
    return source_hash(CODEGEN_SOURCES)


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _artifact_to_json(artifact: CompiledArtifact) -> str:
    return json.dumps({"kernel_sources": artifact.kernel_sources, "wrapper_source": artifact.wrapper_source,
                       "constants": artifact.constants, "meta": artifact.meta}, sort_keys=True)


def _parse_entry(data: bytes, parts: dict) -> tuple[dict, bytes, CompiledArtifact]:
    """(header, body, artifact) of an entry file's bytes; raises CorruptEntry. Runs nothing."""
    header_line, _, body = data.partition(b"\n")
    try:
        header = json.loads(header_line)
    except ValueError as exc:
        raise CorruptEntry("bad header") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptEntry("unknown format")
    if header.get("length") != len(body):
        raise CorruptEntry(f"truncated: body has {len(body)} bytes, header says {header.get('length')}")
    if header.get("sha256") != hashlib.sha256(body).hexdigest():
        raise CorruptEntry("checksum mismatch")
    if header.get("parts") != json.loads(json.dumps(parts)):
        raise CorruptEntry("key parts differ from the file's own record")
    try:
        fields = json.loads(body.decode())
        artifact = CompiledArtifact(fields["kernel_sources"], fields["wrapper_source"], fields["constants"],
                                    fields["meta"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptEntry(f"bad body: {exc}") from exc
    return header, body, artifact


@dataclasses.dataclass
class EntryCheck:
    """What reading a disk entry found. trust: "private" or "authenticated" (loadable), "refused"
    (may be someone else's code: never run) or "corrupt"; reason says why for the last two."""

    artifact: CompiledArtifact | None
    trust: str
    reason: str = ""


class _Stats:
    def __init__(self) -> None:
        self.counts = collections.Counter()
        self.per_bucket: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.compile_seconds = 0.0
        self.recent_misses: collections.deque = collections.deque(maxlen=32)
        self.refused: dict[str, str] = {}  # key -> why its disk entry was refused, until its miss is recorded

    def count(self, event: str, bucket: str) -> None:
        self.counts[event] += 1
        self.per_bucket[bucket][event] += 1

    def as_dict(self) -> dict[str, Any]:
        result = {name: self.counts.get(name, 0) for name in ("compiles", "memory_hits", "disk_hits", "misses",
                                                               "corrupt", "untrusted", "disk_errors")}
        result["compile_seconds"] = self.compile_seconds
        result["per_bucket"] = {bucket: dict(counter) for bucket, counter in sorted(self.per_bucket.items())}
        return result


class CompileCache:
    """Process-wide cache of compiled artifacts for one cache folder.

    `secret` (NEURON_INDUCTOR_CACHE_SECRET) makes the disk tier authenticated: every entry written
    carries a MAC under it and only entries with a valid MAC are loaded. Without it, only private
    entries (see `cache_trust`) are loaded.
    """

    def __init__(self, folder: Path | None, secret: str | None = None) -> None:
        self.memory: dict[str, tuple[dict, CompiledArtifact]] = {}
        self.stats = _Stats()
        self._secret = secret.encode() if secret else None
        self.refusal: str | None = None  # why no entry of this folder is loaded (private mode only)
        self._folder_mode = trust.PRIVATE_FOLDER_MODE
        self.folder, self.writable = self._usable(folder) if folder is not None else (None, False)

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    @functools.cached_property
    def checks(self):
        """Verdicts of the kernel rule check (kernel_checks.py), in this folder's `checks/`
        subfolder; in memory only when this folder's entries are not written."""
        from .kernel_checks import KernelChecks

        return KernelChecks(self.folder if self.writable else None, self._secret.decode() if self._secret else None)

    def _usable(self, folder: Path) -> tuple[Path | None, bool]:
        """(folder, writable): a folder that exists but cannot be written (a shared, pre-filled cache
        mounted read-only) is still read; one that others can write is neither read nor written
        unless the cache is authenticated."""
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            trust.make_folder(folder, trust.PRIVATE_FOLDER_MODE)
        except OSError as exc:
            if not (folder.is_dir() and os.access(folder, os.R_OK | os.X_OK)):
                warnings.warn(f"neuron_inductor: cache folder {folder} is not writable ({exc}); compiled kernels "
                              "are cached in memory only for this process. Set NEURON_INDUCTOR_CACHE_DIR to a "
                              "writable folder.", RuntimeWarning, stacklevel=3)
                return None, False
        st = folder.stat()
        self._folder_mode = stat.S_IMODE(st.st_mode)
        if not self.authenticated:
            self.refusal = trust.ownership_problem("the folder", st)
        if self.refusal:
            warnings.warn(
                f"neuron_inductor: cache folder {folder} is not trusted: {self.refusal}. A cache entry is code that "
                "runs when it is loaded, so this folder's entries are not loaded and new ones are kept in memory "
                f"only. Fix: use a folder only you can write (chmod go-w {folder}, owned by you), or share it "
                "safely by setting the same NEURON_INDUCTOR_CACHE_SECRET in every process that uses it.",
                RuntimeWarning, stacklevel=3)
            return folder, False
        try:
            probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe", delete=True)
            probe.close()
            return folder, True
        except OSError as exc:
            warnings.warn(f"neuron_inductor: cache folder {folder} is read-only ({exc}); its entries are used, "
                          "new ones are cached in memory only for this process.", RuntimeWarning, stacklevel=3)
            return folder, False

    # -- disk --------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def _modes(self) -> tuple[int, int]:
        """(subfolder mode, entry mode): private, or with a secret the cache folder's own (readable by
        whom the folder is, so that a group can share an authenticated cache)."""
        if not self.authenticated:
            return trust.PRIVATE_FOLDER_MODE, trust.PRIVATE_FILE_MODE
        return self._folder_mode, trust.PRIVATE_FILE_MODE | (self._folder_mode & 0o044)

    def check(self, key: str, parts: dict) -> EntryCheck | None:
        """Read and check the entry for `key` without running it; None when there is none."""
        path = self.path(key)
        try:
            st, data = trust.read_regular_file(path)
        except FileNotFoundError:
            return None
        except trust.NotARegularFile as exc:
            return EntryCheck(None, "refused", f"the entry is {exc.strerror}")
        except OSError as exc:
            return EntryCheck(None, "corrupt", f"unreadable: {exc}")
        try:
            problem = None if self.authenticated else (
                self.refusal or trust.ownership_problem("its subfolder", path.parent.stat())
                or trust.ownership_problem("the entry", st))
        except OSError as exc:  # the subfolder went away after the entry was read
            return EntryCheck(None, "corrupt", f"unreadable: {exc}")
        try:
            header, body, artifact = _parse_entry(data, parts)
        except CorruptEntry as exc:
            return EntryCheck(None, "refused", problem) if problem else EntryCheck(None, "corrupt", str(exc))
        if problem is None and self._secret is not None:
            problem = trust.mac_problem(self._secret, header, body)
        if problem:
            return EntryCheck(artifact, "refused", problem)
        return EntryCheck(artifact, "authenticated" if self.authenticated else "private")

    def _write(self, key: str, parts: dict, artifact: CompiledArtifact) -> None:
        if not self.writable:
            return
        try:
            body = _artifact_to_json(artifact).encode()
        except (TypeError, ValueError) as exc:
            log.warning("neuron_inductor: artifact for key %s is not JSON-able (%s); kept in memory only", key, exc)
            return
        fields = {"format": FORMAT, "parts": parts, "length": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        if self._secret is not None:
            fields[trust.MAC_FIELD] = trust.entry_mac(self._secret, fields, body)
        header = json.dumps(fields, sort_keys=True).encode()
        path = self.path(key)
        folder_mode, file_mode = self._modes()
        try:
            trust.make_folder(path.parent, folder_mode)
            problem = None if self.authenticated else trust.ownership_problem("its subfolder", path.parent.stat())
            if problem:  # our entry would sit where someone else can swap it: we would not load it back
                log.warning("neuron_inductor: cache entry %s is not written: %s", path, problem)
                return
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{key}.", delete=False) as tmp:
                tmp.write(header + b"\n" + body)
                tmp.flush()
                os.fsync(tmp.fileno())
                os.fchmod(tmp.fileno(), file_mode)
            os.replace(tmp.name, path)
        except OSError as exc:
            self.stats.counts["disk_errors"] += 1
            log.warning("neuron_inductor: could not write cache entry %s (%s)", path, exc)
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp.name)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        if not self.writable:
            yield
            return
        lock_path = self.path(key).with_suffix(".lock")
        folder_mode, file_mode = self._modes()
        try:
            trust.make_folder(lock_path.parent, folder_mode)
            # Read-only is enough for flock, and lets a process lock a file another user created.
            fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode)
        except OSError:
            yield  # no lock possible: worst case two processes compile the same key
            return
        with open(fd) as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _load_disk(self, key: str, parts: dict) -> CompiledArtifact | None:
        """The entry's artifact if it is sound and trusted; a corrupt one is deleted, a refused one
        is left alone (it may be someone else's); both are reported and return None."""
        found = self.check(key, parts) if self.folder is not None else None
        if found is None:
            return None
        if found.trust == "corrupt":
            self.stats.counts["corrupt"] += 1
            warnings.warn(f"neuron_inductor: cache entry {self.path(key)} is corrupt ({found.reason}); it is "
                          "discarded and rebuilt.", RuntimeWarning, stacklevel=4)
            with contextlib.suppress(OSError):
                self.path(key).unlink()
            return None
        if found.trust == "refused":
            self.stats.counts["untrusted"] += 1
            self.stats.refused[key] = found.reason
            if found.reason != self.refusal:  # a refused folder was reported once, when it was opened
                fix = ("every process sharing this folder must set the same NEURON_INDUCTOR_CACHE_SECRET"
                       if self.authenticated else
                       "delete it, and keep the cache folder writable only by you (or share it with "
                       "NEURON_INDUCTOR_CACHE_SECRET set)")
                warnings.warn(f"neuron_inductor: cache entry {self.path(key)} is not trusted: {found.reason}. Its "
                              f"code is not run; it is rebuilt. Fix: {fix}.", RuntimeWarning, stacklevel=4)
            return None
        return found.artifact

    # -- public --------------------------------------------------------------------------------

    def get_or_compile(self, parts: dict, bucket: str, compile_fn) -> tuple[CompiledArtifact, Any, str]:
        """The artifact for `parts`: from memory, from disk, or from `compile_fn()`.

        `compile_fn()` returns `(artifact, extra)`; `extra` (e.g. the loaded program) is handed
        back on a compile so the caller does not load it twice. Returns (artifact, extra or None,
        source) where source is "memory", "disk" or "compiled".
        """
        key = key_of(parts)
        if key in self.memory:
            self.stats.count("memory_hits", bucket)
            return self.memory[key][1], None, "memory"
        with self._locked(key):
            artifact = self._load_disk(key, parts)
            if artifact is not None:
                self.stats.count("disk_hits", bucket)
                self.memory[key] = (parts, artifact)
                return artifact, None, "disk"
            self.stats.count("misses", bucket)
            refused = self.stats.refused.pop(key, None)
            self.stats.recent_misses.append({"key": key, "parts": parts, **({"refused": refused} if refused else {})})
            artifact, extra = compile_fn()
            self.stats.count("compiles", bucket)
            self.stats.compile_seconds += float(artifact.meta.get("compile_seconds", 0.0))
            self.memory[key] = (parts, artifact)
            if self.folder is not None and not artifact.meta.get(UNCHECKED):  # else: `store_checked` writes it
                self._write(key, parts, artifact)
        return artifact, extra, "compiled"

    def store_checked(self, parts: dict, artifact: CompiledArtifact) -> None:
        """Write a compiled artifact whose kernels were checked at their first use, once all of them
        have passed: only checked kernels reach the disk."""
        assert not artifact.meta.get(UNCHECKED), "kernels not checked yet"
        artifact.meta.pop(UNCHECKED, None)
        if self.folder is not None:
            self._write(key_of(parts), parts, artifact)

    def discard(self, parts: dict) -> None:
        """Forget the memory entry for `parts` (one of its kernels broke a rule at its first use)."""
        self.memory.pop(key_of(parts), None)

    def entries(self) -> list[dict[str, Any]]:
        """Every entry (memory and disk) with its key parts: what `cache explain` compares against."""
        found = {key: {"key": key, "parts": parts, "where": "memory"} for key, (parts, _) in self.memory.items()}
        if self.folder is not None:
            for path in sorted(self.folder.glob(f"*/*{SUFFIX}")):
                key = path.name.removesuffix(SUFFIX)
                try:
                    header = json.loads(trust.read_regular_file(path)[1].partition(b"\n")[0])
                    found.setdefault(key, {"key": key, "parts": header["parts"], "where": "disk"})
                except (OSError, ValueError, KeyError, TypeError):
                    found.setdefault(key, {"key": key, "parts": None, "where": "disk (corrupt header)"})
        return list(found.values())

    def load(self, key: str) -> CompiledArtifact | None:
        if key in self.memory:
            return self.memory[key][1]
        if self.folder is None:
            return None
        entry = next((e for e in self.entries() if e["key"] == key), None)
        if entry is None or entry["parts"] is None:
            return None
        return self._load_disk(key, entry["parts"])

    def clear(self) -> None:
        """Remove every entry, in memory and on disk."""
        self.memory.clear()
        if self.folder is not None:
            for path in [p for pattern in (f"*/*{SUFFIX}", "*/*.lock", f"checks/*/*{SUFFIX}", "checks/*/*.lock")
                         for p in self.folder.glob(pattern)]:
                with contextlib.suppress(OSError):
                    path.unlink()


_caches: dict[tuple[str | None, str | None], CompileCache] = {}


def get_cache(cache_dir: str | None, secret: str | None = None) -> CompileCache:
    """The process-wide cache for a folder (`None`: the default folder) and cache secret."""
    if (cache_dir, secret) not in _caches:
        _caches[cache_dir, secret] = CompileCache(Path(cache_dir) if cache_dir else default_cache_dir(), secret)
    return _caches[cache_dir, secret]


def cache_stats() -> dict[str, Any]:
    """Counters summed over every cache folder used in this process: compiles, memory_hits, disk_hits,
    misses, corrupt entries, untrusted (refused) entries, compile seconds, and per-bucket counts."""
    total: dict[str, Any] = {}
    for cache in _caches.values():
        for name, value in cache.stats.as_dict().items():
            if name == "per_bucket":
                merged = total.setdefault("per_bucket", {})
                for bucket, counts in value.items():
                    merged.setdefault(bucket, collections.Counter()).update(counts)
            else:
                total[name] = total.get(name, 0) + value
    total.setdefault("per_bucket", {})
    total["per_bucket"] = {bucket: dict(counts) for bucket, counts in total["per_bucket"].items()}
    for name in ("compiles", "memory_hits", "disk_hits", "misses", "corrupt", "untrusted", "disk_errors",
                 "compile_seconds"):
        total.setdefault(name, 0)
    return total


def recent_misses() -> list[dict[str, Any]]:
    """The latest misses with their key parts (newest last)."""
    return [miss for cache in _caches.values() for miss in cache.stats.recent_misses]


def reset_stats() -> None:
    for cache in _caches.values():
        cache.stats = _Stats()


def base_key_parts(config) -> dict[str, Any]:
    """The key parts that do not depend on the graph: config, templates, code and versions."""
    from .codegen.render import all_template_hashes

    templates = all_template_hashes()
    return {
        "config": config.cache_hash(),
        "templates": hashlib.sha256(json.dumps(templates, sort_keys=True).encode()).hexdigest()[:16],
        "code": package_source_hash(),
        "neuron_inductor": __version__,
        "torch": torch.__version__,
    }
