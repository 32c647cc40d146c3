"""The compiler's own source as an ingredient of the whole-program cache key: a content
hash of every file between a traced graph and machine code, and the literal defaults of
the compiler's upper-case settings (program_cache.module_settings), from ONE read of
each file, memoized across processes by the files' stat.

Reading and hashing the ~160 files, and parsing their `NAME = <literal>` lines, cost
~30 ms of a warm compile that must fit in 0.1 s. A new process instead stats the files
and reuses, for each file whose stat is unchanged, the content hash and defaults a
previous process recorded in the cache folder. The record is sound, as git's index is:

- content changed => key changed: a file is re-read when its size, mtime, ctime, inode
  or device differ from the record. Any write to a file sets its ctime to the current
  time (no user call can set ctime back), and a file is recorded only once its mtime and
  ctime are `QUIET_NS` (2 s) in the past when it is read, so a later write, even one in
  the same clock tick as the record's file time (coarse file-time granularity), gets a
  different ctime: a file edited within 2 s of being read is simply read again next time.
- the record is an artifact-cache entry (kind "sources"): sealed with the cache's HMAC
  key like every entry, in a folder only the user can write, data-only JSON checked
  field by field; a damaged or planted record is refused, removed and rebuilt.
- without a usable cache folder nothing is recorded and every file is read.

    state = compiler_state()     # state.digest (32 hex), state.defaults {module: {NAME: value}}
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import pathlib
import re
import time
from dataclasses import dataclass

KIND = "sources"
FORMAT = 1
QUIET_NS = 2_000_000_000
# the code that decides what a traced graph compiles to (the executor is rebuilt from the
# program at every load, so the rest of kiln/runtime is not part of the key)
SOURCE_DIRS = ("ir", "passes", "codegen")
SOURCE_FILES = ("runtime/program.py", "runtime/memory_plan.py", "frontend/graph_compile.py",
                "frontend/kernel_cache.py", "frontend/program_cache.py",
                "frontend/compiler_source.py")
SETTING_TYPES = (bool, int, float, str)
# a `NAME = value  # comment` line; matched from the newline before it (the text gets one
# in front and one after), which lets the regex engine jump from newline to newline:
# ~4x faster over the ~160 files than `^...$` with re.M, which tries every position
_DEFAULT = re.compile(r"\n([A-Z][A-Z0-9_]*) = ([^\n]+?)[ \t\r\f\v]*(?:#[^\n]*)?(?=\n)")
STATS = {"read": 0, "recorded": 0}  # files read (hashed) and records reused, this process


@dataclass(frozen=True)
class SourceState:
    """The compiler source's content hash and its settings' default literals."""

    digest: str
    defaults: dict  # module name -> {NAME: literal}


@functools.lru_cache(maxsize=1)
def compiler_state() -> SourceState:
    """The state of kiln's installed compiler source (computed once per process)."""
    return source_state(pathlib.Path(__file__).resolve().parents[1])


