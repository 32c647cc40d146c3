"""TCP links of one group: framed messages, posted receives, abort.

Each pair of ranks shares one socket. Per link, a sender thread drains a FIFO of
outgoing messages (`sendmsg` of header + memoryview: no copy in Python) and a
receiver thread reads headers and lands each payload with `recv_into`, straight into
the buffer a receive was posted for, or into a stash when it came first (MPI's
"unexpected message" queue). Socket calls release the GIL, so sends, receives and
the progress thread's reductions overlap.

A message header carries the sender's view of the call (op, dtype, reduce op, element
count), so ranks that disagree about a collective fail with `CollectiveMismatch`
instead of silently mixing bytes. A peer's EOF fails everything with `PeerFailure`
naming it; `abort()` sends an abort notice to every peer, then shuts the sockets, so
every waiter on every rank returns.
"""

from __future__ import annotations

import collections
import json
import select
import socket
import struct
import threading
import time

from kiln.distributed.errors import (
    CollectiveMismatch, CollectiveTimeout, DistributedError, PeerFailure, error_from_wire,
    error_to_wire,
)

# kind, op, dtype, reduce op, seq (or tag), step, segment, count, payload bytes
HEADER = struct.Struct("!BBBBIIIqQ")
DATA, P2P, ABORT, BYE = 1, 2, 3, 4
_MAX_NOTICE = 1 << 16


class Request:
    """One posted send or receive; `event` is set when it ends (`error` says how)."""

    __slots__ = ("peer", "key", "sig", "view", "event", "error", "callback")

    def __init__(self, peer: int, key: tuple, sig: tuple, view: memoryview, callback=None):
        self.peer, self.key, self.sig, self.view = peer, key, sig, view
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.callback = callback

    def finish(self, error: BaseException | None = None) -> None:
        if self.event.is_set():
            return
        self.error = error
        self.event.set()
        if self.callback is not None:
            self.callback(error)


class Link:
    """The socket to one peer, with its sender and receiver threads."""

    def __init__(self, transport: "Transport", peer: int, sock: socket.socket):
        self.transport, self.peer, self.sock = transport, peer, sock
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
                parts = [parts, req.view] if isinstance(parts, bytes) else parts
                while parts:
                    parts = _advance(parts, self.sock.sendmsg(parts))
                error = None
            except OSError as err:
                error = self._link_error(err)
            self._release()
            req.finish(error)
            if error is not None:
                return

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
            req.view[:] = data
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
                if kind in (ABORT, BYE):
                    info = json.loads(self._read_new(min(nbytes, _MAX_NOTICE)) or b"{}")
                    if kind == BYE:
                        self.departed = True
                        return
                    self.transport.fail(error_from_wire(info, reporter=self.peer,
                                                        group=self.transport.group))
                    return
                key, sig = (kind, seq, step, seg), (op, dt, rop, count)
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
                data = self._read_new(nbytes)
                with self._cond:  # a receive may have been posted while we read
                    req = self._take_posted(key)
                    if req is None:
                        self.stash.setdefault(key, collections.deque()).append((sig, data))
                if req is not None:
                    self._land(req, sig, data)
                elif kind == DATA:
                    # the call may have become active while we read; `activate` checks
                    # the stash after setting it, this checks it after stashing: one sees
                    error = self.transport.check_active(seq, sig, self.peer)
                    if error is not None:
                        self.transport.fail(error)
                        return
        except (OSError, EOFError) as err:
            if not self.transport.closing:
                self.transport.fail(self._link_error(err))
        except ValueError:  # a notice that is not JSON: the stream cannot be trusted
            if not self.transport.closing:
                self.transport.fail(PeerFailure(
                    self.peer, "rank %d sent a malformed message" % self.peer,
                    group=self.transport.group))

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
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _compatible(mine: tuple, theirs: tuple) -> bool:
    """Same op, dtype and reduce op, and the same count unless one side has none (-1)."""
    return mine[:3] == theirs[:3] and (mine[3] == theirs[3] or -1 in (mine[3], theirs[3]))


def _advance(parts: list, sent: int) -> list:
    """Drop `sent` bytes from the front of a list of buffers (after a partial sendmsg)."""
    out = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        out.append(memoryview(part)[sent:] if sent else part)
        sent = 0
    return out


