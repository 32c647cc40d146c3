"""One-sided RMA on the TCP transport: the origin's table of pending requests and the
target's server, which runs on the receiver thread of the link a request came on, so
a target serves its windows while its user code does anything else (or nothing).

Every request travels on the threaded lane with the usual header (tcp_transport.HEADER);
`seq` holds the window id and `step` the origin's request id:

| kind       | dtype | reduce op | segment | count  | payload                          |
|------------|-------|-----------|---------|--------|----------------------------------|
| RMA_PUT    | code  |           |         | offset | the elements                     |
| RMA_ACC    | code  | code      |         | offset | the elements                     |
| RMA_GET    | code  |           |         | offset | the element count (`!q`)         |
| RMA_SIGNAL |       |           | slot    | value  |                                  |
| RMA_REPLY  | (op: 0 done, 1 refused)  |         |        | a get's elements, or a refusal   |

Every request gets one reply, sent once the target applied it; the reply names the
request id, which is how a get's data finds its `out` buffer (landing there with
`recv_into`) and how every operation's `done` is called. Replies to requests that
were cancelled meanwhile (window freed or invalidated here) are read and dropped.

Ordering: one origin's requests to one target leave in issue order on one socket
(`Link.send` is FIFO) and that link's one receiver thread applies them in arrival
order, so a signal is applied after every earlier put or accumulate of the same
origin: put-then-signal makes the data visible before the counter moves.
Atomicity: the target applies each operation with the window's lock held (a put lands
with `recv_into` straight into the window region under it, a get copies the region
under it before the reply goes out), so operations from different peers on one window
never interleave. The lock is held only while one operation is applied; a receiver
thread waiting for it reads nothing else from its peer meanwhile, which is bounded by
the holder's socket read (a transport failure shuts that socket).

A request the target cannot apply (no such window there any more, wrong dtype or
bounds, which the origin checks first) is refused in its reply: only that operation
fails, the group goes on. A transport failure fails every pending request and wakes
every `wait_signal` (`fail_all`, called by the transport when it closes).
"""

from __future__ import annotations

import json
import struct
import threading

import numpy as np

from kiln.distributed.buffers import DTYPE_CODES, REDUCE_CODES, dtype_of
from kiln.distributed.errors import CollectiveArgumentError, DistributedError, WindowInvalidated
from kiln.distributed.protocol import loads_object
from kiln.distributed.tcp_transport import (
    _MAX_NOTICE, HEADER, RMA_ACC, RMA_GET, RMA_PUT, RMA_REPLY, RMA_SIGNAL, Request,
)

_DONE, _REFUSED = 0, 1
_COUNT = struct.Struct("!q")
_NO_SIG = (0, 0, 0, -1)  # sends are never matched against a posted receive
_REDUCE_NAMES = {code: name for name, code in REDUCE_CODES.items()}
_REFUSALS = {"WindowInvalidated": WindowInvalidated,
             "CollectiveArgumentError": CollectiveArgumentError}


_OP_NAMES = {RMA_PUT: "window.put", RMA_ACC: "window.accumulate", RMA_GET: "window.get",
             RMA_SIGNAL: "window.signal"}


class _Pending:
    __slots__ = ("peer", "kind", "window_id", "view", "done")

    def __init__(self, peer: int, kind: int, window_id: int, view, done):
        self.peer, self.kind, self.window_id, self.view, self.done = \
            peer, kind, window_id, view, done


