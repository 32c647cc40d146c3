"""One collective call of the tcp backend over a `Transport` (`Call`: its sends,
receives, scratch and deadline), and the single-round calls in two phases.

Small calls use the transport's direct lane (`Call(direct=True)`, see tcp_direct):
a send is one blocking `sendmsg` from the running thread, a "posted" receive is only
remembered, and waiting for it reads the message in place. Single-round small calls,
whose sends never depend on a receive (all_gather, gather, scatter, reduce_scatter on
the full mesh; all_reduce, broadcast, reduce and barrier between two ranks), also have
a two-phase form, `start_<op>`: it makes every send the call owes its peers and
returns the `Call`, whose `progress()` finishes it later (receives and local
reductions) with the same messages. `ProcessGroup` uses it to start a call on the
caller's thread at submission without ever blocking there: once this rank's sends
are out, no peer waits on this rank for this call.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.distributed.backend import CallContext
from kiln.distributed.buffers import Reducer
from kiln.distributed.tcp_transport import DATA, HEADER, Request, Transport


def byte_view(arr: np.ndarray) -> memoryview:
    """The raw bytes of a flat contiguous array (any dtype, ml_dtypes included)."""
    return memoryview(arr.view(np.uint8))


def split_counts(count: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` nearly equal slices of `count` elements."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class ScratchPool:
    """Receive scratch reused across calls: fresh pages cost a fault and a kernel
    zeroing each, which for a 256 MB ring step was a visible share of the time. Calls
    run one at a time per group, so one pool per group is enough; `get` hands out
    views of one buffer (each call's scratch must be a single `get`, or disjoint)."""

    def __init__(self) -> None:
        self._mem = np.empty(0, np.uint8)
        self._views: dict = {}  # (shape, dtype) -> view of _mem: small calls repeat

    def get(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        view = self._views.get((shape, dtype))
        if view is not None:
            return view
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if self._mem.size < nbytes:
            self._mem = np.empty(nbytes, np.uint8)
            self._views.clear()
        view = self._mem[:nbytes].view(dtype).reshape(shape)
        if len(self._views) < 64:
            self._views[shape, dtype] = view
        return view


class Call:
    """One collective in progress on this rank: its sends, receives and deadline.

    With `direct`, messages use the direct lanes: `send` writes at once, `recv` only
    notes what to read and `wait` reads it (see the module docstring). A two-phase
    call (`start_<op>`) lists its receives with `expect`; `progress` reads them."""

    __slots__ = ("t", "ctx", "pool", "rank", "n", "sig", "segment_bytes", "direct", "_sends",
                 "_recvs", "_then")

    def __init__(self, transport: Transport, ctx: CallContext, segment_bytes: int,
                 pool: "ScratchPool | None" = None, direct: bool = False):
        self.t, self.ctx = transport, ctx
        self.pool = pool or ScratchPool()
        self.rank, self.n = transport.rank, transport.world_size
        self.sig = (ctx.op_code, ctx.dtype_code, ctx.reduce_code, ctx.count)
        self.segment_bytes = segment_bytes
        self.direct = direct
        self._sends: list[Request] = []
        # lets the receiver threads spot a peer's message for this seq with another
        # signature even when its (step, segment) key matches nothing posted here
        transport.activate(ctx.seq, self.sig)

    def what(self) -> str:
        return "%s (seq %d)" % (self.ctx.op, self.ctx.seq)

    def send(self, peer: int, step: int, seg: int, arr: np.ndarray) -> Request | None:
        if self.direct:
            sig = self.sig
            self.t.links[peer].direct_send(
                HEADER.pack(DATA, sig[0], sig[1], sig[2], self.ctx.seq, step, seg, sig[3],
                            arr.nbytes), arr, self.ctx.deadline, self)
            return None
        req = self.t.isend(peer, DATA, self.sig, self.ctx.seq, step, seg, byte_view(arr),
                           deadline=self.ctx.deadline)
        self._sends.append(req)
        return req

    def recv(self, peer: int, step: int, seg: int, arr: np.ndarray, borrow: bool = False):
        """Post a receive into `arr`. `borrow`: the caller only reads the data, through
        `received(req, arr)` after waiting, which may be the early message's own copy."""
        if self.direct:
            return peer, step, seg, arr  # read when waited for
        return self.t.irecv(peer, DATA, self.sig, self.ctx.seq, step, seg, byte_view(arr),
                            borrow=borrow)

    @staticmethod
    def received(req, arr: np.ndarray) -> np.ndarray:
        """The data of a waited-for receive into `arr` (see `recv`'s `borrow`): `arr`,
        the stash's copy, or the shared-memory slot it came in, which stays the
        caller's until `release(req)`."""
        source = getattr(req, "source", None)
        if source is None:
            return arr
        if isinstance(source, bytearray):
            return np.frombuffer(source, arr.dtype)
        return source.claim().view(arr.dtype)

    @staticmethod
    def release(req) -> None:
        """Done reading what `received(req, ...)` returned: its shared-memory slot (if
        any) goes back to the sender."""
        source = getattr(req, "source", None)
        if source is not None and not isinstance(source, bytearray):
            source.release()

    def wait(self, req) -> None:
        if req is None:  # a direct send: already written
            return
        if self.direct:
            peer, step, seg, arr = req
            self.t.links[peer].direct_recv((DATA, self.ctx.seq, step, seg), self.sig, arr,
                                           self.ctx.deadline, self)
            return
        self.t.wait(req, self.ctx.deadline, self.what())

    def finish(self) -> None:
        """Wait until every send of this call left the buffer (so it may be reused)."""
        for req in self._sends:
            self.wait(req)
        self._sends.clear()

    def segments(self, start: int, stop: int, itemsize: int) -> list[tuple[int, int]]:
        per = max(self.segment_bytes // max(itemsize, 1), 1)
        return [(lo, min(lo + per, stop)) for lo in range(start, stop, per)] or [(start, stop)]

    # -- the second phase of a two-phase call (direct lanes) ----------------------------
    def expect(self, recvs: list, then=None) -> "Call":
        """The rest of the call: read `recvs` [(peer, step, array)] in order, then run
        `then()` (the local reduction, if any). Returns the call."""
        self._recvs, self._then = recvs, then
        return self

    def progress(self, soft: float | None = None) -> bool:
        """Finish the call: True once done. With `soft` (a monotonic time), return False
        instead of blocking past it; the call keeps its place and can go on later."""
        recvs = self._recvs
        while recvs:
            peer, step, arr = recvs[0]
            if not self.t.links[peer].direct_recv((DATA, self.ctx.seq, step, 0), self.sig, arr,
                                                  self.ctx.deadline, self, soft):
                return False
            del recvs[0]
        if self._then is not None:
            self._then()
        return True


# -- single-round calls in two phases (direct lanes; see the module docstring) -----------
# Each sends exactly what its blocking counterpart in tcp_algorithms sends, with the same keys, so
# it interoperates with a peer that runs the same call the other way.
def start_all_reduce_pair(call: Call, buf: np.ndarray, reducer: Reducer) -> Call:
    """Recursive doubling with two ranks: one exchange (step 1), then buf (op)= theirs."""
    peer = call.rank ^ 1
    call.send(peer, 1, 0, buf)
    theirs = call.pool.get(buf.shape, buf.dtype)
    return call.expect([(peer, 1, theirs)], lambda: reducer.accumulate(buf, theirs, 2))


def start_broadcast_pair(call: Call, buf: np.ndarray, src: int) -> Call:
    if call.rank == src:
        call.send(1 - src, 0, 0, buf)
        return call.expect([])
    return call.expect([(src, 0, buf)])


def start_reduce_pair(call: Call, buf: np.ndarray, dst: int, reducer: Reducer) -> Call:
    if call.rank != dst:
        call.send(dst, 0, 0, buf)  # written before this returns: buf is not changed
        return call.expect([])
    theirs = call.pool.get(buf.shape, buf.dtype)
    return call.expect([(1 - dst, 0, theirs)], lambda: reducer.accumulate(buf, theirs, 2))


def start_barrier_pair(call: Call) -> Call:
    empty = np.empty(0, np.uint8)
    call.send(1 - call.rank, 0, 0, empty)
    return call.expect([(1 - call.rank, 0, empty)])


def start_all_gather(call: Call, out: np.ndarray, inp: np.ndarray) -> Call:
    k, r = inp.size, call.rank
    for q in range(call.n):
        if q != r:
            call.send(q, 0, 0, inp)
    out[r * k:(r + 1) * k] = inp
    return call.expect([(q, 0, out[q * k:(q + 1) * k]) for q in range(call.n) if q != r])


def start_gather(call: Call, out: np.ndarray | None, inp: np.ndarray, dst: int) -> Call:
    k, r = inp.size, call.rank
    if r != dst:
        call.send(dst, 0, 0, inp)
        return call.expect([])
    out[r * k:(r + 1) * k] = inp
    return call.expect([(q, 0, out[q * k:(q + 1) * k]) for q in range(call.n) if q != r])


def start_scatter(call: Call, out: np.ndarray, inp: np.ndarray | None, src: int) -> Call:
    k, r = out.size, call.rank
    if r != src:
        return call.expect([(src, 0, out)])
    for q in range(call.n):
        if q != r:
            call.send(q, 0, 0, inp[q * k:(q + 1) * k])
    out[:] = inp[r * k:(r + 1) * k]
    return call.expect([])


def start_reduce_scatter(call: Call, out: np.ndarray, inp: np.ndarray,
                         reducer: Reducer) -> Call:
    """Slot q to rank q; the n contributions are combined in rank order."""
    k, r, n = out.size, call.rank, call.n
    for q in range(n):
        if q != r:
            call.send(q, 0, 0, inp[q * k:(q + 1) * k])
    scratch = call.pool.get((n, k), inp.dtype)
    scratch[r] = inp[r * k:(r + 1) * k]

    def then() -> None:
        out[:] = scratch[0]
        for q in range(1, n):
            reducer.combine(out, out, scratch[q])
        reducer.finish(out, n)
    return call.expect([(q, 0, scratch[q]) for q in range(n) if q != r], then)


STARTERS = {"all_reduce": start_all_reduce_pair, "broadcast": start_broadcast_pair,
            "reduce": start_reduce_pair, "barrier": start_barrier_pair,
            "all_gather": start_all_gather, "gather": start_gather, "scatter": start_scatter,
            "reduce_scatter": start_reduce_scatter}