class Transport:
    """All links of one group (full mesh) plus its failure state."""

    def __init__(self, group: str, rank: int, world_size: int, socks: dict[int, socket.socket],
                 describe_sig=repr):
        # errors name the group as users know it: "pg/<name>/e<epoch>" -> "<name>"
        parts = group.split("/")
        self.group = parts[1] if len(parts) == 3 and parts[0] == "pg" else group
        self.rank, self.world_size = rank, world_size
        self.describe_sig = describe_sig
        self.error: DistributedError | None = None
        self.closing = False
        self.on_failure = None  # set by the backend: called once with the first error
        self.active: tuple | None = None  # (seq, signature) of the call in progress
        self._lock = threading.Lock()
        self.links = {peer: Link(self, peer, s) for peer, s in socks.items()}
        for link in self.links.values():
            link.start()

    def activate(self, seq: int, sig: tuple) -> None:
        """Mark the collective `seq` as in progress here; a peer's message for it that
        already arrived under another signature fails the group with the mismatch."""
        self.active = (seq, sig)
        for peer, link in self.links.items():
            with link._cond:
                stashed = [s for key, queue in link.stash.items() if key[0] == DATA
                           and key[1] == seq for s, _ in queue]
            for theirs in stashed:
                error = self.check_active(seq, theirs, peer)
                if error is not None:
                    self.fail(error)
                    return

    def check_active(self, seq: int, sig: tuple, peer: int) -> CollectiveMismatch | None:
        active = self.active
        if active is None or active[0] != seq or _compatible(active[1], sig):
            return None
        return self.links[peer]._mismatch(seq, active[1], sig, "a message for the same seq")

    def isend(self, peer: int, kind: int, sig: tuple, seq: int, step: int, seg: int,
              view: memoryview, callback=None, deadline: float | None = None) -> Request:
        req = Request(peer, (kind, seq, step, seg), sig, view, callback)
        header = HEADER.pack(kind, sig[0], sig[1], sig[2], seq, step, seg, sig[3], len(view))
        self.links[peer].send(header, req, deadline)
        return req

    def irecv(self, peer: int, kind: int, sig: tuple, seq: int, step: int, seg: int,
              view: memoryview, callback=None) -> Request:
        req = Request(peer, (kind, seq, step, seg), sig, view, callback)
        self.links[peer].post(req)
        return req

    def wait(self, req: Request, deadline: float, what: str) -> None:
        """Wait for one request until `deadline`; raise its error or CollectiveTimeout."""
        if not req.event.wait(max(deadline - time.monotonic(), 0.0)):
            raise CollectiveTimeout(
                "%s on rank %d of group '%s' timed out: no progress from rank %d"
                % (what, self.rank, self.group, req.peer), rank=req.peer)
        if req.error is not None:
            raise req.error

    def fail(self, error: DistributedError) -> None:
        """Record the first failure, fail every pending request, tell peers, close."""
        with self._lock:
            if self.error is not None or self.closing:
                return
            self.error = error
        info = error_to_wire(error)
        for link in self.links.values():
            link.send_notice(ABORT, info)
        self._close_links(error)
        if self.on_failure is not None:
            self.on_failure(error)

    def close(self) -> None:
        """Clean departure: a goodbye to every peer, then close."""
        with self._lock:
            if self.closing:
                return
            if self.error is None:
                for link in self.links.values():
                    link.send_notice(BYE)
        from kiln.distributed.errors import GroupAborted
        self._close_links(GroupAborted("group '%s' was destroyed on this rank" % self.group))

    def _close_links(self, error: BaseException) -> None:
        self.closing = True
        for link in self.links.values():
            link.fail_all(error)
            link.shutdown()
        # close the descriptors only once the link threads left them (no fd reuse race);
        # this may run on a link thread, which cannot join itself
        threading.Thread(target=self._reap, name="kiln-%s-reap" % self.group,
                         daemon=True).start()

    def _reap(self) -> None:
        for link in self.links.values():
            for thread in (link._sender, link._receiver):
                if thread.is_alive() and thread is not threading.current_thread():
                    thread.join(timeout=2.0)
            link.sock.close()
