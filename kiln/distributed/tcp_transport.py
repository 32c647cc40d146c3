"""TCP links of one group: framed messages, posted receives, the direct lane, abort.

Each pair of ranks shares two sockets. The *threaded lane* carries large collectives,
point-to-point messages and abort/goodbye notices: per link, a sender thread drains a
FIFO of outgoing messages (`sendmsg` of header + memoryview: no copy in Python) and a
receiver thread reads headers and lands each payload with `recv_into`, straight into
the buffer a receive was posted for, or into a stash when it came first (MPI's
"unexpected message" queue). Socket calls release the GIL, so sends, receives and the
progress thread's reductions overlap. The receiver thread also serves one-sided RMA
operations on this rank's windows (`tcp_rma`), in the order each peer sent them.

The *direct lane* carries the messages of small collectives (at most
KILN_TCP_DIRECT_BYTES, 256 KiB, per message), and no thread of its own reads it: the
thread that runs the group's current call (the caller, a waiter or the progress thread;
`ProcessGroup` lets exactly one run at a time) writes a message with one `sendmsg`
and reads one with one `recvmsg_into` (header and payload, in place), blocked in the
kernel until the peer's bytes arrive. A receiver thread on that path cost two thread
hand-offs per message (the kernel wakes it, it wakes the caller), each a context
switch and a GIL transfer; on a small loaded box those dominated a 1 KB all_reduce.
Why one reader is enough, and safe:

- Calls run one at a time, in the same order on every rank, and every direct-lane
  algorithm sends at most one message per call to each peer, which that peer reads in
  the same call, so the next message on a direct lane is always the one the running
  call expects (its header says so); anything else is a mismatch, reported as
  `CollectiveMismatch` naming both calls.
- A message is at most 256 KiB, well below a direct lane's socket buffers (at least
  1 MiB asked for each way), and a call sends before it receives, so its sends find
  room while the peer sends too. A rank that runs ahead (a broadcast root) may fill
  its peer's buffer and wait, but never on a peer that waits on it: a peer behind
  has already sent what the calls ahead needed from it. SO_SNDTIMEO bounds the wait.
- Deadlines: the sockets carry SO_RCVTIMEO/SO_SNDTIMEO of `_DIRECT_TICK`; a blocked
  read wakes that often to check the call's deadline and the group's failure.
- Failures: a peer's abort notice and EOF still arrive on the threaded lane, whose
  receiver fails the transport and shuts every socket down, which wakes a blocked
  direct read; it then raises the transport's error, so a rank that learns of a
  failure through a peer's closed direct lane still reports the original cause.
- Which lane a call uses is a function of its signature (op, dtype, count) and the
  group's settings, so ranks that agree use the same lane. Ranks that disagree may
  not: a threaded-lane message for the running call is checked against it by the
  receiver thread (`check_active`), and a threaded-lane wait that lasts peeks at the
  direct lanes for a message of the running call with another signature.

The *shared-memory lane* (shm_lane), which a pair of ranks on one host has unless
KILN_TCP_SHM=0, carries the payloads of the threaded lane's large DATA and P2P
messages (over 64 KiB, up to a slot: the ring segment): the sender thread copies the
payload into a slot of the segment both processes map and sends only the header,
with the slot in the high bits of its kind; the receiver thread lands it from there
(or lends the slot to a reduction, `Request.borrow`), in the same order and with the
same matching as a payload read from the socket. Smaller messages, larger ones, RMA
and notices stay on the socket, whose EOF still reports a dead peer.

A message header carries the sender's view of the call (op, dtype, reduce op, element
count), so ranks that disagree about a collective fail with `CollectiveMismatch`
instead of silently mixing bytes. A peer's EOF fails everything with `PeerFailure`
naming it; `abort()` sends an abort notice to every peer, then shuts the sockets, so
every waiter on every rank returns.
"""

from __future__ import annotations

import collections
import json
import math
import select
import socket
import struct
import threading
import time

