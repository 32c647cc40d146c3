"""The backend interface: what a transport must provide to run a `ProcessGroup`.

A `ProcessGroup` validates arguments, orders calls, keeps deadlines and the Flight
Recorder; a `Backend` only moves and combines bytes. Collective methods are called
on the group's progress thread, one at a time, in the same order on every rank, with
flat (1-D, contiguous) numpy buffers already checked; they return when the call is
done on this rank or raise a `DistributedError`. A GPU backend (NCCL) would enqueue
on its stream here and wait on an event; an MPI backend would call mpi4py.

    class MyBackend(Backend):
        name = "mine"
        @classmethod
        def rendezvous(cls, store, prefix, rank, world_size, token, timeout): ...
        def all_reduce(self, ctx, buf, reducer): ...
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kiln.distributed.buffers import Reducer
from kiln.distributed.errors import DistributedError


OP_NAMES = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
            "reduce_scatter", "all_to_all", "barrier", "p2p", "split")
OP_CODES = {name: i + 1 for i, name in enumerate(OP_NAMES)}


@dataclass(slots=True)
class CallContext:
    """What a backend needs to know about one call besides its buffers.

    `count` is the call's element count that every rank must agree on (-1 where ranks
    may legitimately differ, as in all_to_all); backends may send it along to detect
    mismatched calls. `deadline` is a `time.monotonic()` value. `before_blocking`, when
    set, must be called (once is enough) before the first phase of an `eager` call
    waits for anything, e.g. for socket space: the group then records the call in the
    Flight Recorder, which it otherwise does only after the sends went out.
    """

    seq: int
    op: str
    op_code: int
    deadline: float
    dtype_code: int = 0
    reduce_code: int = 0
    count: int = -1
    before_blocking: Callable[[], None] | None = None


class Backend(abc.ABC):
    """Moves data between the ranks of one group. One instance per group and epoch."""

    name: str = "abstract"
    rank: int
    world_size: int

    @classmethod
    @abc.abstractmethod
    def rendezvous(cls, store, prefix: str, rank: int, world_size: int, token: str,
                   timeout: float, epoch: int = 0) -> "Backend":
        """Connect `world_size` ranks that agree on `prefix` (their keys in `store`)."""

    def set_failure_handler(self, handler: Callable[[BaseException], None]) -> None:
        """`handler(error)` is called once when the backend detects a failure on its own
        (a peer's EOF, an abort notice) outside of a running call."""
        self._failure_handler = handler

    def eager(self, op: str, *bufs: np.ndarray) -> Callable | None:
        """How to run collective `op` on these flat buffers in two phases, or None
        (default: never). The buffers: all_reduce, broadcast, reduce: the tensor;
        all_gather, reduce_scatter: (output, input); gather: input; scatter: output;
        barrier: none.

        The function returned takes the method `op`'s arguments (ctx first). It makes
        every send this rank owes its peers for the call, never waiting on a peer, and
        returns the second phase: an object whose `progress(soft=None)` finishes the
        call on this rank (receives, local reduction) and returns True, or, given `soft`
        (a `time.monotonic()` value), returns False rather than block past it, and may
        be called again. `ProcessGroup` may run the first phase on the caller's thread
        at submission and the second on whichever thread waits; the messages must be
        those the method `op` would exchange, whichever way a peer runs the call."""
        return None

    @abc.abstractmethod
    def all_reduce(self, ctx: CallContext, buf: np.ndarray, reducer: Reducer) -> None: ...

    @abc.abstractmethod
    def broadcast(self, ctx: CallContext, buf: np.ndarray, src: int) -> None: ...

    @abc.abstractmethod
    def reduce(self, ctx: CallContext, buf: np.ndarray, dst: int, reducer: Reducer) -> None: ...

    @abc.abstractmethod
    def all_gather(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray) -> None:
        """`out` holds world_size slots of inp.size elements, in rank order."""

    @abc.abstractmethod
    def gather(self, ctx: CallContext, out: np.ndarray | None, inp: np.ndarray,
               dst: int) -> None: ...

    @abc.abstractmethod
    def scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray | None,
                src: int) -> None: ...

    @abc.abstractmethod
    def reduce_scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                       reducer: Reducer) -> None:
        """`inp` holds world_size slots of out.size elements; slot `rank` lands in out."""

    @abc.abstractmethod
    def all_to_all(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                   out_counts: list[int], in_counts: list[int]) -> None:
        """Slot j of `inp` (in_counts[j] elements) goes to rank j; slot i of `out` comes
        from rank i."""

    @abc.abstractmethod
    def barrier(self, ctx: CallContext) -> None: ...

    @abc.abstractmethod
    def send(self, ctx: CallContext, buf: np.ndarray, dst: int, tag: int,
             done: Callable[[BaseException | None], None]) -> None:
        """Start sending; call done(error) when the buffer may be reused. Never blocks
        on the receiver."""

    @abc.abstractmethod
    def recv(self, ctx: CallContext, buf: np.ndarray, src: int, tag: int,
             done: Callable[[BaseException | None], None]) -> None:
        """Post a receive; call done(error) when `buf` holds the message."""

    # -- RMA windows (optional; see kiln.distributed.window) ----------------------------
    # A backend that has them serves a peer's put/get/accumulate/signal on the target
    # without the target's user code, applies each one to a registered `WindowMemory`
    # (its `lock` held: atomic with respect to the other RMA ops on the window), and
    # applies one origin's operations on one window in the order they were issued.
    # `done(error)` is called once the target applied the operation (for a get: once
    # the data is in `out`), or with the error: the target's refusal, the transport's
    # failure, or the error given to `window_unregister`.
    def window_register(self, memory) -> None:
        """Expose `memory` (a `window.WindowMemory`) to peers under `memory.id`."""
        raise DistributedError("backend %s has no RMA windows" % self.name,
                               hint="use the tcp backend for pg.window()")

    def window_unregister(self, window_id: int, error: BaseException) -> None:
        """Stop serving window `window_id`; its pending operations fail with `error`."""
        raise DistributedError("backend %s has no RMA windows" % self.name)

    def window_put(self, window_id: int, dst: int, offset: int, data: np.ndarray,
                   done: Callable[[BaseException | None], None]) -> None:
        """Write the flat array `data` at element `offset` of `dst`'s window."""
        raise DistributedError("backend %s has no RMA windows" % self.name)

    def window_get(self, window_id: int, src: int, offset: int, out: np.ndarray,
                   done: Callable[[BaseException | None], None]) -> None:
        """Read `out.size` elements at `offset` of `src`'s window into the flat `out`."""
        raise DistributedError("backend %s has no RMA windows" % self.name)

    def window_accumulate(self, window_id: int, dst: int, offset: int, data: np.ndarray,
                          reduce_op: str, done: Callable[[BaseException | None], None]) -> None:
        """Combine `data` into `dst`'s window at `offset` with `reduce_op`."""
        raise DistributedError("backend %s has no RMA windows" % self.name)

    def window_signal(self, window_id: int, dst: int, slot: int, value: int,
                      done: Callable[[BaseException | None], None]) -> None:
        """Add `value` to signal counter `slot` of `dst`'s window, after every earlier
        operation of this rank on that window at `dst`."""
        raise DistributedError("backend %s has no RMA windows" % self.name)

    @abc.abstractmethod
    def abort(self, error: BaseException) -> None:
        """Fail everything in flight with `error`, tell the peers, close the connections.
        Local and bounded: it never waits on a peer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the group cleanly (peers see a departure, not a crash)."""
