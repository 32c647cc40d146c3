"""Accept loops that keep serving: the store's port and each rank's data port.

A listening socket faces whoever can reach it, token or not. `Acceptor` runs its
accept loop on a thread and gives every connection its own short-lived thread for
the handshake, under a per-connection deadline of its own (HANDSHAKE_TIMEOUT, never
the job's), so any number of idle or slow strangers cannot delay a real peer:

- **Too many open files** (EMFILE/ENFILE, ENOBUFS/ENOMEM) do not end the loop: it
  drops the oldest connection still in its handshake (unauthenticated, so nobody's
  work is lost; the newest, most likely the peer that just arrived, keeps its turn),
  backs off (10 ms after a drop, up to 1 s when nothing could be dropped), logs one
  line and accepts again. At most `max_pending` handshakes run at once; one more
  drops the oldest the same way (sshd's MaxStartups plays this role).
- **Every per-connection error** (a refused handshake, a reset, a malformed frame, a
  failure of the code serving it) ends that connection only; a thread that cannot
  be started costs its connection, not the loop.
- Log lines go to stderr, at most one per kind every LOG_EVERY seconds, with the
  count of those left out.

A handshake that succeeds hands the connection to `serve(conn, hello)` on the same
thread (the store serves requests there), or, without `serve`, to a queue the owner
reads with `next_ready` (a rank's rendezvous). The owner of a connection closes it.

    >>> acceptor = Acceptor(listener, "store", handshake=auth, serve=handle)
    >>> acceptor.close()
"""

from __future__ import annotations

import collections
import errno
import socket
import sys
import threading
import time
from typing import Callable

HANDSHAKE_TIMEOUT = 5.0  # seconds a connection has to prove it knows the token
MAX_PENDING = 256  # handshakes in progress at once (a job start brings a burst)
LOG_EVERY = 10.0  # seconds between two log lines of one kind
_POLL = 0.2  # the accept loop checks for close() this often
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_LISTENER_GONE = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})


