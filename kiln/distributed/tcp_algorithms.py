"""Collective algorithms over a `Transport`, chosen by message size.

Large messages use bandwidth-optimal pipelines: a ring reduce-scatter + all-gather
(each rank sends 2(n-1)/n of the buffer), a chain for broadcast, cut into segments so
that sending segment j+1 overlaps reducing segment j; medium all_reduces on
power-of-two groups use recursive halving-doubling instead (2 log2 n steps, same
bytes). Small messages use few rounds: recursive doubling (log2 n rounds) for
all_reduce, binomial trees for broadcast and reduce, direct exchange on the full mesh
for all_gather and reduce_scatter.
Receives are posted before the data can arrive, into their final place where the
algorithm allows, so payloads land with one `recv_into` and no extra copy.

The calls' plumbing (`Call`, `ScratchPool`) and the two-phase single-round calls of the
direct lanes (`start_<op>`, `STARTERS`) are in tcp_call, re-exported here.
"""

from __future__ import annotations

import numpy as np

from kiln.distributed.buffers import Reducer
from kiln.distributed.tcp_call import (  # noqa: F401  re-exported (their old home)
    STARTERS, Call, ScratchPool, byte_view, split_counts,
)
from kiln.distributed.tcp_transport import Request

_RESULT_STEP = 1 << 30  # recursive doubling: the result sent back to a folded-in rank


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
