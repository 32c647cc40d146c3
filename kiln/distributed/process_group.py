"""`ProcessGroup`: ordered, nonblocking collectives over a backend, with deadlines.

Every call is checked on the caller's thread (nothing is sent for bad input), gets the
group's next sequence number, a Flight Recorder record and a `Work`, and runs in call
order, one call at a time, so the order is the same on every rank. Each call has a
deadline (the group's `timeout` or the call's own); a call that misses it, a dead
peer, or a mismatched call fails its Work, aborts the group (every later call fails
at once, nothing hangs) and dumps the Flight Recorder on every rank.

    >>> pg = kiln.distributed.init_process_group()
    >>> work = pg.all_reduce(x, op="sum")    # returns at once
    >>> work.wait()

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
import functools
import json
import threading
import time
from typing import Callable, Sequence

import numpy as np

from kiln.distributed import collective_args as args
from kiln.distributed.backend import OP_CODES, Backend, CallContext
from kiln.distributed.buffers import DTYPE_CODES, REDUCE_CODES, Reducer, dtype_of
from kiln.distributed.errors import (
    CollectiveArgumentError, CollectiveTimeout, DistributedError, GroupAborted, RendezvousError,
)
from kiln.distributed.flight_recorder import FlightRecorder, call_site_frames, recorder
from kiln.distributed.work import Work
from kiln.distributed.protocol import check_timeout

# the progress thread's period while calls are being made: it adopts a call parked
# for longer (nobody waited for it), keeps p2p deadlines, and goes to sleep for good
# after a quiet period
_TICK = 0.25
_PARK = float("-inf")  # `soft` of a thread that must not block at all: park at once
_RESERVED_TAGS = 0xFFFFFF00  # p2p tags from here to 2**32 are kiln's (state transfer)
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


def _sync_point(method):
    """A call of a fault-tolerant group first runs what its last reconfiguration left
    to do (rank 0 sends the joiners the state) before it looks at the group."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        ft = self._sync_ft
        if ft is not None and ft.pending:
            ft.before_call()
        return method(self, *args, **kwargs)
    return call


