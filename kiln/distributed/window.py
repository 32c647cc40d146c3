"""RMA windows: one-sided `put`, `get`, `accumulate` and `signal` into a peer's buffer.

Every rank of a group registers a buffer with `pg.window(buffer)` (a collective: all
ranks call it, in the same order); afterwards any rank reaches any peer's buffer
without the peer calling anything: the peer's backend serves the operation on its own
thread (TCP: the receiver thread of the link it came on, see `tcp_rma`).

    >>> win = pg.window(np.zeros(1024, np.float32))
    >>> win.put(1, tokens, offset=256)           # nonblocking, returns a Work
    >>> win.signal(1)                            # applied at rank 1 after the put
    >>> win.wait_signal(slot=0, value=pg.world_size - 1)   # on the receiving rank

Semantics:

- Each operation returns a `Work` that completes once the target applied it (a get:
  once the data is in `out`, also `work.result`). Data given to put/accumulate must
  not change until then; it is sent from its own memory, not copied.
- Order: one rank's operations on one window at one target are applied in the order
  it issued them; a signal is applied after every earlier put/accumulate, so the
  waiter sees the data once it sees the signal. Nothing orders operations of
  different origins (synchronize with signals).
- Each operation is applied at the target as one step, with the window's lock held:
  an accumulate (sum, prod, min, max) is atomic with respect to every other RMA
  operation on the window. The owner's own reads and writes of `win.local` are not
  synchronized with them; use signals.
- Argument errors (rank, bounds of the *target's* window, dtype) raise
  `CollectiveArgumentError` before anything is sent. A dead peer fails the operation
  with the group's error (`PeerFailure`, ...), a missed deadline with
  `CollectiveTimeout`, and both abort the group, as for send/recv. `wait_signal`'s
  timeout only raises: nothing was consumed, the group goes on.
- A window is bound to the backend (group epoch) it was created on. When the group
  is reconfigured, it calls `invalidate(reason)` on each window: pending and later
  operations fail with `WindowInvalidated`; create the window again. `free()` (or
  leaving a `with` block) does the same locally; free a window only once no peer will
  reach it any more (e.g. after a barrier): a peer's operation on a freed window fails.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref

import numpy as np

from kiln.distributed import collective_args as args
from kiln.distributed.buffers import DTYPE_CODES, Reducer, check_reduce_op, dtype_of
from kiln.distributed.errors import (
    CollectiveArgumentError, CollectiveTimeout, DistributedError, GroupAborted,
    WindowInvalidated,
)
from kiln.distributed.flight_recorder import FlightRecorder, call_site_frames, recorder
from kiln.distributed.work import Work
from kiln.ir import dtypes as kd

_RECORDER = recorder()
_started, _completed = FlightRecorder.started, FlightRecorder.completed
_DTYPE_NAMES = {DTYPE_CODES[d.short]: d.name for d in kd.ALL_DTYPES}
_ACCUMULATE_OPS = ("sum", "prod", "min", "max")  # avg would need the count at the target
# window ids: a counter per backend (one group at one epoch), so every rank gives the
# same id to the same window as long as all create their windows in the same order
_IDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_IDS_LOCK = threading.Lock()


class WindowMemory:
    """The buffer one rank exposes in a window and how operations apply to it: by the
    backend for peers, directly for this rank's own operations. Every operation holds
    `lock` while it touches the buffer; signal counters have their own condition."""

    def __init__(self, window_id: int, flat: np.ndarray):
        self.id = window_id
        self.buf = flat
        self.size, self.dtype, self.itemsize = flat.size, flat.dtype, flat.itemsize
        dt = dtype_of(flat)
        self.dtype_code, self.dtype_name = DTYPE_CODES[dt.short], dt.name
        self._raw = memoryview(flat.view(np.uint8))
        self.lock = threading.Lock()
        self._reducers: dict[str, Reducer] = {}  # used under `lock` (they keep scratch)
        self.cond = threading.Condition()
        self.signals: collections.Counter = collections.Counter()
        self.error: BaseException | None = None  # the transport's failure

    def byte_region(self, offset: int, count: int) -> memoryview:
        """The bytes of elements [offset, offset + count) (hold `lock` to write them)."""
        return self._raw[offset * self.itemsize:(offset + count) * self.itemsize]

    def write(self, offset: int, data: np.ndarray) -> None:
        with self.lock:
            self.buf[offset:offset + data.size] = data

    def read(self, offset: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        with self.lock:
            if out is None:
                return self.buf[offset:offset + count].copy()
            out[...] = self.buf[offset:offset + count]
            return out

    def accumulate(self, offset: int, data: np.ndarray, reduce_op: str) -> None:
        with self.lock:
            reducer = self._reducers.get(reduce_op)
            if reducer is None:
                reducer = self._reducers[reduce_op] = Reducer(reduce_op, dtype_of(self.buf))
            region = self.buf[offset:offset + data.size]
            reducer.combine(region, region, data)

    def add_signal(self, slot: int, value: int) -> None:
        with self.cond:
            self.signals[slot] += value
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The transport failed: wake every `wait_signal` (it raises `error`)."""
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()


