"""`NcclComm`: one nonblocking NCCL communicator with deadlines, over any `NcclApi`.

Every communicator kiln makes is nonblocking (`config.blocking = 0`): management calls
may return `ncclInProgress` and are finished by polling `ncclCommGetAsyncError`, and
that is what makes `ncclCommAbort`/`ncclCommShrink(NCCL_SHRINK_ABORT)` safe while a
peer is dead. Collectives are enqueued on a stream and complete through an event; a
`NcclWork.wait` polls the event and the communicator's async error, bounded by its
deadline. On a failure or a timeout of a working communicator it is *revoked*
(ncclCommRevoke: in-flight and later work stops, the communicator stays valid) and the
error raised, so it can still be the parent of an `ncclCommShrink(NCCL_SHRINK_ABORT)`;
one that never finished initializing is aborted. Deciding who survives is the caller's
business (kiln's store-agreed epochs); `free` releases a communicator for good.

    comm = NcclComm.init(api, nranks, unique_id, rank, timeout=60.0)
    comm.all_reduce(send_ptr, recv_ptr, n, np.float32, "sum").wait()
"""

from __future__ import annotations

import threading
import time

from kiln.distributed import nccl_api as api
from kiln.distributed.errors import CollectiveTimeout, NcclError

_POLL_MIN, _POLL_MAX = 1e-4, 5e-3  # seconds between polls of a pending call


def _sleep(step: float) -> float:
    time.sleep(step)
    return min(step * 2, _POLL_MAX)


