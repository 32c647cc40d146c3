"""`TcpBackend`: the built-in CPU backend over plain TCP sockets (works across machines).

Rendezvous: every rank listens on an ephemeral port of the interface it reaches the
store from (or KILN_BIND_ADDR), publishes `host:port` under the group's prefix, then
connects to every lower rank and accepts every higher one, twice: the threaded lane
and the direct lane of each pair (see tcp_transport). Each data connection is
authenticated with the job token (the same HMAC handshake as the store) and names
its group, epoch and lane, so a stray or hostile connection is refused: each
connection has its own handshake thread and deadline (`acceptor`), so strangers on
the port — idle, slow, sending garbage or deep JSON, or enough of them to exhaust
the file limit — never delay or fail the rendezvous of the real peers.

Algorithm choice by size (bytes per rank; tuned with benchmarks/bench_allreduce.py):
KILN_TCP_RING_BYTES (default 256 KiB) switches all_reduce, reduce_scatter,
all_gather, broadcast and reduce from latency-optimal to bandwidth-optimal
algorithms; KILN_TCP_SEGMENT_BYTES is the pipelining grain (default 1 MiB). Unless it
is set, the rings cut 4x larger segments when the group has more ranks than this
machine has cores: every rank's threads then compete for the cores anyway, so finer
pipelining gains little and each segment costs thread wake-ups (4 ranks on 2 cores,
interleaved runs: all_reduce 1.28x faster at 16 MB, 1.13x at 64 MB). Broadcast's
chain keeps the plain grain. On power-of-two groups of 4 or more ranks, all_reduce
from there up to KILN_TCP_HALVING_BYTES (default 8 MiB) uses recursive halving-doubling
(Rabenseifner: 2 log2 n steps instead of the ring's 2(n-1), the same bytes); 4 ranks on
2 cores, ring / halving-doubling interleaved in one job, medians: 1 MB 1.08-1.11x,
2 MB 1.05x, 4 MB 1.04x, 8 MB 1.00-1.02x, 16 MB 0.96-1.00x, 64 MB 0.95-0.97x.

Calls of the latency algorithms whose messages are at most KILN_TCP_DIRECT_BYTES
(256 KiB, the ring threshold: every such message at the defaults) use the direct
lanes; single-round ones (see tcp_algorithms) can also start eagerly on the caller's
thread (`eager`). The value must be the same on every rank (it decides which lane a
message takes) and well below the direct lanes' socket buffers (at least 1 MiB
asked for). Measured on 2 cores, 2 ranks: a 256 KiB all_reduce took 0.09 ms on the
direct lane against 0.27-0.35 ms on the threaded one; 4 ranks 0.53-0.61 ms against
1.05-1.45 ms.

Ranks on the same host also get a shared-memory lane per pair (shm_lane; set up at
rendezvous over the authenticated sockets): the threaded lane's DATA and P2P payloads
over 64 KiB and up to one ring segment go through a ring of 4 slots per direction,
each one ring segment large (KILN_TCP_SEGMENT_BYTES times the ring scale), instead of
through the socket. KILN_TCP_SHM=0 turns it off (for A/B runs, or as an escape
hatch); a pair where either side has it off, or cannot open the other's segment,
uses TCP only. Measured on 2 cores against KILN_TCP_SHM=0, medians of 3 runs of
bench_allreduce.py (3 rounds each): 4 ranks 1.03x at 1 MB, 1.22x at 4 MB, 1.31x at
16 MB, 1.50x at 64 MB; 2 ranks 0.97x, 1.50x, 1.63x, 1.32x. Against Gloo that took 4
ranks from 0.94-1.00x to 1.22-1.53x at 4-64 MB (benchmarks/results/distributed.md).
"""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np

