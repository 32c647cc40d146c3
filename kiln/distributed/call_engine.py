"""How a `ProcessGroup`'s calls run: one execution slot, the fast path, parking, the
progress thread, deadlines and the first failure (the mixin `CallEngine`).

Who runs a call. The group has one execution *slot*: `_running` is the call started
and not yet finished, `_busy` says a thread is advancing it right now. A thread takes
the slot under `_lock`, works outside the lock, and either ends the call or *parks*
it (keeps its second phase in `_cont`, releases `_busy`) when it would block and must
not. Calls are taken in seq order and a call starts only once the previous one ended,
so the per-group order, and the backend's one-call-at-a-time contract, hold whichever
thread takes the slot:

- The fast path: a call the backend can run `eager`ly (a single-round small
  collective: all_reduce/broadcast/reduce/barrier between two ranks, small
  all_gather, gather, scatter, reduce_scatter), made while the slot is free and
  nothing is queued, starts on the caller's thread: its messages go out and it is
  parked, without waking any thread. The seq is assigned and the slot taken under
  one lock hold, so it starts in call order. It stays nonblocking: the first phase
  only sends (a send could wait only for socket space, when the peer is many calls
  behind, and then under the call's deadline, while no peer waits on this rank), and
  afterwards no peer waits on this rank for this call: what is left (reading the
  peers' messages, reducing) concerns this rank only. Its Flight Recorder record is
  made right after the sends (before them if they would wait), so the bookkeeping
  overlaps the message's flight.
- `wait()` runs the calls up to its own on the waiting thread (a parked call's second
  phase reads the peer's message straight from the socket), which saves the thread
  hand-offs that dominated small-message latency; `wait(timeout)`, `is_completed()`
  and `exception()` do the same without blocking past their bound, leaving calls
  that can only run unbounded to the progress thread.
- The progress thread runs queued calls (anything made while another call held the
  slot, or that does not start eagerly), so calls progress with nobody waiting, and
  adopts a call parked for more than `_TICK` (nobody waited for it): its deadline is
  then kept and its failure reported, as for any call. It ticks while calls are
  being made and sleeps for good once the group is quiet (a call that parks wakes it
  only then). `add_done_callback` on a parked call has it adopted at once.

Every phase of every call, whichever thread runs it, ends in `_advance`/`_end`, and
a failure found by any thread goes through `_fail`: the group is aborted, queued
calls fail at their turn, and a parked call nobody runs is failed there and then.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import numpy as np

from kiln.distributed.backend import OP_CODES, CallContext
from kiln.distributed.buffers import DTYPE_CODES, REDUCE_CODES, dtype_of
from kiln.distributed import dump_requests
from kiln.distributed.dump_requests import post_request_async
from kiln.distributed.errors import CollectiveTimeout, DistributedError, GroupAborted
from kiln.distributed.flight_recorder import FlightRecorder, call_site_frames, recorder
from kiln.distributed.protocol import check_timeout
from kiln.distributed.work import Work

# the progress thread's period while calls are being made: it adopts a call parked
# for longer (nobody waited for it), keeps p2p deadlines, and goes to sleep for good
# after a quiet period
_TICK = 0.25
_PARK = float("-inf")  # `soft` of a thread that must not block at all: park at once
_DTYPE_CODES: dict = {}  # numpy dtype -> wire code (dtype_of costs a dict and a lookup)
_RECORDER = recorder()  # the process-wide Flight Recorder (bound once: called per call)
_started, _completed = FlightRecorder.started, FlightRecorder.completed


def _dtype_code(dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = DTYPE_CODES[dtype_of(np.empty(0, dtype)).short]
    return code


class _Blocking:
    """The second phase of a call that does not start eagerly: all of it, blocking."""

    __slots__ = ("run", "ctx")

    def __init__(self, run: Callable[[CallContext], object], ctx: CallContext):
        self.run, self.ctx = run, ctx

    def progress(self, soft: float | None = None) -> bool:
        if soft is not None:
            return False  # cannot be bounded: left to a thread that may block
        self.run(self.ctx)
        return True


class _Then:
    """A second phase followed by the group's own last step (copying list outputs)."""

    __slots__ = ("cont", "fn")

    def __init__(self, cont, fn: Callable[[], None]):
        self.cont, self.fn = cont, fn

    def progress(self, soft: float | None = None) -> bool:
        if not self.cont.progress(soft):
            return False
        self.fn()
        return True


