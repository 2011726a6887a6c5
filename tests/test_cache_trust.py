"""A shared compile cache is never a way to run someone else's code (issue 20).

Each forgery is what an attacker who can write an entry would do: prepend code to the entry's host
wrapper source and recompute its sha256 and length. The injected code writes a marker file, so a
forgery that ran leaves the marker behind (the control in the first test shows it does run when the
entry is trusted). The tests run as root, where chmod does not stop writes, so ownership is tested by
chown'ing an entry to another uid.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch

from neuron_inductor import cache as cache_module
from neuron_inductor import cli, config
from neuron_inductor.cache import CompileCache, cache_stats, get_cache
from neuron_inductor.observe.cache_events import read_misses
from tests.test_cache import PARTS, _compile_counter, assert_processes_compile_each_key_once
from tests.test_faults import _compile_and_check, fresh_process  # noqa: F401  (fixture)

SECRET = "correct horse battery staple"
X = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))


def _new_process(folder: Path, secret: str | None = None) -> dict:
    """Compile and check one function as a new process would (empty Dynamo, empty memory tier); its stats."""
    torch._dynamo.reset()
    cache_module._caches.clear()
    with config.patch(cache_dir=str(folder), cache_secret=secret, fallback="allow"):
        _compile_and_check(X)
    return cache_stats()


def _only_entry(folder: Path) -> Path:
    [entry] = folder.glob(f"*/*{cache_module.SUFFIX}")
    return entry


def _forge(entry: Path, marker: Path, keep_mac: bool = True) -> None:
    """Make the entry's wrapper write `marker` when it is loaded; checksum and length recomputed."""
    header_line, _, body = entry.read_bytes().partition(b"\n")
    header, fields = json.loads(header_line), json.loads(body)
    fields["wrapper_source"] = f"open({str(marker)!r}, 'w').write('x')\n" + fields["wrapper_source"]
    body = json.dumps(fields, sort_keys=True).encode()
    header.update(length=len(body), sha256=hashlib.sha256(body).hexdigest())
    if not keep_mac:
        header.pop("hmac", None)
    entry.write_bytes(json.dumps(header, sort_keys=True).encode() + b"\n" + body)


def _trust_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "not trusted" in str(w.message)]


def _cli(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_forged_entry_in_a_world_writable_folder_is_not_run(fresh_process, tmp_path, capsys):
    folder, marker = fresh_process, tmp_path / "marker"
    assert _new_process(folder)["compiles"] == 1
    entry = _only_entry(folder)
    _forge(entry, marker)
    forged = entry.read_bytes()
    os.chmod(folder, 0o777)

    with pytest.warns(RuntimeWarning) as record:
        stats = _new_process(folder)
    assert not marker.exists()
    assert (stats["compiles"], stats["disk_hits"], stats["untrusted"]) == (1, 0, 1), stats
    [warning] = _trust_warnings(record)  # one warning: the folder, the reason, the fix
    assert str(folder) in warning and "writable by group and others (mode 0777)" in warning
    assert "chmod go-w" in warning and "NEURON_INDUCTOR_CACHE_SECRET" in warning
    assert entry.read_bytes() == forged  # nothing is written into a folder others can write

    out = _cli(capsys, "cache", "--cache-dir", str(folder), "list")
    assert "refused" in out and "NOT TRUSTED: the folder is writable by group and others" in out
    assert "every entry in" in _cli(capsys, "cache", "--cache-dir", str(folder), "explain")

    # Control: in a folder only its owner can write, the same bytes are loaded and their code runs
    # (whoever can write there can run code as the owner anyway), so the refusal above is what stopped it.
    os.chmod(folder, 0o700)
    assert _new_process(folder)["disk_hits"] == 1 and marker.exists()


@pytest.mark.parametrize("keep_mac", [True, False], ids=["stale_mac", "mac_removed"])
def test_forged_entry_is_not_run_with_a_secret(fresh_process, tmp_path, capsys, keep_mac):
    folder, marker = fresh_process, tmp_path / "marker"
    folder.mkdir()
    os.chmod(folder, 0o777)  # shared by every user: the MAC alone decides
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert _new_process(folder, SECRET)["compiles"] == 1
    entry = _only_entry(folder)
    _forge(entry, marker, keep_mac=keep_mac)

    with pytest.warns(RuntimeWarning) as record:
        stats = _new_process(folder, SECRET)
    assert not marker.exists()
    assert (stats["compiles"], stats["disk_hits"], stats["untrusted"]) == (1, 0, 1), stats
    [warning] = _trust_warnings(record)
    reason = "MAC does not match" if keep_mac else "carries no MAC"
    assert str(entry) in warning and reason in warning
    assert reason in read_misses(folder)[-1]["refused"]
    with config.patch(cache_secret=SECRET):
        assert "refused for trust" in _cli(capsys, "cache", "--cache-dir", str(folder), "explain")

    stats = _new_process(folder, SECRET)  # the rebuilt entry replaced the forgery
    assert (stats["compiles"], stats["disk_hits"], stats["untrusted"]) == (0, 1, 0) and not marker.exists()


def test_entry_owned_by_another_user_is_not_run(fresh_process, tmp_path, capsys):
    folder, marker = fresh_process, tmp_path / "marker"
    _new_process(folder)
    entry = _only_entry(folder)
    _forge(entry, marker)
    os.chown(entry, 12345, 12345)
    out = _cli(capsys, "cache", "--cache-dir", str(folder), "list")
    assert "refused: the entry is owned by uid 12345" in out

    with pytest.warns(RuntimeWarning) as record:
        stats = _new_process(folder)
    assert not marker.exists()
    assert (stats["compiles"], stats["disk_hits"], stats["untrusted"]) == (1, 0, 1), stats
    [warning] = _trust_warnings(record)
    assert str(entry) in warning and "owned by uid 12345, not by you" in warning

    assert entry.stat().st_uid == os.getuid()  # the subfolder is ours: the rebuilt entry replaced it
    assert _new_process(folder)["disk_hits"] == 1 and not marker.exists()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["private", "authenticated"])