class ProcessGroup:
    """A set of ranks that run collectives together (create with `init_process_group`).

    `rank` and `world_size` are within this group; `global_ranks[i]` is the rank of
    member i in the world group (a fault-tolerant world numbers its members by uid:
    see kiln.distributed.membership). `epoch` numbers the group's membership; it
    grows when a fault-tolerant group shrinks or grows in place.
    """

    def __init__(self, backend: Backend, *, name: str, rank: int, world_size: int,
                 global_ranks: Sequence[int], store, token: str, timeout: float,
                 epoch: int = 0, backend_factory=None):
        self.backend, self.name = backend, name
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.global_ranks = list(global_ranks)
        self.timeout = float(timeout)
        self.store, self._token = store, token
        self._backend_factory = backend_factory or type(backend)
        self._seq = 0
        self._p2p_seq = 0
        self._splits = 0
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
        self._reducers: dict = {}  # (reduce op, dtype) -> Reducer (checked once)
        self.children: list[ProcessGroup] = []
        self._windows: list = []  # RMA windows on this group's current backend
        self._ft = None  # a FaultTolerance on a fault-tolerant world group
        self._sync_ft = None  # the world's, on the world and every sub-group of it
        self.failed_at: float | None = None  # time.time() of the current epoch's failure
        backend.set_failure_handler(self._on_backend_failure)
        recorder().register_group(name, self.global_ranks, rank, epoch, backend.name)
        self._thread = threading.Thread(target=self._progress_loop,
                                        name="kiln-progress-%s" % name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return "<ProcessGroup %s rank %d/%d epoch %d backend %s>" % (
            self.name, self.rank, self.world_size, self.epoch, self.backend.name)

    # -- collectives -----------------------------------------------------------------
    @_sync_point
    def all_reduce(self, tensor, op: str = "sum", *, timeout: float | None = None) -> Work:
        """Reduce `tensor` across ranks, in place on every rank.

            >>> pg.all_reduce(x, op="max").wait()
        """
        buf = args.buffer("all_reduce", "tensor", tensor, writeable=True)
        try:
            reducer = self._reducers[op, buf.dtype]
        except (KeyError, TypeError):
            reducer = self._reducer("all_reduce", op, buf)
        flat = buf if buf.ndim == 1 else buf.reshape(-1)
        backend = self.backend
        io = [buf]
        starter = backend.eager("all_reduce", flat)
        return self._submit("all_reduce", io, io, buf.size, reducer.op, timeout,
                            lambda ctx: backend.all_reduce(ctx, flat, reducer),
                            extra=reducer.extra,
                            start=starter and (lambda ctx: starter(ctx, flat, reducer)))

    @_sync_point
    def broadcast(self, tensor, src: int = 0, *, timeout: float | None = None) -> Work:
        """Copy `tensor` of rank `src` into `tensor` of every rank.

            >>> pg.broadcast(weights, src=0).wait()
        """
        buf = args.buffer("broadcast", "tensor", tensor, writeable=True)
        src = args.rank("broadcast", "src", src, self.world_size)
        flat = buf if buf.ndim == 1 else buf.reshape(-1)
        backend = self.backend
        io = [buf]
        starter = backend.eager("broadcast", flat)
        return self._submit("broadcast", io, io, buf.size, None, timeout,
                            lambda ctx: backend.broadcast(ctx, flat, src),
                            extra={"root": src},
                            start=starter and (lambda ctx: starter(ctx, flat, src)))

    @_sync_point
    def reduce(self, tensor, dst: int = 0, op: str = "sum", *,
               timeout: float | None = None) -> Work:
        """Reduce `tensor` across ranks into `tensor` of rank `dst` (others keep theirs).

            >>> pg.reduce(loss, dst=0, op="avg").wait()
        """
        buf = args.buffer("reduce", "tensor", tensor, writeable=True)
        dst = args.rank("reduce", "dst", dst, self.world_size)
        reducer = self._reducer("reduce", op, buf)
        flat = buf if buf.ndim == 1 else buf.reshape(-1)
        backend = self.backend
        io = [buf]
        starter = backend.eager("reduce", flat)
        return self._submit("reduce", io, io, buf.size, reducer.op, timeout,
                            lambda ctx: backend.reduce(ctx, flat, dst, reducer),
                            extra={"root": dst, "reduce_op": reducer.op},
                            start=starter and (lambda ctx: starter(ctx, flat, dst, reducer)))

    @_sync_point
    def all_gather(self, output, input, *, timeout: float | None = None) -> Work:
        """Every rank's `input`, in rank order, into `output` on every rank.

        `output` is one array of world_size * input.size elements (any shape), or a
        list of world_size arrays shaped like `input`.

            >>> out = np.empty((pg.world_size, 4), np.float32)
            >>> pg.all_gather(out, x).wait()      # out[i] is rank i's x
        """
        inp = args.buffer("all_gather", "input", input, writeable=False)
        out, finish = args.slotted("all_gather", "output", output, inp, self.world_size)
        oflat, iflat = out.reshape(-1), inp.reshape(-1)
        backend = self.backend
        starter = backend.eager("all_gather", oflat, iflat)
        start = starter and self._then(lambda ctx: starter(ctx, oflat, iflat), finish, output)
        return self._submit("all_gather", [inp], [out], inp.size, None, timeout,
                            lambda ctx: (backend.all_gather(ctx, oflat, iflat), finish()),
                            start=start)

    @_sync_point
    def gather(self, input, output=None, dst: int = 0, *, timeout: float | None = None) -> Work:
        """Every rank's `input` into `output` on rank `dst` (slots as in all_gather).

            >>> pg.gather(x, out if pg.rank == 0 else None, dst=0).wait()
        """
        dst = args.rank("gather", "dst", dst, self.world_size)
        inp = args.buffer("gather", "input", input, writeable=False)
        out, finish = None, (lambda: None)
        if self.rank == dst:
            if output is None:
                raise CollectiveArgumentError("gather: rank %d is dst and needs an output "
                                              "buffer of world_size slots" % dst)
            out, finish = args.slotted("gather", "output", output, inp, self.world_size)
        outs = [out] if out is not None else []
        oflat, iflat = None if out is None else out.reshape(-1), inp.reshape(-1)
        backend = self.backend
        starter = backend.eager("gather", iflat)
        start = starter and self._then(lambda ctx: starter(ctx, oflat, iflat, dst), finish,
                                       output)
        return self._submit("gather", [inp], outs, inp.size, None, timeout,
                            lambda ctx: (backend.gather(ctx, oflat, iflat, dst), finish()),
                            extra={"root": dst}, start=start)

    @_sync_point
    def scatter(self, output, input=None, src: int = 0, *, timeout: float | None = None) -> Work:
        """Slot i of `input` on rank `src` into `output` of rank i.

            >>> pg.scatter(piece, chunks if pg.rank == 0 else None, src=0).wait()
        """
        src = args.rank("scatter", "src", src, self.world_size)
        out = args.buffer("scatter", "output", output, writeable=True)
        inp = None
        if self.rank == src:
            if input is None:
                raise CollectiveArgumentError("scatter: rank %d is src and needs an input "
                                              "of world_size slots" % src)
            inp = args.slotted_input("scatter", "input", input, out, self.world_size)
        ins = [inp] if inp is not None else []
        oflat, iflat = out.reshape(-1), None if inp is None else inp.reshape(-1)
        backend = self.backend
        starter = backend.eager("scatter", oflat)
        return self._submit("scatter", ins, [out], out.size, None, timeout,
                            lambda ctx: backend.scatter(ctx, oflat, iflat, src),
                            extra={"root": src},
                            start=starter and (lambda ctx: starter(ctx, oflat, iflat, src)))

    @_sync_point
    def reduce_scatter(self, output, input, op: str = "sum", *,
                       timeout: float | None = None) -> Work:
        """Reduce `input` (world_size slots) across ranks; slot `rank` lands in `output`.

            >>> pg.reduce_scatter(shard, full_grad, op="avg").wait()
        """
        out = args.buffer("reduce_scatter", "output", output, writeable=True)
        inp = args.slotted_input("reduce_scatter", "input", input, out, self.world_size)
        reducer = self._reducer("reduce_scatter", op, out)
        oflat, iflat = out.reshape(-1), inp.reshape(-1)
        backend = self.backend
        starter = backend.eager("reduce_scatter", oflat, iflat)
        return self._submit("reduce_scatter", [inp], [out], out.size, reducer.op, timeout,
                            lambda ctx: backend.reduce_scatter(ctx, oflat, iflat, reducer),
                            extra={"reduce_op": reducer.op},
                            start=starter and (lambda ctx: starter(ctx, oflat, iflat, reducer)))

    @_sync_point
    def all_to_all(self, output, input, output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None, *,
                   timeout: float | None = None) -> Work:
        """Rows input_split_sizes[j] of `input` go to rank j; rows from rank i land at
        output_split_sizes[i] of `output` (dim 0; equal splits when None).

            >>> pg.all_to_all(out, inp, [1, 3], [2, 2]).wait()
        """
        inp = args.buffer("all_to_all", "input", input, writeable=False)
        out = args.buffer("all_to_all", "output", output, writeable=True)
        args.same_dtype("all_to_all", ("input", inp), ("output", out))
        in_counts = args.splits("all_to_all", "input", inp, input_split_sizes, self.world_size)
        out_counts = args.splits("all_to_all", "output", out, output_split_sizes,
                                 self.world_size)
        return self._submit("all_to_all", [inp], [out], -1, None, timeout,
                            lambda ctx: self.backend.all_to_all(
                                ctx, out.reshape(-1), inp.reshape(-1), out_counts, in_counts),
                            extra={"input_splits": in_counts, "output_splits": out_counts})

    @_sync_point
    def barrier(self, *, timeout: float | None = None) -> Work:
        """Completes once every rank of the group has called barrier.

            >>> pg.barrier().wait()
        """
        return self._submit("barrier", [], [], 0, None, timeout, self.backend.barrier,
                            run_empty=True, start=self.backend.eager("barrier"))

    def _reducer(self, op: str, reduce_op, buf: np.ndarray) -> Reducer:
        """The checked Reducer of (reduce_op, dtype), made once per group (calls of one
        group run one at a time, so they may share its scratch)."""
        try:
            return self._reducers[reduce_op, buf.dtype]
        except KeyError:
            reducer = self._reducers[reduce_op, buf.dtype] = args.reducer(op, reduce_op, buf)
        except TypeError:  # an unhashable reduce op: checked (and refused) there
            reducer = args.reducer(op, reduce_op, buf)
        reducer.extra = {"reduce_op": reducer.op}  # the Flight Recorder's field, made once
        return reducer

    @staticmethod
    def _then(start, finish, output):
        """`start`, followed by `finish` (copying out to a list output) when there is one."""
        if not isinstance(output, (list, tuple)):
            return start
        return lambda ctx: _Then(start(ctx), finish)

    # -- point to point --------------------------------------------------------------
    @_sync_point
    def send(self, tensor, dst: int, tag: int = 0, *, timeout: float | None = None) -> Work:
        """Send `tensor` to rank `dst`; matched by a recv with the same src and tag.

        Sends are eager: they complete once the data left this process, without
        waiting for the receiver, so a send before a recv never deadlocks.

            >>> pg.send(x, dst=1, tag=7).wait()
        """
        return self._p2p_call("send", tensor, dst, tag, timeout)

    @_sync_point
    def recv(self, tensor, src: int, tag: int = 0, *, timeout: float | None = None) -> Work:
        """Receive into `tensor` the message rank `src` sent with `tag`.

            >>> pg.recv(x, src=0, tag=7).wait()
        """
        return self._p2p_call("recv", tensor, src, tag, timeout)

    def _p2p_call(self, op: str, tensor, peer: int, tag: int, timeout: float | None,
                  reserved: bool = False) -> Work:
        buf = args.buffer(op, "tensor", tensor, writeable=(op == "recv"))
        peer = args.rank(op, "dst" if op == "send" else "src", peer, self.world_size)
        if peer == self.rank:
            raise CollectiveArgumentError("%s: rank %d cannot %s itself" % (op, peer, op))
        limit = 2 ** 32 if reserved else _RESERVED_TAGS
        if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) < limit:
            raise CollectiveArgumentError("%s: tag=%r must be an int in [0, %d) (tags from "
                                          "there up are kiln's own)" % (op, tag, _RESERVED_TAGS))
        timeout = self.timeout if timeout is None else check_timeout(timeout, f"{op}(timeout=)")
        with self._lock:
            seq = self._p2p_seq
            self._p2p_seq += 1
        work = Work(op, seq, self.name)  # no owner: the backend's callback ends it
        rec = _RECORDER.record(group=self.name, epoch=self.epoch, seq=seq, op=op, inputs=[buf],
                                outputs=[buf] if op == "recv" else [], timeout=timeout,
                                frames=call_site_frames(depth=3),
                                extra={"p2p": True, "peer": peer, "tag": int(tag)})
        work.record, work.deadline = rec, time.monotonic() + timeout
        ctx = CallContext(seq, op, OP_CODES["p2p"], work.deadline,
                          DTYPE_CODES[dtype_of(buf).short], 0, buf.size)

        def done(error: BaseException | None) -> None:
            with self._lock:
                self._p2p.discard(work)
            _completed(rec, error)
            if work._finish(error) and error is not None:
                self._fail(error, work)

        with self._lock:
            if self._error is not None or self._closed:
                error = self._error or GroupAborted("group '%s' was destroyed" % self.name)
                _completed(rec, error)
                work._finish(error)
                return work
            self._p2p.add(work)
            self._cond.notify()
        _started(rec)
        fn = self.backend.send if op == "send" else self.backend.recv
        fn(ctx, buf.reshape(-1), peer, int(tag), done)
        return work

    # -- ordering, deadlines, failure (see the module docstring) ----------------------
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
            p2p = list(self._p2p)
            self._p2p.clear()
            orphan = None
            if self._running is not None and not self._busy:  # parked: nobody runs it
                orphan = self._running
                self._busy = True
            self._cond.notify_all()
        if first:
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
        if orphan is not None:
            self._end(orphan, self._error)

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

    def _install(self, backend: Backend, *, rank: int, global_ranks: Sequence[int],
                 epoch: int) -> None:
        """Go on at a new epoch with `backend` (see kiln.distributed.fault_tolerance):
        the same object, renumbered, with fresh sequence numbers; RMA windows of the
        old epoch are invalidated."""
        with self._lock:
            self.backend = backend
            self.rank, self.world_size, self.epoch = rank, len(global_ranks), epoch
            self.global_ranks = list(global_ranks)
            self._seq = self._p2p_seq = 0
            self._reducers = {}
            self._error = self.failed_at = None
            windows, self._windows = self._windows, []
        backend.set_failure_handler(self._on_backend_failure)
        recorder().register_group(self.name, self.global_ranks, rank, epoch, backend.name)
        for win in windows:
            win.invalidate("group '%s' was reconfigured to epoch %d" % (self.name, epoch))

    # -- fault tolerance (see kiln.distributed.fault_tolerance) -----------------------
    def _fault_tolerance(self, what: str):
        if self._ft is None:
            raise RendezvousError(
                "%s needs a fault-tolerant world group; group '%s' is not one" % (what, self.name),
                hint="init_process_group(..., fault_tolerant=True); sub-groups follow their "
                "world group's reconfigurations")
        return self._ft

    def should_commit(self, ok: bool = True, *, timeout: float | None = None) -> bool:
        """End a training step: True on every member when every member finished it
        (apply the update now), False on every member otherwise (drop it). A failure
        during the step makes the survivors form the next epoch here, in place.

            >>> if pg.should_commit():
            ...     params, opt_state = update(params, opt_state, grads)
        """
        return self._fault_tolerance("should_commit").should_commit(ok, timeout)

    @property
    def committed_step(self) -> int:
        """How many steps this group committed (should_commit returned True)."""
        return self._fault_tolerance("committed_step").committed_step

    def shrink(self) -> int:
        """Every member calls it: go on with the members that take part (a dead or hung
        one is left out), at the next epoch; returns the new world size."""
        self._fault_tolerance("shrink").reconfigure("shrink")
        return self.world_size

    def grow(self) -> int:
        """Every member calls it: admit the processes waiting to join, at the next
        epoch (they receive the registered state); returns the new world size."""
        ft = self._fault_tolerance("grow")
        ft.before_call()
        ft.reconfigure("grow")
        return self.world_size

    def register_state(self, get_state: Callable[[], dict], set_state: Callable[[dict], None],
                       *, timeout: float | None = None) -> None:
        """What a joiner receives: `get_state()` returns a dict of arrays, `set_state`
        loads one. On a joiner this waits for the state and loads it."""
        self._fault_tolerance("register_state").register_state(get_state, set_state, timeout)

    # -- groups ----------------------------------------------------------------------
    @_sync_point
    def split(self, ranks: Sequence[int] | None = None, *, color: int | None = None,
              key: int | None = None, timeout: float | None = None) -> "ProcessGroup | None":
        """Create a sub-group eagerly; every rank of this group must call it.

        `split([0, 2])` returns the group of ranks 0 and 2 (None on other ranks);
        `split(color=c, key=k)` groups the ranks of equal color, ordered by key then
        rank (color None or negative: no group). The sub-group has its own sockets and
        sequence numbers.

            >>> evens = pg.split(color=pg.rank % 2, key=pg.rank)
        """
        my_color, my_key, digest = args.split_spec(ranks, color, key, self.rank, self.world_size)
        table = np.empty((self.world_size, 3), np.int64)
        self.all_gather(table, np.array([my_color, my_key, digest], np.int64),
                        timeout=timeout).wait()
        if ranks is not None and len(set(table[:, 2].tolist())) != 1:
            bad = [r for r in range(self.world_size) if table[r, 2] != table[0, 2]]
            raise RendezvousError("split: ranks %s passed a different `ranks` list than rank 0"
                                  % bad, hint="every rank must pass the same list to split()")
        index = self._splits
        self._splits += 1
        timeout = self.timeout if timeout is None else timeout
        # a backend that splits its own communicator (nccl: ncclCommSplit) does it on
        # every rank of the parent, those in no sub-group too
        split_backend = getattr(self.backend, "split_backend", None)
        if my_color < 0:
            if split_backend is not None:
                split_backend(None, None, timeout)
            return None
        members = sorted((int(table[r, 1]), r) for r in range(self.world_size)
                         if table[r, 0] == my_color)
        members_ranks = [r for _, r in members]
        name = "%s.s%d" % (self.name, index) + ("" if ranks is not None else ".c%d" % my_color)
        prefix = "pg/%s/e%d" % (name, self.epoch)
        if split_backend is not None:
            backend = split_backend(prefix, members_ranks, timeout)
        else:
            backend = self._backend_factory.rendezvous(
                self.store, prefix, members_ranks.index(self.rank), len(members_ranks),
                self._token, timeout, self.epoch)
        child = ProcessGroup(backend, name=name, rank=members_ranks.index(self.rank),
                             world_size=len(members_ranks),
                             global_ranks=[self.global_ranks[r] for r in members_ranks],
                             store=self.store, token=self._token, timeout=self.timeout,
                             epoch=self.epoch, backend_factory=self._backend_factory)
        child._sync_ft = self._sync_ft
        self.children.append(child)
        return child

    @_sync_point
    def window(self, buffer, *, timeout: float | None = None):
        """Register `buffer` as this rank's part of an RMA window; every rank of the
        group must call it (see `kiln.distributed.window`).

            >>> win = pg.window(np.zeros(1024, np.float32))
            >>> win.put(1, data, offset=16).wait(); win.signal(1)
        """
        from kiln.distributed.window import create_window

        win = create_window(self, buffer, timeout=self.timeout if timeout is None else timeout)
        self._windows.append(win)
        return win

    def dump_flight_recorder(self, directory: str | None = None) -> str | None:
        """Write this rank's Flight Recorder dump (JSON) to `directory` or KILN_FR_DIR.

            >>> pg.dump_flight_recorder("/tmp/fr")
            '/tmp/fr/kiln_fr_rank0.json'
        """
        return recorder().dump(directory, reason="request")

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fail every pending and later call, close the sockets; peers' calls fail too."""
        self._fail(GroupAborted("group '%s' aborted on rank %d: %s"
                                % (self.name, self.rank, reason)), None)

    def destroy(self) -> None:
        """Leave the group cleanly (sub-groups first); queued calls fail with GroupAborted."""
        for child in self.children:
            child.destroy()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()  # the progress thread finishes a parked call, then exits
        self._thread.join(timeout=self.timeout)
        if self._error is None:
            self.backend.close()

    @property
    def is_aborted(self) -> bool:
        return self._error is not None


