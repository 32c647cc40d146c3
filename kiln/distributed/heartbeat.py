"""Heartbeats: telling a dead (hung, stopped) peer from a slow one.

A crashed peer is seen at once: its sockets close (EOF/reset) and every call that needs
it fails with `PeerFailure`. A *hung* peer (SIGSTOP, a debugger, a machine swapping to
death) keeps its sockets open, and without heartbeats its peers would only notice at
each call's own deadline — a `CollectiveTimeout` that blames the wrong thing and comes
late. So every process bumps a counter in the store (`hb/<global rank>`) every
`interval` seconds and watches its peers' counters; a peer whose counter has not moved
for `dead_after` seconds is dead, and the world group (and every sub-group holding that
rank) fails with `PeerFailure` naming it.

Counters, not timestamps: a peer is judged by this process's own monotonic clock (when
did its counter last change?), so clocks of different machines never need to agree.

The timeout hierarchy comes from the one `timeout` the user gives `init_process_group`
(the default deadline of a collective):

    heartbeat interval = timeout / 50, within [0.05 s, 0.5 s]
    dead after         = timeout / 4,  within [2 s, 10 s], and at least 5 intervals

so a hung peer is declared dead well before a collective's own timeout would fire, and
a merely slow peer (alive, heartbeating, late to the collective) still gets the full
`timeout` and a `CollectiveTimeout` (with a short timeout, under 8 s, that timeout may
fire first: the floor of 2 s keeps a CPU-starved process from being taken for dead). A process that leaves cleanly writes `left` and is
never declared dead.

A lost store. The store is how hangs are seen (and, in a fault-tolerant group, how the
group reconfigures and commits steps); a group that lost it is blind. When every store
operation of the heartbeat has failed for `lost_after` seconds (2 x dead-after, at least
5 s: a store that only blinked, or is reconnected, is not lost), the world group and its
sub-groups fail with `StoreLost` (K225) naming the store: the next call raises, so a
job whose store died (its `kiln store` or its launcher was killed) ends in bounded time
instead of running on unsupervised.
"""

from __future__ import annotations

import threading
import time

from kiln.distributed.errors import DistributedError, PeerFailure, StoreLost

LEFT = -1  # the counter value of a process that left the group cleanly
_GOODBYE_TIMEOUT = 2.0  # the most the goodbye (`LEFT`) may take at exit


def intervals(timeout: float) -> tuple[float, float]:
    """(heartbeat interval, dead-after) for a group whose collective deadline is `timeout`."""
    interval = min(max(timeout / 50, 0.05), 0.5)
    # at least 2 s: a process starved of CPU on a loaded machine is not dead
    dead_after = max(min(max(timeout / 4, 2.0), 10.0), 5 * interval)
    return interval, dead_after


class Heartbeat:
    """Publishes this process's liveness and watches the other members of `group`."""

    def __init__(self, store, group, *, interval: float | None = None,
                 dead_after: float | None = None, lost_after: float | None = None):
        default_interval, default_dead = intervals(group.timeout)
        self.interval = interval or default_interval
        self.dead_after = dead_after or default_dead
        self.lost_after = lost_after or max(2 * self.dead_after, 5.0)
        self._group = group
        self._me = group.global_ranks[group.rank]
        self._peers = [r for r in group.global_ranks if r != self._me]
        self._store = store.clone()
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it changed)
        self.dead: set[int] = set()  # peers declared dead (global ranks / uids)
        self._thread = threading.Thread(target=self._loop, name="kiln-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        failing_since = None  # when the store operations began failing, all of them
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                self._store.add("hb/%d" % self._me, 1)
                for peer in self._peers:
                    self._observe(peer, self._store.add("hb/%d" % peer, 0), now)
                failing_since = None
            except DistributedError as err:
                # the store is gone or slow: the data sockets still report crashes, and
                # past lost_after the group is told (see the module docstring)
                failing_since = now if failing_since is None else failing_since
                if time.monotonic() - failing_since > self.lost_after:
                    self._store_lost(err, time.monotonic() - failing_since)
                    return
            if self._stop.wait(self.interval):
                return

    def _store_lost(self, err: DistributedError, silent: float) -> None:
        address = getattr(self._store, "address", "?")
        for group in [self._group] + _descendants(self._group):
            if not group.is_aborted:
                group._fail(StoreLost(
                    "group '%s' lost its store at %s: no store operation succeeded for %.1f s "
                    "(last: %s)" % (group.name, address, silent, getattr(err, "message", err)),
                    address=address), None)

    def _observe(self, peer: int, counter: int, now: float) -> None:
        last = self._seen.get(peer)
        if last is None or counter != last[0]:
            self._seen[peer] = (counter, now)
            return
        if counter < 0 or counter == 0:  # left cleanly, or not started yet
            return
        silent = now - last[1]
        if silent > self.dead_after:
            self._declare_dead(peer, silent)

    def watch(self, members) -> None:
        """Watch these members from now on (a fault-tolerant group's new epoch: one taken
        for dead that made it into the epoch is alive after all, and watched afresh)."""
        members = set(members)
        for uid in members & self.dead:
            self._seen.pop(uid, None)
        self.dead -= members
        self._peers = sorted(m for m in members if m != self._me)

    def _declare_dead(self, peer: int, silent: float) -> None:
        self.dead.add(peer)
        self._peers = [p for p in self._peers if p != peer]  # report once
        world = self._group
        for group in [world] + _descendants(world):
            if peer in group.global_ranks and not group.is_aborted:
                rank = list(group.global_ranks).index(peer)
                group._fail(PeerFailure(
                    rank, "rank %d of group '%s' stopped heartbeating: no sign of life for "
                    "%.1f s (hung or stopped: SIGSTOP, a debugger, an overloaded machine)"
                    % (rank, group.name, silent), group=group.name,
                    hint="a crashed peer is reported at once; this one kept its sockets open. "
                         "Heartbeat deadlines follow the group's timeout (see "
                         "kiln/distributed/heartbeat.py)"), None)

    def stop(self) -> None:
        """Stop beating and say goodbye, so peers never take this exit for a hang."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1.0)
        # the goodbye is bounded: a store that went away (its host left) must not hold
        # the exit for a whole store timeout. A beat still in a store call (a slow or
        # unreachable store) holds the connection: the goodbye gets one of its own
        store = None
        try:
            store = self._store.clone(timeout=_GOODBYE_TIMEOUT) if self._thread.is_alive() \
                else self._store
            store.timeout = min(store.timeout, _GOODBYE_TIMEOUT)
            store.set("hb/%d" % self._me, str(LEFT))
        except DistributedError:
            pass
        finally:
            if store is not None:  # the beat's own connection only once the beat ended
                store.close()


def _descendants(group) -> list:
    out = []
    for child in getattr(group, "children", []):
        out.append(child)
        out += _descendants(child)
    return out
