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

Every header is parsed under limits, before and after authentication: at most
HANDSHAKE_MAX_FRAME bytes before it, MAX_HEADER after; nesting at most MAX_DEPTH
deep (checked before the JSON parser runs, so no frame can exhaust the stack); no
NaN or Infinity (not JSON). A header that breaks them raises `MalformedFrame`; the
frame was read whole, so a server may answer it and go on (the store does).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import numbers
import re
import secrets
import socket
import struct
import time

from kiln.distributed.errors import (
    InvalidTimeout, MalformedFrame, StoreAuthError, StoreError, StoreTimeout,
)



class ConnectionLost(StoreError):
    """The other side closed or reset the connection (K207, like any StoreError). A
    client whose handshake ends so may connect again: a server under pressure drops
    the oldest handshakes (see `acceptor`)."""


_FRAME = struct.Struct("!II")
HANDSHAKE_MAX_FRAME = 4096  # before authentication a peer may send no more than this
MAX_FRAME = 1 << 30
MAX_HEADER = 16 << 20  # a JSON header (values travel in the body)
MAX_DEPTH = 32  # nesting of a header: kiln's own use at most 3
MAX_TIMEOUT = 7 * 24 * 3600.0  # the longest wait a store or a group accepts, in seconds
# a whole string, a lone quote (an unterminated string: the rest is not JSON), or a bracket
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*+"|"|[\[\]{}]', re.S)


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
            raise ConnectionLost("connection lost: %s" % err) from None
        if k == 0:
            raise ConnectionLost("connection closed by the other side")
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
        raise ConnectionLost("connection lost while sending: %s" % err) from None


def recv_raw_frame(sock: socket.socket, deadline: float | None = None,
                   max_size: int = MAX_FRAME) -> tuple[bytes, bytes]:
    """Receive one frame unparsed: (header bytes, body bytes). A size over the limits
    raises MalformedFrame before anything past the prefix is read (the stream is then
    out of step: close it)."""
    head = bytearray(_FRAME.size)
    recv_exact_into(sock, memoryview(head), deadline)
    total, hlen = _FRAME.unpack(head)
    if total > max_size or total < _FRAME.size or hlen > total - _FRAME.size or \
            hlen > MAX_HEADER:
        raise MalformedFrame("malformed frame (size %d, header %d; at most %d and %d)"
                             % (total, hlen, max_size, min(max_size, MAX_HEADER)))
    rest = bytearray(total - _FRAME.size)
    recv_exact_into(sock, memoryview(rest), deadline)
    return bytes(rest[:hlen]), bytes(rest[hlen:])


def recv_frame(sock: socket.socket, deadline: float | None = None,
               max_size: int = MAX_FRAME) -> tuple[dict, bytes]:
    """Receive one frame: (header dict, body bytes). Malformed frames raise
    MalformedFrame (a StoreError)."""
    raw, body = recv_raw_frame(sock, deadline, max_size)
    return loads_object(raw), body


def loads_object(raw: bytes | bytearray, max_depth: int = MAX_DEPTH) -> dict:
    """Parse a JSON object from an untrusted peer, or raise MalformedFrame.

    The nesting depth is measured first (strings removed, then brackets counted), so
    a frame of `[[[[...` is refused without recursing; NaN and Infinity are refused
    as the JSON standard does.

        >>> loads_object(b'{"op": "get", "key": "a"}')
        {'op': 'get', 'key': 'a'}
    """
    raw = bytes(raw)
    depth = _depth(raw)
    if depth > max_depth:
        raise MalformedFrame("malformed frame header (nested %d deep, at most %d)"
                             % (depth, max_depth))
    try:
        value = json.loads(raw.decode(), parse_constant=_refuse_constant)
    except _NotJson as err:
        raise MalformedFrame("malformed frame header (%s)" % err) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise MalformedFrame("malformed frame header (not JSON)") from None
    if not isinstance(value, dict):
        raise MalformedFrame("malformed frame header (not a JSON object)")
    return value


def _depth(raw: bytes) -> int:
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:  # too few brackets to go deep
        return 0
    depth = deepest = 0
    for token in _TOKEN.finditer(raw):  # one pass, left to right: linear in the size
        t = token.group()
        if t == b"[" or t == b"{":
            depth += 1
            deepest = max(deepest, depth)
        elif t == b"]" or t == b"}":
            depth -= 1
        elif t == b'"':
            break
    return deepest


class _NotJson(Exception):
    pass


def _refuse_constant(name: str):
    raise _NotJson("%s is not a JSON number" % name)


def check_timeout(value, what: str = "timeout") -> float:
    """`value` as float seconds if it is a finite number in (0, MAX_TIMEOUT], else
    InvalidTimeout naming `what`.

        >>> check_timeout(2)
        2.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidTimeout("%s=%.60r is not a number of seconds" % (what, value))
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not (0.0 < seconds <= MAX_TIMEOUT):  # False for NaN too
        raise InvalidTimeout("%s=%.60r: a timeout must be a finite number of seconds in "
                             "(0, %d]" % (what, value, MAX_TIMEOUT))
    return seconds


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
    try:
        header, _ = recv_frame(sock, deadline, max_size=HANDSHAKE_MAX_FRAME)
    except MalformedFrame:
        header = {}  # refused below, like a wrong MAC
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
