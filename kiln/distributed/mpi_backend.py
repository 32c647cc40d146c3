"""`MpiBackend`: the collective contract on MPI communicators (mpi4py, Open MPI 5 + ULFM).

    >>> pg = kiln.distributed.init_process_group("mpi")  # mpirun, kiln launch --engine mpi

Every kiln call maps to one nonblocking MPI call on the user's memory (zero-copy: numpy
views go to MPI as they are): all_reduce -> Iallreduce(IN_PLACE) below 1 MB, kiln's
ring over Isend/Irecv from 1 MB (mpi_ring.py: Open MPI's nonblocking all_reduce is
a binomial tree there, 3-9x slower), broadcast -> Ibcast,
reduce -> Ireduce, all_gather -> Iallgather, gather/scatter -> Igather/Iscatter,
reduce_scatter -> Ireduce_scatter_block, all_to_all -> Ialltoallv, barrier -> Ibarrier,
send/recv -> Isend/Irecv with the tag; the group's thread waits in `Wait`. (Open MPI's
blocking collectives were 1.5-1.8x faster at 16-64 MB here, but with them the 12 MB
all_reduce of the dead-peer test hung after the SIGKILL, where the nonblocking one fails
with ERR_PROC_FAILED.) Data-moving calls go as bytes, so every kiln dtype travels;
reductions use MPI's own ops where MPI has the type (bool, integers, float16/32/64,
complex64) and a user-defined op over kiln's `Reducer` for bfloat16 and the float8
types (reduced in float32, as the tcp backend does), and for 8- and 16-bit integer sums
(Open MPI's AVX op saturates them).

Deadlines and failures. A watcher thread keeps the running call's deadline and the
p2p requests: past the deadline it *revokes* the communicator (ULFM `MPI_Comm_revoke`),
which ends every pending call on it, on every rank. A dead peer makes MPI
return `ERR_PROC_FAILED` (Open MPI reports a SIGKILL in tens of ms; while idle, the
watcher's wildcard probe finds it); the backend names the rank from `Get_failed` and
revokes, so peers blocked elsewhere (`ERR_REVOKED`) get out too, and read the reason
the first rank posted in the store. A hung peer (SIGSTOP) is invisible to MPI: kiln's
heartbeat declares it dead and aborts the group, which revokes here as well. While a
communicator is made from a group the watcher makes no MPI call (mpi_world.QUIET: Open
MPI can lose the new communicator's first messages to another thread's progress).

Mismatched calls. MPI cannot tell that ranks called different collectives: it may
hang, fail or mix the bytes. Unless KILN_MPI_CHECK=0, each call first all-gathers its
signature (op, dtype, reduce op, count: 32 bytes a rank) and raises
`CollectiveMismatch` on every rank when they differ, naming the ranks and both calls.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from kiln.distributed import mpi_world
from kiln.distributed.backend import Backend, CallContext
from kiln.distributed.buffers import Reducer
from kiln.distributed.mpi_ring import MpiRing
from kiln.distributed.errors import (
    CollectiveMismatch, CollectiveTimeout, DistributedError, GroupAborted, MpiError,
    PeerFailure, StoreError, error_from_wire, error_to_wire,
)
from kiln.distributed.tcp_backend import _describe_sig
from kiln.ir import dtypes as kd

_USER_OP_DTYPES = {kd.bfloat16.short, kd.float8_e4m3fn.short, kd.float8_e5m2.short}
# Open MPI 5.0.11's AVX reduction component *saturates* 8- and 16-bit integer sums of a
# vector's length or more (seen here: uint8 200 + 100 -> 255); kiln's sums wrap, as numpy's do
_SATURATED = {kd.uint8.short, kd.int8.short, kd.int16.short}
_TAG_BITS = 30  # tag t travels on p2p communicator t >> 30 with MPI tag t & (2**30 - 1)
_WATCH_IDLE = 0.02  # the watcher's period with nothing to poll (deadlines, revocation)
_WATCH_BUSY = 0.0005  # ... and its first period while p2p requests are pending
_WATCH_BUSY_MAX = 0.005
_PROBE_TAG = (1 << _TAG_BITS) - 1  # the idle probe's tag (it only looks)
_SPLIT_TAGS = 1 << 20  # split k makes its group with MPI tag 2 + k % _SPLIT_TAGS


def _bytes(buf: np.ndarray) -> np.ndarray:
    return buf.view(np.uint8) if buf.dtype != np.uint8 else buf


class _Ops:
    """MPI op and buffer spec of each (reduce op, dtype): built once per process."""

    def __init__(self, MPI):
        self.MPI = MPI
        self._cache: dict = {}
        self._types: dict = {}

    def get(self, reducer: Reducer):
        key = (reducer.op, reducer.dtype.short)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._make(reducer)
        return hit

    def _make(self, reducer: Reducer):
        MPI, dt = self.MPI, reducer.dtype
        if dt.short in _USER_OP_DTYPES or (reducer.op == "sum" and dt.short in _SATURATED):
            size = np.dtype(dt.np_dtype).itemsize
            mtype = self._types.get(size)
            if mtype is None:
                mtype = self._types[size] = MPI.BYTE.Create_contiguous(size).Commit()
            own = Reducer(reducer.op, dt)  # its own float32 scratch: MPI may call it anywhere
            np_dtype = np.dtype(dt.np_dtype)

            def combine(inbuf, outbuf, datatype):
                a = np.frombuffer(inbuf, np_dtype)
                b = np.frombuffer(outbuf, np_dtype)
                own.combine(b, a, b)
            return MPI.Op.Create(combine, commute=True), mtype
        if dt.is_bool:
            op = {"sum": MPI.LOR, "max": MPI.LOR, "prod": MPI.LAND, "min": MPI.LAND}[reducer.op]
        else:
            op = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN,
                  "max": MPI.MAX}[reducer.op]
        return op, None


def _spec(buf: np.ndarray, mtype):
    return buf if mtype is None else [buf, buf.size, mtype]


class MpiBackend(Backend):
    """One kiln group on one MPI communicator (and three duplicates for p2p tags).

        >>> backend = MpiBackend.rendezvous(store, "pg/world/e0", rank, world_size, token, 10.0)
    """

    name = "mpi"

    def __init__(self, comm, prefix: str, store, p2p_comms: list | None = None,
                 ring_comm=None):
        MPI = mpi_world.load_mpi()
        self.MPI, self.comm, self.prefix, self.store = MPI, comm, prefix, store
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.group = prefix.split("/")[1] if prefix.count("/") >= 2 else prefix  # its name
        # p2p on four communicators: MPI tags stop at 2**31 - 1, kiln's go up to 2**32
        self.p2p_comms = p2p_comms or [comm] + [comm.Dup() for _ in range(3)]
        self._ring = MpiRing(self, ring_comm or comm.Dup())  # large all_reduce
        self._comms = self.p2p_comms + [self._ring.comm]  # what abort() revokes
        for c in self._comms:
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self.check = os.environ.get("KILN_MPI_CHECK", "1") != "0"
        self._ops = mpi_world.ops()
        self._failure_handler = None
        self._splits = 0  # split_backend calls so far (the same on every rank)
        self._error: BaseException | None = None  # why this rank revoked (or closed)
        self._revoked = False
        self._lock = threading.Lock()
        self._call: tuple | None = None  # (deadline, ctx) of the collective in MPI now
        self._pending: list = []  # [request, done, ctx] of p2p calls in flight
        self._wake = threading.Event()
        self._stop = False
        self._sig = np.zeros(4, np.int64)
        self._sigs = np.zeros((self.world_size, 4), np.int64)
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="kiln-mpi-watch-%s" % prefix)
        self._watcher.start()
        mpi_world._BACKENDS.append(self)  # closed, its communicators freed, at exit

    @classmethod
    def rendezvous(cls, store, prefix: str, rank: int, world_size: int, token: str,
                   timeout: float, epoch: int = 0) -> "MpiBackend":
        deadline = time.monotonic() + timeout
        comm = mpi_world.communicator(store, prefix, rank, world_size, token, timeout, epoch)
        dups = mpi_world.bounded(lambda: [comm.Dup() for _ in range(4)], deadline,
                                 "group '%s' (p2p communicators)" % prefix)
        return cls(comm, prefix, store, [comm] + dups[:3], dups[3])

    def split_backend(self, prefix: str | None, members: list[int] | None,
                      timeout: float) -> "MpiBackend | None":
        """The backend of a sub-group made by `ProcessGroup.split`, which calls this on
        every rank of this group (prefix None: in no sub-group), in the same order.

        `MPI_Comm_create_group` over the members, on this group's ring communicator
        (collective over the members only; its own messages travel there with tag
        2 + split number, which no ring message uses), not `Create_from_group`: the new
        communicator's CID is agreed over a communicator every member already has, so
        no first message can arrive before this rank set the new one up, whatever other
        threads do in MPI meanwhile (see mpi_world's module docstring)."""
        self._splits += 1
        if prefix is None:
            return None
        deadline = time.monotonic() + timeout
        parent = self._ring.comm
        group = parent.Get_group().Incl(members)
        tag = 2 + self._splits % _SPLIT_TAGS
        comm = mpi_world.bounded(lambda: parent.Create_group(group, tag), deadline,
                                 "group '%s'" % prefix)
        comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        dups = mpi_world.bounded(lambda: [comm.Dup() for _ in range(4)], deadline,
                                 "group '%s' (p2p communicators)" % prefix)
        return MpiBackend(comm, prefix, self.store, [comm] + dups[:3], dups[3])

    # -- running one call ------------------------------------------------------------
    def _run(self, ctx: CallContext, start) -> None:
        """Check the call's signature across ranks (unless KILN_MPI_CHECK=0), start the
        MPI call, and wait for it under the call's deadline."""
        self._check(ctx)
        self.wait_requests(ctx, start)

    def _check(self, ctx: CallContext) -> None:
        if self._error is not None:
            raise self._error
        if self.check and self.world_size > 1:
            sig = self._sig
            sig[0], sig[1], sig[2], sig[3] = ctx.op_code, ctx.dtype_code, ctx.reduce_code, ctx.count
            self.wait_requests(ctx, lambda: self.comm.Iallgather(sig, self._sigs))
            self._compare(ctx)

    def wait_requests(self, ctx: CallContext, requests) -> None:
        """Wait for MPI requests (a list, or a function that starts one) under the call's
        deadline (past it the watcher revokes); MPI's errors become kiln's."""
        with self._lock:
            self._call = (ctx.deadline, ctx)
        try:
            if callable(requests):
                requests().Wait()
            else:
                self.MPI.Request.Waitall(requests)
        except self.MPI.Exception as err:
            raise self._translate(err, "%s (seq %d)" % (ctx.op, ctx.seq)) from None
        finally:
            with self._lock:
                self._call = None

    def _compare(self, ctx: CallContext) -> None:
        sigs = self._sigs
        if (sigs == sigs[0]).all():
            return
        bad = [r for r in range(self.world_size) if not (sigs[r] == sigs[0]).all()]
        calls = [_describe_sig(tuple(int(v) for v in sigs[r])) for r in [0] + bad]
        raise CollectiveMismatch(
            "group '%s' seq %d: rank 0 called %s but rank%s %s called %s" % (
                self.group, ctx.seq, calls[0], "s" if len(bad) > 1 else "",
                ", ".join(map(str, bad)), "; ".join(calls[1:])), rank=bad[0])

    def _translate(self, err, what: str) -> DistributedError:
        """The kiln error of a failed MPI call."""
        if self._error is not None:  # this rank revoked: its own reason
            return self._error
        MPI = self.MPI
        cls = err.Get_error_class()
        if cls in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED):
            failed = self.failed_ranks()
            if failed:
                return PeerFailure(failed[0], "rank %d of group '%s' failed during %s: MPI "
                                   "reported the process dead (ULFM)" % (failed[0], self.group,
                                                                        what), group=self.group)
            remote = self._remote_reason(0.5)
            if remote is not None:
                return remote
            return GroupAborted("%s: group '%s' was revoked by a peer" % (what, self.group))
        return MpiError("%s on group '%s' failed in MPI: %s" % (what, self.group,
                                                                err.Get_error_string()))

    def failed_ranks(self) -> list[int]:
        """Ranks of this communicator that MPI knows dead (locally, so far)."""
        try:
            group = self.comm.Get_failed()
        except self.MPI.Exception:
            return []
        n = group.Get_size()
        if n == 0:
            return []
        ranks = self.MPI.Group.Translate_ranks(group, list(range(n)), self.comm.Get_group())
        return sorted(r for r in ranks if r >= 0)

    def _remote_reason(self, timeout: float) -> DistributedError | None:
        """The reason the rank that revoked posted in the store (bounded wait)."""
        key = "%s/mpi/revoked" % self.prefix
        try:
            client = self.store.clone()
            try:
                client.wait([key], timeout=timeout)
                info = json.loads(client.get(key, timeout=timeout))
            finally:
                client.close()
        except (StoreError, ValueError):
            return None
        return error_from_wire(info, reporter=int(info.get("by", -1)), group=self.group)

    # -- the watcher: deadlines, p2p completion, revocation while idle --------------------
    def _watch(self) -> None:
        period = _WATCH_IDLE
        while not self._stop:
            self._wake.wait(period)
            self._wake.clear()
            if self._stop:
                return
            with self._lock:
                call, pending = self._call, list(self._pending)
            now = time.monotonic()
            if call is not None and now > call[0] and self._error is None:
                ctx = call[1]
                self._local_failure(CollectiveTimeout(
                    "%s (seq %d, group '%s') did not complete within its deadline"
                    % (ctx.op, ctx.seq, self.group)))
            if not mpi_world.QUIET.watch():
                continue  # a communicator is being made from a group: no MPI call now
            try:
                finished, failure = self._look(pending, now, call is None)
            finally:
                mpi_world.QUIET.watched()
            for (_, done, _), error in finished:
                done(error)
            if failure is not None:
                self._local_failure(failure)
            if not pending:
                period = _WATCH_IDLE
            else:  # poll fast right after a completion, then back off
                period = _WATCH_BUSY if finished else min(period * 2, _WATCH_BUSY_MAX)

    def _look(self, pending: list, now: float, idle: bool) -> tuple[list, BaseException | None]:
        """The watcher's MPI calls of one round: the p2p requests that completed (taken
        off the pending list, as (entry, error); their callbacks are the caller's) and,
        while idle, a failure found by a probe."""
        finished = self._poll(pending, now)
        if finished or not idle or self._error is not None:
            return finished, None
        # found while idle, as the tcp backend finds a peer's EOF: MPI learns of a dead
        # process only inside a call, and a wildcard probe is the cheapest (it fails with
        # ERR_PROC_FAILED, after which Get_failed names the rank)
        try:
            self.comm.Iprobe(self.MPI.ANY_SOURCE, _PROBE_TAG)
        except self.MPI.Exception:
            pass
        failed = self.failed_ranks()
        if failed:
            return finished, PeerFailure(failed[0], "rank %d of group '%s' died: MPI reported "
                                         "the process dead (ULFM)" % (failed[0], self.group),
                                         group=self.group)
        if self.comm.Is_revoked():
            return finished, self._translate_revoked()
        return finished, None

    def _poll(self, pending: list, now: float) -> list:
        finished = []
        for entry in pending:
            req, done, ctx = entry
            try:
                ok = req.Test()
                error = None
            except self.MPI.Exception as err:
                ok, error = True, self._translate(err, "%s (p2p seq %d)" % (ctx.op, ctx.seq))
            if not ok and now > ctx.deadline:
                continue  # the group's progress thread expires it (CollectiveTimeout)
            if ok:
                with self._lock:
                    if entry in self._pending:
                        self._pending.remove(entry)
                finished.append((entry, error))
        return finished

    def _translate_revoked(self) -> DistributedError:
        return self._translate(_Revoked(self.MPI), "an idle group")

    def _local_failure(self, error: BaseException) -> None:
        handler = self._failure_handler
        if handler is not None:
            handler(error)  # the group aborts: abort() below revokes
        else:
            self.abort(error)

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, ctx: CallContext, buf: np.ndarray, reducer: Reducer) -> None:
        if self._ring.usable(buf):  # kiln's ring from 1 MB: see mpi_ring.py for why
            self._check(ctx)
            try:
                self._ring.all_reduce(ctx, buf, reducer)
            except self.MPI.Exception as err:  # posting a send or receive failed
                raise self._translate(err, "%s (seq %d)" % (ctx.op, ctx.seq)) from None
        else:
            op, mtype = self._ops.get(reducer)
            self._run(ctx, lambda: self.comm.Iallreduce(self.MPI.IN_PLACE, _spec(buf, mtype),
                                                        op))
        reducer.finish(buf, self.world_size)

    def broadcast(self, ctx: CallContext, buf: np.ndarray, src: int) -> None:
        self._run(ctx, lambda: self.comm.Ibcast(_bytes(buf), root=src))

    def reduce(self, ctx: CallContext, buf: np.ndarray, dst: int, reducer: Reducer) -> None:
        op, mtype = self._ops.get(reducer)
        if self.rank == dst:
            self._run(ctx, lambda: self.comm.Ireduce(self.MPI.IN_PLACE, _spec(buf, mtype), op,
                                                     root=dst))
            reducer.finish(buf, self.world_size)
        else:
            self._run(ctx, lambda: self.comm.Ireduce(_spec(buf, mtype), None, op, root=dst))

    def all_gather(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray) -> None:
        self._run(ctx, lambda: self.comm.Iallgather(_bytes(inp), _bytes(out)))

    def gather(self, ctx: CallContext, out: np.ndarray | None, inp: np.ndarray,
               dst: int) -> None:
        self._run(ctx, lambda: self.comm.Igather(
            _bytes(inp), _bytes(out) if self.rank == dst else None, root=dst))

    def scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray | None,
                src: int) -> None:
        self._run(ctx, lambda: self.comm.Iscatter(
            _bytes(inp) if self.rank == src else None, _bytes(out), root=src))

    def reduce_scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                       reducer: Reducer) -> None:
        op, mtype = self._ops.get(reducer)
        # mpi4py counts a user-typed send buffer per block, as the receive buffer
        send = inp if mtype is None else [inp, out.size, mtype]
        self._run(ctx, lambda: self.comm.Ireduce_scatter_block(send, _spec(out, mtype), op))
        reducer.finish(out, self.world_size)

    def all_to_all(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                   out_counts: list[int], in_counts: list[int]) -> None:
        item = inp.dtype.itemsize
        send = [c * item for c in in_counts]
        recv = [c * item for c in out_counts]
        self._run(ctx, lambda: self.comm.Ialltoallv(
            [_bytes(inp), (send, _offsets(send))], [_bytes(out), (recv, _offsets(recv))]))

    def barrier(self, ctx: CallContext) -> None:
        self._run(ctx, self.comm.Ibarrier)

    # -- point to point --------------------------------------------------------------
    def _p2p(self, ctx: CallContext, tag: int):
        return self.p2p_comms[tag >> _TAG_BITS], tag & ((1 << _TAG_BITS) - 1)

    def send(self, ctx: CallContext, buf: np.ndarray, dst: int, tag: int, done) -> None:
        comm, mtag = self._p2p(ctx, tag)
        self._post(ctx, done, lambda: comm.Isend(_bytes(buf), dst, mtag))

    def recv(self, ctx: CallContext, buf: np.ndarray, src: int, tag: int, done) -> None:
        comm, mtag = self._p2p(ctx, tag)
        self._post(ctx, done, lambda: comm.Irecv(_bytes(buf), src, mtag))

    def _post(self, ctx: CallContext, done, start) -> None:
        if self._error is not None:
            done(self._error)
            return
        try:
            req = start()
        except self.MPI.Exception as err:
            done(self._translate(err, "%s (p2p seq %d)" % (ctx.op, ctx.seq)))
            return
        with self._lock:
            self._pending.append([req, done, ctx])
        self._wake.set()

    # -- lifecycle -------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Revoke the communicators (every pending call on them ends, on every rank)
        after posting the reason for the peers; local and bounded."""
        with self._lock:
            if self._revoked:
                return
            self._revoked = True
            if self._error is None:
                self._error = error
            pending, self._pending = self._pending, []
        info = dict(error_to_wire(error), by=self.rank)
        poster = threading.Thread(target=self._post_reason, args=(info,), daemon=True,
                                  name="kiln-mpi-revoke-reason")
        poster.start()
        poster.join(0.5)  # peers look for it when their calls end: post it first, bounded
        for comm in self._comms:
            try:
                comm.Revoke()
            except self.MPI.Exception:
                pass
        for _, done, _ in pending:
            done(self._error)
        self._stop = True
        self._wake.set()

    def _post_reason(self, info: dict) -> None:
        try:
            client = self.store.clone()
            try:
                client.compare_and_set("%s/mpi/revoked" % self.prefix, None, json.dumps(info))
            finally:
                client.close()
        except StoreError:
            pass  # the peers fall back to MPI's own view of the failure

    def communicators(self) -> list:
        """The communicators of this group (freed at exit: mpi_world.free_communicators)."""
        return [self.comm] + self._comms

    def close(self) -> None:
        """Leave the group: stop the watcher and the ring's helper thread (the
        communicators are freed at exit, by mpi_world.free_communicators)."""
        with self._lock:
            if self._error is None:
                self._error = GroupAborted("group '%s' was closed" % self.group)
            pending, self._pending = self._pending, []
        for _, done, _ in pending:
            done(self._error)
        self._stop = True
        self._wake.set()
        self._watcher.join(1.0)
        self._ring.close()


class _Revoked(Exception):
    """Stands for the MPI exception of a call on a revoked communicator."""

    def __init__(self, MPI):
        super().__init__("revoked")
        self._class = MPI.ERR_REVOKED

    def Get_error_class(self) -> int:
        return self._class


def _offsets(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