def _nothing(ctx: CallContext) -> None:
    """The start of an empty call: there is nothing to send or receive."""
    return None


def _dump_everywhere(pg: ProcessGroup, reason: str) -> None:
    """Dump here, and post a dump request every rank's watcher picks up from the store."""
    rec = recorder()
    try:
        rec.dump(reason=reason)
    except OSError:
        pass
    if rec.dump_dir is None or pg.store is None:
        return

    def request() -> None:
        try:
            gen = pg.store.add("fr/dump_gen", 1)
            pg.store.set("fr/dump/%d" % gen, json.dumps({"reason": reason, "rank": rec.rank}))
        except DistributedError:
            pass  # the store may be gone with the failed rank; local dumps still exist

    thread = threading.Thread(target=request, name="kiln-fr-request", daemon=True)
    _PENDING_DUMP_REQUESTS.append(thread)
    thread.start()


# posted from a thread so a failing call returns at once; a process that exits right after
# must still deliver them, or its peers never learn to dump (see `flush_dump_requests`)
_PENDING_DUMP_REQUESTS: list[threading.Thread] = []


def flush_dump_requests(timeout: float = 5.0) -> None:
    """Wait (bounded) until this process's dump requests have reached the store."""
    deadline = time.monotonic() + timeout
    while _PENDING_DUMP_REQUESTS:
        _PENDING_DUMP_REQUESTS.pop().join(max(0.0, deadline - time.monotonic()))
