"""Flight Recorder dump requests between ranks, carried by the store.

A rank that fails dumps its own recorder and posts a request, so every other rank dumps
too (`post_request`): `fr/dump_gen` counts the requests, `fr/dump/<n>` holds the n-th
(its reason and the rank that posted it). Each process's `DumpWatcher` reads them in
order, dumps, and then acknowledges in its own key `fr/watch/<id>` (its rank and the last
request it handled). That key is ephemeral: it dies with the watcher's connection, so a
process that left or was killed is never waited for.

The store lives in one process (rank 0, or a rank of an MPI job, unless `kiln launch`
or a `kiln store` hosts it). When that process leaves right after a failure, its peers'
watchers may not have read the request yet: the store would go with it, and so would
their dumps. So the host lingers (`linger`): before it takes the store down, it waits
until every watcher still connected has acknowledged every posted request, or one is
known dead by the heartbeat, at most KILN_FR_LINGER seconds (5 by default; 0 turns it
off). With no request posted it does not wait at all.

    >>> post_request(store, "CollectiveTimeout on rank 0", rank=0)   # from a failing rank
    >>> linger(server, 5.0, dead=set())                               # the host, at exit
    True
"""

from __future__ import annotations

import json
import os
import threading
import time

from kiln.distributed.errors import DistributedError, RendezvousError, StoreTimeout
from kiln.distributed.flight_recorder import recorder

GEN_KEY = "fr/dump_gen"
REQUEST_KEY = "fr/dump/%d"
WATCH_PREFIX = "fr/watch/"
_WATCH_IDS = "fr/watch_ids"
DEFAULT_LINGER = 5.0
# a request numbered (`fr/dump_gen`) but still unwritten after this long, while later
# ones exist, is skipped: its poster died between the two store operations, and the
# requests after it must still be served
_GAP_GRACE = 2.0
_POLL = 1.0  # a watcher's wait on the store for the next request, per turn


def linger_seconds() -> float:
    """How long a store host waits at exit for its peers to read dump requests:
    KILN_FR_LINGER (seconds, >= 0; 0 turns it off), 5 s when unset."""
    text = os.environ.get("KILN_FR_LINGER")
    if text is None or not text.strip():
        return DEFAULT_LINGER
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 600:
        raise RendezvousError("KILN_FR_LINGER=%r is not a number of seconds in [0, 600]"
                              % text, hint="unset it for the default (5 s), or 0 to turn "
                              "the store host's wait for Flight Recorder dumps off")
    return value


# -- posting --------------------------------------------------------------------------
def post_request(store, reason: str, rank: int) -> int:
    """Post a dump request every rank's watcher will read; its number."""
    gen = store.add(GEN_KEY, 1)
    store.set(REQUEST_KEY % gen, json.dumps({"reason": reason, "rank": rank}))
    return gen


# posted from a thread so a failing call returns at once; a process that exits right after
# must still deliver them, or its peers never learn to dump (see `flush_dump_requests`)
_PENDING: list[threading.Thread] = []
# failures being handled whose request is not posted yet: a failing group wakes its
# waiters (the backend's abort) before it gets to post, and a waiter that exits at once
# would let the store host linger for nothing and leave (see `Hold`)
_HELD = threading.Condition()
_HOLDS = 0


class Hold:
    """Taken by a failing group before its failure becomes visible to anyone, released
    once its request is posted (or none is needed): `flush_dump_requests`, at exit,
    waits for it. Without it a waiter woken by the backend's abort could exit before
    the request existed, and a store host would not linger for it."""

    def __init__(self) -> None:
        global _HOLDS
        self._held = True
        with _HELD:
            _HOLDS += 1

    def release(self) -> None:
        """Its request is posted (or none is needed); once only."""
        global _HOLDS
        with _HELD:
            if self._held:
                self._held = False
                _HOLDS -= 1
                _HELD.notify_all()


def post_request_async(store, reason: str, rank: int) -> None:
    """`post_request` on a thread (a store that went away with a failed rank is ignored:
    the local dumps exist anyway); `flush_dump_requests` waits for it."""
    def post() -> None:
        try:
            post_request(store, reason, rank)
        except DistributedError:
            pass

    thread = threading.Thread(target=post, name="kiln-fr-request", daemon=True)
    _PENDING.append(thread)
    thread.start()


def flush_dump_requests(timeout: float = 5.0) -> None:
    """Wait (bounded) until this process's dump requests have reached the store,
    including those of failures still being handled (`Hold`)."""
    deadline = time.monotonic() + timeout
    with _HELD:
        _HELD.wait_for(lambda: _HOLDS == 0, timeout)
    while _PENDING:
        _PENDING.pop().join(max(0.0, deadline - time.monotonic()))


