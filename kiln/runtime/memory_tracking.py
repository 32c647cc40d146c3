"""Per-process memory figures, readable from outside: what `kiln mem` lists.

Each kiln process that has used a device allocator publishes its figures as one small
JSON file, `<pid>.json`, in a per-user folder (`$KILN_MEM_DIR`, else
`$XDG_RUNTIME_DIR/kiln-mem`, else `/tmp/kiln-mem-<uid>`, created 0700 and used only
when this user owns it). A daemon thread rewrites the file when the figures change
(checked every `INTERVAL` seconds: eager ops pay nothing for it) and the file is
removed at exit. A reader ignores files of processes that are gone (or whose pid was
reused: the process start time is in the file) and reads JSON only, never pickle.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import tempfile
import threading
import time

INTERVAL = 0.25  # seconds between checks for changed figures
FORMAT = "kiln-mem/1"
_MAX_FILE = 1 << 16  # a reader refuses anything bigger

_lock = threading.Lock()
_stop = threading.Event()
_thread: threading.Thread | None = None
_path: str | None = None


def mem_dir() -> str:
    """The folder the figures of this user's kiln processes are published in."""
    explicit = os.environ.get("KILN_MEM_DIR")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kiln-mem")
    return os.path.join(tempfile.gettempdir(), f"kiln-mem-{os.getuid()}")


def _safe_dir(path: str) -> bool:
    """Create the folder 0700; use it only if it is a real folder this user owns."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return False
    import stat

    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    except (IndexError, ValueError):
        return None


def figures() -> dict:
    """This process's figures per device, as published."""
    from kiln.runtime.device import allocators

    out = {}
    for device, allocator in sorted(allocators().items()):
        out[device] = {"allocated": allocator.memory_allocated(),
                       "reserved": allocator.memory_reserved(),
                       "peak_allocated": allocator.max_memory_allocated(),
                       "peak_reserved": allocator.max_memory_reserved(),
                       "limit": allocator.limit, "total": allocator.total_memory,
                       "num_ooms": allocator.num_ooms}
    return out


def _versions() -> tuple:
    from kiln.runtime.device import allocators

    out = []
    for device, allocator in sorted(allocators().items()):
        allocator.settle()
        out.append((device, allocator.version))
    return tuple(out)


def publish() -> None:
    """Write this process's figures now (atomically: a reader never sees half a file)."""
    global _path
    folder = mem_dir()
    if not _safe_dir(folder):
        return
    path = os.path.join(folder, f"{os.getpid()}.json")
    record = {"format": FORMAT, "pid": os.getpid(), "start_time": start_time(os.getpid()),
              "command": " ".join(sys.argv)[:200] or sys.executable, "updated": time.time(),
              "devices": figures()}
    temporary = f"{path}.{threading.get_ident()}.tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(record, f)
        os.replace(temporary, path)
        _path = path
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass


def _loop() -> None:
    last = None
    while True:
        versions = _versions()
        if versions != last:
            publish()
            last = versions
        if _stop.wait(INTERVAL):
            return


def ensure_publisher() -> None:
    """Start publishing this process's figures (once; `KILN_MEM_PUBLISH=0` turns it off)."""
    global _thread
    if _thread is not None or os.environ.get("KILN_MEM_PUBLISH", "1") == "0":
        return
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="kiln-mem-publisher", daemon=True)
            _thread.start()
            atexit.register(_withdraw)


def _withdraw() -> None:
    """At exit: stop the thread (bounded) and remove this process's file."""
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2.0)
    if _path is not None:
        try:
            os.unlink(_path)
        except OSError:
            pass


def _after_fork_in_child() -> None:
    # the parent's thread does not exist here and the file is the parent's. A forked
    # child (often left with os._exit, which skips atexit) does not publish on its own.
    global _thread, _path, _lock, _stop
    _thread, _path = None, None
    _lock, _stop = threading.Lock(), threading.Event()


os.register_at_fork(after_in_child=_after_fork_in_child)


def read_processes(folder: str | None = None) -> list[dict]:
    """The live kiln processes of this user that publish figures, by pid; stale files
    (the process is gone, or its pid now belongs to another process) are skipped."""
    folder = folder or mem_dir()
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        stem, dot, ext = name.partition(".")
        if ext != "json" or not stem.isdigit():
            continue
        pid = int(stem)
        record = _read(os.path.join(folder, name))
        if record is None or record.get("pid") != pid or not _alive(pid, record):
            continue
        out.append(record)
    return sorted(out, key=lambda r: r["pid"])


def _read(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE + 1)
    except OSError:
        return None
    if len(data) > _MAX_FILE:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    devices = record.get("devices")
    if not isinstance(devices, dict) or not isinstance(record.get("pid"), int):
        return None
    for figures_ in devices.values():
        if not isinstance(figures_, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in figures_.values()):
            return None
    if not isinstance(record.get("command"), str):
        record["command"] = "?"
    return record


def _alive(pid: int, record: dict) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = record.get("start_time")
    return started is None or start_time(pid) in (None, started)