class Acceptor:
    """Accepts on `listener` (bound and listening) until `close()`.

    `handshake(conn)` authenticates a new connection within its own deadline and
    returns what the peer said (its hello) or raises; `serve(conn, hello)` then owns
    the connection. Without `serve`, authenticated connections queue for
    `next_ready`. `name` prefixes the log lines ("kiln store: ...").
    """

    def __init__(self, listener: socket.socket, name: str,
                 handshake: Callable[[socket.socket], dict],
                 serve: Callable[[socket.socket, dict], None] | None = None, *,
                 max_pending: int = MAX_PENDING):
        self._listener = listener
        self.name = name
        self._handshake, self._serve = handshake, serve
        self._max_pending = max(int(max_pending), 1)
        self._lock = threading.Condition()
        self._pending: dict[socket.socket, float] = {}  # in handshake, oldest first
        self._ready: collections.deque[tuple[socket.socket, dict]] = collections.deque()
        self._closed = False
        self._stop = threading.Event()
        self._logged: dict[str, tuple[float | None, int]] = {}  # kind -> (last, left out)
        self.refused = 0  # connections that failed their handshake or were dropped
        listener.settimeout(_POLL)
        self._thread = threading.Thread(target=self._loop, name="kiln-%s-accept" % name,
                                        daemon=True)
        self._thread.start()

    # -- the owner's side --------------------------------------------------------------
    def next_ready(self, deadline: float) -> tuple[socket.socket, dict] | None:
        """The next authenticated (connection, hello), or None at `deadline`."""
        with self._lock:
            while not self._ready:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._lock.wait(remaining)
            return self._ready.popleft()

    def is_alive(self) -> bool:
        """True while the accept loop runs (it ends only at close())."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop accepting; drop every connection in its handshake or not yet taken."""
        with self._lock:
            self._closed = True
            pending, ready = list(self._pending), [c for c, _ in self._ready]
            self._pending.clear()
            self._ready.clear()
            for conn in pending:
                _shutdown(conn)  # its thread closes it
            for conn in ready:
                conn.close()
            self._lock.notify_all()
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def log(self, kind: str, message: str) -> None:
        """One line on stderr, unless a line of this kind went out under LOG_EVERY ago."""
        now = time.monotonic()
        with self._lock:
            last, left_out = self._logged.get(kind, (None, 0))
            if last is not None and now - last < LOG_EVERY:
                self._logged[kind] = (last, left_out + 1)
                return
            self._logged[kind] = (now, 0)
        more = " (and %d more like it)" % left_out if left_out else ""
        try:
            print("kiln %s: %s%s" % (self.name, message, more), file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed: serving matters more than the log
            pass

    # -- the accept loop ---------------------------------------------------------------
    def _loop(self) -> None:
        backoff = 0.0
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as err:
                if self._closed:
                    return
                if err.errno in _LISTENER_GONE:
                    self.log("listener", "the listening socket is gone (%s); no longer "
                             "accepting" % err)
                    return
                if err.errno in _RESOURCE_ERRNOS:
                    dropped = self._drop_oldest()
                    backoff = 0.01 if dropped else min(max(2 * backoff, 0.05), 1.0)
                    self.log("resources", "cannot accept a connection (%s): %s; backing off "
                             "%.2f s and serving on" % (
                                 errno.errorcode.get(err.errno, err.errno),
                                 "dropped the oldest unauthenticated one" if dropped else
                                 "no unauthenticated connection to drop", backoff))
                else:  # that connection failed before we got it (ECONNABORTED, EPROTO...)
                    backoff = 0.01
                    self.log("accept", "accept failed (%s); serving on" % err)
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            self._start(conn)

    def _start(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            if len(self._pending) >= self._max_pending:
                self._drop_oldest_locked()
                self.log("pending", "%d connections in their handshake at once: dropped the "
                         "oldest" % self._max_pending)
            self._pending[conn] = time.monotonic()
        try:
            threading.Thread(target=self._run, args=(conn,), daemon=True,
                             name="kiln-%s-conn" % self.name).start()
        except RuntimeError as err:  # no thread for it: this connection only is lost
            self._discard(conn)
            self.log("threads", "cannot start a thread for a connection (%s); dropped it"
                     % err)
            self._stop.wait(0.05)

    def _run(self, conn: socket.socket) -> None:
        try:
            hello = self._handshake(conn)
        except Exception as err:  # noqa: BLE001 - a stranger's connection may fail any way
            if self._discard(conn):  # not when dropped: that was logged already
                self.log("refused", "refused a connection: %s" % _describe(err))
            return
        with self._lock:
            if self._pending.pop(conn, None) is None or self._closed:  # dropped meanwhile
                conn.close()
                return
            if self._serve is None:
                self._ready.append((conn, hello))
                self._lock.notify_all()
                return
        try:
            self._serve(conn, hello)
        except Exception as err:  # noqa: BLE001 - the connection ends, the server goes on
            self.log("serve", "a connection failed: %s" % _describe(err))
            conn.close()

    def _discard(self, conn: socket.socket) -> bool:
        """Close a connection that failed its handshake; False if it had been dropped."""
        with self._lock:  # closed under the lock: a drop never shuts a reused descriptor
            was_pending = self._pending.pop(conn, None) is not None
            self.refused += was_pending
            conn.close()
        return was_pending

    def _drop_oldest(self) -> bool:
        with self._lock:
            return self._drop_oldest_locked()

    def _drop_oldest_locked(self) -> bool:
        if not self._pending:
            return False
        oldest = next(iter(self._pending))
        del self._pending[oldest]
        self.refused += 1
        _shutdown(oldest)  # its handshake fails at once, and its thread closes it
        return True


def _describe(err: BaseException) -> str:
    return getattr(err, "message", None) or "%s: %s" % (type(err).__name__, err)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
