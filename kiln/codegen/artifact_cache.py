"""The on-disk cache of compiled artifacts (object code), keyed by content hash.

The key hashes everything the machine code depends on: kiln's version, the backend
and its options, the host CPU, and the Kernel IR of every kernel in the module. The
cache runs code it finds on disk, so it trusts only what kiln itself wrote
(`kiln.codegen.cache_trust`):

- the cache root must be a directory of the current user that nobody else can write
  into (created 0700; checked on every load and store);
- an entry is `MAGIC | HMAC(secret key, kind, key, payload) | payload`, tagged with a
  per-cache secret key only the user can read: a planted file, an entry of an older
  format, or an entry moved under another function's key is refused, removed and
  rebuilt — never loaded;
- object code (kind "objects") is also checked structurally (`cache_elf`) before the
  loader sees it, so even a damaged entry kiln wrote is rebuilt instead of crashing.

An unusable root disables the cache for the process with one `KilnCacheWarning`
(compiling still works). When the user named the folder with `KILN_CACHE_DIR` and it is
unsafe (another user's, or group/world writable), `load` and `store` raise
`KilnCacheError` (K360) instead: a setting the user chose is not silently ignored.

Entries are written to a temporary file in the same folder and renamed into place, so a
reader never sees half a file and processes compiling at once all end with a valid entry.

Location: `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import warnings
from typing import Callable

from kiln.codegen import cache_elf, cache_trust
from kiln.errors import KilnCacheError, KilnCacheWarning

MAGIC = cache_trust.MAGIC
MAX_ENTRY_BYTES = 1 << 30
# what this process's cache did (tests and `kiln bench` read it); "corrupt" counts every
# entry refused (bad tag, bad object, not the user's file), "disabled" every load or
# store skipped because the root is unusable
STATS = {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "disabled": 0}
_WARNED: set = set()


def cache_dir() -> str:
    """The cache root: `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`."""
    root = os.environ.get("KILN_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "kiln")
    return root


def content_key(*parts: str) -> str:
    """sha256 of the length-delimited `parts`, as hex: the name of a cache entry."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def trusted_root() -> tuple[str, bytes] | None:
    """(root, secret key) of a cache that may be used now, or None when it is disabled
    (after one warning). Raises `KilnCacheError` for an unsafe `KILN_CACHE_DIR`."""
    root = cache_dir()
    try:
        cache_trust.ensure_root(root)
        return root, cache_trust.secret_key(root)
    except cache_trust.CacheUnusable as e:
        STATS["disabled"] += 1
        if e.unsafe and os.environ.get("KILN_CACHE_DIR"):
            raise KilnCacheError(
                f"compile cache: refusing KILN_CACHE_DIR={root}: {e.reason}; another user could "
                "plant code kiln would run",
                hint="`chmod go-w` the folder if it is yours, or set KILN_CACHE_DIR to a folder of "
                     "your own (kiln creates it with mode 0700)") from None
        if (root, e.reason) not in _WARNED:
            _WARNED.add((root, e.reason))
            warnings.warn(f"kiln: compile cache disabled ({e.reason}); compiled code will not be "
                          "reused across processes. Set KILN_CACHE_DIR to a folder of your own.",
                          KilnCacheWarning, stacklevel=3)
        return None


def _path(root: str, key: str, kind: str) -> str:
    if not kind.isidentifier() or not all(c in "0123456789abcdef" for c in key) or len(key) < 2:
        raise ValueError(f"artifact cache: bad entry name {kind}/{key}")
    return os.path.join(root, kind, key[:2], f"{key}.bin")


def _validate_objects(payload: bytes) -> None:
    machine = cache_elf.host_machine()
    if machine is not None:  # host objects are ELF only where the host is ELF
        for part in cache_elf.unpack_objects(payload):  # one object, or several packed
            cache_elf.check_object(part, machine=machine, relocatable=True)


# per-kind structural checks of a payload, run after its tag verified (raise ValueError)
VALIDATORS: dict[str, Callable[[bytes], None]] = {"objects": _validate_objects}


def load(key: str, kind: str = "objects", validate: Callable[[bytes], None] | None = None) -> bytes | None:
    """The cached payload that kiln stored under `key`, or None when absent, refused or
    the cache is disabled. A refused entry (wrong tag, failing `validate` or the kind's
    check, not a regular file of this user) is removed so that the next store replaces it."""
    trusted = trusted_root()
    if trusted is None:
        return None
    root, secret = trusted
    path = _path(root, key, kind)
    blob = _read_entry(path)
    if blob is None:
        STATS["misses"] += 1
        return None
    payload = cache_trust.unseal(secret, kind, key, blob) if blob else None
    check = validate or VALIDATORS.get(kind)
    if payload is not None and check is not None:
        try:
            check(payload)
        except ValueError:
            payload = None
    if payload is None:
        STATS["corrupt"] += 1
        _remove(path)
        return None
    STATS["hits"] += 1
    return payload


def _read_entry(path: str) -> bytes | None:
    """The file's bytes; b"" for something that is not this user's regular file (to be
    refused); None when absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return b""  # a symlink, or unreadable
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_size > MAX_ENTRY_BYTES):
            return b""
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_ENTRY_BYTES + 1)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.remove(path)
    except OSError:
        pass


def store(key: str, payload: bytes, kind: str = "objects") -> bool:
    """Write an entry atomically; False (and no exception) when the cache is disabled or
    unwritable. Raises `KilnCacheError` for an unsafe `KILN_CACHE_DIR`."""
    trusted = trusted_root()
    if trusted is None or len(payload) > MAX_ENTRY_BYTES:
        return False
    root, secret = trusted
    try:
        write_sealed(cache_trust.ensure_subdir(root, kind, key[:2]), _path(root, key, kind),
                     secret, kind, key, payload)
        STATS["writes"] += 1
    except OSError:
        return False
    return True


def write_sealed(folder: str, path: str, secret: bytes, kind: str, key: str, payload: bytes) -> None:
    """`payload` sealed (cache_trust.seal) into `path`, atomically: written to a temporary
    file in `folder` (the same folder as `path`) and renamed into place. Raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cache_trust.seal(secret, kind, key, payload))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
