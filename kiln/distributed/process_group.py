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

How the calls run (one execution slot, the fast path, parking, the progress thread,
failure): kiln/distributed/call_engine.py, the mixin `CallEngine`.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Sequence

import numpy as np

from kiln.distributed import collective_args as args
from kiln.distributed.backend import OP_CODES, Backend, CallContext
from kiln.distributed.buffers import DTYPE_CODES, Reducer, dtype_of
from kiln.distributed.call_engine import _RECORDER, CallEngine, _completed, _started, _Then
from kiln.distributed.dump_requests import flush_dump_requests  # noqa: F401  (its old home)
from kiln.distributed.errors import CollectiveArgumentError, GroupAborted, RendezvousError
from kiln.distributed.flight_recorder import call_site_frames, recorder
from kiln.distributed.protocol import check_timeout
from kiln.distributed.work import Work

_RESERVED_TAGS = 0xFFFFFF00  # p2p tags from here to 2**32 are kiln's (state transfer)


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


class ProcessGroup(CallEngine):
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
        self._splits = 0
        self._init_engine()
        self._reducers: dict = {}  # (reduce op, dtype) -> Reducer (checked once)
        self.children: list[ProcessGroup] = []
        self._windows: list = []  # RMA windows on this group's current backend
        self._ft = None  # a FaultTolerance on a fault-tolerant world group
        self._sync_ft = None  # the world's, on the world and every sub-group of it
        self.failed_at: float | None = None  # time.time() of the current epoch's failure
        backend.set_failure_handler(self._on_backend_failure)
        recorder().register_group(name, self.global_ranks, rank, epoch, backend.name)
        self._start_engine()

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

    def pending_joins(self) -> list[int]:
        """The ids of processes waiting to join this fault-tolerant group (started with
        `join=True`, e.g. `kiln launch --on-failure replace`'s replacements); the next
        `should_commit` admits them."""
        return self._fault_tolerance("pending_joins").membership.pending_joins()

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