# -- watching -------------------------------------------------------------------------
class DumpWatcher:
    """Reads the dump requests posted to the store, in order, dumps this process's
    recorder for each one another rank posted, and acknowledges each (see the module
    docstring). It announces itself before the constructor returns, so a store host
    that lingers knows to wait for it from then on."""

    def __init__(self, store):
        self._store = store.clone()
        self._stop = threading.Event()
        self._next = 1
        self.acked = 0  # the last request handled (dumped for, or skipped)
        self._key = WATCH_PREFIX + str(self._store.add(_WATCH_IDS, 1))
        self._announced = -1  # the store connection (generation) the key lives on
        self._announce()
        self._thread = threading.Thread(target=self._loop, name="kiln-fr-watch", daemon=True)
        self._thread.start()

    def _announce(self) -> None:
        """(Re)write the ephemeral acknowledgement; after a reconnect the server has
        dropped it with the old connection. Skipped once stopped (it would connect anew)."""
        if self._stop.is_set():
            return
        self._store.set(self._key, json.dumps({"rank": recorder().rank, "acked": self.acked}),
                        ephemeral=True)
        self._announced = self._store.generation

    def _loop(self) -> None:
        missing = 0  # turns the next request has been numbered but not written
        try:
            while not self._stop.is_set():
                try:
                    if self._announced != self._store.generation:
                        self._announce()
                    raw = self._next_request()
                except DistributedError:
                    if self._stop.wait(0.2):
                        return
                    continue
                if raw is None:  # not posted yet, or numbered and never written
                    missing = missing + 1 if self._numbered() else 0
                    if missing * _POLL < _GAP_GRACE:
                        continue
                    info = None
                else:
                    try:
                        info = json.loads(raw)
                    except ValueError:
                        info = {}
                missing = 0
                if isinstance(info, dict) and info.get("rank") != recorder().rank:
                    try:
                        recorder().dump(reason="requested by rank %s: %s"
                                        % (info.get("rank"), info.get("reason")))
                    except OSError:
                        pass  # an unwritable directory: acknowledged all the same
                self.acked = self._next
                self._next += 1
                try:
                    self._announce()
                except DistributedError:
                    pass  # the next turn reconnects and announces again
        finally:
            self._store.close()  # the acknowledgement key goes with the connection

    def _next_request(self) -> bytes | None:
        """The next request's JSON, or None when it is not there within a turn."""
        key = REQUEST_KEY % self._next
        try:
            self._store.wait([key], timeout=_POLL)
        except StoreTimeout:
            return None
        return self._store.get(key, timeout=_POLL)

    def _numbered(self) -> bool:
        """Whether request `_next` was numbered, though not written (a gap)."""
        if self._stop.is_set():
            return False
        try:
            return self._store.add(GEN_KEY, 0) > self._next
        except DistributedError:
            return False

    def stop(self, wait: float = 0.0) -> None:
        """End the watcher now: its connection is shut down under it (a wait on the
        store in progress fails at once), so the store drops its acknowledgement key and
        a lingering store host stops waiting for this process. `wait` > 0 blocks up to
        that long for its thread to have ended."""
        self._stop.set()
        self._store.interrupt()
        if wait > 0:
            self._thread.join(wait)


# -- the store host's wait at exit ----------------------------------------------------
def pending_watchers(data: dict, dead=()) -> list[int]:
    """Ranks of the watchers in store contents `data` that still have a posted request
    to read (`dead`: ranks known dead, not waited for)."""
    try:
        gen = int(data.get(GEN_KEY, b"0"))
    except ValueError:
        return []
    behind = []
    if gen <= 0:
        return behind
    for key, value in list(data.items()):
        if not key.startswith(WATCH_PREFIX):
            continue
        try:
            info = json.loads(value)
            rank, acked = info["rank"], int(info["acked"])
        except (ValueError, KeyError, TypeError):
            continue
        if acked < gen and rank not in dead:
            behind.append(rank)
    return sorted(behind)


def linger(server, timeout: float, dead=()) -> bool:
    """In the process hosting the store (`server`), at exit: wait until every connected
    watcher has handled every posted dump request, at most `timeout` s. True when none
    is left behind (at once when no request was posted); `dead` (a live set, e.g. the
    heartbeat's) names ranks not to wait for."""
    if timeout <= 0:
        return not pending_watchers(server.contents(), dead)
    return server.wait_for(lambda data: not pending_watchers(data, dead), timeout)