def create_window(pg, buffer, timeout: float) -> "Window":
    """Register `buffer` on every rank of `pg` (collective; `ProcessGroup.window`).

    Each rank's size may differ; the dtype must be the same on every rank.
    """
    arr = args.buffer("window", "buffer", buffer, writeable=True)
    flat = arr.reshape(-1)
    backend = pg.backend
    with _IDS_LOCK:
        window_id = _IDS.get(backend, 0)
        _IDS[backend] = window_id + 1
    memory = WindowMemory(window_id, flat)
    # registered before the exchange: a peer may reach it as soon as its exchange ends
    backend.window_register(memory)
    table = np.empty((pg.world_size, 3), np.int64)
    try:
        pg.all_gather(table, np.array([window_id, flat.size, memory.dtype_code], np.int64),
                      timeout=timeout).wait()
        _check_table(pg, table, window_id)
    except BaseException as err:
        backend.window_unregister(window_id, err)
        raise
    return Window(pg, backend, memory, arr, [int(s) for s in table[:, 1]], timeout)


def _check_table(pg, table: np.ndarray, window_id: int) -> None:
    ids = table[:, 0].tolist()
    if len(set(ids)) != 1:
        raise CollectiveArgumentError(
            "window: ranks of group '%s' are creating different windows (window ids by rank: "
            "%s)" % (pg.name, ids),
            hint="every rank must create the group's windows in the same order")
    codes = table[:, 2].tolist()
    if len(set(codes)) != 1:
        by_dtype: dict[str, list[int]] = {}
        for rank, code in enumerate(codes):
            by_dtype.setdefault(_DTYPE_NAMES.get(code, "code %d" % code), []).append(rank)
        text = "; ".join("rank%s %s: %s" % ("s" if len(r) > 1 else "",
                                            ", ".join(map(str, r)), name)
                         for name, r in by_dtype.items())
        raise CollectiveArgumentError(
            "window: the ranks of group '%s' registered buffers of different dtypes (%s)"
            % (pg.name, text), hint="every rank registers a buffer of one dtype; sizes may differ")


