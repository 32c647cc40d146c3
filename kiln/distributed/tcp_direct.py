"""The direct lane of a TCP link (the mixin `DirectLane` of `tcp_link.Link`).

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
"""

from __future__ import annotations

import math
import select
import socket
import time

from kiln.distributed.errors import CollectiveTimeout, DistributedError
from kiln.distributed.tcp_messages import _CAUSE_GRACE, HEADER, _advance, _compatible


class DirectLane:
    """The direct-lane half of a `Link` (used only by the thread running the group's
    current call): the link provides `direct`, `transport`, `peer`, `departed`, `_head`,
    `_poller`, `_receiver`, `_mismatch` and `_link_error`."""

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
