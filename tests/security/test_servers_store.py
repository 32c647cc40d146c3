"""Hostile clients of the store (in-process): deep JSON before and after
authentication, malformed requests of every kind, NaN/inf/negative timeouts at both
ends. Each must get a refusal or a `bad_request` reply; no server thread may die or
spin, and the server must keep serving everyone else."""

from __future__ import annotations

import math
import socket
import struct
import threading
import time

import pytest

import kiln.distributed as dist
from kiln.distributed import (
    InvalidTimeout, MalformedFrame, Store, StoreBadRequest, StoreServer,
)
from kiln.distributed.acceptor import MAX_PENDING
from kiln.distributed.protocol import (
    HANDSHAKE_MAX_FRAME, client_handshake, loads_object, recv_frame, send_frame,
)
from kiln.errors import KilnError

TOKEN = "right"


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that escaped any thread while the test ran (a dead server thread)."""
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


@pytest.fixture
def server(thread_errors):
    srv = StoreServer("127.0.0.1", 0, token=TOKEN, handshake_timeout=2.0)
    yield srv
    srv.close()
    assert thread_errors == []


def _raw(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def _authenticated(server) -> socket.socket:
    sock = _raw(server)
    client_handshake(sock, TOKEN, "store", timeout=5)
    return sock


def _frame(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("!II", 8 + len(header) + len(body), len(header)) + header + body


def _ask(sock, header, body=b""):
    """Send one request (a dict, or raw header bytes) and read the reply."""
    if isinstance(header, dict):
        send_frame(sock, header, body)
    else:
        sock.sendall(_frame(header, body))
    return recv_frame(sock, time.monotonic() + 5)


def _serves(server) -> None:
    store = Store(server.address, TOKEN, timeout=5)
    store.set("probe", b"ok")
    assert store.get("probe") == b"ok"
    store.close()


def test_deep_json_before_authentication_is_refused(server):
    sock = _raw(server)
    recv_frame(sock, time.monotonic() + 5)  # the challenge
    sock.sendall(_frame(b"[" * (HANDSHAKE_MAX_FRAME - 8)))  # 4 KB of '[', the frame limit
    reply, _ = recv_frame(sock, time.monotonic() + 5)
    assert reply["op"] == "refused"
    sock.close()
    _serves(server)


def test_deep_json_after_authentication_gets_bad_request(server):
    sock = _authenticated(server)
    for header in (b"[" * 100_000, b'{"op":' * 5000, b'{"op": "get", "key": "a", "x": ' +
                   b"[" * 40 + b"]" * 40 + b"}"):
        reply, _ = _ask(sock, header)
        assert reply == {"ok": False, "error": "bad_request",
                         "message": reply["message"]} and "nested" in reply["message"]
    assert _ask(sock, {"op": "ping"})[0] == {"ok": True}  # the same connection goes on
    sock.close()
    _serves(server)


MALFORMED = [
    ({"op": "get", "key": "a", "timeout": math.nan}, "NaN"),
    ({"op": "get", "key": "a", "timeout": math.inf}, "Infinity"),
    ({"op": "get", "key": "a", "timeout": -1.0}, "timeout"),
    ({"op": "get", "key": "a", "timeout": 0}, "timeout"),
    ({"op": "get", "key": "a", "timeout": 1e300}, "timeout"),
    ({"op": "get", "key": "a", "timeout": "5"}, "timeout"),
    ({"op": "wait", "keys": ["a"], "timeout": -math.inf}, "Infinity"),
    ({"op": "wait", "keys": ["a"], "timeout": True}, "timeout"),
    ({"op": "get", "key": 7}, "key"),
    ({"op": "get"}, "key"),
    ({"op": "set", "key": ["a"]}, "key"),
    ({"op": "set", "key": "a", "ephemeral": "yes"}, "ephemeral"),
    ({"op": "add", "key": "n", "amount": "x"}, "amount"),
    ({"op": "add", "key": "n", "amount": [1]}, "amount"),
    ({"op": "add", "key": "n", "amount": 1.5}, "amount"),
    ({"op": "add", "key": "n", "amount": 10 ** 30}, "64-bit"),
    ({"op": "wait", "keys": "abc"}, "keys"),
    ({"op": "wait", "keys": [1, 2]}, "keys"),
    ({"op": "check", "keys": 5}, "keys"),
    ({"op": "check", "keys": [["a"]]}, "keys"),
    ({"op": "check"}, "keys"),
    ({"op": "cas", "key": "c", "expected_len": "x"}, "expected_len"),
    ({"op": "cas", "key": "c", "expected_len": -5}, "expected_len"),
    ({"op": "cas", "key": "c", "expected_len": 100}, "expected_len"),
    ({"op": "delete", "key": None}, "key"),
    ({"op": "delete_prefix"}, "prefix"),
    ({"op": "delete_prefix", "prefix": ""}, "prefix"),
    ({"op": "delete_prefix", "prefix": 3}, "prefix"),
    ({"op": "list", "prefix": {"a": 1}}, "prefix"),
    ({"op": 5}, "op"),
    ({"op": "nope"}, "op"),
    ({}, "op"),
]


@pytest.mark.parametrize("request_, field", MALFORMED,
                         ids=["%s-%s" % (r.get("op"), f) for r, f in MALFORMED])
def test_malformed_request_gets_bad_request_and_the_connection_goes_on(server, request_, field):
    store = Store(server.address, TOKEN, timeout=5)
    store.set("kept", b"1")
    store.set("n", b"3")
    sock = _authenticated(server)
    # answered at once (a timeout of NaN once spun the thread and never answered; the
    # read's own deadline bounds the test)
    reply, value = _ask(sock, request_, b"xy")
    assert reply["ok"] is False and reply["error"] == "bad_request", reply
    assert field in reply["message"] and value == b""
    assert _ask(sock, {"op": "ping"})[0] == {"ok": True}
    # nothing was applied
    assert store.list_keys("") == ["kept", "n"] and store.get("n") == b"3"
    sock.close()
    store.close()


def test_non_json_headers_get_bad_request(server):
    sock = _authenticated(server)
    for header in (b"\xff\xfe", b"not json", b"[1, 2]", b'"op"', b'{"op": "get", "key": "a",'
                   b' "timeout": NaN}', b'{"op": "ping", "x": Infinity}', b""):
        reply, _ = _ask(sock, header)
        assert reply["error"] == "bad_request", (header, reply)
    assert _ask(sock, {"op": "ping"})[0] == {"ok": True}
    sock.close()


def test_an_oversized_header_is_answered_then_the_connection_ends(server):
    sock = _authenticated(server)
    sock.sendall(struct.pack("!II", 64 << 20, 32 << 20))  # a 32 MiB header announced
    reply, _ = recv_frame(sock, time.monotonic() + 5)
    assert reply["error"] == "bad_request" and "malformed frame" in reply["message"]
    with pytest.raises(dist.StoreError):
        recv_frame(sock, time.monotonic() + 5)
    sock.close()
    _serves(server)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 0, 10 ** 400, 1e9,
                                 "30", True])
def test_client_timeouts_are_checked(server, bad):
    with pytest.raises(InvalidTimeout) as info:
        Store(server.address, TOKEN, timeout=bad)
    assert info.value.code == "K220" and isinstance(info.value, KilnError)
    store = Store(server.address, TOKEN, timeout=5)
    with pytest.raises(InvalidTimeout, match="get timeout"):
        store.get("k", timeout=bad)
    with pytest.raises(InvalidTimeout, match="wait timeout"):
        store.wait(["k"], timeout=bad)
    with pytest.raises(InvalidTimeout):
        store.timeout = bad
    assert store.timeout == 5.0
    with pytest.raises(InvalidTimeout):
        StoreServer("127.0.0.1", 0, token=TOKEN, handshake_timeout=bad)
    with pytest.raises(InvalidTimeout, match="init_process_group timeout"):
        dist.init_process_group(rank=0, world_size=1, store=server.address, token=TOKEN,
                                timeout=bad)
    assert not dist.is_initialized()
    store.set("k", b"v")  # the client is still usable
    assert store.get("k", timeout=1) == b"v"
    store.close()


def test_a_bad_key_type_from_the_client_is_a_numbered_error(server):
    store = Store(server.address, TOKEN, timeout=5)
    with pytest.raises(StoreBadRequest) as info:
        store.get(5)
    assert info.value.code == "K221" and "key" in str(info.value)
    store.set("n", b"not a number")
    with pytest.raises(StoreBadRequest, match="integer"):
        store.add("n", 1)
    assert store.get("n") == b"not a number"
    store.close()


@pytest.mark.parametrize("raw", [b"[" * 4096, b'{"a":' * 2000 + b"1" + b"}" * 2000,
                                 b'{"a": NaN}', b"[]", b"\xc3\x28"])
def test_loads_object_refuses_without_recursing(raw):
    with pytest.raises(MalformedFrame) as info:
        loads_object(raw)
    assert isinstance(info.value, ValueError) and info.value.code == "K222"


def test_loads_object_reads_brackets_inside_strings_as_text():
    text = '{"k": "%s", "e": "\\"[[[[", "n": [[1], {"a": []}]}' % ("[" * 500)
    assert loads_object(text.encode()) == {"k": "[" * 500, "e": '"[[[[', "n": [[1], {"a": []}]}


def test_many_idle_strangers_do_not_lock_a_client_out(server):
    # more idle strangers than the handshakes the store runs at once: the oldest are
    # dropped, so a real client still gets its turn while they hang on
    strangers = [_raw(server) for _ in range(MAX_PENDING + 40)]
    try:
        _serves(server)
        assert len(server._acceptor._pending) <= MAX_PENDING
        assert server._acceptor.refused >= 40
    finally:
        for s in strangers:
            s.close()
