"""`Work`: the handle of one nonblocking collective or point-to-point call.

    >>> work = pg.all_reduce(buf)        # returns at once
    >>> work.is_completed()              # poll ...
    >>> work.wait(timeout=5.0)           # ... or block; raises the failure, if any
    True

A Work ends exactly once: completed, or failed with a `DistributedError`
(`PeerFailure`, `CollectiveTimeout`, `CollectiveMismatch`, `GroupAborted`).
"""

from __future__ import annotations

import threading
import time

from kiln.distributed.errors import CollectiveTimeout


class Work:
    """The future of one call; created by `ProcessGroup`, finished by its progress thread."""

    __slots__ = ("op", "seq", "group", "_event", "_error", "_callbacks", "_lock", "deadline",
                 "record", "result", "helper")

    def __init__(self, op: str, seq: int, group: str):
        self.op, self.seq, self.group = op, seq, group
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()
        self.deadline: float | None = None  # monotonic; set when the call starts
        self.record: dict | None = None
        self.result = None  # e.g. the list of outputs of all_gather into a list
        # the group's `_help(work)`: an unbounded wait runs the queued call itself
        self.helper = None

    def is_completed(self) -> bool:
        """True once the call finished, successfully or not."""
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The failure, or None (also None while still running)."""
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; True on success, else raise the failure.

        `timeout` bounds only this wait: past it, CollectiveTimeout is raised and the
        call keeps running under its own deadline (set by the group's `timeout`).
        Without a timeout, a call still queued is run on this thread (bounded by its
        own deadline), which is faster than handing it to the progress thread.
        """
        if timeout is None and self.helper is not None and not self._event.is_set():
            self.helper(self)
        if not self._event.wait(timeout):
            raise CollectiveTimeout(
                "%s (seq %d, group '%s') not finished after waiting %.3g s; it is still "
                "running under its own deadline" % (self.op, self.seq, self.group, timeout),
                hint="wait longer, or pass a larger `timeout=` to the collective")
        if self._error is not None:
            raise self._error
        return True

    def add_done_callback(self, fn) -> None:
        """Call fn(work) when done (at once if already done), from the finishing thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: BaseException | None = None) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True

    def __repr__(self) -> str:
        state = "running" if not self.is_completed() else (
            "completed" if self._error is None else "failed: %s" % type(self._error).__name__)
        return "<Work %s seq=%d group=%s %s>" % (self.op, self.seq, self.group, state)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a monotonic deadline (None: unbounded), never negative."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.0)