from kiln.distributed import shm_lane
from kiln.distributed import tcp_algorithms as alg
from kiln.distributed.backend import OP_CODES, OP_NAMES, Backend, CallContext
from kiln.distributed.buffers import DTYPE_CODES, REDUCE_CODES, Reducer
from kiln.distributed.acceptor import HANDSHAKE_TIMEOUT, Acceptor
from kiln.distributed.errors import RendezvousError, StoreError, StoreTimeout
from kiln.distributed.protocol import (
    ConnectionLost, client_handshake, parse_address, server_handshake,
)
from kiln.distributed.tcp_rma import RmaEngine
from kiln.distributed.tcp_transport import _DIRECT_TICK, P2P, Transport

DATA_ROLE = "kiln-data"
_CONNECT_ATTEMPTS = 5  # per data connection: see _connect_peer
_DTYPE_NAMES = {code: short for short, code in DTYPE_CODES.items()}
_REDUCE_NAMES = {code: name for name, code in REDUCE_CODES.items()}


def _describe_sig(sig: tuple) -> str:
    op, dt, rop, count = sig
    text = "%s(%s" % (OP_NAMES[op - 1] if 0 < op <= len(OP_NAMES) else "op%d" % op,
                      _DTYPE_NAMES.get(dt, "?"))
    if rop:
        text += ", %s" % _REDUCE_NAMES.get(rop, "?")
    if count >= 0:
        text += ", count=%d" % count
    return text + ")"


def _tune(socks: dict[int, socket.socket], direct: dict[int, socket.socket]) -> None:
    # fixed buffers beat Linux autotuning on loopback (measured); 4 MiB (the usual
    # net.core.wmem_max; the kernel caps larger requests) beat the former 256 KiB by
    # 1.3-2x at 1-64 MB, 2 and 4 ranks, interleaved A/B runs. 0 keeps autotuning
    size = int(os.environ.get("KILN_TCP_SOCKET_BUFFER", 4 << 20))
    # direct lanes always get fixed buffers (at least 1 MiB asked): a blocking send of a
    # 256 KiB message must find room while its peer is busy sending too
    tick = struct.pack("ll", int(_DIRECT_TICK), int(_DIRECT_TICK % 1 * 1e6))
    for lane, group in ((0, socks), (1, direct)):
        for sock in group.values():
            sock.settimeout(None)  # link threads block; deadlines are kept by the waiters
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            want = max(size, 1 << 20) if lane else size
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                if want:
                    sock.setsockopt(socket.SOL_SOCKET, opt, want)
            if lane:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tick)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tick)


