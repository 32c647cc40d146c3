"""`NcclBackend`: kiln's `Backend` contract over one nonblocking NCCL communicator.

Rendezvous (kiln.distributed.nccl_groups): rank 0 makes the NCCL unique id and
publishes it under the group's prefix in kiln's authenticated store; every rank reads it
and creates its communicator with `NcclComm.init` (nonblocking, polled, bounded). A
fault-tolerant group's later epochs shrink and grow the previous communicator in place,
and `ProcessGroup.split` is one `ncclCommSplit`. Each collective is enqueued on the
backend's stream and waited for through its event, bounded by the call's deadline;
gather, scatter, all_to_all and p2p are grouped ncclSend/ncclRecv calls.

Buffers are passed to NCCL by address, so with the real library they must be device
accessible (kiln's CUDA tensors live in managed memory); the fake NCCL of the tests
works on host memory. Types NCCL has no reduction for are mapped: bool reduces as
uint8 (sum/max -> max, prod/min -> min), complex sums as pairs of floats.

    backend = NcclBackend.rendezvous(store, "pg/world/e0", rank, world, token, 60.0)
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from kiln.distributed import nccl_api as api
from kiln.distributed.backend import Backend, CallContext
from kiln.distributed.buffers import Reducer
from kiln.distributed.errors import CollectiveArgumentError
from kiln.distributed.nccl_comm import NcclComm

_BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class NcclBackend(Backend):
    """One rank of a group over NCCL (see the module docstring)."""

    name = "nccl"

    def __init__(self, comm: NcclComm, stream: int = 0, *, groups=None, key: str = "",
                 epoch: int = 0):
        self.comm, self.stream = comm, stream
        self.rank, self.world_size = comm.rank, comm.size
        self.groups, self.key, self.epoch = groups, key, epoch  # see nccl_groups
        self._scratch = np.zeros(1, np.int32)
        self._rma_engine = None  # NcclRma, made by the first pg.window

    @classmethod
    def rendezvous(cls, store, prefix: str, rank: int, world_size: int, token: str,
                   timeout: float, epoch: int = 0, *, nccl: api.NcclApi | None = None
                   ) -> "NcclBackend":
        """Exchange the unique id through `store` under `prefix` and create the
        communicator, or derive it from this process's previous one for the group
        (shrink/grow: kiln.distributed.nccl_groups). `nccl` is the NcclApi to use
        (default: this process's, the real libnccl unless `set_nccl_api` changed it)."""
        from kiln.distributed.nccl_groups import NcclGroups, default_groups

        groups = default_groups() if nccl is None else NcclGroups(nccl)
        return groups.rendezvous(store, prefix, rank, world_size, token, timeout, epoch)

    def split_backend(self, prefix: str | None, members: list[int] | None,
                      timeout: float) -> "NcclBackend | None":
        """`ProcessGroup.split`'s hook, called on every rank: ncclCommSplit into the
        sub-group of parent ranks `members` (in their new order), None for no group."""
        from kiln.distributed.nccl_groups import NcclGroups

        groups = self.groups if self.groups is not None else NcclGroups(self.comm.api)
        return groups.split(self, prefix, members, timeout)

    # -- helpers ------------------------------------------------------------------------------
    def _wait(self, ctx: CallContext, work) -> None:
        work.wait(timeout=max(ctx.deadline - time.monotonic(), 0.0))

    def _typed(self, op: str, buf: np.ndarray, reduce_op: str) -> tuple[np.ndarray, str]:
        """The buffer and op NCCL reduces (see the module docstring)."""
        if buf.dtype == np.bool_:
            return buf.view(np.uint8), _BOOL_OPS[reduce_op]
        if buf.dtype.kind == "c":
            if reduce_op not in ("sum", "avg"):
                raise CollectiveArgumentError(
                    "%s: NCCL reduces complex tensors with sum or avg only, not %r"
                    % (op, reduce_op))
            return buf.view(buf.real.dtype), reduce_op
        return buf, reduce_op

    @staticmethod
    def _plain(buf: np.ndarray) -> np.ndarray:
        """A view NCCL can move byte for byte (copies need no arithmetic)."""
        return buf.view(np.uint8)

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, ctx: CallContext, buf: np.ndarray, reducer: Reducer) -> None:
        b, op = self._typed("all_reduce", buf, reducer.op)
        self._wait(ctx, self.comm.all_reduce(_ptr(b), _ptr(b), b.size, b.dtype, op,
                                             self.stream))

    def broadcast(self, ctx: CallContext, buf: np.ndarray, src: int) -> None:
        b = self._plain(buf)
        self._wait(ctx, self.comm.broadcast(_ptr(b), _ptr(b), b.size, b.dtype, src,
                                            self.stream))

    def reduce(self, ctx: CallContext, buf: np.ndarray, dst: int, reducer: Reducer) -> None:
        b, op = self._typed("reduce", buf, reducer.op)
        self._wait(ctx, self.comm.reduce(_ptr(b), _ptr(b), b.size, b.dtype, op, dst,
                                         self.stream))

    def all_gather(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray) -> None:
        o, i = self._plain(out), self._plain(inp)
        self._wait(ctx, self.comm.all_gather(_ptr(i), _ptr(o), i.size, np.uint8, self.stream))

    def reduce_scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                       reducer: Reducer) -> None:
        o, op = self._typed("reduce_scatter", out, reducer.op)
        i, _ = self._typed("reduce_scatter", inp, reducer.op)
        self._wait(ctx, self.comm.reduce_scatter(_ptr(i), _ptr(o), o.size, o.dtype, op,
                                                 self.stream))

    def _exchange(self, ctx: CallContext, sends, recvs) -> None:
        sends = [(p, n, peer) for p, n, peer in sends if n]
        recvs = [(p, n, peer) for p, n, peer in recvs if n]
        if sends or recvs:
            self._wait(ctx, self.comm.send_recv(sends, recvs, np.uint8, self.stream))

    def gather(self, ctx: CallContext, out: np.ndarray | None, inp: np.ndarray,
               dst: int) -> None:
        i = self._plain(inp)
        if self.rank != dst:
            self._exchange(ctx, [(_ptr(i), i.size, dst)], [])
            return
        o = self._plain(out)
        n = i.size
        o[dst * n:(dst + 1) * n] = i
        self._exchange(ctx, [], [(_ptr(o) + r * n, n, r) for r in range(self.world_size)
                                 if r != dst])

    def scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray | None,
                src: int) -> None:
        o = self._plain(out)
        if self.rank != src:
            self._exchange(ctx, [], [(_ptr(o), o.size, src)])
            return
        i, n = self._plain(inp), o.size
        o[:] = i[src * n:(src + 1) * n]
        self._exchange(ctx, [(_ptr(i) + r * n, n, r) for r in range(self.world_size)
                             if r != src], [])

    def all_to_all(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                   out_counts: list[int], in_counts: list[int]) -> None:
        item = inp.dtype.itemsize
        o, i = self._plain(out), self._plain(inp)
        in_off = np.concatenate([[0], np.cumsum(in_counts)]) * item
        out_off = np.concatenate([[0], np.cumsum(out_counts)]) * item
        me = self.rank
        o[out_off[me]:out_off[me + 1]] = i[in_off[me]:in_off[me + 1]]
        peers = [r for r in range(self.world_size) if r != me]
        self._exchange(ctx, [(_ptr(i) + int(in_off[r]), in_counts[r] * item, r) for r in peers],
                       [(_ptr(o) + int(out_off[r]), out_counts[r] * item, r) for r in peers])

    def barrier(self, ctx: CallContext) -> None:
        s = self._scratch
        self._wait(ctx, self.comm.all_reduce(_ptr(s), _ptr(s), 1, np.int32, "sum",
                                             self.stream))

    # -- p2p: NCCL matches sends and receives in order per peer pair (no tags) ------------------
    def send(self, ctx: CallContext, buf: np.ndarray, dst: int, tag: int,
             done: Callable[[BaseException | None], None]) -> None:
        self._p2p(ctx, [(_ptr(self._plain(buf)), buf.nbytes, dst)], [], done, buf)

    def recv(self, ctx: CallContext, buf: np.ndarray, src: int, tag: int,
             done: Callable[[BaseException | None], None]) -> None:
        self._p2p(ctx, [], [(_ptr(self._plain(buf)), buf.nbytes, src)], done, buf)

    def _p2p(self, ctx, sends, recvs, done, buf: np.ndarray) -> None:
        """Enqueue now (keeps the per-peer order), complete on a helper thread: a send
        never waits here for its receiver. The wait is bounded by the call's deadline;
        the thread holds `buf` until NCCL is done with it."""
        try:
            work = self.comm.send_recv(sends, recvs, np.uint8, self.stream)
        except BaseException as exc:  # noqa: BLE001 - handed to the Work
            done(exc)
            return

        def complete(keep=buf) -> None:
            try:
                work.wait(timeout=max(ctx.deadline - time.monotonic(), 0.0))
            except BaseException as exc:  # noqa: BLE001 - handed to the Work
                done(exc)
                return
            done(None)

        threading.Thread(target=complete, name="kiln-nccl-p2p", daemon=True).start()

    # -- RMA windows: NCCL registered windows, put/signal (kiln.distributed.nccl_window) ----
    def _rma(self):
        if self._rma_engine is None:
            from kiln.distributed.nccl_window import NcclRma
            self._rma_engine = NcclRma(self)
        return self._rma_engine

    def window_register(self, memory) -> None:
        self._rma().register(memory)

    def window_unregister(self, window_id: int, error: BaseException) -> None:
        self._rma().unregister(window_id, error)

    def window_put(self, window_id: int, dst: int, offset: int, data: np.ndarray,
                   done) -> None:
        self._rma().put(window_id, dst, offset, data, done)

    def window_signal(self, window_id: int, dst: int, slot: int, value: int, done) -> None:
        self._rma().signal(window_id, dst, slot, value, done)

    def window_get(self, window_id: int, src: int, offset: int, out: np.ndarray,
                   done) -> None:
        self._rma().unsupported("get", done)

    def window_accumulate(self, window_id: int, dst: int, offset: int, data: np.ndarray,
                          reduce_op: str, done) -> None:
        self._rma().unsupported("accumulate", done)

    # -- lifetime -----------------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Stop the communicator's work: revoked, not freed, so that the group's next
        epoch can shrink it (nccl_groups); freed when nothing will."""
        if self._rma_engine is not None:
            self._rma_engine.fail(error)
        self.comm.stop()
        if self.groups is None or not self.groups.retains(self):
            self.comm.free()

    def close(self) -> None:
        """Leave the group: the communicator is kept while it may be the parent of the
        group's next epoch (its NcclGroups frees it then, or on release), freed otherwise."""
        if self._rma_engine is not None:
            from kiln.distributed.errors import GroupAborted
            self._rma_engine.fail(GroupAborted("the nccl backend of rank %d was closed"
                                               % self.rank))
        if self.groups is None or not self.groups.retains(self):
            self.comm.free()
