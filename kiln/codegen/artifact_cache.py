"""The on-disk cache of compiled artifacts (object code), keyed by content hash.

The key hashes everything the machine code depends on: kiln's version, the backend
and its options, the host CPU, and the Kernel IR of every kernel in the module. An
entry is `MAGIC | sha256(payload) | payload`, written to a temporary file in the
same folder and renamed into place, so a reader never sees half a file and two
processes compiling the same function at once both end with a valid entry. An entry
whose checksum does not match is deleted and rebuilt.

Location: `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

MAGIC = b"KILNOBJ1"
_DIGEST = 32
# what this process's cache did (tests and `kiln bench` read it)
STATS = {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0}


def cache_dir() -> str:
    root = os.environ.get("KILN_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "kiln")
    return root


def content_key(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _path(key: str, kind: str) -> str:
    return os.path.join(cache_dir(), kind, key[:2], f"{key}.bin")


def load(key: str, kind: str = "objects") -> bytes | None:
    """The cached payload, or None when absent or corrupt (a corrupt entry is removed)."""
    path = _path(key, kind)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        STATS["misses"] += 1
        return None
    header = len(MAGIC) + _DIGEST
    if (len(blob) >= header and blob[:len(MAGIC)] == MAGIC
            and hashlib.sha256(blob[header:]).digest() == blob[len(MAGIC):header]):
        STATS["hits"] += 1
        return blob[header:]
    STATS["corrupt"] += 1
    try:
        os.remove(path)
    except OSError:
        pass
    return None


def store(key: str, payload: bytes, kind: str = "objects") -> bool:
    """Write an entry atomically; False (and no exception) when the cache is unwritable."""
    path = _path(key, kind)
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
            STATS["writes"] += 1
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
    except OSError:
        return False
    return True