from kiln.distributed.errors import (
    CollectiveMismatch, CollectiveTimeout, DistributedError, PeerFailure, error_from_wire,
    error_to_wire,
)
from kiln.distributed.protocol import loads_object

# kind, op, dtype, reduce op, seq (or tag), step, segment, count, payload bytes
HEADER = struct.Struct("!BBBBIIIqQ")
DATA, P2P, ABORT, BYE = 1, 2, 3, 4
# one-sided operations on RMA windows, served by the target's receiver thread (tcp_rma)
RMA_PUT, RMA_GET, RMA_ACC, RMA_SIGNAL, RMA_REPLY = 5, 6, 7, 8, 9
_MAX_NOTICE = 1 << 16
# a blocked direct-lane read or write wakes this often to check deadline and failure
_DIRECT_TICK = 0.1
# after a direct lane broke, how long to wait for the threaded lane's abort notice or
# EOF to say why (a peer that aborts sends its notice there before it closes), and how
# long a peer that left cleanly has to exit before this rank's call fails
_CAUSE_GRACE = 2.0
# a threaded-lane wait longer than this peeks at the direct lanes for a mismatch
_PEEK_AFTER = 0.05


class Request:
    """One posted send or receive; `event` is set when it ends (`error` says how)."""

    __slots__ = ("peer", "key", "sig", "view", "event", "error", "callback", "borrow",
                 "source")

    def __init__(self, peer: int, key: tuple, sig: tuple, view: memoryview, callback=None,
                 borrow: bool = False):
        self.peer, self.key, self.sig, self.view = peer, key, sig, view
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.callback = callback
        # a receive whose reader only reads the data (a reduction's operand) may borrow
        # the stash's copy of a message that came first, instead of a second copy into
        # `view`: `source` is then that copy (None: the data is in `view`)
        self.borrow = borrow
        self.source: bytearray | None = None

    def finish(self, error: BaseException | None = None) -> None:
        if self.event.is_set():
            return
        self.error = error
        self.event.set()
        if self.callback is not None:
            self.callback(error)


