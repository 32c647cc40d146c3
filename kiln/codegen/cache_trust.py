"""Who may write kiln's compile cache, and how kiln knows an entry is its own.

The cache holds machine code that kiln loads into the process, so an entry is used only
when two things hold:

- **The folder is the user's own.** The cache root is created with mode 0700; on every
  use it must be a directory owned by the effective user and writable by nobody else
  (no group or world write bit). This is the check pip makes before using its cache
  and the guarantee `tempfile.mkdtemp` gives. A root that fails it is refused.
- **The entry carries kiln's tag.** Each cache keeps a secret key, 32 random bytes in
  `<root>/hmac.key` (mode 0600, owned by the user, read through the opened file so a
  swapped path cannot substitute another file). An entry is
  `MAGIC | HMAC-SHA256(key, MAGIC, kind, cache key, payload) | payload`: a file planted
  by anyone who cannot read the key, or an entry moved under another function's key,
  fails the tag and is never loaded.

A key file that is missing is created; one that is not the user's, is readable by
others, or has the wrong size is replaced by a fresh key (kiln owns the folder, so it
may), which invalidates every entry written under the old one.

    >>> key = secret_key(ensure_root(tempfile.mkdtemp()))
    >>> unseal(key, "objects", "ab12", seal(key, "objects", "ab12", b"code"))
    b'code'
    >>> unseal(key, "objects", "cd34", seal(key, "objects", "ab12", b"code")) is None
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import tempfile

MAGIC = b"KILNOBJ2"
KEY_FILE = "hmac.key"
_KEY_BYTES = 32
_TAG_BYTES = 32


class CacheUnusable(Exception):
    """The cache root cannot be used. `unsafe`: refused for safety (another user could
    write into it), as opposed to merely unwritable (not a folder, no permission)."""

    def __init__(self, reason: str, *, unsafe: bool):
        super().__init__(reason)
        self.reason = reason
        self.unsafe = unsafe


def check_dir(path: str) -> None:
    """Raise `CacheUnusable` unless `path` is a directory owned by this user that nobody
    else may write into. Symlinks are followed: the folder entries land in is checked."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CacheUnusable(f"{path}: {e.strerror}", unsafe=False) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheUnusable(f"{path} is not a directory", unsafe=False)
    uid = os.geteuid()
    if st.st_uid != uid:
        raise CacheUnusable(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})",
                            unsafe=True)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheUnusable(f"{path} is writable by its group or by others "
                            f"(mode {stat.S_IMODE(st.st_mode):04o})", unsafe=True)


def ensure_root(path: str) -> str:
    """The cache root `path`, created with mode 0700 when missing, checked by `check_dir`."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file in the way: check_dir says so
    except OSError as e:
        raise CacheUnusable(f"cannot create {path}: {e.strerror}", unsafe=False) from None
    check_dir(path)
    return path


def ensure_subdir(root: str, *parts: str) -> str:
    """`root/parts...` created with mode 0700 (inside a checked root nobody else can add
    folders, so only the result's type is checked)."""
    path = root
    for part in parts:
        path = os.path.join(path, part)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(path)
    return path


def secret_key(root: str) -> bytes:
    """This cache's secret key, created (or replaced, when unusable) as a 0600 file."""
    path = os.path.join(root, KEY_FILE)
    key = _read_key(path)
    return key if key is not None else _new_key(root, path)


def _read_key(path: str) -> bytes | None:
    """The key in `path`, or None when it is missing or cannot be trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # missing, a symlink, a FIFO...: a fresh key replaces it
    try:
        st = os.fstat(fd)  # the opened file itself: a path swapped after the open is harmless
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o077 or st.st_size != _KEY_BYTES):
            return None
        data = os.read(fd, _KEY_BYTES + 1)
        return data if len(data) == _KEY_BYTES else None
    finally:
        os.close(fd)


def _new_key(root: str, path: str) -> bytes:
    """Write a fresh key. Two processes creating it at once agree on one: the first
    `link` wins and the other reads the winner's key; a bad key file is replaced."""
    key = os.urandom(_KEY_BYTES)
    try:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".key-")  # mode 0600
    except OSError as e:
        raise CacheUnusable(f"cannot write the cache key in {root}: {e.strerror}", unsafe=False) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        try:
            os.link(tmp, path)
            return key
        except FileExistsError:
            existing = _read_key(path)
            if existing is not None:
                return existing
        except OSError:
            pass  # a file system without hard links: replace below
        os.replace(tmp, path)
        return key
    except OSError as e:
        raise CacheUnusable(f"cannot write the cache key {path}: {e.strerror}", unsafe=False) from None
    finally:
        try:
            os.remove(tmp)
        except OSError:
            pass


def tag(key: bytes, kind: str, name: str, payload: bytes) -> bytes:
    """HMAC-SHA256 over the format, the entry's kind and cache key, and the payload."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (MAGIC, kind.encode(), name.encode()):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    mac.update(payload)
    return mac.digest()


def seal(key: bytes, kind: str, name: str, payload: bytes) -> bytes:
    """The bytes of an entry: MAGIC, the tag, the payload."""
    return MAGIC + tag(key, kind, name, payload) + payload


def unseal(key: bytes, kind: str, name: str, blob: bytes) -> bytes | None:
    """The payload of an entry kiln wrote under this key, kind and name; None otherwise."""
    header = len(MAGIC) + _TAG_BYTES
    if len(blob) < header or blob[:len(MAGIC)] != MAGIC:
        return None
    payload = blob[header:]
    if not hmac.compare_digest(blob[len(MAGIC):header], tag(key, kind, name, payload)):
        return None
    return payload