def source_state(root: pathlib.Path) -> SourceState:
    """The content hash and setting defaults of the compiler files under `root` (a kiln
    package folder), reusing the stat-keyed record in the cache folder where it holds."""
    files = _files(root)
    memo_key = _memo_key(root)
    record = _load_record(memo_key)
    now = time.time_ns()
    digest = hashlib.sha256()
    defaults: dict = {}
    fresh: dict = {}
    for rel, path, in_dirs in files:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        stamp = None if st is None else [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
        old = record.get(rel)
        if stamp is not None and old is not None and old[0] == stamp:
            STATS["recorded"] += 1
            file_hash, found = old[1], old[2]
        else:
            with open(path, "rb") as f:  # an absent file is an error here, as before
                data = f.read()
            STATS["read"] += 1
            file_hash = hashlib.sha256(data).hexdigest()
            found = _literal_defaults(data.decode("utf-8", "replace")) if in_dirs else {}
        if stamp is not None and max(stamp[1], stamp[2]) < now - QUIET_NS:
            fresh[rel] = [stamp, file_hash, found]
        digest.update(rel.encode() + b"\0" + file_hash.encode() + b"\n")
        if found:
            parts = rel[:-3].split("/")
            defaults["kiln." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = found
    if fresh != record:
        _store_record(memo_key, fresh)
    return SourceState(digest.hexdigest()[:32], defaults)


def _files(root: pathlib.Path) -> list:
    """(relative path, path, in a source folder) of every compiler file, sorted (plain
    strings and os.scandir: pathlib objects cost more than the stats)."""
    base = str(root)
    skip = len(base) + 1
    out = []
    for d in SOURCE_DIRS:
        stack = [os.path.join(base, d)]
        while stack:
            with os.scandir(stack.pop()) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        if e.name != "__pycache__":
                            stack.append(e.path)
                    elif e.name.endswith(".py"):
                        out.append((e.path[skip:].replace(os.sep, "/"), e.path, True))
    out.sort()
    return out + [(f, os.path.join(base, f), False) for f in SOURCE_FILES]


def _literal_defaults(text: str) -> dict:
    """{NAME: literal} of a file's top-level `NAME = <literal>` lines (bool, int, float,
    str); `ast.literal_eval` evaluates no code."""
    found = {}
    for m in _DEFAULT.finditer(f"\n{text}\n"):
        try:
            value = ast.literal_eval(m.group(2))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if type(value) in SETTING_TYPES:
            found[m.group(1)] = value
    return found


def _memo_key(root: pathlib.Path) -> str:
    from kiln._version import __version__
    from kiln.codegen.artifact_cache import content_key

    return content_key("compiler-source", str(FORMAT), __version__, str(root))


def _record_path(key: str) -> tuple[str, bytes] | None:
    """(path of the record, the cache's secret key), or None when there is no usable
    cache folder. An unsafe KILN_CACHE_DIR records nothing here (program_cache.load
    raises K360 for it)."""
    from kiln.codegen import artifact_cache
    from kiln.errors import KilnCacheError

    try:
        trusted = artifact_cache.trusted_root()
    except KilnCacheError:
        return None
    if trusted is None:
        return None
    root, secret = trusted
    # not a `.bin` artifact entry: the record is bookkeeping of the key, not a compiled
    # artifact, and stays out of the artifact cache's entry counts and statistics
    return os.path.join(root, KIND, f"{key}.rec"), secret


def _load_record(key: str) -> dict:
    """{relative path: [stat, sha256, defaults]} from the cache folder, or {} (absent,
    refused, or no usable cache folder). A refused record is removed."""
    from kiln.codegen import artifact_cache, cache_trust

    where = _record_path(key)
    if where is None:
        return {}
    path, secret = where
    blob = artifact_cache._read_entry(path)  # this user's regular file only, no symlink
    if blob is None:
        return {}
    payload = cache_trust.unseal(secret, KIND, key, blob) if blob else None
    try:
        if payload is None:
            raise ValueError("bad tag")
        return _parse_record(payload)
    except ValueError:
        artifact_cache._remove(path)
        return {}


def _parse_record(payload: bytes) -> dict:
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise ValueError("bad record")
    for item in doc["files"].values():
        if type(item) is not list or len(item) != 3:
            raise ValueError("bad record")
        stamp, file_hash, found = item
        if type(stamp) is not list or len(stamp) != 5 or type(file_hash) is not str \
                or len(file_hash) != 64 or type(found) is not dict:
            raise ValueError("bad record")
        for n in stamp:
            if type(n) is not int:
                raise ValueError("bad record")
        for k, v in found.items():
            if type(v) not in SETTING_TYPES:
                raise ValueError("bad record")
    return doc["files"]


def _store_record(key: str, files: dict) -> None:
    """Write the record atomically (a temporary file renamed into place); nothing when
    the cache folder is unusable or unwritable."""
    from kiln.codegen import artifact_cache, cache_trust

    where = _record_path(key)
    if where is None:
        return
    path, secret = where
    payload = json.dumps({"format": FORMAT, "files": files}, separators=(",", ":")).encode()
    try:
        folder = cache_trust.ensure_subdir(os.path.dirname(os.path.dirname(path)), KIND)
        artifact_cache.write_sealed(folder, path, secret, KIND, key, payload)
    except OSError:
        pass
