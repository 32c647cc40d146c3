"""`Work`: the handle of one nonblocking collective or point-to-point call.

    >>> work = pg.all_reduce(buf)        # returns at once
    >>> work.is_completed()              # poll ...
    >>> work.wait(timeout=5.0)           # ... or block; raises the failure, if any
    True

A Work ends exactly once: completed, or failed with a `DistributedError`
(`PeerFailure`, `CollectiveTimeout`, `CollectiveMismatch`, `GroupAborted`).

A failed group fails every later call with the same stored error. `wait()` never
raises that stored object itself: each raise is a fresh copy (same class, same fields,
the original as its `__cause__` when it has a traceback of its own), so a retry loop
over 10,000 failed calls does not grow one traceback by two frames per raise; and
the copy says what to do next (`should_commit()` on a fault-tolerant group).

A collective's Work knows its group (`_owner`): waiting on it, or polling it, lets the
group make progress on that thread (`ProcessGroup._help`) instead of handing the work
to the progress thread and being woken back. Nothing blocks unless the caller asked
to: `is_completed()` and `exception()` only take what already arrived.
"""

from __future__ import annotations

import threading
import time

from kiln.distributed.protocol import check_timeout
from kiln.distributed.errors import (
    CollectiveArgumentError, CollectiveTimeout, DistributedError, WindowInvalidated,
)

# guards every Work's end and its lazily made Event: one process-wide lock held for a
# few bytecodes is cheaper than a Lock and an Event per call, and a call that a
# waiter runs itself never needs the Event at all
_LOCK = threading.Lock()


class Work:
    """The future of one call; created by `ProcessGroup`, finished by whichever thread
    runs the call to its end."""

    __slots__ = ("op", "seq", "group", "_done", "_error", "_callbacks", "_event", "deadline",
                 "record", "result", "_owner", "_call")

    def __init__(self, op: str, seq: int, group: str, owner=None):
        self.op, self.seq, self.group = op, seq, group
        self._done = False
        self._error: BaseException | None = None
        self._callbacks: list | None = None
        self._event: threading.Event | None = None  # made when a thread must block
        self.deadline: float | None = None  # monotonic; set when the call starts
        self.record: dict | None = None
        self.result = None  # e.g. the list of outputs of all_gather into a list
        self._owner = owner  # the ProcessGroup of a collective (None: p2p)
        self._call = None  # the group's private description of the call while queued

    def is_completed(self) -> bool:
        """True once the call finished, successfully or not (takes what already
        arrived for it, without blocking)."""
        if not self._done and self._owner is not None:
            self._owner._help(self, time.monotonic())
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The failure, or None (also None while still running)."""
        if not self._done and self._owner is not None:
            self._owner._help(self, time.monotonic())
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; True on success, else raise the failure.

        `timeout` bounds only this wait: past it, CollectiveTimeout is raised and the
        call keeps running under its own deadline (set by the group's `timeout`).
        The waiting thread runs the call itself when it can (bounded by `timeout`),
        which is faster than handing it to the progress thread.
        """
        if not self._done:
            end = None if timeout is None else time.monotonic() + check_timeout(timeout, "wait(timeout=)")
            if self._owner is not None:
                self._owner._help(self, end)
            if not self._done:
                event = self._event_to_wait()
                if event is not None and not event.wait(
                        None if end is None else max(end - time.monotonic(), 0.0)):
                    raise CollectiveTimeout(
                        "%s (seq %d, group '%s') not finished after waiting %.3g s; it is "
                        "still running under its own deadline" % (self.op, self.seq,
                                                                   self.group, timeout),
                        hint="wait longer, or pass a larger `timeout=` to the collective")
        if self._error is not None:
            raise self._fresh_error()
        return True

    def _fresh_error(self) -> BaseException:
        """A new exception object for this raise (see the module docstring)."""
        error = self._error
        cls = type(error)
        try:
            fresh = cls.__new__(cls, *error.args)
            fresh.args = error.args  # OSError subclasses fill args in __init__, not __new__
            fresh.__dict__.update(error.__dict__)
        except Exception:  # an exotic exception type: at least drop the old frames
            return error.with_traceback(None)
        if error.__traceback__ is not None:  # where it happened, kept once, never grown
            fresh.__cause__ = error
        advice = self._advice(error)
        if advice and fresh.args and isinstance(fresh.args[0], str):
            fresh.args = (fresh.args[0] + "\n  next: " + advice,) + fresh.args[1:]
        return fresh

    def _advice(self, error: BaseException) -> str | None:
        """What a caller must do after a group failure, instead of retrying the call."""
        if not isinstance(error, DistributedError) or isinstance(
                error, (WindowInvalidated, CollectiveArgumentError)):
            return None
        tolerant = None if self._owner is None else self._owner._sync_ft is not None
        if tolerant is False:
            return ("group '%s' runs no more calls after a failure and is not fault-"
                    "tolerant: end the job (or use init_process_group(..., fault_tolerant="
                    "True), which survives failures)" % self.group)
        text = ("every call of group '%s' fails with this error until the group is "
                "reconfigured: end the step with pg.should_commit() (it returns False, the "
                "step is dropped and the survivors go on at the next epoch) or call "
                "pg.shrink(); retrying the call itself fails again" % self.group)
        return text if tolerant else text + " (on a fault-tolerant group; others must end)"

    def add_done_callback(self, fn) -> None:
        """Call fn(work) when done (at once if already done), from the finishing thread."""
        with _LOCK:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                fn = None
        if fn is not None:
            fn(self)
        elif self._owner is not None:
            self._owner._adopt_parked()  # nobody may wait: the progress thread finishes it

    def _event_to_wait(self) -> threading.Event | None:
        with _LOCK:
            if self._done:
                return None
            if self._event is None:
                self._event = threading.Event()
            return self._event

    def _finish(self, error: BaseException | None = None) -> bool:
        with _LOCK:
            if self._done:
                return False
            self._error = error
            self._done = True
            event, callbacks = self._event, self._callbacks
            self._callbacks = None
        if event is not None:
            event.set()
        for fn in callbacks or ():
            fn(self)
        return True

    def __repr__(self) -> str:
        state = "running" if not self._done else (
            "completed" if self._error is None else "failed: %s" % type(self._error).__name__)
        return "<Work %s seq=%d group=%s %s>" % (self.op, self.seq, self.group, state)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a monotonic deadline (None: unbounded), never negative."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.0)
