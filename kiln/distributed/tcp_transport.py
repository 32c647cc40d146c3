"""TCP links of one group: framed messages, posted receives, the direct lane, abort.

Layers: tcp_messages (header, kinds, `Request`), tcp_link (`Link`: the sockets to one
peer, its threaded lane and shared-memory lane), tcp_direct (the direct lane of a
link), and here `Transport`: all links of one group (a full mesh) plus its failure
state. The first failure wins: it fails every pending request, sends an abort notice
to every peer and shuts the sockets, so every waiter on every rank returns; a clean
`close` says goodbye instead. Which lane carries what, and why, is in tcp_link and
tcp_direct. The names other modules import from here (`HEADER`, the kinds,
`Request`, ...) are re-exported from tcp_messages.
"""

from __future__ import annotations

import socket
import threading
import time

from kiln.distributed.errors import CollectiveMismatch, CollectiveTimeout, DistributedError, \
    error_to_wire
from kiln.distributed.tcp_link import Link
from kiln.distributed.tcp_messages import (  # noqa: F401  re-exported (their old home)
    _DIRECT_TICK, _MAX_NOTICE, _PEEK_AFTER, ABORT, BYE, DATA, HEADER, P2P, RMA_ACC, RMA_GET,
    RMA_PUT, RMA_REPLY, RMA_SIGNAL, Request, _compatible,
)


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
