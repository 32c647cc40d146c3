"""The Flight Recorder: a bounded ring buffer of every collective this process issued.

Every backend's collectives pass through `ProcessGroup`, which appends a record when a
call is scheduled and updates it when it starts, completes or fails. Dumps are JSON
(plain data, no object serialization), one file per rank (`kiln_fr_rank<R>.json`), written on failure, on
timeout, on SIGUSR1, when another rank asks through the store, or on request
(`pg.dump_flight_recorder(dir)`). `kiln fr DIR` reads them all (see `fr_analysis`).

    >>> from kiln.distributed.flight_recorder import recorder
    >>> path = recorder().dump("/tmp/fr", reason="manual")
"""

from __future__ import annotations

import collections
import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
import types

DUMP_VERSION = 1
_KILN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THREADING_FILE = os.path.abspath(threading.__file__)


_INTERNAL: dict = {}  # code object -> whether it is kiln's or threading's (skipped)


def call_site_frames(limit: int = 4, depth: int = 1) -> list[tuple]:
    """The innermost `limit` frames outside kiln, from `depth` frames up (1: the
    caller; more skips frames known to be kiln's), as (code object, instruction
    offset): cheap to take (no line-table lookup, no I/O); `resolve_frames` turns them
    into (file, line, function) when a dump is written."""
    frames: list[tuple] = []
    frame = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        internal = _INTERNAL.get(code)
        if internal is None:
            name = code.co_filename
            internal = _INTERNAL[code] = name.startswith(_KILN_DIR) or name == _THREADING_FILE
        if not internal:
            frames.append((code, frame.f_lasti))
            if len(frames) == limit:
                break
        frame = frame.f_back
    return frames


def resolve_frames(frames: list) -> list[tuple]:
    """(file, line, function) of frames from `call_site_frames` (others pass through)."""
    out = []
    for frame in frames:
        code = frame[0]
        if isinstance(code, types.CodeType):
            line = next((ln for start, end, ln in code.co_lines() if start <= frame[1] < end),
                        code.co_firstlineno)
            out.append((code.co_filename, line or code.co_firstlineno, code.co_name))
        else:
            out.append(tuple(frame))
    return out


_DTYPE_NAMES: dict = {}
_SHAPES: dict = {}  # (shape, dtype) -> (sizes, dtype names) of one array, shared by records