def _nothing(ctx: CallContext) -> None:
    """The start of an empty call: there is nothing to send or receive."""
    return None


class CallEngine:
    """The call machinery of a `ProcessGroup` (a mixin): the group provides `backend`,
    `name`, `rank`, `epoch`, `timeout`, `store`, `_sync_ft` and `failed_at`."""

    def _init_engine(self) -> None:
        """The slot's state (before the backend may report a failure)."""
        self._seq = 0
        self._p2p_seq = 0
        self._error: BaseException | None = None
        self._closed = False
        # `with self._lock` (a C lock) where nothing waits: cheaper than the Condition's
        # Python-level __enter__; waiting and notifying go through `_cond`, on that lock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque[Work] = collections.deque()
        self._p2p: set[Work] = set()
        self._running: Work | None = None  # the call in the slot (see the module docstring)
        self._busy = False  # a thread is advancing `_running`
        self._cont = None  # the parked second phase of `_running` (when not busy)
        self._parked_at = 0.0
        self._adopt = False  # a parked call has callbacks: the progress thread ends it
        self._slot_waiters = 0  # threads in _help waiting for the slot
        self._asleep = False  # the progress thread sleeps without a tick

    def _start_engine(self) -> None:
        """Start the progress thread."""
        self._thread = threading.Thread(target=self._progress_loop,
                                        name="kiln-progress-%s" % self.name, daemon=True)
        self._thread.start()

    def _submit(self, op: str, inputs: list, outputs: list, count: int, reduce_op: str | None,
                timeout: float | None, run: Callable[[CallContext], object],
                extra: dict | None = None, run_empty: bool = False, start=None) -> Work:
        timeout = self.timeout if timeout is None else check_timeout(timeout, f"{op}(timeout=)")
        first = inputs[0] if inputs else (outputs[0] if outputs else None)
        dtype_code = 0 if first is None else (_DTYPE_CODES.get(first.dtype) or
                                              _dtype_code(first.dtype))
        if count == 0 and not run_empty:
            # an empty call moves nothing on any rank (count agrees across ranks), but
            # keeps its place in the sequence; all_to_all (count -1) always runs
            run, start = None, _nothing
        what = (inputs, outputs, count, timeout, extra)  # for the Flight Recorder
        with self._lock:
            seq = self._seq
            self._seq += 1
            work = Work(op, seq, self.name, self)
            ctx = CallContext(seq, op, OP_CODES[op], 0.0, dtype_code,
                              REDUCE_CODES[reduce_op] if reduce_op else 0, count)
            if start is None or self._running is not None or self._queue or \
                    self._error is not None or self._closed:
                self._record(work, what, None, 4)  # under the lock: in seq order
                work._call = (ctx, timeout, run, start)
                self._queue.append(work)
                if not self._busy:  # else the running call's end wakes the thread
                    self._cond.notify()
                return work
            # the fast path: take the slot and start here (module docstring)
            self._running = work
            self._busy = True
            if self._asleep:  # let it tick: a call nobody waits for must be adopted
                self._asleep = False
                self._cond.notify()
        self._begin(work, ctx, timeout, run, start, _PARK, what)
        return work

    def _record(self, work: Work, what: tuple, started_ns: int | None, depth: int) -> None:
        """Give `work` its Flight Recorder record (`what` from `_submit`), unless it has
        one; `depth`: how many frames up the collective's caller is, at least."""
        if work.record is None:
            inputs, outputs, count, timeout, extra = what
            work.record = _RECORDER.record(
                group=self.name, epoch=self.epoch, seq=work.seq, op=work.op, inputs=inputs,
                outputs=outputs, timeout=timeout, frames=call_site_frames(depth=depth),
                numel=count, extra=extra, started_ns=started_ns)

    def _begin(self, work: Work, ctx: CallContext, timeout: float, run, start,
               soft: float | None, what: tuple | None = None) -> bool:
        """Start `work` (this thread holds the slot) and advance it (`_advance`).

        `what` (the fast path, from `_submit`): `work` has no record yet; it gets one
        once its sends went out (or before they block), so that the bookkeeping runs
        while the message travels instead of before it leaves."""
        error = self._error
        if error is None and self._closed:
            error = GroupAborted("group '%s' was destroyed before %s ran" % (self.name, work.op))
        cont = None
        if error is None:
            ctx.deadline = work.deadline = time.monotonic() + timeout
            if what is None:
                _started(work.record)
            else:
                started = time.time_ns()
                ctx.before_blocking = lambda: self._record(work, what, started, 1)
            try:
                if start is not None:
                    cont = start(ctx)
                elif run is not None:
                    cont = _Blocking(run, ctx)
            except DistributedError as err:
                error = err
            except Exception as err:  # a bug must fail the Work, not kill the thread
                error = DistributedError("%s (seq %d) failed inside kiln: %r"
                                         % (work.op, work.seq, err))
            if what is not None:
                self._record(work, what, started, 5)  # _begin, _submit, the collective
            if error is not None:
                self._fail(error, work)
        elif what is not None:
            self._record(work, what, None, 5)
        if cont is None:
            self._end(work, error)
            return True
        return self._advance(work, cont, soft)

    def _advance(self, work: Work, cont, soft: float | None) -> bool:
        """Advance the call in the slot (this thread holds it): to its end (True), or
        until `soft` (a monotonic time; `_PARK`: not at all), then park it (False)."""
        if soft != _PARK:
            error = None
            try:
                done = cont.progress(soft)
            except DistributedError as err:
                error = err
            except Exception as err:  # a bug must fail the Work, not kill the thread
                error = DistributedError("%s (seq %d) failed inside kiln: %r"
                                         % (work.op, work.seq, err))
            if error is not None:
                self._fail(error, work)
                self._end(work, error)
                return True
            if done:
                self._end(work, None)
                return True
        with self._lock:
            self._cont = cont
            self._parked_at = time.monotonic()
            self._busy = False
            if self._queue or self._slot_waiters or self._adopt or self._closed or \
                    self._error is not None:
                self._cond.notify_all()
        return False

    def _end(self, work: Work, error: BaseException | None) -> None:
        _completed(work.record, error)
        with self._lock:
            self._running = self._cont = None
            self._busy = False
            if self._queue or self._slot_waiters:
                self._cond.notify_all()
        work._finish(error)

    def _help(self, work: Work, soft: float | None) -> None:
        """Run calls in order up to `work` on this thread (`Work.wait` and friends):
        without `soft`, blocking until `work` ended; with `soft` (a monotonic time), only
        until then, parking the running call, and never starting a call that can only
        run blocking (the progress thread runs those)."""
        while not work._done:
            with self._lock:
                while self._busy and not work._done:
                    left = None if soft is None else soft - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    self._slot_waiters += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._slot_waiters -= 1
                if work._done:
                    return
                running, cont = self._running, self._cont
                if running is None:
                    if not self._queue:
                        return
                    running = self._queue[0]
                    call = running._call
                    if soft is not None and call[3] is None and call[2] is not None:
                        return
                    self._queue.popleft()
                    running._call = None
                    self._running = running
                self._busy = True
            if cont is None:
                done = self._begin(running, *call, soft)
            else:
                done = self._advance(running, cont, soft)
            if not done:
                return

    def _adopt_parked(self) -> None:
        """Have the progress thread finish a parked call now (it has callbacks)."""
        with self._lock:
            if self._running is not None and not self._busy:
                self._adopt = True
                self._asleep = False
                self._cond.notify_all()

    def _progress_loop(self) -> None:
        seen = -1
        while True:
            with self._lock:
                while True:
                    if not self._busy:
                        running, cont = self._running, self._cont
                        if running is not None and (
                                self._queue or self._closed or self._adopt or
                                self._error is not None or
                                time.monotonic() - self._parked_at >= _TICK):
                            self._adopt = False
                            self._busy = True
                            break
                        if running is None and self._queue:
                            running, cont = self._queue.popleft(), None
                            call, running._call = running._call, None
                            self._running = running
                            self._busy = True
                            break
                    if self._closed and self._running is None and not self._queue:
                        return
                    if self._running is not None or self._p2p or self._seq != seen:
                        seen = self._seq
                        self._cond.wait(_TICK)
                    else:  # quiet for a whole tick: sleep until a call needs the thread
                        self._asleep = True
                        self._cond.wait()
                        self._asleep = False
                    self._expire_p2p()
            if cont is None:
                self._begin(running, *call, None)
            else:
                self._advance(running, cont, None)

    def _expire_p2p(self) -> None:
        now = time.monotonic()
        for work in [w for w in self._p2p if w.deadline is not None and w.deadline < now]:
            error = CollectiveTimeout("%s (p2p seq %d, group '%s') did not complete within "
                                      "%.3g s" % (work.op, work.seq, self.name,
                                                  work.record["timeout_s"]),
                                      rank=work.record.get("peer"))
            self._p2p.discard(work)
            threading.Thread(target=self._fail, args=(error, work), daemon=True).start()

    def _fail(self, error: BaseException, work: Work | None, deliberate: bool = False) -> None:
        """First failure wins: abort the backend (peers are told), fail queued, parked
        and pending calls, dump the Flight Recorder here and ask every rank to dump.
        `deliberate`: the end of an epoch every member is reaching too (a grow): the
        backend says goodbye instead, and nothing is dumped."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = error
                self.failed_at = time.time()  # wall clock: comparable with other processes
                # from here waiters may see the failure and exit: that waits for the post
                held = dump_requests.Hold()
            p2p = list(self._p2p)
            self._p2p.clear()
            orphan = None
            if self._running is not None and not self._busy:  # parked: nobody runs it
                orphan = self._running
                self._busy = True
            self._cond.notify_all()
        if first:
            try:
                self._report_failure(error, work, p2p, orphan, deliberate)
            finally:
                held.release()
        if orphan is not None:
            self._end(orphan, self._error)

    def _report_failure(self, error: BaseException, work: Work | None, p2p: list,
                        orphan: Work | None, deliberate: bool) -> None:
        """The first failure's aftermath (see `_fail`): abort, fail the p2p calls,
        record it, dump and ask every rank to dump."""
        if deliberate:
            self.backend.close()
        else:
            self.backend.abort(error)
        for w in p2p:
            if w._finish(error):
                _completed(w.record, error)
        tolerant = self._sync_ft is not None
        if tolerant and not deliberate:  # the failure itself, even found while idle
            note = _RECORDER.record(group=self.name, epoch=self.epoch, seq=-1, op="failure",
                                    inputs=[], outputs=[], timeout=self.timeout, frames=[],
                                    extra={"p2p": True})
            _completed(note, error)
        if not deliberate and (work is not None or p2p or orphan is not None or tolerant):
            _dump_everywhere(self, "%s on rank %d of group '%s': %s" % (
                type(error).__name__, self.rank, self.name,
                getattr(error, "message", error)))

    def _on_backend_failure(self, error: BaseException) -> None:
        with self._lock:
            busy = self._running is not None or bool(self._queue) or bool(self._p2p)
        self._fail(error, self._running if busy else None)

    def _drain(self) -> None:
        """Wait (bounded) until the failed epoch's calls have all ended: queued calls
        fail with the group's error at their turn, and must not run on a new backend."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while (self._running is not None or self._queue) and time.monotonic() < deadline:
                self._cond.notify_all()
                self._cond.wait(0.05)


def _dump_everywhere(pg, reason: str) -> None:
    """Dump here, and post a dump request every rank's watcher picks up from the store."""
    rec = recorder()
    try:
        rec.dump(reason=reason)
    except OSError:
        pass
    if rec.dump_dir is not None and pg.store is not None:
        post_request_async(pg.store, reason, rec.rank)
