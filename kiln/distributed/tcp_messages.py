"""The messages of kiln's TCP transport: the header, the message kinds, and a posted
`Request`.

Every message is a fixed 32-byte `HEADER` followed by its payload:

    kind | op | dtype | reduce op | seq (or p2p tag) | step | segment | count | bytes

- `kind`: DATA (a collective's message), P2P (send/recv), ABORT and BYE (notices with
  a JSON payload of at most `_MAX_NOTICE` bytes: why a peer aborted, or that it left
  cleanly), and the one-sided RMA kinds served by the target's receiver thread
  (tcp_rma). A payload carried by the shared-memory lane has its slot number + 1 in
  the kind's high four bits; only the header then travels on the socket.
- (kind, seq, step, segment) is the message's *key*: a receive is posted for a key
  and matched to the message with that key (two messages of one key arrive in order).
- (op, dtype, reduce op, count) is the sender's view of the call, its *signature*, so
  ranks that disagree about a collective fail with `CollectiveMismatch` instead of
  silently mixing bytes (`_compatible`: a count of -1 matches any).

A `Request` is one posted send or receive; its event is set when it ends.
"""

from __future__ import annotations

import struct
import threading

# kind, op, dtype, reduce op, seq (or tag), step, segment, count, payload bytes
HEADER = struct.Struct("!BBBBIIIqQ")
DATA, P2P, ABORT, BYE = 1, 2, 3, 4
# one-sided operations on RMA windows, served by the target's receiver thread (tcp_rma)
RMA_PUT, RMA_GET, RMA_ACC, RMA_SIGNAL, RMA_REPLY = 5, 6, 7, 8, 9
_MAX_NOTICE = 1 << 16
# a blocked direct-lane read or write wakes this often to check deadline and failure
_DIRECT_TICK = 0.1
# after a direct lane broke, how long to wait for the threaded lane's abort notice or
# EOF to say why (a peer that aborts sends its notice there before it closes), and how
# long a peer that left cleanly has to exit before this rank's call fails
_CAUSE_GRACE = 2.0
# a threaded-lane wait longer than this peeks at the direct lanes for a mismatch
_PEEK_AFTER = 0.05


class Request:
    """One posted send or receive; `event` is set when it ends (`error` says how)."""

    __slots__ = ("peer", "key", "sig", "view", "event", "error", "callback", "borrow",
                 "source")

    def __init__(self, peer: int, key: tuple, sig: tuple, view: memoryview, callback=None,
                 borrow: bool = False):
        self.peer, self.key, self.sig, self.view = peer, key, sig, view
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.callback = callback
        # a receive whose reader only reads the data (a reduction's operand) may borrow
        # the stash's copy of a message that came first, instead of a second copy into
        # `view`: `source` is then that copy (None: the data is in `view`)
        self.borrow = borrow
        self.source: bytearray | None = None

    def finish(self, error: BaseException | None = None) -> None:
        if self.event.is_set():
            return
        self.error = error
        self.event.set()
        if self.callback is not None:
            self.callback(error)


def _compatible(mine: tuple, theirs: tuple) -> bool:
    """Same op, dtype and reduce op, and the same count unless one side has none (-1)."""
    return mine[:3] == theirs[:3] and (mine[3] == theirs[3] or -1 in (mine[3], theirs[3]))


def _advance(parts: list, sent: int) -> list:
    """Drop `sent` bytes from the front of a list of buffers (after a partial sendmsg)."""
    out = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        out.append(memoryview(part)[sent:] if sent else part)
        sent = 0
    return out