def _dtype_name(dtype) -> str:
    """str(dtype), cached: numpy's dtype __str__ costs microseconds on every call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _describe(arrays: list) -> tuple[list, list]:
    """([shape as list, ...], [dtype name, ...]) of arrays, cached for one array."""
    if len(arrays) != 1:
        return [list(a.shape) for a in arrays], [_dtype_name(a.dtype) for a in arrays]
    a = arrays[0]
    key = (a.shape, a.dtype)
    found = _SHAPES.get(key)
    if found is None:
        if len(_SHAPES) > 4096:  # many distinct shapes: start over rather than grow
            _SHAPES.clear()
        found = _SHAPES[key] = ([list(a.shape)], [_dtype_name(a.dtype)])
    return found


class FlightRecorder:
    """The process-wide ring buffer; thread-safe. Size from KILN_FR_BUFFER_SIZE (2000)."""

    def __init__(self, capacity: int | None = None):
        capacity = capacity or int(os.environ.get("KILN_FR_BUFFER_SIZE", "2000"))
        self._records: collections.deque[dict] = collections.deque(maxlen=max(capacity, 1))
        self._lock = threading.Lock()
        self._next_id = 0
        self.rank = 0
        self.world_size = 1
        self.groups: dict[str, dict] = {}
        self.dump_dir: str | None = os.environ.get("KILN_FR_DIR") or None

    def register_group(self, name: str, ranks: list[int], rank: int, epoch: int,
                       backend: str) -> None:
        """Remember a group's membership (global ranks) at an epoch; dumps carry it for
        cross-checks (under `group_key(name, epoch)`: every epoch of a group that
        changed membership keeps its own entry)."""
        with self._lock:
            self.groups[group_key(name, epoch)] = {"ranks": list(ranks), "rank": rank,
                                                   "epoch": epoch, "backend": backend}

    def record(self, *, group: str, epoch: int, seq: int, op: str, inputs: list, outputs: list,
               timeout: float, frames: list, numel: int | None = None,
               extra: dict | None = None, started_ns: int | None = None) -> dict:
        """Append a record in state 'scheduled' and return it (the caller updates it);
        with `started_ns` (a `time.time_ns()` value), of a call that was started then,
        in state 'started'.

        Its size and dtype lists are shared between records of equal operands (made
        once per shape and dtype): treat a record's values as read-only."""
        now = started_ns or time.time_ns()
        in_sizes, in_dtypes = _describe(inputs)
        out_sizes, out_dtypes = (in_sizes, in_dtypes) if outputs is inputs else \
            _describe(outputs)
        rec = {
            "id": 0, "group": group, "epoch": epoch, "seq": seq, "op": op,
            "input_sizes": in_sizes, "input_dtypes": in_dtypes,
            "output_sizes": out_sizes, "output_dtypes": out_dtypes,
            "state": "scheduled", "time_created_ns": now, "time_started_ns": None,
            "time_completed_ns": None, "timeout_s": timeout, "frames": frames,
            "error": None,
        }
        if numel is not None:
            rec["numel"] = numel
        if extra:
            rec.update(extra)
        if started_ns is not None:
            rec["state"], rec["time_started_ns"] = "started", started_ns
        with self._lock:
            rec["id"] = self._next_id
            self._next_id += 1
            self._records.append(rec)
        return rec

    @staticmethod
    def started(rec: dict) -> None:
        rec["time_started_ns"] = time.time_ns()
        rec["state"] = "started"

    @staticmethod
    def completed(rec: dict, error: BaseException | None = None) -> None:
        rec["time_completed_ns"] = time.time_ns()
        if error is None:
            rec["state"] = "completed"
        else:
            rec["state"] = "failed"
            rec["error"] = "%s: %s" % (type(error).__name__, getattr(error, "message", error))
            if getattr(error, "group_name", None) == rec.get("group"):
                rec["failed_rank"] = error.rank  # a PeerFailure: the dead peer, in group ranks

    def snapshot(self, reason: str) -> dict:
        """The whole dump as a JSON-able dict."""
        with self._lock:
            records = [dict(r) for r in self._records]
            groups = {k: dict(v) for k, v in self.groups.items()}
        for rec in records:  # resolve source lines only now: recording stays cheap
            rec["frames"] = [
                {"file": f, "line": ln, "function": fn,
                 "source": linecache.getline(f, ln).strip()}
                for f, ln, fn in resolve_frames(rec["frames"])]
        return {
            "version": DUMP_VERSION, "rank": self.rank, "world_size": self.world_size,
            "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
            "time_ns": time.time_ns(), "groups": groups, "records": records,
        }

    def dump(self, directory: str | None = None, reason: str = "request") -> str | None:
        """Write `kiln_fr_rank<R>.json` into `directory` (or KILN_FR_DIR); its path.

        Returns None when no directory is configured. The file is replaced atomically,
        so a reader never sees half a dump.
        """
        directory = directory or self.dump_dir
        if not directory:
            return None
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "kiln_fr_rank%d.json" % self.rank)
        tmp = "%s.%d.tmp" % (path, threading.get_ident())
        with open(tmp, "w") as f:
            json.dump(self.snapshot(reason), f, indent=1, default=str)
        os.replace(tmp, path)
        return path


def group_key(name: str, epoch: int) -> str:
    """How dumps and their analysis name one epoch of a group: its name at epoch 0
    (groups that never change), `name@e<epoch>` after a reconfiguration."""
    return name if not epoch else "%s@e%d" % (name, epoch)


_RECORDER = FlightRecorder()


def recorder() -> FlightRecorder:
    """The process-wide Flight Recorder."""
    return _RECORDER


def install_signal_handler() -> bool:
    """Dump on SIGUSR1 (from the main thread only; an existing handler is kept)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        return False
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return False

    def on_signal(signum, frame):
        # dump from a thread: the interrupted code may hold the recorder's lock
        threading.Thread(target=_RECORDER.dump, kwargs={"reason": "SIGUSR1"},
                         daemon=True).start()

    signal.signal(signal.SIGUSR1, on_signal)
    return True
