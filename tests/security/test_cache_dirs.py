"""Who may write the compile cache: the folder must be the user's own and closed to
others, its key private; otherwise nothing is loaded from it (an unsafe KILN_CACHE_DIR
raises K360, an unsafe default folder warns once and compiles without caching).

These tests run as root in CI, so `os.chown` hands folders to another uid."""

import os
import stat
import warnings

import numpy as np
import pytest

import kiln as kn
from kiln.codegen import artifact_cache, cache_trust
from kiln.errors import KilnCacheError, KilnCacheWarning

OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="os.chown to another uid needs root")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_cache_is_private(tmp_path, monkeypatch):
    root = tmp_path / "a" / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    key = artifact_cache.content_key("k")
    assert artifact_cache.store(key, b"payload", "blobs")
    assert mode(root) == 0o700 and mode(root / "blobs") == 0o700
    keyfile = root / cache_trust.KEY_FILE
    assert mode(keyfile) == 0o600 and keyfile.stat().st_size == 32
    (entry,) = root.rglob("*.bin")
    assert mode(entry) == 0o600
    assert artifact_cache.load(key, "blobs") == b"payload"


@needs_root
@pytest.mark.parametrize("setup, reason", [
    (lambda p: os.chown(p, OTHER_UID, OTHER_UID), f"owned by uid {OTHER_UID}"),
    (lambda p: os.chmod(p, 0o775), "writable by its group or by others"),
    (lambda p: os.chmod(p, 0o1777), "writable by its group or by others"),
], ids=["other-owner", "group-writable", "world-writable-sticky"])
def test_unsafe_explicit_cache_dir_raises(tmp_path, monkeypatch, setup, reason):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    setup(root)
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    key = artifact_cache.content_key("k")
    with pytest.raises(KilnCacheError, match=reason) as info:
        artifact_cache.store(key, b"payload", "blobs")
    assert info.value.code == "K360" and str(root) in str(info.value)
    with pytest.raises(KilnCacheError):
        artifact_cache.load(key, "blobs")
    with pytest.raises(KilnCacheError, match="K360"):
        kn.compile(lambda x: x + 1)(np.ones(3, np.float32))
    assert list(root.iterdir()) == []  # not even a key was written there


@needs_root
def test_unsafe_default_cache_warns_once_and_compiles(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "kiln"
    root.mkdir()
    os.chown(root, OTHER_UID, OTHER_UID)
    before = dict(artifact_cache.STATS)
    with pytest.warns(KilnCacheWarning, match=f"owned by uid {OTHER_UID}"):
        out = kn.compile(lambda x: x * 5 - 1)(np.arange(4, dtype=np.float32))
    assert out.numpy().tolist() == [-1.0, 4.0, 9.0, 14.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process and folder
        assert artifact_cache.load(artifact_cache.content_key("k"), "blobs") is None
        assert artifact_cache.store(artifact_cache.content_key("k"), b"x", "blobs") is False
    assert artifact_cache.STATS["disabled"] >= before["disabled"] + 3
    assert artifact_cache.STATS["writes"] == before["writes"]
    assert list(root.iterdir()) == []


@needs_root
@pytest.mark.parametrize("spoil", ["foreign", "readable", "short", "symlink"])
def test_untrusted_key_is_replaced_and_its_entries_refused(tmp_path, monkeypatch, spoil):
    root = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    key = artifact_cache.content_key("k")
    artifact_cache.store(key, b"payload", "blobs")
    keyfile = root / cache_trust.KEY_FILE
    old = keyfile.read_bytes()
    if spoil == "foreign":
        os.chown(keyfile, OTHER_UID, OTHER_UID)
    elif spoil == "readable":
        os.chmod(keyfile, 0o644)
    elif spoil == "short":
        keyfile.write_bytes(old[:16])
    else:
        other = tmp_path / "known-key"
        other.write_bytes(old)
        os.chmod(other, 0o600)
        keyfile.unlink()
        keyfile.symlink_to(other)
    corrupt = artifact_cache.STATS["corrupt"]
    # the entry was tagged with a key someone else may know: refused, never trusted
    assert artifact_cache.load(key, "blobs") is None
    assert artifact_cache.STATS["corrupt"] == corrupt + 1
    assert not keyfile.is_symlink() and mode(keyfile) == 0o600 and keyfile.stat().st_uid == os.geteuid()
    assert keyfile.read_bytes() != old and len(keyfile.read_bytes()) == 32
    assert artifact_cache.store(key, b"payload", "blobs")
    assert artifact_cache.load(key, "blobs") == b"payload"


@needs_root
def test_entry_not_owned_by_the_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    key = artifact_cache.content_key("k")
    artifact_cache.store(key, b"payload", "blobs")
    (entry,) = (tmp_path / "cache").rglob("*.bin")
    os.chown(entry, OTHER_UID, OTHER_UID)  # a valid tag, but not a file this user wrote
    assert artifact_cache.load(key, "blobs") is None
    assert not entry.exists()


def test_symlinked_entry_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    key = artifact_cache.content_key("k")
    artifact_cache.store(key, b"payload", "blobs")
    (entry,) = (tmp_path / "cache").rglob("*.bin")
    real = tmp_path / "elsewhere.bin"
    entry.rename(real)
    entry.symlink_to(real)
    assert artifact_cache.load(key, "blobs") is None
    assert real.exists() and not entry.exists()


def test_concurrent_key_creation_agrees(tmp_path):
    """Processes creating a cache's key at once all end with the same key."""
    import subprocess
    import sys

    # cache_trust needs only the standard library: load it alone, so the processes start at once
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('cache_trust', sys.argv[2])\n"
            "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n"
            "print(t.secret_key(t.ensure_root(sys.argv[1])).hex())")
    root = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), cache_trust.__file__],
                              stdout=subprocess.PIPE, text=True) for _ in range(8)]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert keys == {(root / cache_trust.KEY_FILE).read_bytes().hex()}