class Window:
    """One RMA window of a group: every rank's registered buffer (create with
    `pg.window(buffer)`; see the module docstring for the semantics).

    `local` is this rank's buffer, `sizes[r]` the element count of rank r's, `dtype`
    their common dtype, `id` the window's number in its group and epoch.
    """

    def __init__(self, pg, backend, memory: WindowMemory, local: np.ndarray,
                 sizes: list[int], timeout: float):
        self._pg, self._backend, self._memory = pg, backend, memory
        self._local = local
        self.id = memory.id
        self.group, self.rank, self.world_size = pg.name, pg.rank, pg.world_size
        self.epoch = pg.epoch
        self.sizes = tuple(sizes)
        self.dtype = memory.dtype
        self.timeout = float(timeout)
        self._seq = itertools.count()
        self._dead: tuple[str, str] | None = None  # ("invalidated" | "freed", reason)

    def __repr__(self) -> str:
        state = "" if self._dead is None else " " + self._dead[0]
        return "<Window %d of group %s rank %d/%d %s sizes=%s%s>" % (
            self.id, self.group, self.rank, self.world_size, self._memory.dtype_name,
            list(self.sizes), state)

    @property
    def local(self) -> np.ndarray:
        """This rank's registered buffer (the array given to `pg.window`)."""
        return self._local

    # -- operations ------------------------------------------------------------------
    def put(self, dst: int, data, offset: int = 0, *, timeout: float | None = None) -> Work:
        """Write `data` (flattened) into rank `dst`'s window at element `offset`.

            >>> win.put(1, np.ones(8, np.float32), offset=16).wait()
        """
        op = "window.put"
        self._usable(op)
        flat = self._data(op, data)
        dst = args.rank(op, "dst", dst, self.world_size)
        offset = self._bounds(op, dst, offset, flat.size)
        return self._issue(op, dst, [flat], [], offset, flat.size, timeout,
                           lambda: self._memory.write(offset, flat),
                           lambda done: self._backend.window_put(self.id, dst, offset, flat,
                                                                 done))

    def get(self, src: int, offset: int, count: int, out=None, *,
            timeout: float | None = None) -> Work:
        """Read `count` elements at `offset` of rank `src`'s window into `out` (a new
        1-D array when None); the array is `work.result`.

            >>> w = win.get(0, offset=0, count=4); w.wait(); w.result
        """
        op = "window.get"
        self._usable(op)
        src = args.rank(op, "src", src, self.world_size)
        count = _index(op, "count", count)
        if out is None:
            result = np.empty(count, self.dtype)
        else:
            result = args.buffer(op, "out", out, writeable=True)
            self._same_dtype(op, "out", result)
            if result.size != count:
                raise CollectiveArgumentError("%s: out has %d elements, count is %d"
                                              % (op, result.size, count))
        flat = result.reshape(-1)
        offset = self._bounds(op, src, offset, count)
        work = self._issue(op, src, [], [flat], offset, count, timeout,
                           lambda: self._memory.read(offset, count, flat),
                           lambda done: self._backend.window_get(self.id, src, offset, flat,
                                                                 done))
        work.result = result
        return work

    def accumulate(self, dst: int, data, offset: int = 0, op: str = "sum", *,
                   timeout: float | None = None) -> Work:
        """Combine `data` into rank `dst`'s window at `offset`: window = window (op)
        data, elementwise; op is sum, prod, min or max. Atomic per operation at the
        target with respect to every other RMA operation on the window.

            >>> win.accumulate(0, counts, op="sum").wait()
        """
        name = "window.accumulate"
        self._usable(name)
        flat = self._data(name, data)
        if str(getattr(op, "value", op)).lower() not in _ACCUMULATE_OPS:
            raise CollectiveArgumentError("%s: op=%r is not an accumulate op; use one of %s"
                                          % (name, op, ", ".join(_ACCUMULATE_OPS)))
        reduce_op = check_reduce_op(name, op, dtype_of(flat))  # e.g. no min on complex
        dst = args.rank(name, "dst", dst, self.world_size)
        offset = self._bounds(name, dst, offset, flat.size)
        return self._issue(name, dst, [flat], [], offset, flat.size, timeout,
                           lambda: self._memory.accumulate(offset, flat, reduce_op),
                           lambda done: self._backend.window_accumulate(
                               self.id, dst, offset, flat, reduce_op, done),
                           reduce_op=reduce_op)

    def signal(self, dst: int, slot: int = 0, value: int = 1, *,
               timeout: float | None = None) -> Work:
        """Add `value` to signal counter `slot` of rank `dst`'s window, after every
        earlier put and accumulate of this rank to `dst` on this window.

            >>> win.put(1, x); win.signal(1, slot=0)     # rank 1 sees x once it sees this
        """
        op = "window.signal"
        self._usable(op)
        dst = args.rank(op, "dst", dst, self.world_size)
        slot, value = _slot(op, slot), _value(op, value)
        memory = self._memory
        return self._issue(op, dst, [], [], None, 0, timeout,
                           lambda: memory.add_signal(slot, value),
                           lambda done: self._backend.window_signal(self.id, dst, slot, value,
                                                                    done),
                           slot=slot, value=value)

    def wait_signal(self, slot: int = 0, value: int = 1, *,
                    timeout: float | None = None) -> None:
        """Block until this rank's counter `slot` is at least `value`, then subtract
        `value` (consume the signals). Raises `CollectiveTimeout` after `timeout`
        (default: the window's) without consuming anything, or the group's failure.

            >>> win.wait_signal(slot=0, value=pg.world_size - 1)
        """
        op = "window.wait_signal"
        self._usable(op)
        slot, value = _slot(op, slot), _value(op, value)
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        memory = self._memory
        with memory.cond:
            while True:
                if self._dead is not None:
                    raise self._dead_error(op)
                if memory.error is not None:
                    raise memory.error
                if memory.signals[slot] >= value:
                    memory.signals[slot] -= value
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(
                        "%s: signal slot %d of window %d (group '%s', rank %d) is at %d, "
                        "waited %.3g s for %d" % (op, slot, self.id, self.group, self.rank,
                                                  memory.signals[slot], timeout, value),
                        hint="a peer has not signalled yet: check that every sender calls "
                        "win.signal(...) for this slot, or pass a larger timeout=")
                memory.cond.wait(left)

    # -- lifetime --------------------------------------------------------------------
    def invalidate(self, reason: str) -> None:
        """Make the window unusable (the group calls it when it is reconfigured):
        pending and later operations fail with `WindowInvalidated`."""
        self._end("invalidated", reason)

    def free(self) -> None:
        """Stop exposing this rank's buffer; pending and later operations here fail
        with `WindowInvalidated`, and so do peers' later operations on it."""
        self._end("freed", "freed on rank %d" % self.rank)
        windows = getattr(self._pg, "_windows", None)
        if windows is not None and self in windows:
            windows.remove(self)

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def _end(self, kind: str, reason: str) -> None:
        with self._memory.cond:
            if self._dead is not None:
                return
            self._dead = (kind, reason)
            self._memory.cond.notify_all()  # wake wait_signal
        self._backend.window_unregister(self.id, self._dead_error(None))

    # -- helpers ---------------------------------------------------------------------
    def _dead_error(self, op: str | None) -> WindowInvalidated:
        """The error of a call `op` on the dead window (None: of a pending operation)."""
        kind, reason = self._dead
        text = "window %d of group '%s' (created at epoch %d) was %s" % (
            self.id, self.group, self.epoch, kind)
        if op is not None:
            text = "%s: %s" % (op, text)
        else:
            text += " while an operation on it was pending"
        if kind == "freed":
            return WindowInvalidated(text + " on rank %d; create a new one with "
                                     "pg.window(buffer)" % self.rank)
        epoch = self._pg.epoch  # the group sets its new epoch before it invalidates
        if epoch != self.epoch:
            text += ": the group was reconfigured to epoch %d" % epoch
        else:
            text += " (%s)" % reason
        return WindowInvalidated(text + "; re-create it with pg.window(buffer) on every rank")

    def _usable(self, op: str) -> None:
        if self._dead is not None:
            raise self._dead_error(op)

    def _same_dtype(self, op: str, name: str, arr: np.ndarray) -> None:
        if arr.dtype != self.dtype:
            raise CollectiveArgumentError(
                "%s: %s is %s but window %d holds %s; convert it with .astype(win.dtype)"
                % (op, name, dtype_of(arr).name, self.id, self._memory.dtype_name))

    def _data(self, op: str, data) -> np.ndarray:
        arr = args.buffer(op, "data", data, writeable=False)
        self._same_dtype(op, "data", arr)
        return arr.reshape(-1)

    def _bounds(self, op: str, peer: int, offset, count: int) -> int:
        offset = _index(op, "offset", offset)
        if offset + count > self.sizes[peer]:
            raise CollectiveArgumentError(
                "%s: offset %d + %d elements exceeds rank %d's window of %d %s"
                % (op, offset, count, peer, self.sizes[peer], self._memory.dtype_name))
        return offset

    def _issue(self, op: str, peer: int, inputs: list, outputs: list, offset: int | None,
               count: int, timeout: float | None, local, remote, **extra) -> Work:
        """Record the operation and start it: here when `peer` is this rank, else on
        the backend, whose callback ends the Work (kept like a p2p call by the group:
        its deadline, and failing it when the group fails)."""
        pg = self._pg
        timeout = self.timeout if timeout is None else float(timeout)
        seq = next(self._seq)
        work = Work(op, seq, self.group)  # no owner: the backend's callback ends it
        info = {"p2p": True, "rma": True, "window": self.id, "peer": peer}
        if offset is not None:
            info["offset"] = offset
        info.update(extra)
        rec = _RECORDER.record(group=self.group, epoch=self.epoch, seq=seq, op=op,
                               inputs=inputs, outputs=outputs, timeout=timeout,
                               frames=call_site_frames(depth=3), numel=count, extra=info)
        work.record, work.deadline = rec, time.monotonic() + timeout

        def done(error: BaseException | None) -> None:
            with pg._lock:
                pg._p2p.discard(work)
            if work._finish(error):
                _completed(rec, error)

        with pg._lock:
            error = pg._error
            if error is None and pg._closed:
                error = GroupAborted("group '%s' was destroyed" % self.group)
            if error is None and peer != self.rank:
                pg._p2p.add(work)  # the progress thread keeps its deadline
                pg._cond.notify()
        _started(rec)
        if error is not None:
            done(error)
        elif peer == self.rank:
            try:
                local()
            except Exception as err:  # a bug must fail the Work, not the caller's thread
                error = DistributedError("%s failed inside kiln: %r" % (op, err))
            done(error)
        else:
            remote(done)
        return work


def _index(op: str, name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise CollectiveArgumentError("%s: %s=%r must be a non-negative int" % (op, name, value))
    return int(value)


def _slot(op: str, slot) -> int:
    if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or \
            not 0 <= int(slot) < 2 ** 32:
        raise CollectiveArgumentError("%s: slot=%r must be an int in [0, 2**32)" % (op, slot))
    return int(slot)


def _value(op: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or \
            not 1 <= int(value) < 2 ** 62:
        raise CollectiveArgumentError("%s: value=%r must be a positive int" % (op, value))
    return int(value)