class RmaEngine:
    """The RMA state of one transport: registered windows and pending requests."""

    def __init__(self, transport):
        self.transport = transport
        self._lock = threading.Lock()
        self._windows: dict = {}  # window id -> window.WindowMemory
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        self.error: BaseException | None = None  # set once the transport closed

    # -- registry --------------------------------------------------------------------
    def register(self, memory) -> None:
        with self._lock:
            if self.error is not None:
                raise self.error
            self._windows[memory.id] = memory

    def unregister(self, window_id: int, error: BaseException) -> None:
        with self._lock:
            self._windows.pop(window_id, None)
            gone = [rid for rid, p in self._pending.items() if p.window_id == window_id]
            cancelled = [self._pending.pop(rid) for rid in gone]
        for p in cancelled:
            p.done(error)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            pending = list(self._pending.values())
            self._pending.clear()
            memories = list(self._windows.values())
        for p in pending:
            p.done(error)
        for memory in memories:
            memory.fail(error)

    # -- origin ----------------------------------------------------------------------
    def put(self, window_id: int, dst: int, offset: int, data: np.ndarray, done) -> None:
        self._request(dst, RMA_PUT, window_id, _code(data), 0, 0, offset, _bytes(data), None,
                      done)

    def accumulate(self, window_id: int, dst: int, offset: int, data: np.ndarray,
                   reduce_op: str, done) -> None:
        self._request(dst, RMA_ACC, window_id, _code(data), REDUCE_CODES[reduce_op], 0, offset,
                      _bytes(data), None, done)

    def get(self, window_id: int, src: int, offset: int, out: np.ndarray, done) -> None:
        self._request(src, RMA_GET, window_id, _code(out), 0, 0, offset,
                      memoryview(_COUNT.pack(out.size)), _bytes(out), done)

    def signal(self, window_id: int, dst: int, slot: int, value: int, done) -> None:
        self._request(dst, RMA_SIGNAL, window_id, 0, 0, slot, value, memoryview(b""), None, done)

    def _request(self, peer: int, kind: int, window_id: int, dt: int, rop: int, seg: int,
                 count: int, payload: memoryview, reply_view, done) -> None:
        with self._lock:
            error = self.error
            if error is None:
                rid = self._next
                self._next = (rid + 1) & 0xFFFFFFFF
                self._pending[rid] = _Pending(peer, kind, window_id, reply_view, done)
        if error is not None:
            done(error)
            return
        header = HEADER.pack(kind, 0, dt, rop, window_id, rid, seg, count, len(payload))

        def sent(err: BaseException | None) -> None:
            if err is not None:
                self._finish(rid, err)
        # no deadline: a user thread never waits here for socket space (the sender
        # thread takes what does not fit); the op's deadline is kept by its group
        self.transport.links[peer].send(header, Request(peer, (kind, window_id, rid, 0),
                                                        _NO_SIG, payload, sent))

    def _finish(self, rid: int, error: BaseException | None) -> None:
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is not None:
            p.done(error)

    # -- target: called by the receiver thread of `link` -----------------------------
    def serve(self, link, kind: int, op: int, dt: int, rop: int, window_id: int, rid: int,
              seg: int, count: int, nbytes: int) -> None:
        """Apply one request (its header read, its payload still on the socket) and
        send the reply; socket errors propagate (the receiver fails the transport)."""
        if kind == RMA_REPLY:
            self._on_reply(link, op, rid, nbytes)
            return
        memory = self._windows.get(window_id)
        n = None  # the element count of a get (of a put or accumulate: its payload's)
        if kind == RMA_GET:
            if nbytes != _COUNT.size:
                raise ValueError("RMA_GET with a %d-byte payload" % nbytes)
            n = _COUNT.unpack(link._read_new(nbytes))[0]
            nbytes = 0
        refusal = self._refusal(memory, kind, dt, rop, window_id, count, n, nbytes)
        if refusal is not None:
            _drain(link, nbytes)
            self._reply(link, window_id, rid, refusal=refusal)
            return
        data = None
        try:
            if kind == RMA_PUT:
                with memory.lock:
                    link._read(memory.byte_region(count, nbytes // memory.itemsize))
            elif kind == RMA_ACC:
                incoming = np.empty(nbytes // memory.itemsize, memory.dtype)
                link._read(_bytes(incoming))  # outside the lock: other peers' ops go on
                memory.accumulate(count, incoming, _REDUCE_NAMES[rop])
            elif kind == RMA_GET:
                data = memory.read(count, n)
            else:
                memory.add_signal(seg, count)
        except (OSError, EOFError):
            raise
        except Exception as err:  # a bug must fail the operation, not the receiver thread
            self._reply(link, window_id, rid, refusal=(
                "DistributedError", "it failed inside kiln on rank %d: %r"
                % (self.transport.rank, err)))
            return
        self._reply(link, window_id, rid, data=data)

    def _refusal(self, memory, kind: int, dt: int, rop: int, window_id: int, offset: int,
                 n: int | None, nbytes: int) -> tuple | None:
        """Why the request cannot be applied here, as (error class name, message)."""
        where = "rank %d of group '%s'" % (self.transport.rank, self.transport.group)
        if memory is None:
            return ("WindowInvalidated", "%s has no window %d (freed there, or the group was "
                    "reconfigured)" % (where, window_id))
        if kind == RMA_SIGNAL:
            return None
        if dt != memory.dtype_code:
            return ("CollectiveArgumentError", "window %d on %s holds %s, the request another "
                    "dtype (code %d)" % (window_id, where, memory.dtype_name, dt))
        if kind != RMA_GET and nbytes % memory.itemsize:
            return ("CollectiveArgumentError", "a payload of %d bytes is not a whole number "
                    "of %s elements" % (nbytes, memory.dtype_name))
        if n is None:
            n = nbytes // memory.itemsize
        if kind == RMA_ACC and rop not in _REDUCE_NAMES:
            return ("CollectiveArgumentError", "unknown reduce op code %d" % rop)
        if offset < 0 or n < 0 or offset + n > memory.size:
            return ("CollectiveArgumentError", "offset %d + %d elements exceeds the window of "
                    "%d %s on %s" % (offset, n, memory.size, memory.dtype_name, where))
        return None

    def _reply(self, link, window_id: int, rid: int, *, refusal: tuple | None = None,
               data: np.ndarray | None = None) -> None:
        if refusal is not None:
            status = _REFUSED
            payload = memoryview(json.dumps({"type": refusal[0], "message": refusal[1]})
                                 .encode()[:_MAX_NOTICE])
        else:
            status = _DONE
            payload = _bytes(data) if data is not None else memoryview(b"")
        header = HEADER.pack(RMA_REPLY, status, 0, 0, window_id, rid, 0, -1, len(payload))
        link.send(header, Request(link.peer, (RMA_REPLY, window_id, rid, 0), _NO_SIG, payload))

    def _on_reply(self, link, status: int, rid: int, nbytes: int) -> None:
        with self._lock:
            p = self._pending.get(rid)
            if p is not None and p.peer == link.peer:
                del self._pending[rid]
            else:
                p = None
        if p is None:  # cancelled meanwhile (freed, invalidated): nobody wants it
            _drain(link, nbytes)
            return
        if status != _DONE:
            info = loads_object(link._read_new(min(nbytes, _MAX_NOTICE)) or b"{}")
            _drain(link, nbytes - min(nbytes, _MAX_NOTICE))
            cls = _REFUSALS.get(info.get("type"), DistributedError)
            p.done(cls("%s to rank %d refused: %s" % (_OP_NAMES[p.kind], link.peer,
                                                      info.get("message"))))
            return
        want = 0 if p.view is None else len(p.view)
        if nbytes != want:
            _drain(link, nbytes)
            p.done(DistributedError("%s: rank %d answered with %d bytes, expected %d"
                                    % (_OP_NAMES[p.kind], link.peer, nbytes, want)))
            return
        if nbytes:
            link._read(p.view)
        p.done(None)


def _code(arr: np.ndarray) -> int:
    return DTYPE_CODES[dtype_of(arr).short]


def _bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.view(np.uint8))


def _drain(link, nbytes: int) -> None:
    """Read and drop `nbytes` of payload, keeping the stream in step."""
    if nbytes <= 0:
        return
    chunk = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        k = min(nbytes, len(chunk))
        link._read(chunk[:k])
        nbytes -= k