def test_honest_entries_are_disk_hits(fresh_process, capsys, secret):
    folder = fresh_process
    assert _new_process(folder, secret)["compiles"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        stats = _new_process(folder, secret)
    assert (stats["compiles"], stats["disk_hits"], stats["untrusted"]) == (0, 1, 0), stats
    header = json.loads(_only_entry(folder).read_bytes().partition(b"\n")[0])
    assert ("hmac" in header) == (secret is not None)
    with config.patch(cache_secret=secret):
        out = _cli(capsys, "cache", "--cache-dir", str(folder), "list")
        assert ("authenticated" if secret else "private") in out.splitlines()[1]
        key = _only_entry(folder).name.removesuffix(cache_module.SUFFIX)
        shown = _cli(capsys, "cache", "--cache-dir", str(folder), "show", key[:8])
        assert f"trust: {'authenticated' if secret else 'private'}" in shown


def test_an_entry_under_another_secret_is_refused(fresh_process):
    _new_process(fresh_process, SECRET)
    with pytest.warns(RuntimeWarning, match="MAC does not match"):
        stats = _new_process(fresh_process, "another secret")
    assert (stats["compiles"], stats["disk_hits"], stats["untrusted"]) == (1, 0, 1)


def test_default_folder_and_entries_are_private_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cache_module, "_caches", {})
    old_umask = os.umask(0)
    try:
        store = get_cache(None)
        store.get_or_compile(PARTS, "b", _compile_counter()[0])
    finally:
        os.umask(old_umask)
    assert store.folder == tmp_path / "xdg" / "neuron_inductor"
    entry = _only_entry(store.folder)
    modes = [stat.S_IMODE(path.stat().st_mode) for path in (store.folder, entry.parent, entry,
                                                            entry.with_suffix(".lock"))]
    assert modes == [0o700, 0o700, 0o600, 0o600]


def test_authenticated_entries_take_the_shared_folders_permissions(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o2775)  # a group's folder: setgid, group-writable
    CompileCache(folder, secret=SECRET).get_or_compile(PARTS, "b", _compile_counter()[0])
    entry = _only_entry(folder)
    assert stat.S_IMODE(entry.parent.stat().st_mode) == 0o2775 and stat.S_IMODE(entry.stat().st_mode) == 0o644


def test_four_processes_on_an_authenticated_shared_folder_compile_each_key_once(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    stderr = assert_processes_compile_each_key_once(folder, tmp_path / "compiles.log", secret=SECRET)
    assert "not trusted" not in stderr and "MAC" not in stderr


def test_secret_stays_out_of_keys_dumps_and_logs(monkeypatch):
    monkeypatch.setenv("NEURON_INDUCTOR_CACHE_SECRET", SECRET)
    with_secret = config.resolve()
    assert with_secret.cache_secret == SECRET
    assert with_secret.cache_hash() == config.resolve({"cache_secret": ""}).cache_hash()
    assert SECRET not in repr(with_secret) and SECRET not in json.dumps(with_secret.as_dict())
    assert with_secret.as_dict()["cache_secret"] == "<set>"
