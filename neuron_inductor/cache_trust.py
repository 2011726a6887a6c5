"""Whether a compile-cache entry on disk may be run.

A cache entry is code: its kernel sources and host wrapper are exec'd when it is loaded. Its
sha256 only detects corruption, since whoever can write the file can recompute it. So an entry is
loaded only when one of these holds:

- private (no secret set): the cache folder, the entry's subfolder and the entry file are owned by
  this user (or root) and writable by nobody else. Whoever could forge such an entry could already
  run code as this user.
- authenticated (`NEURON_INDUCTOR_CACHE_SECRET` set): the entry's header carries an HMAC-SHA256,
  under that secret, of its other header fields and its body. Owners and modes do not matter then,
  so one folder can be shared by ranks, pods and users that hold the secret.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any

MAC_FIELD = "hmac"
_MAC_CONTEXT = b"neuron_inductor cache entry v1\n"  # a MAC made under this secret for anything else never matches

PRIVATE_FOLDER_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class NotARegularFile(OSError):
    """An entry path that is a symbolic link, FIFO, device or folder: never read."""


def ownership_problem(what: str, st: os.stat_result) -> str | None:
    """Why a folder or file with this stat may hold someone else's writing, or None when only
    this user (or root) can have written it."""
    if st.st_uid not in (os.getuid(), 0):
        return f"{what} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    writers = [name for bit, name in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if st.st_mode & bit]
    if writers:
        return f"{what} is writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_folder(path: Path, mode: int) -> None:
    """Create `path` (its parent exists) with exactly `mode`, whatever the umask; an existing folder is kept."""
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        return
    os.chmod(path, mode)  # mkdir's mode is masked by the umask


def read_regular_file(path: Path) -> tuple[os.stat_result, bytes]:
    """(stat, bytes) of a regular file, without following a symbolic link or blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotARegularFile(errno.ELOOP, "a symbolic link", str(path)) from None
        raise
    with open(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(errno.EINVAL, "not a regular file", str(path))
        return st, handle.read()


def entry_mac(secret: bytes, header: dict[str, Any], body: bytes) -> str:
    """HMAC-SHA256 of an entry's header fields (all but the MAC itself) and body."""
    fields = json.dumps({name: value for name, value in header.items() if name != MAC_FIELD}, sort_keys=True)
    return hmac.new(secret, _MAC_CONTEXT + fields.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def mac_problem(secret: bytes, header: dict[str, Any], body: bytes) -> str | None:
    """Why an entry's MAC does not prove it was written under `secret`, or None."""
    mac = header.get(MAC_FIELD)
    if not isinstance(mac, str):
        return "it carries no MAC (written without NEURON_INDUCTOR_CACHE_SECRET)"
    if not hmac.compare_digest(mac.encode("utf-8", "replace"), entry_mac(secret, header, body).encode()):
        return "its MAC does not match (written under another secret, or forged)"
    return None
