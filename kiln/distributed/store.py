"""A TCP key-value store for rendezvous and coordination.

`StoreServer` serves the keys (rank 0 hosts one in-process on a thread, `kiln launch`
hosts one for its workers, `kiln store --port P` runs one alone); `Store` is the
client. Every client authenticates with the job token first (see `protocol`); every
operation has a deadline and raises `StoreTimeout` past it.

    >>> server = StoreServer("127.0.0.1", 0, token="secret")
    >>> store = Store(server.address, token="secret")
    >>> store.set("a", b"1"); store.add("n", 5)
    5
    >>> store.get("a")
    b'1'
"""

from __future__ import annotations

import socket
import threading
import time

from kiln.distributed.acceptor import HANDSHAKE_TIMEOUT, Acceptor
from kiln.distributed.errors import (
    InvalidTimeout, MalformedFrame, StoreAuthError, StoreBadRequest, StoreError, StoreTimeout,
)
from kiln.distributed.protocol import (
    ConnectionLost, check_timeout, client_handshake, loads_object, parse_address, recv_frame,
    recv_raw_frame, send_frame, server_handshake,
)

ROLE = "store"
_INT64 = 1 << 63


class StoreServer:
    """Serves the store on (host, port) from daemon threads; port 0 picks a free port.

        >>> server = StoreServer("127.0.0.1", 0, token="t"); server.port > 0
        True
        >>> server.close()

    It keeps serving whatever its clients do (see `acceptor`): strangers, too many
    connections for the process's file limit, malformed or hostile requests. A
    request it cannot apply gets the reply `bad_request` and the connection stays
    usable; a frame that breaks the protocol's limits ends that connection only.
    """

    def __init__(self, host: str, port: int, token: str, *,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT):
        if not token:
            raise StoreAuthError("a store needs a job token", hint="set KILN_TOKEN")
        self._token = token
        self._handshake_timeout = check_timeout(handshake_timeout, "handshake_timeout")
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._owner: dict[str, socket.socket] = {}  # ephemeral key -> the connection it lives on
        listener = socket.create_server((host, port), backlog=128)
        self.host, self.port = listener.getsockname()[:2]
        self._acceptor = Acceptor(listener, "store", self._handshake, self._serve)

    @property
    def address(self) -> str:
        return "%s:%d" % (self.host, self.port)

    def close(self) -> None:
        """Stop serving and drop every connection (blocked waits return an error)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn)
        self._acceptor.close()

    def contents(self) -> dict[str, bytes]:
        """A copy of every key and value (for the process hosting the store)."""
        with self._cond:
            return dict(self._data)

    def wait_for(self, predicate, timeout: float) -> bool:
        """Block until `predicate(data)` holds, at most `timeout` s; whether it held.

        `predicate` gets the live key -> value dict, with the store's lock held: it must
        only read it, and quickly. It is tried again at every change, and at least every
        0.1 s (it may depend on more than the data); a closed store ends the wait."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._data):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def serve_forever(self) -> None:
        """Block the calling thread until close() (used by `kiln store`)."""
        while self._acceptor.is_alive():
            time.sleep(0.5)

    def _handshake(self, conn: socket.socket) -> dict:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return server_handshake(conn, self._token, ROLE, self._handshake_timeout)

    def _serve(self, conn: socket.socket, hello: dict) -> None:
        """One authenticated client's requests, in order, until it hangs up."""
        with self._cond:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            while True:
                try:
                    raw, body = recv_raw_frame(conn, deadline=None)
                except MalformedFrame as err:  # a size out of bounds: the stream is lost
                    send_frame(conn, _bad(err.message), deadline=time.monotonic() + 1.0)
                    return
                try:
                    reply, value = self._apply(loads_object(raw), body, conn)
                except MalformedFrame as err:  # read whole: answer it, serve the next
                    reply, value = _bad(err.message), b""
                except Exception as err:  # noqa: BLE001 - a bug here must not end the server
                    self._acceptor.log("internal", "a request failed: %s: %s"
                                       % (type(err).__name__, err))
                    reply, value = {"ok": False, "error": "internal",
                                    "message": "%s: %s" % (type(err).__name__, err)}, b""
                send_frame(conn, reply, value)
        except StoreError:
            pass  # the client hung up, or vanished mid-frame
        finally:
            with self._cond:
                self._conns.discard(conn)
                for key in [k for k, c in self._owner.items() if c is conn]:
                    del self._owner[key]  # its process is gone (or hung up): so is the key
                    self._data.pop(key, None)
                self._cond.notify_all()
            conn.close()

    def _apply(self, h: dict, body: bytes, conn: socket.socket | None = None) -> tuple[dict, bytes]:
        """The reply to request `h` (its value bytes in `body`). Every field is checked
        before anything is applied; a request that breaks a rule gets `bad_request`."""
        op = h.get("op")
        rule = _REQUESTS.get(op) if isinstance(op, str) else None
        if rule is None:
            return _bad("unknown op %.60r" % (op,)), b""
        for field, (kinds, required) in rule.items():
            if field not in h:
                if required:
                    return _bad("%s needs the field %r" % (op, field)), b""
                continue
            value = h[field]
            if not _is(value, kinds):
                return _bad("%s: field %r must be %s, not %.60r"
                            % (op, field, _KIND_NAMES[kinds], value)), b""
        timeout = 0.0
        if "timeout" in h:
            try:
                timeout = check_timeout(h["timeout"])
            except InvalidTimeout as err:
                return _bad("%s: %s" % (op, err.message)), b""
        return getattr(self, "_op_" + op)(h, body, conn, timeout)

    # -- the operations (fields already checked) ---------------------------------------
    def _op_set(self, h, body, conn, timeout):
        key = h["key"]
        with self._cond:
            self._data[key] = body
            if h.get("ephemeral") and conn is not None:
                self._owner[key] = conn
            else:
                self._owner.pop(key, None)
            self._cond.notify_all()
        return {"ok": True}, b""

    def _op_get(self, h, body, conn, timeout):
        key = h["key"]
        with self._cond:  # the value is read under the lock that saw it set
            if not self._wait_locked([key], timeout):
                return {"ok": False, "error": "timeout", "message": "key %r not set" % key}, b""
            return {"ok": True}, self._data[key]

    def _op_add(self, h, body, conn, timeout):
        key = h["key"]
        amount = h.get("amount", 0)
        if not -_INT64 <= amount < _INT64:
            return _bad("add: amount %d is not a 64-bit integer" % amount), b""
        with self._cond:
            try:
                value = int(self._data.get(key, b"0")) + amount
                text = str(value).encode()
            except ValueError:
                return _bad("key %r does not hold an integer" % key), b""
            self._data[key] = text
            self._cond.notify_all()
        return {"ok": True, "value": value}, b""

    def _op_wait(self, h, body, conn, timeout):
        keys = h["keys"]
        with self._cond:
            if not self._wait_locked(keys, timeout):
                missing = [k for k in keys if k not in self._data]
                return {"ok": False, "error": "timeout",
                        "message": "keys not set: %s" % ", ".join(missing)}, b""
        return {"ok": True}, b""

    def _op_check(self, h, body, conn, timeout):
        with self._cond:
            return {"ok": True, "value": all(k in self._data for k in h["keys"])}, b""

    def _op_cas(self, h, body, conn, timeout):
        key, expected_len = h["key"], h.get("expected_len")  # None: swap only when absent
        if expected_len is not None and not 0 <= expected_len <= len(body):
            return _bad("cas: expected_len=%d outside the body's %d bytes"
                        % (expected_len, len(body))), b""
        expected, desired = body[:expected_len or 0], body[expected_len or 0:]
        with self._cond:
            current = self._data.get(key)
            if (expected_len is None and current is None) or (
                    expected_len is not None and current == expected):
                self._data[key] = current = desired
                self._cond.notify_all()
            return {"ok": True, "present": current is not None}, current or b""

    def _op_delete(self, h, body, conn, timeout):
        with self._cond:
            self._owner.pop(h["key"], None)
            return {"ok": True, "value": self._data.pop(h["key"], None) is not None}, b""

    def _op_delete_prefix(self, h, body, conn, timeout):
        prefix = h["prefix"]
        if not prefix:
            return _bad("delete_prefix needs a non-empty prefix"), b""
        with self._cond:
            keys = [k for k in self._data if k.startswith(prefix)]
            for k in keys:
                del self._data[k]
                self._owner.pop(k, None)
        return {"ok": True, "value": len(keys)}, b""

    def _op_list(self, h, body, conn, timeout):
        prefix = h.get("prefix", "")
        with self._cond:
            keys = sorted(k for k in self._data if k.startswith(prefix))
        return {"ok": True, "keys": keys}, b""

    def _op_ping(self, h, body, conn, timeout):
        return {"ok": True}, b""

    def _wait_locked(self, keys: list[str], timeout: float) -> bool:
        """With self._cond held: wait until every key is set, at most `timeout` s."""
        deadline = time.monotonic() + timeout
        while not all(k in self._data for k in keys):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return False
            self._cond.wait(remaining)
        return True