class Link:
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

    # -- the direct lane (used only by the thread running the group's current call) -----
    def direct_send(self, header: bytes, arr, deadline: float, call) -> None:
        """Write one message (header + the bytes of the flat array `arr`) until the
        kernel took it all; `call` (a `tcp_algorithms.Call`) names the call in a timeout.
        The first attempt does not block; if it cannot finish, the call's context is
        told (`before_blocking`) before this blocks."""
        parts = [header, arr]
        left = len(header) + arr.nbytes
        flags = socket.MSG_DONTWAIT
        while True:
            try:
                sent = self.direct.sendmsg(parts, (), flags)
            except BlockingIOError:  # full; or SO_SNDTIMEO: the peer has not read for a tick
                sent = 0
            except OSError as err:
                raise self._direct_broken(err, deadline, call) from None
            left -= sent
            if not left:
                return
            if flags:
                flags = 0
                hook = call.ctx.before_blocking
                if hook is not None:
                    hook()
            if sent:
                parts = _advance([p.view("u1") if hasattr(p, "dtype") else p for p in parts],
                                 sent)
            else:
                self._direct_tick(deadline, call)

    def direct_recv(self, key: tuple, sig: tuple, arr, deadline: float, call,
                    soft: float | None = None) -> bool:
        """Read the next direct-lane message into the flat array `arr`; it must be the
        message `key` = (kind, seq, step, segment) of signature `sig` and fill `arr`
        exactly. With `soft` (a monotonic time), return False if no message started to
        arrive by then (nothing is consumed); a message that started is read whole.
        Header and payload come in with one `recvmsg_into` (a valid message is exactly
        that long, so nothing of the next one is taken); after a mismatch the payload
        bytes in `arr` are undefined and the group fails."""
        sock = self.direct
        if soft is not None:
            if self._poller is None:
                self._poller = select.poll()
                self._poller.register(sock, select.POLLIN)
            limit = min(soft, deadline)
            if not self._poller.poll(max(math.ceil((limit - time.monotonic()) * 1e3), 0)):
                if time.monotonic() >= deadline:
                    self._direct_tick(deadline, call)
                return False
        head = self._head
        while True:
            try:
                got = sock.recvmsg_into([head, arr] if arr.nbytes else [head])[0]
            except BlockingIOError:  # SO_RCVTIMEO: nothing for a tick
                self._direct_tick(deadline, call)
                continue
            except OSError as err:
                raise self._direct_broken(err, deadline, call) from None
            if got == 0:
                raise self._direct_broken(EOFError("connection closed"), deadline, call)
            break
        if got < HEADER.size:
            self._direct_read(head, got, HEADER.size, deadline, call)
            got = HEADER.size
        kind, op, dt, rop, seq, step, seg, count, nbytes = HEADER.unpack(head)
        theirs = (op, dt, rop, count)
        if (kind, seq, step, seg) != key or nbytes != arr.nbytes or theirs != sig and \
                not _compatible(sig, theirs):
            if (kind, seq) != key[:2]:
                detail = "its message is for seq %d, this rank is at seq %d" % (seq, key[1])
            elif (step, seg) != key[2:]:
                detail = "message for step %d, expected step %d" % (step, key[2])
            else:
                detail = "message of %d bytes, expected %d" % (nbytes, arr.nbytes)
            error = self._mismatch(key[1], sig, theirs, detail)
            self.transport.fail(error)  # the stream is out of step: nothing more is read
            raise error
        if got - HEADER.size < nbytes:
            self._direct_read(arr, got - HEADER.size, nbytes, deadline, call)
        return True

    def direct_peek(self) -> tuple | None:
        """(kind, seq, signature) of the message waiting on the direct lane, if a whole
        header is there (nothing is consumed)."""
        try:
            data = self.direct.recv(HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return None
        if len(data) < HEADER.size:
            return None
        kind, op, dt, rop, seq, _, _, count, _ = HEADER.unpack(data)
        return kind, seq, (op, dt, rop, count)

    def _direct_read(self, buf, got: int, nbytes: int, deadline: float, call) -> None:
        """Read bytes [got, nbytes) of `buf` (a bytearray or a flat array)."""
        sock = self.direct
        raw = memoryview(buf if isinstance(buf, bytearray) else buf.view("u1"))
        while got < nbytes:
            try:
                k = sock.recv_into(raw[got:], nbytes - got)
            except BlockingIOError:  # SO_RCVTIMEO: nothing for a tick
                self._direct_tick(deadline, call)
                continue
            except OSError as err:
                raise self._direct_broken(err, deadline, call) from None
            if k == 0:
                raise self._direct_broken(EOFError("connection closed"), deadline, call)
            got += k

    def _direct_tick(self, deadline: float, call) -> None:
        """A tick passed without progress: raise the group's failure or the timeout."""
        transport = self.transport
        if transport.error is not None or transport.closing:
            raise transport.error or transport.close_error
        if time.monotonic() >= deadline:
            raise CollectiveTimeout(
                "%s on rank %d of group '%s' timed out: no progress from rank %d"
                % (call.what(), transport.rank, transport.group, self.peer), rank=self.peer)

    def _direct_broken(self, err: BaseException, deadline: float, call) -> DistributedError:
        """The direct lane failed (EOF, reset): the cause, preferring what the threaded
        lane reports (a peer that aborts or dies shows there too, with the reason). A
        peer that left the group cleanly (said goodbye) fails the call with PeerFailure
        only after `_CAUSE_GRACE` (or at the call's deadline, if sooner): its own exit
        status is the news, and a launcher that sees this rank fail first would blame
        the wrong rank."""
        transport = self.transport
        give_up = time.monotonic() + _CAUSE_GRACE
        while transport.error is None and not transport.closing:
            now = time.monotonic()
            if now >= give_up or (now >= deadline if self.departed else
                                  not self._receiver.is_alive()):
                break
            transport.failed.wait(0.02)
        if transport.error is not None or transport.closing:
            return transport.error or transport.close_error
        if self.departed and time.monotonic() < give_up:  # the deadline came first
            error = CollectiveTimeout(
                "%s on rank %d of group '%s' timed out: rank %d left the group"
                % (call.what(), transport.rank, transport.group, self.peer), rank=self.peer)
        else:
            error = self._link_error(err)
        transport.fail(error)
        return transport.error or error

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
                 describe_sig=repr, direct: dict[int, socket.socket] | None = None,
                 shm: dict | None = None):
        # errors name the group as users know it: "pg/<name>/e<epoch>" -> "<name>"
        parts = group.split("/")
        self.group = parts[1] if len(parts) == 3 and parts[0] == "pg" else group
        self.rank, self.world_size = rank, world_size
        self.describe_sig = describe_sig
        self.error: DistributedError | None = None
        self.failed = threading.Event()  # set with `error`
        self.closing = False
        self.close_error: BaseException | None = None  # why the links were closed
        self.on_failure = None  # set by the backend: called once with the first error
        self.active: tuple | None = None  # (seq, signature) of the call in progress
        self.rma = None  # the backend's tcp_rma.RmaEngine: serves RMA_* messages
        self._lock = threading.Lock()
        direct, shm = direct or {}, shm or {}
        self.links = {peer: Link(self, peer, s, direct.get(peer), shm.get(peer))
                      for peer, s in socks.items()}
        for link in self.links.values():
            link.start()

    def activate(self, seq: int, sig: tuple) -> None:
        """Mark the collective `seq` as in progress here; a peer's message for it that
        already arrived under another signature fails the group with the mismatch."""
        self.active = (seq, sig)
        for peer, link in self.links.items():
            # unlocked emptiness test: a message stashed after it sees `active` set
            # (the receiver checks it after stashing), so one of the two checks sees it
            if not link.stash:
                continue
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
              view: memoryview, callback=None, borrow: bool = False) -> Request:
        req = Request(peer, (kind, seq, step, seg), sig, view, callback, borrow)
        self.links[peer].post(req)
        return req

    def wait(self, req: Request, deadline: float, what: str) -> None:
        """Wait for one request until `deadline`; raise its error or CollectiveTimeout.
        A wait that lasts peeks at the direct lanes now and then: a peer that runs this
        seq as a small collective (another signature) sent its message there."""
        wait = _PEEK_AFTER
        while not req.event.wait(max(min(deadline - time.monotonic(), wait), 0.0)):
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(
                    "%s on rank %d of group '%s' timed out: no progress from rank %d"
                    % (what, self.rank, self.group, req.peer), rank=req.peer)
            self.peek_direct()
            wait = 2 * _DIRECT_TICK
        if req.error is not None:
            raise req.error

    def peek_direct(self) -> None:
        """Fail with CollectiveMismatch if a direct lane holds a message for the running
        call with another signature (only the thread running the call may call this)."""
        active = self.active
        if active is None or self.error is not None:
            return
        for peer, link in self.links.items():
            if link.direct is None:
                continue
            head = link.direct_peek()
            if head is not None and head[0] == DATA and head[1] == active[0] and \
                    not _compatible(active[1], head[2]):
                self.fail(link._mismatch(active[0], active[1], head[2],
                                         "its message came on the direct lane"))
                return

    def fail(self, error: DistributedError) -> None:
        """Record the first failure, fail every pending request, tell peers, close."""
        with self._lock:
            if self.error is not None or self.closing:
                return
            self.error = error
        self.failed.set()
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
        self.close_error = error
        self.closing = True
        for link in self.links.values():
            link.fail_all(error)
            link.shutdown()
        if self.rma is not None:
            self.rma.fail_all(error)
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
            if link.direct is not None:
                link.direct.close()
            if link.shm is not None:
                link.shm.close()