def _ring_segment_scale(world_size: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return 4 if world_size > cores else 1


def _segment_sizes(world_size: int) -> tuple[int, int]:
    """(segment bytes, ring segment scale): the scale is 1 when the env var is set."""
    segment = int(os.environ.get("KILN_TCP_SEGMENT_BYTES", 1 << 20))
    return segment, 1 if "KILN_TCP_SEGMENT_BYTES" in os.environ else \
        _ring_segment_scale(world_size)


def _connect_peer(host: str, port: int, token: str, hello: dict,
                  deadline: float) -> socket.socket:
    """One authenticated data connection to a lower rank. A connection the peer
    dropped during the handshake (its data port sheds the oldest handshakes when
    strangers crowd it) is made again, a few times; a refused connect or a wrong
    token is final."""
    for attempt in range(_CONNECT_ATTEMPTS):
        sock = socket.create_connection((host, port),
                                        timeout=max(deadline - time.monotonic(), 0.01))
        try:
            client_handshake(sock, token, DATA_ROLE, max(deadline - time.monotonic(), 0.01),
                             hello=hello)
            return sock
        except ConnectionLost:
            sock.close()
            if attempt == _CONNECT_ATTEMPTS - 1 or time.monotonic() >= deadline:
                raise
        except BaseException:  # a wrong token, not a kiln data port, the deadline
            sock.close()
            raise
        time.sleep(min(0.01 * 2 ** attempt, max(deadline - time.monotonic(), 0.0)))
    raise AssertionError("unreachable")


def _accept_peers(acceptor: Acceptor, lanes: tuple[dict, dict], prefix: str, rank: int,
                  world_size: int, epoch: int, deadline: float) -> None:
    """Take both lanes from every higher rank. A connection that knows the token but
    belongs elsewhere (another group or epoch: a late member of an earlier
    reconfiguration) is closed and the wait goes on; a second connection for the
    same peer and lane replaces the first (the peer made it again)."""
    wanted = {(peer, lane) for peer in range(rank + 1, world_size) for lane in (0, 1)}
    while not wanted <= {(p, lane) for lane in (0, 1) for p in lanes[lane]}:
        got = acceptor.next_ready(deadline)
        if got is None:
            missing = sorted(wanted - {(p, lane) for lane in (0, 1) for p in lanes[lane]})
            raise StoreTimeout("ranks %s never connected to this rank's data port (%d "
                               "other connections refused)"
                               % (sorted({p for p, _ in missing}), acceptor.refused))
        sock, theirs = got
        peer, lane = theirs.get("rank"), theirs.get("lane")
        if type(peer) is not int or type(lane) is not int or (peer, lane) not in wanted or \
                (theirs.get("group"), theirs.get("epoch")) != (prefix, epoch):
            sock.close()
            acceptor.log("stale", "closed a connection of group %.80r epoch %.20r rank %.20r "
                         "(this is group %r epoch %d)" % (theirs.get("group"),
                                                          theirs.get("epoch"), peer, prefix,
                                                          epoch))
            continue
        old = lanes[lane].get(peer)
        if old is not None:
            old.close()
        lanes[lane][peer] = sock


class TcpBackend(Backend):
    """Full mesh of authenticated TCP sockets among the ranks of one group.

        >>> backend = TcpBackend.rendezvous(store, "pg/world/e0", rank, world_size, token, 10.0)
    """

    name = "tcp"

    def __init__(self, group: str, rank: int, world_size: int, socks: dict[int, socket.socket],
                 direct: dict[int, socket.socket] | None = None, shm: dict | None = None):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.ring_bytes = int(os.environ.get("KILN_TCP_RING_BYTES", 256 << 10))
        # messages up to this size use the direct lanes (-1: none, e.g. no direct sockets)
        self.direct_bytes = int(os.environ.get("KILN_TCP_DIRECT_BYTES", 256 << 10)) \
            if direct else -1
        # the rings cut segments `ring_segment_scale` times larger
        self.segment_bytes, self.ring_segment_scale = _segment_sizes(world_size)
        # all_reduce of at most this many bytes past ring_bytes uses halving-doubling on
        # power-of-two groups of 4 or more ranks (0: always the ring)
        self.halving_bytes = int(os.environ.get("KILN_TCP_HALVING_BYTES", 8 << 20))
        self._failure_handler = None
        self._pool = alg.ScratchPool()
        self._starters = {op: self._starter(fn) for op, fn in alg.STARTERS.items()}
        self.transport = Transport(group, rank, world_size, socks, describe_sig=_describe_sig,
                                   direct=direct, shm=shm)
        self.transport.on_failure = self._on_failure
        self._rma = self.transport.rma = RmaEngine(self.transport)

    @classmethod
    def rendezvous(cls, store, prefix: str, rank: int, world_size: int, token: str,
                   timeout: float, epoch: int = 0) -> "TcpBackend":
        deadline = time.monotonic() + timeout
        host = os.environ.get("KILN_BIND_ADDR") or store.local_address()
        listener = socket.create_server((host, 0), backlog=max(2 * world_size, 64))
        lanes: tuple[dict[int, socket.socket], dict[int, socket.socket]] = ({}, {})
        shm: dict = {}
        hello = {"group": prefix, "rank": rank, "epoch": epoch}
        # every connection gets its own handshake thread and deadline: a stranger,
        # however idle or hostile, never holds up a peer (see acceptor)
        acceptor = Acceptor(listener, "data port (rank %d of %s)" % (rank, prefix),
                            handshake=lambda conn: server_handshake(
                                conn, token, DATA_ROLE,
                                max(min(HANDSHAKE_TIMEOUT, deadline - time.monotonic()), 0.01)),
                            max_pending=2 * world_size + 64)
        try:
            store.set("%s/addr/%d" % (prefix, rank), "%s:%d" % listener.getsockname()[:2])
            keys = ["%s/addr/%d" % (prefix, r) for r in range(world_size)]
            store.wait(keys, timeout=max(deadline - time.monotonic(), 0.01))
            for peer in range(rank):
                peer_host, port = parse_address(store.get(keys[peer]).decode())
                for lane in (0, 1):
                    lanes[lane][peer] = _connect_peer(peer_host, port, token,
                                                      dict(hello, lane=lane), deadline)
            _accept_peers(acceptor, lanes, prefix, rank, world_size, epoch, deadline)
            # a shared-memory lane with each peer on this host, the slots one ring
            # segment each (the largest messages the rings and chains send)
            segment, scale = _segment_sizes(world_size)
            shm = shm_lane.connect(lanes[0], rank, token, segment * scale, deadline)
        except (OSError, StoreError) as err:
            for sock in list(lanes[0].values()) + list(lanes[1].values()):
                sock.close()
            raise RendezvousError(
                "rank %d could not join group '%s' of %d ranks within %.1f s: %s"
                % (rank, prefix, world_size, timeout, getattr(err, "message", err)),
                hint="check that all %d ranks started and use the same store and KILN_TOKEN"
                % world_size) from None
        finally:
            acceptor.close()
        _tune(*lanes)
        return cls(prefix, rank, world_size, *lanes, shm=shm)

    def _on_failure(self, error: BaseException) -> None:
        if self._failure_handler is not None:
            self._failure_handler(error)

    def _call(self, ctx: CallContext, ring: bool = False, message: int | None = None) -> alg.Call:
        """The Call object of one collective; `message`: the size of each of its messages
        when it runs a latency algorithm (direct lanes up to `direct_bytes`)."""
        seg = self.segment_bytes * (self.ring_segment_scale if ring else 1)
        return alg.Call(self.transport, ctx, seg, self._pool,
                        direct=message is not None and message <= self.direct_bytes)

    # -- eager start (single-round calls on the direct lanes; see tcp_algorithms) -------
    def eager(self, op: str, *bufs):
        n, direct = self.world_size, self.direct_bytes
        if n == 1 or direct < 0:
            return None
        if op == "all_reduce" or op == "reduce":
            buf = bufs[0]
            ok = n == 2 and buf.nbytes <= direct and (buf.nbytes <= self.ring_bytes
                                                      or buf.size < n)
        elif op == "broadcast":
            ok = n == 2 and bufs[0].nbytes <= direct and bufs[0].nbytes <= self.ring_bytes
        elif op == "barrier":
            ok = n == 2
        elif op == "all_gather":  # (out, inp)
            ok = bufs[0].nbytes <= self.ring_bytes and bufs[1].nbytes <= direct
        elif op == "reduce_scatter":  # (out, inp)
            ok = bufs[1].nbytes <= self.ring_bytes and bufs[0].nbytes <= direct
        elif op == "gather" or op == "scatter":  # one slot
            ok = bufs[0].nbytes <= direct
        else:
            ok = False
        return self._starters[op] if ok else None

    def _starter(self, algorithm):
        def start(ctx: CallContext, *args) -> alg.Call:
            return algorithm(alg.Call(self.transport, ctx, self.segment_bytes, self._pool,
                                      direct=True), *args)
        return start

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, ctx: CallContext, buf: np.ndarray, reducer: Reducer) -> None:
        if self.world_size == 1:
            return reducer.finish(buf, 1)
        if buf.nbytes <= self.ring_bytes or buf.size < self.world_size:
            alg.allreduce_recursive_doubling(self._call(ctx, message=buf.nbytes), buf, reducer)
        elif self.world_size & (self.world_size - 1) == 0 and self.world_size > 2 and \
                buf.nbytes <= self.halving_bytes:
            alg.allreduce_halving_doubling(self._call(ctx, ring=True), buf, reducer)
        else:
            alg.allreduce_ring(self._call(ctx, ring=True), buf, reducer)

    def broadcast(self, ctx: CallContext, buf: np.ndarray, src: int) -> None:
        if self.world_size == 1:
            return
        if buf.nbytes <= self.ring_bytes:
            alg.broadcast_tree(self._call(ctx, message=buf.nbytes), buf, src)
        else:
            alg.broadcast_chain(self._call(ctx), buf, src)

    def reduce(self, ctx: CallContext, buf: np.ndarray, dst: int, reducer: Reducer) -> None:
        if self.world_size == 1:
            return reducer.finish(buf, 1)
        if buf.nbytes <= self.ring_bytes or buf.size < self.world_size:
            alg.reduce_tree(self._call(ctx, message=buf.nbytes), buf, dst, reducer)
        else:
            alg.reduce_ring(self._call(ctx, ring=True), buf, dst, reducer)

    def all_gather(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray) -> None:
        if out.nbytes <= self.ring_bytes or self.world_size == 1:
            alg.all_gather_direct(self._call(ctx, message=inp.nbytes), out, inp)
        else:
            alg.all_gather_ring(self._call(ctx, ring=True), out, inp)

    def gather(self, ctx: CallContext, out: np.ndarray | None, inp: np.ndarray,
               dst: int) -> None:
        alg.gather_direct(self._call(ctx, message=inp.nbytes), out, inp, dst)

    def scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray | None,
                src: int) -> None:
        alg.scatter_direct(self._call(ctx, message=out.nbytes), out, inp, src)

    def reduce_scatter(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                       reducer: Reducer) -> None:
        if inp.nbytes <= self.ring_bytes or self.world_size == 1:
            alg.reduce_scatter_direct(self._call(ctx, message=out.nbytes), out, inp, reducer)
        else:
            alg.reduce_scatter_ring(self._call(ctx, ring=True), out, inp, reducer)

    def all_to_all(self, ctx: CallContext, out: np.ndarray, inp: np.ndarray,
                   out_counts: list[int], in_counts: list[int]) -> None:
        # threaded lanes only: each rank's sizes differ, so no lane choice both ends of
        # a message would agree on
        alg.all_to_all_direct(self._call(ctx), out, inp, out_counts, in_counts)

    def barrier(self, ctx: CallContext) -> None:
        if self.world_size > 1:
            alg.barrier_dissemination(self._call(ctx, message=0))

    # -- point to point --------------------------------------------------------------
    def _p2p_sig(self, ctx: CallContext) -> tuple:
        return (OP_CODES["p2p"], ctx.dtype_code, 0, ctx.count)

    def send(self, ctx: CallContext, buf: np.ndarray, dst: int, tag: int, done) -> None:
        self.transport.isend(dst, P2P, self._p2p_sig(ctx), tag, 0, 0, alg.byte_view(buf),
                             callback=done)

    def recv(self, ctx: CallContext, buf: np.ndarray, src: int, tag: int, done) -> None:
        self.transport.irecv(src, P2P, self._p2p_sig(ctx), tag, 0, 0, alg.byte_view(buf),
                             callback=done)

    # -- RMA windows (served by the receiver threads: tcp_rma) ---------------------------
    def window_register(self, memory) -> None:
        self._rma.register(memory)

    def window_unregister(self, window_id: int, error: BaseException) -> None:
        self._rma.unregister(window_id, error)

    def window_put(self, window_id: int, dst: int, offset: int, data: np.ndarray, done) -> None:
        self._rma.put(window_id, dst, offset, data, done)

    def window_get(self, window_id: int, src: int, offset: int, out: np.ndarray, done) -> None:
        self._rma.get(window_id, src, offset, out, done)

    def window_accumulate(self, window_id: int, dst: int, offset: int, data: np.ndarray,
                          reduce_op: str, done) -> None:
        self._rma.accumulate(window_id, dst, offset, data, reduce_op, done)

    def window_signal(self, window_id: int, dst: int, slot: int, value: int, done) -> None:
        self._rma.signal(window_id, dst, slot, value, done)

    # -- lifecycle -------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        self.transport.fail(error)

    def close(self) -> None:
        self.transport.close()
