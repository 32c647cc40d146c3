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

from kiln.distributed.errors import StoreAuthError, StoreError, StoreTimeout
from kiln.distributed.protocol import (
    client_handshake, parse_address, recv_frame, send_frame, server_handshake,
)

ROLE = "store"
_MAX_WAIT = 7 * 24 * 3600.0


class StoreServer:
    """Serves the store on (host, port) from daemon threads; port 0 picks a free port.

        >>> server = StoreServer("127.0.0.1", 0, token="t"); server.port > 0
        True
        >>> server.close()
    """

    def __init__(self, host: str, port: int, token: str, *, handshake_timeout: float = 5.0):
        if not token:
            raise StoreAuthError("a store needs a job token", hint="set KILN_TOKEN")
        self._token = token
        self._handshake_timeout = handshake_timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._owner: dict[str, socket.socket] = {}  # ephemeral key -> the connection it lives on
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.settimeout(0.2)  # lets the accept loop notice close()
        self.host, self.port = self._listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="kiln-store", daemon=True)
        self._thread.start()

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
        self._listener.close()
        self._thread.join(timeout=2.0)

    def serve_forever(self) -> None:
        """Block the calling thread until close() (used by `kiln store`)."""
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="kiln-store-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            server_handshake(conn, self._token, ROLE, self._handshake_timeout)
        except StoreError:
            conn.close()  # unauthenticated: nothing it sent is read past the handshake
            return
        with self._cond:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            while True:
                header, body = recv_frame(conn, deadline=None)
                reply, value = self._apply(header, body, conn)
                send_frame(conn, reply, value)
        except StoreError:
            pass
        finally:
            with self._cond:
                self._conns.discard(conn)
                for key in [k for k, c in self._owner.items() if c is conn]:
                    del self._owner[key]  # its process is gone (or hung up): so is the key
                    self._data.pop(key, None)
                self._cond.notify_all()
            conn.close()

    def _wait_for(self, keys: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + min(max(timeout, 0.0), _MAX_WAIT)
        with self._cond:
            while not all(k in self._data for k in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(remaining)
            return True

    def _apply(self, h: dict, body: bytes, conn: socket.socket | None = None) -> tuple[dict, bytes]:
        op, key = h.get("op"), h.get("key")
        if op in ("set", "get", "add", "cas", "delete") and not isinstance(key, str):
            return {"ok": False, "error": "bad_request", "message": "missing key"}, b""
        if op == "set":
            with self._cond:
                self._data[key] = body
                if h.get("ephemeral") and conn is not None:
                    self._owner[key] = conn
                else:
                    self._owner.pop(key, None)
                self._cond.notify_all()
            return {"ok": True}, b""
        if op == "get":
            if not self._wait_for([key], float(h.get("timeout", 0.0))):
                return {"ok": False, "error": "timeout", "message": "key %r not set" % key}, b""
            with self._cond:
                return {"ok": True}, self._data[key]
        if op == "add":
            with self._cond:
                try:
                    value = int(self._data.get(key, b"0")) + int(h.get("amount", 0))
                except ValueError:
                    return {"ok": False, "error": "bad_request",
                            "message": "key %r does not hold an integer" % key}, b""
                self._data[key] = str(value).encode()
                self._cond.notify_all()
            return {"ok": True, "value": value}, b""
        if op == "wait":
            keys = h.get("keys")
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                return {"ok": False, "error": "bad_request", "message": "keys must be a list"}, b""
            if not self._wait_for(keys, float(h.get("timeout", 0.0))):
                with self._cond:
                    missing = [k for k in keys if k not in self._data]
                return {"ok": False, "error": "timeout",
                        "message": "keys not set: %s" % ", ".join(missing)}, b""
            return {"ok": True}, b""
        if op == "check":
            keys = h.get("keys") or []
            with self._cond:
                return {"ok": True, "value": all(k in self._data for k in keys)}, b""
        if op == "cas":
            expected_len = h.get("expected_len")  # None: swap only when the key is absent
            expected, desired = body[:expected_len or 0], body[expected_len or 0:]
            with self._cond:
                current = self._data.get(key)
                if (expected_len is None and current is None) or (
                        expected_len is not None and current == expected):
                    self._data[key] = current = desired
                    self._cond.notify_all()
                return {"ok": True, "present": current is not None}, current or b""
        if op == "delete":
            with self._cond:
                self._owner.pop(key, None)
                return {"ok": True, "value": self._data.pop(key, None) is not None}, b""
        if op == "delete_prefix":
            prefix = str(h.get("prefix", ""))
            with self._cond:
                keys = [k for k in self._data if k.startswith(prefix)]
                for k in keys:
                    del self._data[k]
                    self._owner.pop(k, None)
            return {"ok": True, "value": len(keys)}, b""
        if op == "list":
            prefix = str(h.get("prefix", ""))
            with self._cond:
                keys = sorted(k for k in self._data if k.startswith(prefix))
            return {"ok": True, "keys": keys}, b""
        if op == "ping":
            return {"ok": True}, b""
        return {"ok": False, "error": "bad_request", "message": "unknown op %r" % op}, b""


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
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.generation = 0  # connections made so far (a change means a reconnect)
        with self._lock:
            self._connect(time.monotonic() + timeout)

    def clone(self) -> "Store":
        """A second connection to the same server (for a thread that blocks in wait)."""
        return Store(self.address, self._token, self.timeout)

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
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout("cannot connect to the store at %s" % self.address,
                                   hint="is the store running (rank 0 or kiln launch hosts it)?")
            try:
                sock = socket.create_connection((self.host, self.port), timeout=remaining)
                break
            except OSError:
                time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            client_handshake(sock, self._token, ROLE, max(deadline - time.monotonic(), 0.5))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.generation += 1

    def _call(self, header: dict, body: bytes = b"",
              timeout: float | None = None) -> tuple[dict, bytes]:
        timeout = self.timeout if timeout is None else timeout
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
            raise StoreError(message)
        return reply, value


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
