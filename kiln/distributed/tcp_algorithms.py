"""Collective algorithms over a `Transport`, chosen by message size.

Large messages use bandwidth-optimal pipelines: a ring reduce-scatter + all-gather
(each rank sends 2(n-1)/n of the buffer), a chain for broadcast, cut into segments so
that sending segment j+1 overlaps reducing segment j; medium all_reduces on
power-of-two groups use recursive halving-doubling instead (2 log2 n steps, same bytes). Small messages use few rounds:
recursive doubling (log2 n rounds) for all_reduce, binomial trees for broadcast and
reduce, direct exchange on the full mesh for all_gather and reduce_scatter.
Receives are posted before the data can arrive, into their final place where the
algorithm allows, so payloads land with one `recv_into` and no extra copy.

Small calls use the transport's direct lane (`Call(direct=True)`, see tcp_transport):
a send is one blocking `sendmsg` from the running thread, a "posted" receive is only
remembered, and waiting for it reads the message in place. Single-round small calls,
whose sends never depend on a receive (all_gather, gather, scatter, reduce_scatter on
the full mesh; all_reduce, broadcast, reduce and barrier between two ranks), also have
a two-phase form, `start_<op>`: it makes every send the call owes its peers and
returns the `Call`, whose `progress()` finishes it later (receives and local
reductions) with the same messages. `ProcessGroup` uses it to start a call on the caller's thread
at submission without ever blocking there: once this rank's sends are out, no peer
waits on this rank for this call.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.distributed.backend import CallContext
from kiln.distributed.buffers import Reducer
from kiln.distributed.tcp_transport import DATA, HEADER, Request, Transport

_RESULT_STEP = 1 << 30  # recursive doubling: the result sent back to a folded-in rank


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


# -- all_reduce --------------------------------------------------------------------------
def allreduce_recursive_doubling(call: Call, buf: np.ndarray, reducer: Reducer) -> None:
    """log2(n) exchange rounds; ranks beyond the largest power of two fold in first."""
    n, r = call.n, call.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if r >= p:  # fold into r - p, get the result back
        call.send(r - p, 0, 0, buf)
        call.wait(call.recv(r - p, _RESULT_STEP, 0, buf))
        call.finish()
        return
    rounds = p.bit_length() - 1
    scratch = np.empty((rounds + 1, buf.size), buf.dtype)
    partners = [r ^ (1 << k) for k in range(rounds)]
    reqs = [call.recv(peer, k + 1, 0, scratch[k + 1]) for k, peer in enumerate(partners)]
    if r < rem:
        call.wait(call.recv(r + p, 0, 0, scratch[0]))
        reducer.combine(buf, buf, scratch[0])
    for k, peer in enumerate(partners):
        sent = call.send(peer, k + 1, 0, buf)
        call.wait(reqs[k])
        call.wait(sent)  # buf is about to change under the send
        reducer.combine(buf, buf, scratch[k + 1])
    reducer.finish(buf, n)
    if r < rem:
        call.send(r + p, _RESULT_STEP, 0, buf)
    call.finish()


def ring_reduce_scatter(call: Call, work: np.ndarray, chunks: list[tuple[int, int]],
                        reducer: Reducer, shift: int, step0: int = 0) -> int:
    """Reduce `work` (n chunks) in place around the ring; returns the chunk this rank
    then holds fully reduced, (rank + shift + 1) mod n."""
    n, r = call.n, call.rank
    right, left = (r + 1) % n, (r - 1) % n
    size = max(hi - lo for lo, hi in chunks)
    rbuf = call.pool.get((2, size), work.dtype)
    segs = [call.segments(lo, hi, work.itemsize) for lo, hi in chunks]

    def post(s: int) -> list[Request]:
        c = (r + shift - s - 1) % n
        off = chunks[c][0]
        return [call.recv(left, step0 + s, j, rbuf[s % 2, lo - off:hi - off], borrow=True)
                for j, (lo, hi) in enumerate(segs[c])]

    for j, (lo, hi) in enumerate(segs[(r + shift) % n]):
        call.send(right, step0, j, work[lo:hi])
    pending = {s: post(s) for s in range(min(2, n - 1))}
    for s in range(n - 1):
        c = (r + shift - s - 1) % n
        off = chunks[c][0]
        for j, (lo, hi) in enumerate(segs[c]):
            req = pending[s][j]
            call.wait(req)
            reducer.combine(work[lo:hi], work[lo:hi],
                            call.received(req, rbuf[s % 2, lo - off:hi - off]))
            call.release(req)
            if s + 1 < n - 1:
                call.send(right, step0 + s + 1, j, work[lo:hi])
        del pending[s]
        if s + 2 < n - 1:
            pending[s + 2] = post(s + 2)
    return (r + shift + 1) % n


def ring_all_gather(call: Call, buf: np.ndarray, chunks: list[tuple[int, int]], shift: int,
                    step0: int = 0) -> None:
    """Every rank starts with chunk (rank + shift) mod n of `buf` and ends with all."""
    n, r = call.n, call.rank
    right, left = (r + 1) % n, (r - 1) % n
    segs = [call.segments(lo, hi, buf.itemsize) for lo, hi in chunks]
    reqs = [[call.recv(left, step0 + s, j, buf[lo:hi])
             for j, (lo, hi) in enumerate(segs[(r + shift - s - 1) % n])] for s in range(n - 1)]
    for j, (lo, hi) in enumerate(segs[(r + shift) % n]):
        call.send(right, step0, j, buf[lo:hi])
    for s in range(n - 1):
        for j, (lo, hi) in enumerate(segs[(r + shift - s - 1) % n]):
            call.wait(reqs[s][j])
            if s + 1 < n - 1:
                call.send(right, step0 + s + 1, j, buf[lo:hi])


def allreduce_ring(call: Call, buf: np.ndarray, reducer: Reducer) -> None:
    chunks = split_counts(buf.size, call.n)
    own = ring_reduce_scatter(call, buf, chunks, reducer, shift=0)
    lo, hi = chunks[own]
    reducer.finish(buf[lo:hi], call.n)
    ring_all_gather(call, buf, chunks, shift=1, step0=call.n)
    call.finish()


def allreduce_halving_doubling(call: Call, buf: np.ndarray, reducer: Reducer) -> None:
    """Rabenseifner's all_reduce for a power-of-two group: a reduce-scatter by recursive
    halving, then an all-gather by recursive doubling, 2 log2(n) exchange steps instead
    of the ring's 2(n-1) (each rank still sends 2(n-1)/n of the buffer). Fewer steps
    mean fewer hand-offs between ranks, which counts when ranks outnumber cores.

    The buffer is cut in n blocks (rank r ends the reduce-scatter owning block r); a
    message carries a run of blocks, in segments numbered in address order. Received
    data is forwarded as soon as it is ready: in the reduce-scatter the half the next
    step sends is reduced (and sent) first; in the all-gather each rank sends its block
    to every partner at once and forwards each segment as it lands."""
    n, r = call.n, call.rank
    levels = n.bit_length() - 1
    bounds = [lo for lo, _ in split_counts(buf.size, n)] + [buf.size]

    def segs(b0: int, b1: int) -> list[tuple[int, int]]:
        """The segments of blocks [b0, b1), in address order."""
        out = []
        for b in range(b0, b1):
            out.extend(call.segments(bounds[b], bounds[b + 1], buf.itemsize))
        return out

    # reduce-scatter: step k exchanges with r ^ mask, mask = n/2, n/4, .., 1; the group
    # [g0, g0 + 2 mask) of blocks halves and r keeps the half that holds block r
    plan = []  # (peer, keep blocks, send blocks)
    g0 = 0
    for k in range(levels):
        mask = n >> (k + 1)
        mid = g0 + mask
        keep, give = ((mid, mid + mask), (g0, mid)) if r & mask else \
            ((g0, mid), (mid, mid + mask))
        plan.append((r ^ mask, keep, give))
        g0 = keep[0]
    scratch = call.pool.get((buf.size,), buf.dtype)
    posted, off = [], 0
    for k, (peer, keep, _) in enumerate(plan):
        base = bounds[keep[0]]
        lst = []
        for j, (lo, hi) in enumerate(segs(*keep)):
            lst.append((lo, hi, off + lo - base, call.recv(
                peer, k, j, scratch[off + lo - base:off + hi - base], borrow=True)))
        posted.append(lst)
        off += bounds[keep[1]] - base
    peer, _, give = plan[0]
    for j, (lo, hi) in enumerate(segs(*give)):
        call.send(peer, 0, j, buf[lo:hi])
    for k in range(levels):
        if k + 1 < levels:
            nxt_peer, _, nxt_give = plan[k + 1]
            first = (bounds[nxt_give[0]], bounds[nxt_give[1]])
            out_segs = segs(*nxt_give)
        else:
            first = (0, 0)
        lst = posted[k]
        order = [e for e in lst if first[0] <= e[0] < first[1]] + \
            [e for e in lst if not first[0] <= e[0] < first[1]]
        sent = 0
        for lo, hi, so, req in order:
            call.wait(req)
            reducer.combine(buf[lo:hi], buf[lo:hi], call.received(req, scratch[so:so + hi - lo]))
            call.release(req)
            if first[0] <= lo < first[1]:
                # segments of one block run align: forward the ones now complete
                while sent < len(out_segs) and out_segs[sent][1] <= hi:
                    s_lo, s_hi = out_segs[sent]
                    call.send(nxt_peer, k + 1, sent, buf[s_lo:s_hi])
                    sent += 1
    lo, hi = bounds[r], bounds[r + 1]
    reducer.finish(buf[lo:hi], n)

    # all-gather: step t exchanges with r ^ (1 << t) the 2^t blocks each side holds
    held = [(r & ~((1 << t) - 1), (r & ~((1 << t) - 1)) + (1 << t)) for t in range(levels)]
    theirs = [((r ^ (1 << t)) & ~((1 << t) - 1), ((r ^ (1 << t)) & ~((1 << t) - 1)) + (1 << t))
              for t in range(levels)]
    reqs = [[(lo, hi, call.recv(r ^ (1 << t), levels + t, j, buf[lo:hi]))
             for j, (lo, hi) in enumerate(segs(*theirs[t]))] for t in range(levels)]
    seg_index = [{s: j for j, s in enumerate(segs(*held[t]))} for t in range(levels)]
    for t in range(levels):  # block r goes to every partner at once
        for lo_hi in segs(r, r + 1):
            call.send(r ^ (1 << t), levels + t, seg_index[t][lo_hi], buf[lo_hi[0]:lo_hi[1]])
    for t in range(levels):
        for lo, hi, req in reqs[t]:
            call.wait(req)
            for u in range(t + 1, levels):  # forward to the later partners
                call.send(r ^ (1 << u), levels + u, seg_index[u][lo, hi], buf[lo:hi])
    call.finish()


# -- broadcast and reduce ----------------------------------------------------------------
def broadcast_tree(call: Call, buf: np.ndarray, src: int) -> None:
    """Binomial tree (MPICH's): ceil(log2 n) rounds."""
    n = call.n
    v = (call.rank - src) % n
    mask = 1
    while mask < n:
        if v & mask:
            call.wait(call.recv((v - mask + src) % n, 0, 0, buf))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            call.send((v + mask + src) % n, 0, 0, buf)
        mask >>= 1
    call.finish()


def broadcast_chain(call: Call, buf: np.ndarray, src: int) -> None:
    """Pipelined chain src -> src+1 -> ...: each segment is forwarded as it lands."""
    n = call.n
    v = (call.rank - src) % n
    nxt, prev = (call.rank + 1) % n, (call.rank - 1) % n
    segs = call.segments(0, buf.size, buf.itemsize)
    reqs = [call.recv(prev, 0, j, buf[lo:hi]) for j, (lo, hi) in enumerate(segs)] if v else []
    for j, (lo, hi) in enumerate(segs):
        if v:
            call.wait(reqs[j])
        if v < n - 1:
            call.send(nxt, 0, j, buf[lo:hi])
    call.finish()


def reduce_tree(call: Call, buf: np.ndarray, dst: int, reducer: Reducer) -> None:
    """Binomial tree towards dst; only dst's buffer changes."""
    n = call.n
    v = (call.rank - dst) % n
    acc = buf if v == 0 else buf.copy()
    children = []
    mask = 1
    while mask < n and not v & mask:
        if v | mask < n:
            children.append(((v | mask) + dst) % n)
        mask <<= 1
    scratch = np.empty((max(len(children), 1), buf.size), buf.dtype)
    reqs = [call.recv(child, 0, 0, scratch[i]) for i, child in enumerate(children)]
    for i, req in enumerate(reqs):
        call.wait(req)
        reducer.combine(acc, acc, scratch[i])
    if v:
        call.send(((v & ~mask) + dst) % n, 0, 0, acc)
    else:
        reducer.finish(acc, n)
    call.finish()


def reduce_ring(call: Call, buf: np.ndarray, dst: int, reducer: Reducer) -> None:
    """Ring reduce-scatter, then every owner sends its reduced chunk to dst."""
    n, r = call.n, call.rank
    work = buf if r == dst else buf.copy()
    chunks = split_counts(buf.size, n)
    own = ring_reduce_scatter(call, work, chunks, reducer, shift=-1)
    if r == dst:
        reqs = [call.recv(q, n, 0, buf[chunks[q][0]:chunks[q][1]]) for q in range(n) if q != r]
        for req in reqs:
            call.wait(req)
        reducer.finish(buf, n)
    else:
        lo, hi = chunks[own]
        call.send(dst, n, 0, work[lo:hi])
    call.finish()


# -- gathers and scatters ----------------------------------------------------------------
def all_gather_direct(call: Call, out: np.ndarray, inp: np.ndarray) -> None:
    """Everyone sends its slot to everyone: one round on the full mesh."""
    k, r = inp.size, call.rank
    reqs = [call.recv(q, 0, 0, out[q * k:(q + 1) * k]) for q in range(call.n) if q != r]
    for q in range(call.n):
        if q != r:
            call.send(q, 0, 0, inp)
    out[r * k:(r + 1) * k] = inp
    for req in reqs:
        call.wait(req)
    call.finish()


def all_gather_ring(call: Call, out: np.ndarray, inp: np.ndarray) -> None:
    k = inp.size
    out[call.rank * k:(call.rank + 1) * k] = inp
    ring_all_gather(call, out, [(q * k, (q + 1) * k) for q in range(call.n)], shift=0)
    call.finish()


def gather_direct(call: Call, out: np.ndarray | None, inp: np.ndarray, dst: int) -> None:
    k, r = inp.size, call.rank
    if r != dst:
        call.send(dst, 0, 0, inp)
    else:
        reqs = [call.recv(q, 0, 0, out[q * k:(q + 1) * k]) for q in range(call.n) if q != r]
        out[r * k:(r + 1) * k] = inp
        for req in reqs:
            call.wait(req)
    call.finish()


def scatter_direct(call: Call, out: np.ndarray, inp: np.ndarray | None, src: int) -> None:
    k, r = out.size, call.rank
    if r != src:
        call.wait(call.recv(src, 0, 0, out))
    else:
        for q in range(call.n):
            if q != r:
                call.send(q, 0, 0, inp[q * k:(q + 1) * k])
        out[:] = inp[r * k:(r + 1) * k]
    call.finish()


def reduce_scatter_direct(call: Call, out: np.ndarray, inp: np.ndarray,
                          reducer: Reducer) -> None:
    """Send slot q to rank q; combine the n contributions in rank order."""
    k, r, n = out.size, call.rank, call.n
    scratch = np.empty((n, k), inp.dtype)
    reqs = {q: call.recv(q, 0, 0, scratch[q]) for q in range(n) if q != r}
    for q in range(n):
        if q != r:
            call.send(q, 0, 0, inp[q * k:(q + 1) * k])
    scratch[r] = inp[r * k:(r + 1) * k]
    for q in range(n):
        if q in reqs:
            call.wait(reqs[q])
        if q == 0:
            out[:] = scratch[0]
        else:
            reducer.combine(out, out, scratch[q])
    reducer.finish(out, n)
    call.finish()


def reduce_scatter_ring(call: Call, out: np.ndarray, inp: np.ndarray, reducer: Reducer) -> None:
    k = out.size
    work = inp.copy()  # the input is the caller's: reduce in a copy
    chunks = [(q * k, (q + 1) * k) for q in range(call.n)]
    own = ring_reduce_scatter(call, work, chunks, reducer, shift=-1)
    out[:] = work[chunks[own][0]:chunks[own][1]]
    reducer.finish(out, call.n)
    call.finish()


def all_to_all_direct(call: Call, out: np.ndarray, inp: np.ndarray, out_counts: list[int],
                      in_counts: list[int]) -> None:
    """Pairwise exchange; empty slots still send a (0-byte) message, so ranks that
    disagree about the splits fail with a mismatch instead of waiting."""
    r = call.rank
    out_off = np.concatenate([[0], np.cumsum(out_counts)]).astype(int)
    in_off = np.concatenate([[0], np.cumsum(in_counts)]).astype(int)
    reqs = [call.recv(q, 0, 0, out[out_off[q]:out_off[q + 1]]) for q in range(call.n) if q != r]
    for i in range(1, call.n):  # start with the next rank: spreads the load over links
        q = (r + i) % call.n
        call.send(q, 0, 0, inp[in_off[q]:in_off[q + 1]])
    out[out_off[r]:out_off[r + 1]] = inp[in_off[r]:in_off[r + 1]]
    for req in reqs:
        call.wait(req)
    call.finish()


def barrier_dissemination(call: Call) -> None:
    """ceil(log2 n) rounds of empty messages; nobody leaves before everyone arrived."""
    n, r = call.n, call.rank
    empty = np.empty(0, np.uint8)
    dist, step = 1, 0
    while dist < n:
        call.send((r + dist) % n, step, 0, empty)
        call.wait(call.recv((r - dist) % n, step, 0, empty))
        dist <<= 1
        step += 1
    call.finish()


# -- single-round calls in two phases (direct lanes; see the module docstring) -----------
# Each sends exactly what its blocking counterpart above sends, with the same keys, so
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
