"""One TCP link of a group: the sockets to one peer, with the threaded lane's sender
and receiver threads (the direct lane is `tcp_direct.DirectLane`).

Each pair of ranks shares two sockets. The *threaded lane* carries large collectives,
point-to-point messages and abort/goodbye notices: per link, a sender thread drains a
FIFO of outgoing messages (`sendmsg` of header + memoryview: no copy in Python) and a
receiver thread reads headers and lands each payload with `recv_into`, straight into
the buffer a receive was posted for, or into a stash when it came first (MPI's
"unexpected message" queue). Socket calls release the GIL, so sends, receives and the
progress thread's reductions overlap. The receiver thread also serves one-sided RMA
operations on this rank's windows (`tcp_rma`), in the order each peer sent them.

The *shared-memory lane* (shm_lane), which a pair of ranks on one host has unless
KILN_TCP_SHM=0, carries the payloads of the threaded lane's large DATA and P2P
messages (over 64 KiB, up to a slot: the ring segment): the sender thread copies the
payload into a slot of the segment both processes map and sends only the header,
with the slot in the high bits of its kind; the receiver thread lands it from there
(or lends the slot to a reduction, `Request.borrow`), in the same order and with the
same matching as a payload read from the socket. Smaller messages, larger ones, RMA
and notices stay on the socket, whose EOF still reports a dead peer.
"""

from __future__ import annotations

import collections
import json
import select
import socket
import threading
import time
from typing import TYPE_CHECKING

from kiln.distributed.errors import CollectiveMismatch, DistributedError, PeerFailure, \
    error_from_wire
from kiln.distributed.protocol import loads_object
from kiln.distributed.tcp_direct import DirectLane
from kiln.distributed.tcp_messages import (
    _MAX_NOTICE, ABORT, BYE, DATA, HEADER, P2P, RMA_PUT, RMA_REPLY, Request, _advance,
    _compatible,
)

if TYPE_CHECKING:
    from kiln.distributed.tcp_transport import Transport