class NcclWork:
    """A call enqueued on a stream: done when its event is, failed when the
    communicator's async error says so."""

    def __init__(self, comm: "NcclComm", call: str, event: int, deadline: float):
        self.comm, self.call, self.event, self.deadline = comm, call, event, deadline
        self._done = False

    def is_completed(self) -> bool:
        """Poll once: True when done; raises if the communicator failed."""
        if self._done:
            return True
        if self.comm.api.event_query(self.event):
            self._finish()
            return True
        self.comm.check_async(self.call)
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until done, at most until the call's deadline (or `timeout` seconds);
        on timeout the communicator is aborted and `CollectiveTimeout` (K203) raised."""
        deadline = self.deadline if timeout is None else min(
            self.deadline, time.monotonic() + timeout)
        step = _POLL_MIN
        while not self.is_completed():
            if time.monotonic() >= deadline:
                how = self.comm.stop()
                raise CollectiveTimeout(
                    "NCCL %s on rank %d did not complete within its deadline; the "
                    "communicator was %s" % (self.call, self.comm.rank, how))
            step = _sleep(step)

    def _finish(self) -> None:
        self._done = True
        self.comm.api.event_destroy(self.event)


class NcclComm:
    """A nonblocking communicator (`handle`) of `size` ranks; this process is `rank`."""

    def __init__(self, napi: api.NcclApi, handle: int, rank: int, size: int,
                 timeout: float):
        self.api, self.handle, self.rank, self.size = napi, handle, rank, size
        self.timeout = timeout
        self.aborted = False  # freed (ncclCommAbort/Destroy): the handle is gone
        self.revoked = False  # ncclCommRevoke: no more work, still a valid parent
        self.ready = False  # its (nonblocking) creation completed
        self.lock = threading.RLock()  # serializes the calls that enqueue work

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def init(cls, napi: api.NcclApi, nranks: int, unique_id: bytes, rank: int, *,
             timeout: float) -> "NcclComm":
        """ncclCommInitRankConfig(blocking=0), polled to completion within `timeout`."""
        res, handle = napi.comm_init_rank_config(nranks, unique_id, rank, blocking=False)
        comm = cls(napi, handle, rank, nranks, timeout)
        comm._settle("ncclCommInitRankConfig", res, time.monotonic() + timeout)
        comm.ready = True
        return comm

    def _settle(self, call: str, res: int, deadline: float) -> None:
        """Finish a nonblocking management call on this communicator: poll its async
        state until it is no longer in progress, abort and raise on error or deadline."""
        if res not in (api.SUCCESS, api.IN_PROGRESS):
            self._fail(call, res)
        step = _POLL_MIN
        while True:
            got, state = self.api.comm_get_async_error(self.handle)
            if got != api.SUCCESS:
                self._fail("ncclCommGetAsyncError", got)
            if state == api.SUCCESS:
                return
            if state != api.IN_PROGRESS:
                self._fail(call, state)
            if time.monotonic() >= deadline:
                how = self.stop()
                raise CollectiveTimeout("NCCL %s on rank %d was still in progress at its "
                                        "deadline; the communicator was %s"
                                        % (call, self.rank, how))
            step = _sleep(step)

    def _parent(self, call: str) -> None:
        """A freed communicator cannot be split, shrunk or grown (its handle is gone)."""
        if self.aborted or not self.ready:
            raise NcclError("%s on rank %d: the parent communicator was %s" % (
                call, self.rank, "aborted" if self.aborted else "never initialized"),
                call=call, result=api.INVALID_USAGE,
                hint="a failed communicator is revoked, not aborted, so that it can shrink")

    def _child(self, call: str, res: int, handle: int, rank: int, size: int) -> "NcclComm | None":
        if res not in (api.SUCCESS, api.IN_PROGRESS):
            self._fail(call, res)
        if not handle:
            return None
        child = NcclComm(self.api, handle, rank, size, self.timeout)
        child._settle(call, res, time.monotonic() + self.timeout)
        child.ready = True
        return child

    def split(self, color: int, key: int, *, rank: int, size: int) -> "NcclComm | None":
        """ncclCommSplit: the ranks with this `color` (api.SPLIT_NOCOLOR: none) form a new
        communicator ordered by `key`; `rank`/`size` are this rank's place in it, which
        the caller computed from the colors every rank agreed on through the store."""
        self._parent("ncclCommSplit")
        res, handle = self.api.comm_split(self.handle, color, key, blocking=False)
        return self._child("ncclCommSplit", res, handle, rank, size)

    def shrink(self, exclude: list[int], *, abort_pending: bool = True) -> "NcclComm":
        """ncclCommShrink without the `exclude` ranks (the failed ones, agreed through the
        store); with `abort_pending` (NCCL_SHRINK_ABORT) pending work is dropped first,
        as it must be when a peer is dead. Survivors keep their order."""
        self._parent("ncclCommShrink")
        flags = api.SHRINK_ABORT if abort_pending else api.SHRINK_DEFAULT
        gone = sorted(set(exclude))
        res, handle = self.api.comm_shrink(self.handle, gone, flags, blocking=False)
        new_rank = self.rank - sum(1 for r in gone if r < self.rank)
        return self._child("ncclCommShrink", res, handle, new_rank, self.size - len(gone))

    def grow_id(self) -> bytes:
        """ncclCommGetUniqueId: the id one member publishes (through the store) for the
        ranks that will join at the next grow."""
        self._parent("ncclCommGetUniqueId")
        res, uid = self.api.comm_get_unique_id(self.handle)
        if res != api.SUCCESS:
            self._fail("ncclCommGetUniqueId", res)
        return uid

    def grow(self, nranks: int) -> "NcclComm":
        """ncclCommGrow as a member: the new communicator has `nranks` ranks; members keep
        their ranks, joiners take the ranks after them."""
        self._parent("ncclCommGrow")
        res, handle = self.api.comm_grow(self.handle, nranks, None, -1, blocking=False)
        return self._child("ncclCommGrow", res, handle, self.rank, nranks)

    @classmethod
    def join(cls, napi: api.NcclApi, nranks: int, grow_id: bytes, rank: int, *,
             timeout: float) -> "NcclComm":
        """ncclCommGrow as a joiner (no parent communicator), with the members' grow id."""
        res, handle = napi.comm_grow(0, nranks, grow_id, rank, blocking=False)
        comm = cls(napi, handle, rank, nranks, timeout)
        comm._settle("ncclCommGrow", res, time.monotonic() + timeout)
        comm.ready = True
        return comm

    # -- failure and teardown ---------------------------------------------------------------
    def check_async(self, call: str) -> None:
        """Raise (after revoking) if the communicator reports an asynchronous error."""
        if self.aborted or self.revoked:
            raise NcclError("NCCL %s on rank %d: the communicator was %s" % (
                call, self.rank, "aborted" if self.aborted else "revoked"),
                call=call, result=api.INVALID_USAGE)
        got, state = self.api.comm_get_async_error(self.handle)
        if got != api.SUCCESS:
            self._fail("ncclCommGetAsyncError", got)
        if state not in (api.SUCCESS, api.IN_PROGRESS):
            self._fail(call, state)

    def _fail(self, call: str, res: int):
        text = self.api.get_error_string(res)
        how = self.stop()
        raise NcclError("%s on rank %d of %d failed: %s (%s); the communicator was %s"
                        % (call, self.rank, self.size, api.result_name(res), text, how),
                        call=call, result=res)

    def stop(self) -> str:
        """End this communicator's work after a failure; never raises. A working one is
        revoked (it stays the parent of a later shrink), one still being created is
        aborted. Returns what was done ("revoked" / "aborted")."""
        if self.ready and not self.aborted:
            if not self.revoked:
                self.revoked = True
                self.api.comm_revoke(self.handle)
            return "revoked"
        self.abort()
        return "aborted"

    def revoke(self) -> None:
        """ncclCommRevoke: stop this communicator's in-flight work (before a shrink)."""
        if self.revoked or self.aborted:
            return
        self.revoked = True
        res = self.api.comm_revoke(self.handle)
        if res not in (api.SUCCESS, api.IN_PROGRESS):
            self._fail("ncclCommRevoke", res)

    def abort(self) -> None:
        """ncclCommAbort, once; never raises (it runs on failure paths). The handle is
        freed: the communicator cannot be shrunk or grown afterwards."""
        if not self.aborted and self.handle:
            self.aborted = True
            self.api.comm_abort(self.handle)

    def free(self) -> None:
        """Release the communicator: finalize and destroy a healthy one (bounded by the
        timeout), abort a revoked or failed one; never raises."""
        if self.aborted or not self.handle:
            return
        if self.revoked or not self.ready:
            self.abort()
            return
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - a failed flush: abort is the way out
            self.abort()

    def destroy(self) -> None:
        """Finalize (flush pending work, bounded by the timeout), then destroy."""
        if self.aborted or not self.handle:
            return
        self._settle("ncclCommFinalize", self.api.comm_finalize(self.handle),
                     time.monotonic() + self.timeout)
        self.aborted = True
        self.api.comm_destroy(self.handle)

    # -- collectives --------------------------------------------------------------------------
    def _enqueue(self, call: str, issue, stream: int) -> NcclWork:
        """Run `issue()` (one NCCL call on the stream) and record its event, under the
        communicator's lock: NCCL calls on one communicator must not run concurrently
        (the group's progress thread and the RMA thread both issue them)."""
        with self.lock:
            res = issue() if callable(issue) else issue
            if res not in (api.SUCCESS, api.IN_PROGRESS):
                self._fail(call, res)
            event = self.api.event_record(stream)
        return NcclWork(self, call, event, time.monotonic() + self.timeout)

    def _dt(self, call: str, dtype) -> int:
        code = api.nccl_dtype(dtype)
        if code < 0:
            raise NcclError("%s: NCCL has no data type for %s" % (call, dtype), call=call,
                            result=api.INVALID_ARGUMENT,
                            hint="cast to a numeric dtype NCCL reduces (int8..float64, bfloat16)")
        return code

    def _op(self, call: str, op: str) -> int:
        if op not in api.REDUCE_OPS:
            raise NcclError("%s: unknown reduce op %r; NCCL has %s" % (
                call, op, ", ".join(api.REDUCE_OPS)), call=call, result=api.INVALID_ARGUMENT)
        return api.REDUCE_OPS[op]

    def all_reduce(self, send: int, recv: int, count: int, dtype, op: str = "sum",
                   stream: int = 0) -> NcclWork:
        """ncclAllReduce of `count` elements (send may equal recv: in place)."""
        c = "ncclAllReduce"
        dt, rop, h = self._dt(c, dtype), self._op(c, op), self.handle
        return self._enqueue(c, lambda: self.api.all_reduce(send, recv, count, dt, rop, h,
                                                            stream), stream)

    def broadcast(self, send: int, recv: int, count: int, dtype, root: int,
                  stream: int = 0) -> NcclWork:
        c = "ncclBroadcast"
        dt, h = self._dt(c, dtype), self.handle
        return self._enqueue(c, lambda: self.api.broadcast(send, recv, count, dt, root, h,
                                                           stream), stream)

    def reduce(self, send: int, recv: int, count: int, dtype, op: str, root: int,
               stream: int = 0) -> NcclWork:
        c = "ncclReduce"
        dt, rop, h = self._dt(c, dtype), self._op(c, op), self.handle
        return self._enqueue(c, lambda: self.api.reduce(send, recv, count, dt, rop, root, h,
                                                        stream), stream)

    def all_gather(self, send: int, recv: int, send_count: int, dtype,
                   stream: int = 0) -> NcclWork:
        """recv holds `size` slots of send_count elements, in rank order."""
        c = "ncclAllGather"
        dt, h = self._dt(c, dtype), self.handle
        return self._enqueue(c, lambda: self.api.all_gather(send, recv, send_count, dt, h,
                                                            stream), stream)

    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype, op: str = "sum",
                       stream: int = 0) -> NcclWork:
        c = "ncclReduceScatter"
        dt, rop, h = self._dt(c, dtype), self._op(c, op), self.handle
        return self._enqueue(c, lambda: self.api.reduce_scatter(send, recv, recv_count, dt,
                                                                rop, h, stream), stream)

    def send_recv(self, sends: list[tuple[int, int, int]], recvs: list[tuple[int, int, int]],
                  dtype, stream: int = 0) -> NcclWork:
        """One group of ncclSend (buf, count, peer) and ncclRecv (buf, count, peer) calls
        (all_to_all and p2p are built from this)."""
        dt = self._dt("ncclSend/ncclRecv", dtype)
        with self.lock:
            return self._group(sends, recvs, dt, stream)

    def _group(self, sends, recvs, dt: int, stream: int) -> NcclWork:
        res = self.api.group_start()
        if res != api.SUCCESS:
            self._fail("ncclGroupStart", res)
        for buf, count, peer in sends:
            res = self.api.send(buf, count, dt, peer, self.handle, stream)
            if res not in (api.SUCCESS, api.IN_PROGRESS):
                self.api.group_end()
                self._fail("ncclSend", res)
        for buf, count, peer in recvs:
            res = self.api.recv(buf, count, dt, peer, self.handle, stream)
            if res not in (api.SUCCESS, api.IN_PROGRESS):
                self.api.group_end()
                self._fail("ncclRecv", res)
        return self._enqueue("ncclGroupEnd", self.api.group_end(), stream)

    # -- one-sided ------------------------------------------------------------------------------
    def register_window(self, buf: int, nbytes: int) -> int:
        """ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC), collective, polled to
        completion within the timeout: the window handle."""
        c = "ncclCommWindowRegister"
        if self.aborted or self.revoked:
            self.check_async(c)
        res, win = self.api.comm_window_register(self.handle, buf, nbytes,
                                                 api.WIN_COLL_SYMMETRIC)
        self._settle(c, res, time.monotonic() + self.timeout)
        return win

    def deregister_window(self, win: int) -> None:
        """ncclCommWindowDeregister; never raises (it runs when a window is freed)."""
        if not self.aborted and win:
            self.api.comm_window_deregister(self.handle, win)

    def put_signal(self, send: int, nbytes: int, peer: int, win: int, offset: int,
                   stream: int = 0) -> NcclWork:
        """ncclPutSignal of `nbytes` bytes to byte `offset` of `peer`'s window part, then
        one signal (index 0, context 0) to `peer`."""
        c = "ncclPutSignal"
        u8, h = api.DTYPES["uint8"], self.handle
        return self._enqueue(c, lambda: self.api.put_signal(send, nbytes, u8, peer, win, offset,
                                                            0, 0, h, stream), stream)

    def wait_signal(self, counts: dict[int, int], stream: int = 0) -> NcclWork:
        """ncclWaitSignal: the stream waits for counts[peer] more signals from each peer."""
        c = "ncclWaitSignal"
        descs = [(n, peer, 0, 0) for peer, n in sorted(counts.items()) if n > 0]
        h = self.handle
        return self._enqueue(c, lambda: self.api.wait_signal(descs, h, stream), stream)
