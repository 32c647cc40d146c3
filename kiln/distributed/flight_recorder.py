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

DUMP_VERSION = 1
_KILN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THREADING_FILE = os.path.abspath(threading.__file__)


def call_site_frames(limit: int = 4) -> list[list]:
    """[file, line, function] of the innermost `limit` frames outside kiln (cheap: no I/O)."""
    frames: list[list] = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < limit:
        filename = frame.f_code.co_filename
        if not filename.startswith(_KILN_DIR) and filename != _THREADING_FILE:
            frames.append([filename, frame.f_lineno, frame.f_code.co_name])
        frame = frame.f_back
    return frames


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    """str(dtype), cached: numpy's dtype __str__ costs microseconds on every call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


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
        """Remember a group's membership (global ranks); dumps carry it for cross-checks."""
        with self._lock:
            self.groups[name] = {"ranks": list(ranks), "rank": rank, "epoch": epoch,
                                 "backend": backend}

    def record(self, *, group: str, epoch: int, seq: int, op: str, inputs: list, outputs: list,
               timeout: float, frames: list, extra: dict | None = None) -> dict:
        """Append a record in state 'scheduled' and return it (the caller updates it)."""
        now = time.time_ns()
        rec = {
            "id": 0, "group": group, "epoch": epoch, "seq": seq, "op": op,
            "input_sizes": [list(a.shape) for a in inputs],
            "input_dtypes": [_dtype_name(a.dtype) for a in inputs],
            "output_sizes": [list(a.shape) for a in outputs],
            "output_dtypes": [_dtype_name(a.dtype) for a in outputs],
            "state": "scheduled", "time_created_ns": now, "time_started_ns": None,
            "time_completed_ns": None, "timeout_s": timeout, "frames": frames,
            "error": None,
        }
        if extra:
            rec.update(extra)
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

    def snapshot(self, reason: str) -> dict:
        """The whole dump as a JSON-able dict."""
        with self._lock:
            records = [dict(r) for r in self._records]
            groups = {k: dict(v) for k, v in self.groups.items()}
        for rec in records:  # resolve source lines only now: recording stays cheap
            rec["frames"] = [
                {"file": f, "line": ln, "function": fn,
                 "source": linecache.getline(f, ln).strip()} for f, ln, fn in rec["frames"]]
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
