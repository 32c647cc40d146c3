"""RMA windows on NCCL: kiln's window API (kiln.distributed.window) over NCCL's
registered windows and `ncclPutSignal` / `ncclWaitSignal`.

What NCCL 2.32 has is put-with-signal: `ncclPutSignal` writes into a peer's registered
window and then bumps a per-origin signal counter there, which the peer's stream can
wait for (`ncclWaitSignal`). There is no get and no remote accumulate, and a signal
carries no value. kiln maps its API onto that:

- `pg.window(buf)` registers `buf` (ncclCommWindowRegister, symmetric, collective) and a
  small *signal pad* of kiln's own (ncclMemAlloc'd, registered the same way): one
  24-byte record per origin rank, [cumulative signal value, PutSignal ops issued,
  a check word that catches a record read half-written].
- `win.put(dst, data, offset)` is one `ncclPutSignal`; its Work completes when the put's
  event on the stream completed.
- `win.signal(dst, slot=0, value)` waits until this rank's earlier puts to `dst` on the
  window completed, then writes this rank's record into `dst`'s pad (one more
  `ncclPutSignal`). The target's RMA thread polls its pad; for a new record it enqueues
  `ncclWaitSignal` for NCCL's signal count of every PutSignal the origin had issued
  (the record's, and the puts before it), and once that wait completed credits the
  value to the window's signal counter (what `wait_signal` waits on). So a waiter sees
  every put made before the signal, on NCCL's own guarantee.
  NCCL has one signal index here: only slot 0 exists on nccl.
- `get` and `accumulate` raise `NcclWindowUnsupported` (K253): NCCL has no call for them.

One thread per backend issues the operations in order, completes their Works and
watches the pads; every NCCL call on the communicator goes through its lock.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from kiln.distributed.errors import (
    CollectiveTimeout, DistributedError, NcclWindowUnsupported,
)

_RECORD = 24  # bytes per origin in a signal pad: value, ops issued, value ^ ops ^ _CHECK
_CHECK = 0x6B696C6E5F736967  # a record read while being written fails its check: reread
_POLL_MIN, _POLL_MAX = 1e-4, 2e-3


class _Win:
    """One registered window: the user's buffer and this rank's signal pad."""

    def __init__(self, memory, win: int, pad: int, pad_win: int, world: int):
        self.memory, self.win, self.pad, self.pad_win = memory, win, pad, pad_win
        self.seen = np.zeros(world, np.int64)  # value credited from each origin
        self.claimed = np.zeros(world, np.int64)  # value seen in the pad (credit pending)
        self.sent = np.zeros(world, np.int64)  # value this rank signalled to each peer
        self.puts: dict[int, list] = collections.defaultdict(list)  # dst -> pending puts
        self.error: BaseException | None = None


class NcclRma:
    """The RMA side of one NcclBackend (see the module docstring)."""

    def __init__(self, backend):
        self.backend, self.comm = backend, backend.comm
        self.api, self.rank, self.world = backend.comm.api, backend.rank, backend.world_size
        self.wins: dict[int, _Win] = {}
        self.issued = np.zeros(self.world, np.int64)  # PutSignal ops issued to each peer
        self.drained = np.zeros(self.world, np.int64)  # signals consumed from each peer
        self._queue: collections.deque = collections.deque()
        self._pending: list = []  # (NcclWork, done or None, kept buffers)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._last_wait = None  # the newest ncclWaitSignal's work

    # -- the backend's window methods ---------------------------------------------------
    def register(self, memory) -> None:
        buf = memory.buf
        nbytes = max(buf.nbytes, 1)
        pad = self.api.mem_alloc(self.world * _RECORD)
        if not pad:
            raise DistributedError("ncclMemAlloc of a %d-byte signal pad failed on rank %d"
                                   % (self.world * _RECORD, self.rank))
        try:
            win = self.comm.register_window(buf.ctypes.data, nbytes)
            pad_win = self.comm.register_window(pad, self.world * _RECORD)
        except BaseException:
            self.api.mem_free(pad)
            raise
        with self._lock:
            self.wins[memory.id] = _Win(memory, win, pad, pad_win, self.world)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kiln-nccl-rma",
                                                daemon=True)
                self._thread.start()

    def unregister(self, window_id: int, error: BaseException) -> None:
        with self._lock:
            w = self.wins.pop(window_id, None)
            if w is None:
                return
            w.error = error
            mine = [item for item in self._queue if item[0] is w]
            for item in mine:
                self._queue.remove(item)
        for item in mine:
            item[-1](error)
        self.comm.deregister_window(w.win)
        self.comm.deregister_window(w.pad_win)
        self.api.mem_free(w.pad)

    def put(self, window_id: int, dst: int, offset: int, data: np.ndarray, done) -> None:
        self._submit(window_id, "put", dst, offset, data, done)

    def signal(self, window_id: int, dst: int, slot: int, value: int, done) -> None:
        if slot != 0:
            done(NcclWindowUnsupported(
                "window.signal: slot %d on backend nccl; NCCL windows have one signal "
                "counter, slot 0" % slot))
            return
        self._submit(window_id, "signal", dst, value, None, done)

    def unsupported(self, op: str, done) -> None:
        done(NcclWindowUnsupported(
            "window.%s on backend nccl: NCCL 2.32 has ncclPutSignal and ncclSignal but no "
            "one-sided get or accumulate" % op,
            hint="put the data from the rank that has it (win.put + win.signal), or use the "
            "tcp backend's windows"))

    def fail(self, error: BaseException) -> None:
        """The backend failed or closed: every pending operation fails with `error`."""
        with self._lock:
            if self._error is None:
                self._error = error
            queued, self._queue = list(self._queue), collections.deque()
            pending, self._pending = self._pending, []
            wins = list(self.wins.values())
        for item in queued:
            item[-1](error)
        for _, done, _ in pending:
            if done is not None:
                done(error)
        for w in wins:
            w.memory.fail(error)

    # -- the RMA thread ---------------------------------------------------------------------
    def _submit(self, window_id: int, kind: str, dst: int, arg, data, done) -> None:
        with self._lock:
            error = self._error
            w = self.wins.get(window_id)
            if error is None and w is None:
                error = DistributedError("window %d is not registered on rank %d"
                                         % (window_id, self.rank))
            if error is None:
                self._queue.append((w, kind, dst, arg, data, time.monotonic()
                                    + self.comm.timeout, done))
        if error is not None:
            done(error)

    def _loop(self) -> None:
        step = _POLL_MIN
        while True:
            with self._lock:
                if self._error is not None:
                    return
            try:
                busy = self._issue() | self._complete() | self._watch()
            except DistributedError as err:
                self.fail(err)
                return
            step = _POLL_MIN if busy else min(step * 2, _POLL_MAX)
            time.sleep(step)

    def _issue(self) -> bool:
        """Start queued operations in order; a signal waits for its window's earlier
        puts to its target (it stays first in the queue until they completed)."""
        busy = False
        while True:
            with self._lock:
                if not self._queue:
                    return busy
                w, kind, dst, arg, data, deadline, done = self._queue[0]
            if kind == "signal":
                w.puts[dst] = [p for p in w.puts[dst] if not p.is_completed()]
                if w.puts[dst]:
                    if time.monotonic() > deadline:
                        raise CollectiveTimeout("window.signal on rank %d: the puts before "
                                                "it did not complete" % self.rank)
                    return busy
                w.sent[dst] += arg
                self.issued[dst] += 1
                v, n = int(w.sent[dst]), int(self.issued[dst])
                record = np.array([v, n, v ^ n ^ _CHECK], np.uint64).view(np.int64)
                work = self.comm.put_signal(record.ctypes.data, _RECORD, dst, w.pad_win,
                                            self.rank * _RECORD, self.backend.stream)
                keep = record
            else:
                item = w.memory.itemsize
                self.issued[dst] += 1
                work = self.comm.put_signal(data.ctypes.data, data.nbytes, dst, w.win,
                                            arg * item, self.backend.stream)
                w.puts[dst].append(work)
                keep = data
            with self._lock:
                self._queue.popleft()
                self._pending.append((work, done, keep))
            busy = True

    def _complete(self) -> bool:
        with self._lock:
            pending = list(self._pending)
        finished = [(work, done) for work, done, _ in pending if work.is_completed()]
        if not finished:
            return False
        ended = {id(work) for work, _ in finished}
        with self._lock:
            self._pending = [p for p in self._pending if id(p[0]) not in ended]
        for _, done in finished:
            if done is not None:
                done(None)
        return True

    def _watch(self) -> bool:
        """Read the pads; credit new signal values once NCCL's signals of the puts
        before them arrived (one ncclWaitSignal for everything issued so far)."""
        with self._lock:
            wins = list(self.wins.values())
        ops = self.drained.copy()
        credits = []
        for w in wins:
            pad = np.frombuffer(self.api.copy_to_host(w.pad, self.world * _RECORD),
                                np.uint64).reshape(self.world, 3)
            for origin in range(self.world):
                value, issued, check = (int(x) for x in pad[origin])
                if value ^ issued ^ _CHECK != check:
                    continue  # never written, or caught mid-write: next poll
                ops[origin] = max(ops[origin], issued)
                if value > w.claimed[origin]:
                    w.claimed[origin] = value
                    credits.append((w, origin, value))
        if not credits and (ops <= self.drained).all():
            return False
        counts = {p: int(ops[p] - self.drained[p]) for p in range(self.world)
                  if ops[p] > self.drained[p]}
        if counts:
            self._last_wait = self.comm.wait_signal(counts, self.backend.stream)
            self.drained[:] = ops
        wait = self._last_wait

        def credit(_error=None, credits=credits):
            for w, origin, value in credits:
                if value > w.seen[origin]:
                    w.memory.add_signal(0, value - int(w.seen[origin]))
                    w.seen[origin] = value

        if wait is None or wait.is_completed():
            credit()
        else:
            with self._lock:
                self._pending.append((wait, credit, None))
        return True