class Link(DirectLane):
    """The sockets to one peer: the threaded lane, with its sender and receiver
    threads, and the direct lane (module docstring)."""

    def __init__(self, transport: "Transport", peer: int, sock: socket.socket,
                 direct: socket.socket | None = None, shm=None):
        self.transport, self.peer, self.sock = transport, peer, sock
        self.direct = direct  # the direct lane (module docstring); None: threaded only
        self.shm = shm  # the shared-memory lane (shm_lane.ShmLane); None: payloads on TCP
        self._head = bytearray(HEADER.size)  # direct-lane header, read in place
        self._poller = None  # select.poll of the direct lane, for bounded waits
        self.departed = False  # the peer said goodbye: its EOF is not a crash
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[bytes, Request]] = collections.deque()
        self._busy = False
        self.posted: dict[tuple, collections.deque[Request]] = {}
        self.stash: dict[tuple, collections.deque[tuple[tuple, bytearray]]] = {}
        name = "kiln-%s-r%d" % (transport.group, peer)
        self._sender = threading.Thread(target=self._send_loop, name=name + "-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=name + "-recv", daemon=True)

    def start(self) -> None:
        self._sender.start()
        self._receiver.start()

    # -- sending ---------------------------------------------------------------------
    def send(self, header: bytes, req: Request, deadline: float | None = None) -> None:
        """Send a message, in order. A small message on an idle link is written by the
        caller (no thread hand-off on the latency path); with a `deadline` (the progress
        thread's calls) it waits for socket space up to the deadline, without one (p2p
        from user threads) only what fits at once goes out here. Large messages and
        leftovers go to the sender thread, so sending overlaps receiving and reducing
        (measured: writing large segments inline was 1.5-3x slower on 2 cores)."""
        with self._cond:
            if self.transport.error is not None:
                req.finish(self.transport.error)
                return
            if self._queue or self._busy or len(req.view) > 65536:
                self._queue.append((header, req))
                self._cond.notify()
                return
            self._busy = True
        parts = [header, req.view]
        try:
            while parts:
                try:
                    parts = _advance(parts, self.sock.sendmsg(parts, [], socket.MSG_DONTWAIT))
                except BlockingIOError:
                    pass
                if not parts:
                    break
                wait = 0.0 if deadline is None else min(deadline - time.monotonic(), 0.1)
                if wait <= 0 or self.transport.error is not None:
                    break
                select.select([], [self.sock], [], wait)
        except (OSError, ValueError) as err:
            self._release()
            req.finish(self._link_error(err))
            return
        if not parts:
            self._release()
            req.finish()
            return
        with self._cond:  # the rest goes to the sender thread
            self._queue.appendleft((parts, req))
            self._busy = False
            self._cond.notify()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._busy) and not self.transport.closing:
                    self._cond.wait()
                if self.transport.closing:
                    return
                parts, req = self._queue.popleft()
                self._busy = True
            try:
                if isinstance(parts, bytes):  # a whole message (a list: the rest of one)
                    shm = self.shm
                    if shm is not None and parts[0] in (DATA, P2P) and \
                            shm.carries(len(req.view)):
                        # payload into a shared-memory slot, only the header goes out
                        parts = [shm.put(parts, req.view, self._alive)]
                    else:
                        parts = [parts, req.view]
                while parts:
                    parts = _advance(parts, self.sock.sendmsg(parts))
                error = None
            except (OSError, EOFError) as err:
                error = self._link_error(err)
            self._release()
            req.finish(error)
            if error is not None:
                return

    def _alive(self) -> bool:
        return self.transport.error is None and not self.transport.closing

    def send_notice(self, kind: int, info: dict | None = None) -> None:
        """Best effort, non-blocking: an abort or goodbye notice."""
        payload = json.dumps(info or {}).encode()[:_MAX_NOTICE]
        try:
            self.sock.sendmsg([HEADER.pack(kind, 0, 0, 0, 0, 0, 0, -1, len(payload)), payload],
                              [], socket.MSG_DONTWAIT)
        except OSError:
            pass

    # -- receiving -------------------------------------------------------------------
    def post(self, req: Request) -> None:
        """Register a receive; completes at once if the message is already stashed."""
        with self._cond:
            stashed = self.stash.get(req.key)
            if stashed:
                sig, data = stashed.popleft()
                if not stashed:
                    del self.stash[req.key]
            else:
                if self.transport.error is not None:
                    req.finish(self.transport.error)
                    return
                self.posted.setdefault(req.key, collections.deque()).append(req)
                return
        self._land(req, sig, data)

    def _land(self, req: Request, sig: tuple, data: bytearray) -> None:
        error = self._check(req, sig, len(data))
        if error is None:
            if req.borrow:
                req.source = data  # read in place; a ShmMessage is released by the reader
            elif isinstance(data, bytearray):
                req.view[:] = data
            else:
                data.copy_to(req.view)
        req.finish(error)
        if error is not None:
            self.transport.fail(error)

    def _check(self, req: Request, sig: tuple, nbytes: int) -> BaseException | None:
        mine, theirs = req.sig, sig
        if _compatible(mine, theirs) and nbytes == len(req.view):
            return None
        return self._mismatch(req.key[1], mine, theirs, "message of %d bytes, expected %d"
                              % (nbytes, len(req.view)))

    def _mismatch(self, seq: int, mine: tuple, theirs: tuple, detail: str) -> CollectiveMismatch:
        describe = self.transport.describe_sig
        return CollectiveMismatch(
            "rank %d and rank %d disagree at seq %s of group '%s': rank %d called %s, "
            "this rank called %s (%s)"
            % (self.transport.rank, self.peer, seq, self.transport.group, self.peer,
               describe(theirs), describe(mine), detail), rank=self.peer)

    def _take_posted(self, key: tuple) -> Request | None:
        queue = self.posted.get(key)
        if not queue:
            return None
        req = queue.popleft()
        if not queue:
            del self.posted[key]
        return req

    def _recv_loop(self) -> None:
        head = bytearray(HEADER.size)
        head_view = memoryview(head)
        try:
            while True:
                self._read(head_view)
                kind, op, dt, rop, seq, step, seg, count, nbytes = HEADER.unpack(head)
                slot, kind = kind >> 4, kind & 15  # slot: payload in shared memory (+1)
                if slot and (self.shm is None or kind not in (DATA, P2P)):
                    raise ValueError("shared-memory message without a lane")
                if kind >= RMA_PUT:  # applied here: the target's user code takes no part
                    rma = self.transport.rma
                    if rma is None or kind > RMA_REPLY:
                        raise ValueError("unknown message kind %d" % kind)
                    rma.serve(self, kind, op, dt, rop, seq, step, seg, count, nbytes)
                    continue
                if kind in (ABORT, BYE):
                    info = loads_object(self._read_new(min(nbytes, _MAX_NOTICE)) or b"{}")
                    if kind == BYE:
                        self.departed = True
                        return
                    self.transport.fail(error_from_wire(info, reporter=self.peer,
                                                        group=self.transport.group))
                    return
                key, sig = (kind, seq, step, seg), (op, dt, rop, count)
                if slot:
                    self._arrived(key, sig, self.shm.arrived(slot - 1, nbytes))
                    self.shm.relieve()
                    continue
                with self._cond:
                    req = self._take_posted(key)
                if req is not None:
                    error = self._check(req, sig, nbytes)
                    if error is not None:
                        req.finish(error)
                        self.transport.fail(error)
                        return
                    self._read(req.view)
                    req.finish()
                    continue
                active = self.transport.active
                if kind == DATA and active is not None and active[0] == seq and \
                        not _compatible(active[1], sig):
                    self.transport.fail(self._mismatch(seq, active[1], sig,
                                                       "message of %d bytes" % nbytes))
                    return
                self._arrived(key, sig, self._read_new(nbytes))
        except (OSError, EOFError) as err:
            if not self.transport.closing:
                self.transport.fail(self._link_error(err))
        except ValueError:  # a notice that is not JSON: the stream cannot be trusted
            if not self.transport.closing:
                self.transport.fail(PeerFailure(
                    self.peer, "rank %d sent a malformed message" % self.peer,
                    group=self.transport.group))

    def _arrived(self, key: tuple, sig: tuple, data) -> None:
        """Land a message whose payload is in hand (a bytearray or a ShmMessage) in the
        receive posted for it, or stash it until one is."""
        with self._cond:  # a receive may have been posted while we read
            req = self._take_posted(key)
            if req is None:
                self.stash.setdefault(key, collections.deque()).append((sig, data))
        if req is not None:
            self._land(req, sig, data)
        elif key[0] == DATA:
            # the call may have become active while we read; `activate` checks the
            # stash after setting it, this checks it after stashing: one of them sees
            error = self.transport.check_active(key[1], sig, self.peer)
            if error is not None:
                self.transport.fail(error)

    def _read(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("connection closed")
            got += k

    def _read_new(self, n: int) -> bytearray:
        data = bytearray(n)
        self._read(memoryview(data))
        return data

    def _link_error(self, err: BaseException) -> DistributedError:
        if self.transport.error is not None:
            return self.transport.error
        if self.departed:
            what = "left the group (it destroyed its process group or exited)"
        else:
            what = "closed its connection (%s): the process died or was killed" % (
                err if str(err) else type(err).__name__)
        return PeerFailure(self.peer, "rank %d of group '%s' %s" % (self.peer,
                                                                    self.transport.group, what),
                           group=self.transport.group)

    def fail_all(self, error: BaseException) -> None:
        with self._cond:
            reqs = [r for q in self.posted.values() for r in q] + [r for _, r in self._queue]
            self.posted.clear()
            self._queue.clear()
            self._cond.notify_all()
        for req in reqs:
            req.finish(error)

    def shutdown(self) -> None:
        for sock in (self.sock, self.direct):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
