"""A peer's notice on an established data link (after authentication) parsed under the
same limits as every frame: 64 KiB of `[`, a JSON list, NaN. The group fails with a
`PeerFailure` naming the peer, every waiter returns, and no receiver thread dies with a
RecursionError or any other exception."""

from __future__ import annotations

import socket
import threading

import pytest

from kiln.distributed import PeerFailure
from kiln.distributed.tcp_transport import ABORT, HEADER, Transport


@pytest.mark.parametrize("payload", [b"[" * 65536, b"[1, 2]", b'{"type": NaN}',
                                     b'{"a":' * 3000], ids=["brackets", "list", "nan", "deep"])
def test_a_malformed_abort_notice_fails_the_group_cleanly(monkeypatch, payload):
    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    mine, theirs = socket.socketpair()
    transport = Transport("pg/world/e0", 0, 2, {1: mine})
    try:
        theirs.sendall(HEADER.pack(ABORT, 0, 0, 0, 0, 0, 0, -1, len(payload)) + payload)
        assert transport.failed.wait(20), "the receiver never reported the bad notice"
        assert isinstance(transport.error, PeerFailure) and transport.error.rank == 1
        assert "malformed" in transport.error.message
        link = transport.links[1]
        link._receiver.join(timeout=20)
        assert not link._receiver.is_alive()
    finally:
        transport.close()
        theirs.close()
    assert escaped == []