# field kinds of a request; a timeout is checked apart (finite, in (0, 7 days])
_STR, _INT, _BOOL, _KEYS, _INT_OR_NULL, _NUMBER = "str", "int", "bool", "keys", "int?", "num"
_KIND_NAMES = {_STR: "a string", _INT: "an integer", _BOOL: "true or false",
               _KEYS: "a list of strings", _INT_OR_NULL: "an integer or null",
               _NUMBER: "a number of seconds"}
_KEY = {"key": (_STR, True)}
_TIMEOUT = {"timeout": (_NUMBER, False)}
_REQUESTS: dict[str, dict[str, tuple[str, bool]]] = {
    "set": {**_KEY, "ephemeral": (_BOOL, False)},
    "get": {**_KEY, **_TIMEOUT},
    "add": {**_KEY, "amount": (_INT, False)},
    "wait": {"keys": (_KEYS, True), **_TIMEOUT},
    "check": {"keys": (_KEYS, True)},
    "cas": {**_KEY, "expected_len": (_INT_OR_NULL, False)},
    "delete": dict(_KEY),
    "delete_prefix": {"prefix": (_STR, True)},
    "list": {"prefix": (_STR, False)},
    "ping": {},
}


def _is(value, kind: str) -> bool:
    if kind == _STR:
        return isinstance(value, str)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT or kind == _INT_OR_NULL:
        return (value is None and kind == _INT_OR_NULL) or (
            isinstance(value, int) and not isinstance(value, bool))
    if kind == _KEYS:
        return isinstance(value, list) and all(isinstance(k, str) for k in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # _NUMBER


def _bad(message: str) -> dict:
    return {"ok": False, "error": "bad_request", "message": message}


class Store:
    """A client of a `StoreServer`; thread-safe, one request at a time per connection.

        >>> store = Store("127.0.0.1:29500", token=os.environ["KILN_TOKEN"], timeout=30)
        >>> store.wait(["ready/0", "ready/1"], timeout=5.0)

    `timeout` is the default deadline of every operation, including the initial
    connect (retried until then, so the server may come up later than the client).
    """

    def __init__(self, address: str, token: str, timeout: float = 30.0):
        self.address = address
        self.host, self.port = parse_address(address)
        self._token = token
        self.timeout = timeout  # checked: finite, in (0, 7 days]
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.generation = 0  # connections made so far (a change means a reconnect)
        with self._lock:
            self._connect(time.monotonic() + self.timeout)

    @property
    def timeout(self) -> float:
        """The default deadline of every operation, in seconds."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = check_timeout(value, "Store timeout")

    def clone(self, timeout: float | None = None) -> "Store":
        """A second connection to the same server (for a thread that blocks in wait),
        with this one's default deadline unless `timeout` is given."""
        return Store(self.address, self._token, self.timeout if timeout is None else timeout)

    def local_address(self) -> str:
        """The local IP this client reaches the store from (the interface peers can reach)."""
        with self._lock:
            if self._sock is None:
                self._connect(time.monotonic() + self.timeout)
            return self._sock.getsockname()[0]

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def interrupt(self) -> None:
        """Shut this connection down from any thread, without waiting for a call in
        progress: that call fails at once (the connection is lost), and the server drops
        the ephemeral keys it held. The next call connects afresh."""
        sock = self._sock
        if sock is not None:
            _shutdown(sock)

    def set(self, key: str, value: bytes | str, *, ephemeral: bool = False) -> None:
        """Set `key` to `value` (str is UTF-8 encoded). An `ephemeral` key lives as long
        as this client's connection: the server deletes it when the connection ends, so
        a process that dies (even by SIGKILL) takes its key with it at once."""
        self._call({"op": "set", "key": key, "ephemeral": True} if ephemeral else
                   {"op": "set", "key": key}, _as_bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of `key`, waiting up to `timeout` for it to be set."""
        return self._call({"op": "get", "key": key}, timeout=timeout)[1]

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add `amount` to the integer at `key` (0 when unset); the new value."""
        return int(self._call({"op": "add", "key": key, "amount": int(amount)})[0]["value"])

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key is set; StoreTimeout names the missing ones."""
        self._call({"op": "wait", "keys": list(keys)}, timeout=timeout)

    def check(self, keys: list[str]) -> bool:
        """True when every key is set (never blocks)."""
        return bool(self._call({"op": "check", "keys": list(keys)})[0]["value"])

    def compare_and_set(self, key: str, expected: bytes | str | None,
                        desired: bytes | str) -> bytes | None:
        """Set `key` to `desired` if it holds `expected` (None: if it is absent).

        Returns the value after the operation (None if the key is still absent).
        """
        body = b"" if expected is None else _as_bytes(expected)
        header = {"op": "cas", "key": key, "expected_len": None if expected is None else len(body)}
        reply, value = self._call(header, body + _as_bytes(desired))
        return value if reply.get("present") else None

    def delete(self, key: str) -> bool:
        """Delete `key`; True if it existed."""
        return bool(self._call({"op": "delete", "key": key})[0]["value"])

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with `prefix` (not empty); how many there were."""
        if not prefix:
            raise StoreError("delete_prefix needs a non-empty prefix")
        return int(self._call({"op": "delete_prefix", "prefix": prefix})[0]["value"])

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key starting with `prefix`, sorted."""
        return list(self._call({"op": "list", "prefix": prefix})[0]["keys"])

    def _connect(self, deadline: float) -> None:
        """Connect and authenticate, retrying until `deadline`: a server not up yet, or
        one that dropped this connection in its handshake (it sheds the oldest
        handshakes when strangers crowd it). A wrong token is final."""
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout("cannot connect to the store at %s" % self.address,
                                   hint="is the store running (rank 0 or kiln launch hosts it)?")
            try:
                sock = socket.create_connection((self.host, self.port), timeout=remaining)
            except OSError:
                sock = None
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    client_handshake(sock, self._token, ROLE,
                                     max(deadline - time.monotonic(), 0.5))
                except ConnectionLost:  # dropped mid-handshake: try again
                    sock.close()
                except BaseException:  # a wrong token, not a kiln store, the deadline
                    sock.close()
                    raise
                else:
                    self._sock = sock
                    self.generation += 1
                    return
            time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 0.5)

    def _call(self, header: dict, body: bytes = b"",
              timeout: float | None = None) -> tuple[dict, bytes]:
        timeout = self.timeout if timeout is None else check_timeout(
            timeout, "store %s timeout" % header["op"])
        if header["op"] in ("get", "wait"):
            header["timeout"] = timeout
        # the server answers a wait at its deadline; allow for the round trip on top
        deadline = time.monotonic() + timeout + (1.0 if "timeout" in header else 0.0)
        with self._lock:
            if self._sock is None:
                self._connect(deadline)
            try:
                send_frame(self._sock, header, body, deadline=deadline)
                reply, value = recv_frame(self._sock, deadline)
            except StoreError:
                # the reply may still arrive later: this connection's framing is unknown now
                self._sock.close()
                self._sock = None
                raise
        if not reply.get("ok"):
            message = "store %s %s: %s" % (header["op"], header.get("key", header.get("keys", "")),
                                           reply.get("message", reply.get("error")))
            if reply.get("error") == "timeout":
                raise StoreTimeout(message + " within %.1f s" % timeout)
            if reply.get("error") == "bad_request":
                raise StoreBadRequest(message)
            raise StoreError(message)
        return reply, value


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
