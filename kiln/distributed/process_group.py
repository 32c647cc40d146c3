"""`ProcessGroup`: ordered, nonblocking collectives over a backend, with deadlines.

Every call is checked on the caller's thread (nothing is sent for bad input), gets the
group's next sequence number, a Flight Recorder record and a `Work`, and is queued
for the group's progress thread, which runs calls one at a time in call order, so
the order is the same on every rank. Each call has a deadline (the group's `timeout`
or the call's own); a call that misses it, a dead peer, or a mismatched call fails
its Work, aborts the group (every later call fails at once, nothing hangs) and dumps
the Flight Recorder on every rank.

    >>> pg = kiln.distributed.init_process_group()
    >>> work = pg.all_reduce(x, op="sum")    # returns at once
    >>> work.wait()
"""

from __future__ import annotations

import collections
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
from kiln.distributed.flight_recorder import call_site_frames, recorder
from kiln.distributed.work import Work


class ProcessGroup:
    """A set of ranks that run collectives together (create with `init_process_group`).

    `rank` and `world_size` are within this group; `global_ranks[i]` is the rank of
    member i in the world group. `epoch` numbers the group's membership (0 until
    membership changes are supported).
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
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._p2p: set[Work] = set()
        self._running: Work | None = None
        self.children: list[ProcessGroup] = []
        backend.set_failure_handler(self._on_backend_failure)
        recorder().register_group(name, self.global_ranks, rank, epoch, backend.name)
        self._thread = threading.Thread(target=self._progress_loop,
                                        name="kiln-progress-%s" % name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return "<ProcessGroup %s rank %d/%d epoch %d backend %s>" % (
            self.name, self.rank, self.world_size, self.epoch, self.backend.name)

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, tensor, op: str = "sum", *, timeout: float | None = None) -> Work:
        """Reduce `tensor` across ranks, in place on every rank.

            >>> pg.all_reduce(x, op="max").wait()
        """
        buf = args.buffer("all_reduce", "tensor", tensor, writeable=True)
        reducer = args.reducer("all_reduce", op, buf)
        flat = buf.reshape(-1)
        return self._submit("all_reduce", [buf], [buf], buf.size, reducer.op, timeout,
                            lambda ctx: self.backend.all_reduce(ctx, flat, reducer),
                            extra={"reduce_op": reducer.op})

    def broadcast(self, tensor, src: int = 0, *, timeout: float | None = None) -> Work:
        """Copy `tensor` of rank `src` into `tensor` of every rank.

            >>> pg.broadcast(weights, src=0).wait()
        """
        buf = args.buffer("broadcast", "tensor", tensor, writeable=True)
        src = args.rank("broadcast", "src", src, self.world_size)
        flat = buf.reshape(-1)
        return self._submit("broadcast", [buf], [buf], buf.size, None, timeout,
                            lambda ctx: self.backend.broadcast(ctx, flat, src),
                            extra={"root": src})

    def reduce(self, tensor, dst: int = 0, op: str = "sum", *,
               timeout: float | None = None) -> Work:
        """Reduce `tensor` across ranks into `tensor` of rank `dst` (others keep theirs).

            >>> pg.reduce(loss, dst=0, op="avg").wait()
        """
        buf = args.buffer("reduce", "tensor", tensor, writeable=True)
        dst = args.rank("reduce", "dst", dst, self.world_size)
        reducer = args.reducer("reduce", op, buf)
        flat = buf.reshape(-1)
        return self._submit("reduce", [buf], [buf], buf.size, reducer.op, timeout,
                            lambda ctx: self.backend.reduce(ctx, flat, dst, reducer),
                            extra={"root": dst, "reduce_op": reducer.op})

    def all_gather(self, output, input, *, timeout: float | None = None) -> Work:
        """Every rank's `input`, in rank order, into `output` on every rank.

        `output` is one array of world_size * input.size elements (any shape), or a
        list of world_size arrays shaped like `input`.

            >>> out = np.empty((pg.world_size, 4), np.float32)
            >>> pg.all_gather(out, x).wait()      # out[i] is rank i's x
        """
        inp = args.buffer("all_gather", "input", input, writeable=False)
        out, finish = args.slotted("all_gather", "output", output, inp, self.world_size)
        return self._submit("all_gather", [inp], [out], inp.size, None, timeout,
                            lambda ctx: (self.backend.all_gather(ctx, out.reshape(-1),
                                                                 inp.reshape(-1)), finish()))

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
        return self._submit("gather", [inp], outs, inp.size, None, timeout,
                            lambda ctx: (self.backend.gather(
                                ctx, None if out is None else out.reshape(-1), inp.reshape(-1),
                                dst), finish()),
                            extra={"root": dst})

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
        return self._submit("scatter", ins, [out], out.size, None, timeout,
                            lambda ctx: self.backend.scatter(
                                ctx, out.reshape(-1), None if inp is None else inp.reshape(-1),
                                src),
                            extra={"root": src})

    def reduce_scatter(self, output, input, op: str = "sum", *,
                       timeout: float | None = None) -> Work:
        """Reduce `input` (world_size slots) across ranks; slot `rank` lands in `output`.

            >>> pg.reduce_scatter(shard, full_grad, op="avg").wait()
        """
        out = args.buffer("reduce_scatter", "output", output, writeable=True)
        inp = args.slotted_input("reduce_scatter", "input", input, out, self.world_size)
        reducer = args.reducer("reduce_scatter", op, out)
        return self._submit("reduce_scatter", [inp], [out], out.size, reducer.op, timeout,
                            lambda ctx: self.backend.reduce_scatter(
                                ctx, out.reshape(-1), inp.reshape(-1), reducer),
                            extra={"reduce_op": reducer.op})

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

    def barrier(self, *, timeout: float | None = None) -> Work:
        """Completes once every rank of the group has called barrier.

            >>> pg.barrier().wait()
        """
        return self._submit("barrier", [], [], 0, None, timeout, self.backend.barrier,
                            run_empty=True)

    # -- point to point --------------------------------------------------------------
    def send(self, tensor, dst: int, tag: int = 0, *, timeout: float | None = None) -> Work:
        """Send `tensor` to rank `dst`; matched by a recv with the same src and tag.

        Sends are eager: they complete once the data left this process, without
        waiting for the receiver, so a send before a recv never deadlocks.

            >>> pg.send(x, dst=1, tag=7).wait()
        """
        return self._p2p_call("send", tensor, dst, tag, timeout)

    def recv(self, tensor, src: int, tag: int = 0, *, timeout: float | None = None) -> Work:
        """Receive into `tensor` the message rank `src` sent with `tag`.

            >>> pg.recv(x, src=0, tag=7).wait()
        """
        return self._p2p_call("recv", tensor, src, tag, timeout)

    def _p2p_call(self, op: str, tensor, peer: int, tag: int, timeout: float | None) -> Work:
        buf = args.buffer(op, "tensor", tensor, writeable=(op == "recv"))
        peer = args.rank(op, "dst" if op == "send" else "src", peer, self.world_size)
        if peer == self.rank:
            raise CollectiveArgumentError("%s: rank %d cannot %s itself" % (op, peer, op))
        if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) < 2 ** 32:
            raise CollectiveArgumentError("%s: tag=%r must be an int in [0, 2**32)" % (op, tag))
        timeout = self.timeout if timeout is None else float(timeout)
        with self._cond:
            seq = self._p2p_seq
            self._p2p_seq += 1
        work = Work(op, seq, self.name)
        rec = recorder().record(group=self.name, epoch=self.epoch, seq=seq, op=op, inputs=[buf],
                                outputs=[buf] if op == "recv" else [], timeout=timeout,
                                frames=call_site_frames(),
                                extra={"p2p": True, "peer": peer, "tag": int(tag)})
        work.record, work.deadline = rec, time.monotonic() + timeout
        ctx = CallContext(seq, op, OP_CODES["p2p"], work.deadline,
                          DTYPE_CODES[dtype_of(buf).short], 0, buf.size)

        def done(error: BaseException | None) -> None:
            with self._cond:
                self._p2p.discard(work)
            recorder().completed(rec, error)
            if work._finish(error) and error is not None:
                self._fail(error, work)

        with self._cond:
            if self._error is not None or self._closed:
                error = self._error or GroupAborted("group '%s' was destroyed" % self.name)
                recorder().completed(rec, error)
                work._finish(error)
                return work
            self._p2p.add(work)
            self._cond.notify()
        recorder().started(rec)
        fn = self.backend.send if op == "send" else self.backend.recv
        fn(ctx, buf.reshape(-1), peer, int(tag), done)
        return work

    # -- ordering, deadlines, failure ------------------------------------------------
    def _submit(self, op: str, inputs: list, outputs: list, count: int, reduce_op: str | None,
                timeout: float | None, run: Callable[[CallContext], object],
                extra: dict | None = None, run_empty: bool = False) -> Work:
        timeout = self.timeout if timeout is None else float(timeout)
        dt = dtype_of(inputs[0] if inputs else outputs[0]) if (inputs or outputs) else None
        with self._cond:
            seq = self._seq
            self._seq += 1
            work = Work(op, seq, self.name)
            work.helper = self._help
            rec = recorder().record(group=self.name, epoch=self.epoch, seq=seq, op=op,
                                    inputs=inputs, outputs=outputs, timeout=timeout,
                                    frames=call_site_frames(),
                                    extra=dict(extra or {}, numel=count))
            work.record = rec
            ctx = CallContext(seq, op, OP_CODES[op], 0.0,
                              DTYPE_CODES[dt.short] if dt is not None else 0,
                              REDUCE_CODES[reduce_op] if reduce_op else 0, count)
            # an empty call moves nothing on any rank (count agrees across ranks), but
            # keeps its place in the sequence; all_to_all (count -1) always runs
            empty = not run_empty and count == 0
            self._queue.append((work, ctx, timeout, None if empty else run))
            if self._running is None:  # else the running call's end wakes the thread
                self._cond.notify()
        return work

    def _progress_loop(self) -> None:
        while True:
            with self._cond:
                # one call at a time: also wait while a waiter runs one inline (_help)
                while (not self._queue or self._running is not None) and not self._closed:
                    self._cond.wait(0.25 if self._p2p else None)
                    self._expire_p2p()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._running = item[0]
            self._execute(*item)

    def _help(self, work: Work) -> None:
        """Run queued calls up to `work` on the waiting thread (they are started in
        call order, one at a time, exactly as the progress thread would). This saves
        the two thread hand-offs (caller -> progress thread -> caller) that dominate
        small-message latency. Returns when `work` ran or another thread is running."""
        while not work.is_completed():
            with self._cond:
                if self._running is not None or not self._queue or self._closed:
                    return
                item = self._queue.popleft()
                self._running = item[0]
            self._execute(*item)

    def _execute(self, work: Work, ctx: CallContext, timeout: float, run) -> None:
        rec = work.record
        error = self._error
        if error is None and self._closed:
            error = GroupAborted("group '%s' was destroyed before %s ran" % (self.name, work.op))
        if error is None:
            ctx.deadline = work.deadline = time.monotonic() + timeout
            recorder().started(rec)
            try:
                if run is not None:
                    run(ctx)
            except DistributedError as err:
                error = err
            except Exception as err:  # a bug must fail the Work, not kill the thread
                error = DistributedError("%s (seq %d) failed inside kiln: %r"
                                         % (work.op, work.seq, err))
            if error is not None:
                self._fail(error, work)
        recorder().completed(rec, error)
        with self._cond:
            self._running = None
            if self._queue:  # only the progress thread waits here, and only for a call
                self._cond.notify()
        work._finish(error)

    def _expire_p2p(self) -> None:
        now = time.monotonic()
        for work in [w for w in self._p2p if w.deadline is not None and w.deadline < now]:
            error = CollectiveTimeout("%s (p2p seq %d, group '%s') did not complete within "
                                      "%.3g s" % (work.op, work.seq, self.name,
                                                  work.record["timeout_s"]),
                                      rank=work.record.get("peer"))
            self._p2p.discard(work)
            threading.Thread(target=self._fail, args=(error, work), daemon=True).start()

    def _fail(self, error: BaseException, work: Work | None) -> None:
        """First failure wins: abort the backend (peers are told), fail queued and
        pending calls, dump the Flight Recorder here and ask every rank to dump."""
        with self._cond:
            first = self._error is None
            if first:
                self._error = error
            p2p = list(self._p2p)
            self._p2p.clear()
            self._cond.notify_all()
        if not first:
            return
        self.backend.abort(error)
        for w in p2p:
            if w._finish(error):
                recorder().completed(w.record, error)
        if work is not None or p2p:
            _dump_everywhere(self, "%s on rank %d of group '%s': %s" % (
                type(error).__name__, self.rank, self.name, getattr(error, "message", error)))

    def _on_backend_failure(self, error: BaseException) -> None:
        with self._cond:
            busy = self._running is not None or bool(self._queue) or bool(self._p2p)
        self._fail(error, self._running if busy else None)

    # -- groups ----------------------------------------------------------------------
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
        if my_color < 0:
            return None
        members = sorted((int(table[r, 1]), r) for r in range(self.world_size)
                         if table[r, 0] == my_color)
        members_ranks = [r for _, r in members]
        name = "%s.s%d" % (self.name, index) + ("" if ranks is not None else ".c%d" % my_color)
        timeout = self.timeout if timeout is None else timeout
        backend = self._backend_factory.rendezvous(
            self.store, "pg/%s/e%d" % (name, self.epoch), members_ranks.index(self.rank),
            len(members_ranks), self._token, timeout, self.epoch)
        child = ProcessGroup(backend, name=name, rank=members_ranks.index(self.rank),
                             world_size=len(members_ranks),
                             global_ranks=[self.global_ranks[r] for r in members_ranks],
                             store=self.store, token=self._token, timeout=self.timeout,
                             epoch=self.epoch, backend_factory=self._backend_factory)
        self.children.append(child)
        return child

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
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=self.timeout)
        if self._error is None:
            self.backend.close()

    @property
    def is_aborted(self) -> bool:
        return self._error is not None


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
