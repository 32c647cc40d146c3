"""The small wire protocol shared by the store and the data sockets.

A frame is `[u32 total][u32 header_len][header: UTF-8 JSON object][body: raw bytes]`,
big-endian. JSON carries the request; raw bytes carry values, so nothing is ever
turned into objects or evaluated: a hostile peer can only send a frame that fails to parse.

Every connection starts with a mutual HMAC-SHA256 challenge-response over the job
token (the token itself never crosses the wire):

    server -> client  {"op": "challenge", "nonce": Ns}
    client -> server  {"op": "auth", "nonce": Nc, "mac": H(token, "client", role, Ns, Nc, hello)}
    server -> client  {"op": "welcome", "mac": H(token, "server", role, Ns, Nc)}   (or "refused")

Until the server accepts the client's MAC it reads at most one small frame and
applies nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time

from kiln.distributed.errors import StoreAuthError, StoreError, StoreTimeout

_FRAME = struct.Struct("!II")
HANDSHAKE_MAX_FRAME = 4096  # before authentication a peer may send no more than this
MAX_FRAME = 1 << 30


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Fill `view` from `sock`, or raise StoreTimeout at `deadline` / StoreError on EOF.
    Without a deadline it blocks however long the peer is idle (the store server waits
    for a client's next request so)."""
    got, n = 0, len(view)
    if deadline is None:
        sock.settimeout(None)
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout("connection timed out while reading %d bytes" % n)
            sock.settimeout(remaining)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise StoreTimeout("connection timed out while reading %d bytes" % n) from None
        except OSError as err:
            raise StoreError("connection lost: %s" % err) from None
        if k == 0:
            raise StoreError("connection closed by the other side")
        got += k


def send_frame(sock: socket.socket, header: dict, body: bytes | memoryview = b"",
               deadline: float | None = None) -> None:
    """Send one frame; the JSON header must be an object."""
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    prefix = _FRAME.pack(_FRAME.size + len(hbytes) + len(body), len(hbytes))
    # no deadline: block (a timeout left on the socket by an earlier call, e.g. the
    # handshake's, would otherwise end an idle connection)
    sock.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
    try:
        if len(body) > 65536:
            sock.sendall(prefix + hbytes)
            sock.sendall(body)
        else:
            sock.sendall(prefix + hbytes + bytes(body))
    except socket.timeout:
        raise StoreTimeout("connection timed out while sending") from None
    except OSError as err:
        raise StoreError("connection lost while sending: %s" % err) from None


def recv_frame(sock: socket.socket, deadline: float | None = None,
               max_size: int = MAX_FRAME) -> tuple[dict, bytes]:
    """Receive one frame: (header dict, body bytes). Malformed frames raise StoreError."""
    head = bytearray(_FRAME.size)
    recv_exact_into(sock, memoryview(head), deadline)
    total, hlen = _FRAME.unpack(head)
    if total > max_size or hlen > total - _FRAME.size:
        raise StoreError("malformed frame (size %d, header %d)" % (total, hlen))
    rest = bytearray(total - _FRAME.size)
    recv_exact_into(sock, memoryview(rest), deadline)
    try:
        header = json.loads(bytes(rest[:hlen]).decode())
    except (UnicodeDecodeError, ValueError):
        raise StoreError("malformed frame header (not JSON)") from None
    if not isinstance(header, dict):
        raise StoreError("malformed frame header (not a JSON object)")
    return header, bytes(rest[hlen:])


def _mac(token: str, *parts: str) -> str:
    msg = "\x1f".join(("kiln-auth-v1",) + parts).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def server_handshake(sock: socket.socket, token: str, role: str, timeout: float) -> dict:
    """Authenticate a connecting client; returns its `hello` dict or raises StoreAuthError.

    On failure the client is told "refused"; the caller must close the socket and
    apply nothing the client sent.
    """
    deadline = time.monotonic() + timeout
    nonce_s = secrets.token_hex(16)
    send_frame(sock, {"op": "challenge", "nonce": nonce_s, "role": role}, deadline=deadline)
    header, _ = recv_frame(sock, deadline, max_size=HANDSHAKE_MAX_FRAME)
    nonce_c, mac, hello = header.get("nonce"), header.get("mac"), header.get("hello", {})
    ok = (header.get("op") == "auth" and isinstance(nonce_c, str) and isinstance(mac, str)
          and isinstance(hello, dict))
    if ok:
        hello_text = json.dumps(hello, sort_keys=True, separators=(",", ":"))
        expected = _mac(token, "client", role, nonce_s, nonce_c, hello_text)
        ok = hmac.compare_digest(expected, mac)
    if not ok:
        try:
            send_frame(sock, {"op": "refused", "error": "authentication failed"},
                       deadline=time.monotonic() + 1.0)
        except StoreError:
            pass
        raise StoreAuthError("%s client failed authentication (wrong or missing job token)" % role)
    send_frame(sock, {"op": "welcome", "mac": _mac(token, "server", role, nonce_s, nonce_c)},
               deadline=deadline)
    return hello


def client_handshake(sock: socket.socket, token: str, role: str, timeout: float,
                     hello: dict | None = None) -> None:
    """Prove knowledge of `token` to the server and check that it knows it too."""
    deadline = time.monotonic() + timeout
    header, _ = recv_frame(sock, deadline, max_size=HANDSHAKE_MAX_FRAME)
    if header.get("op") != "challenge" or not isinstance(header.get("nonce"), str):
        raise StoreError("peer did not start the kiln handshake (is this a kiln %s?)" % role)
    if header.get("role") != role:
        raise StoreError("peer is a kiln %s, expected a %s" % (header.get("role"), role))
    nonce_s, nonce_c = header["nonce"], secrets.token_hex(16)
    hello = hello or {}
    hello_text = json.dumps(hello, sort_keys=True, separators=(",", ":"))
    send_frame(sock, {"op": "auth", "nonce": nonce_c, "hello": hello,
                      "mac": _mac(token, "client", role, nonce_s, nonce_c, hello_text)},
               deadline=deadline)
    reply, _ = recv_frame(sock, deadline, max_size=HANDSHAKE_MAX_FRAME)
    if reply.get("op") == "refused":
        raise StoreAuthError(
            "the %s refused this client: wrong job token" % role,
            hint="every process of a job must use the same KILN_TOKEN (kiln launch sets it)",
        )
    mac = reply.get("mac")
    if reply.get("op") != "welcome" or not isinstance(mac, str) or not hmac.compare_digest(
            mac, _mac(token, "server", role, nonce_s, nonce_c)):
        raise StoreAuthError("the %s could not prove it knows the job token" % role)


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port), with a clear error otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise StoreError("bad store address %r: expected HOST:PORT, e.g. 127.0.0.1:29500"
                         % address)
    return host.strip("[]"), int(port)
