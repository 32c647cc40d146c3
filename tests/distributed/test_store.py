"""The store: every operation, deadlines, and authentication (in-process, fast)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from harness import reserved_port
from kiln.distributed import Store, StoreAuthError, StoreError, StoreServer, StoreTimeout
from kiln.distributed.protocol import recv_frame, send_frame


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, token="right")
    yield srv
    srv.close()


def test_operations(server):
    store = Store(server.address, "right", timeout=5)
    store.set("a", b"\x00\x01binary")
    assert store.get("a") == b"\x00\x01binary"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2
    assert store.compare_and_set("c", None, b"first") == b"first"
    assert store.compare_and_set("c", None, b"second") == b"first"
    assert store.compare_and_set("c", b"wrong", b"x") == b"first"
    assert store.compare_and_set("c", b"first", b"third") == b"third"
    assert store.compare_and_set("absent", b"x", b"y") is None
    store.set("p/1", "x")
    store.set("p/2", "y")
    assert store.list_keys("p/") == ["p/1", "p/2"]
    assert store.check(["p/1", "a"]) and not store.check(["p/3"])
    assert store.delete("p/1") and not store.delete("p/1")
    assert store.list_keys("p/") == ["p/2"]


def test_an_idle_connection_stays_open(server):
    # the server must wait for a client's next request however long it takes (a
    # timeout left over from the handshake once closed connections idle for 5 s)
    srv = StoreServer("127.0.0.1", 0, token="right", handshake_timeout=0.3)
    try:
        store = Store(srv.address, "right", timeout=5)
        store.set("a", "1")
        time.sleep(0.8)
        assert store.get("a") == b"1"
    finally:
        srv.close()


def test_delete_prefix(server):
    store = Store(server.address, "right", timeout=5)
    for key in ("s/1/a", "s/1/b", "s/10/a", "t"):
        store.set(key, "x")
    assert store.delete_prefix("s/1/") == 2
    assert store.list_keys("") == ["s/10/a", "t"]
    with pytest.raises(StoreError, match="non-empty"):
        store.delete_prefix("")


def test_ephemeral_keys_die_with_their_connection(server):
    store = Store(server.address, "right", timeout=5)
    owner = store.clone()
    owner.set("live/1", "1", ephemeral=True)
    owner.set("kept", "1")
    store.set("live/2", "1", ephemeral=True)
    assert store.list_keys("live/") == ["live/1", "live/2"]
    generation = owner.generation
    owner.close()  # as a killed process's socket closes
    deadline = time.monotonic() + 5
    while store.check(["live/1"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.list_keys("live/") == ["live/2"] and store.check(["kept"])
    owner.set("live/1", "again", ephemeral=True)  # reconnects by itself
    assert owner.generation == generation + 1 and store.get("live/1") == b"again"
    store.set("live/2", "plain")  # a plain set makes the key outlive its writer
    store.set("live/3", "1", ephemeral=True)  # shows when the server has seen the close
    store.close()
    deadline = time.monotonic() + 5
    while owner.check(["live/3"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not owner.check(["live/3"]) and owner.get("live/2") == b"plain"


def test_wait_blocks_until_set_and_times_out(server):
    store = Store(server.address, "right", timeout=5)
    other = store.clone()
    threading.Timer(0.2, other.set, args=("late", b"1")).start()
    start = time.monotonic()
    store.wait(["late"], timeout=5)
    assert 0.1 < time.monotonic() - start < 3
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="never"):
        store.wait(["never"], timeout=0.3)
    with pytest.raises(StoreTimeout):
        store.get("never", timeout=0.3)
    assert time.monotonic() - start < 2.5
    assert store.get("late") == b"1"  # the connection is still usable


def test_wrong_token_is_refused_and_nothing_applied(server):
    with pytest.raises(StoreAuthError, match="wrong job token"):
        Store(server.address, "wrong", timeout=2)
    # a raw client that skips the handshake and sends a set: dropped before applying
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=2)
    recv_frame(raw, time.monotonic() + 2)  # the challenge
    send_frame(raw, {"op": "set", "key": "evil"}, b"1")
    header, _ = recv_frame(raw, time.monotonic() + 2)
    assert header["op"] == "refused"
    with pytest.raises(StoreError, match="closed"):
        recv_frame(raw, time.monotonic() + 2)
    raw.close()
    # an oversized pre-auth frame is cut off too
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=2)
    recv_frame(raw, time.monotonic() + 2)
    raw.sendall(struct.pack("!II", 1 << 20, 10) + b"x" * 100)
    raw.close()
    store = Store(server.address, "right", timeout=2)
    assert store.list_keys("") == []


def test_client_refuses_a_server_without_the_token():
    fake = StoreServer("127.0.0.1", 0, token="other")
    try:
        with pytest.raises(StoreAuthError):
            Store(fake.address, "mine", timeout=2)
    finally:
        fake.close()


def test_connect_deadline():
    start = time.monotonic()
    with reserved_port() as port, pytest.raises(StoreTimeout, match="cannot connect"):
        Store("127.0.0.1:%d" % port, "t", timeout=0.5)
    assert time.monotonic() - start < 2
