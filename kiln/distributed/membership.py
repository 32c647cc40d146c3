"""Epoch-numbered membership, kept in the store: views, failures, joins and step votes.

The store is the one authority (ARCHITECTURE.md, "The reconfiguration protocol"). A
member is named by a *uid* that never changes: its launch rank for the processes of
the first epoch, a fresh number from `ft/next_uid` for every joiner. Keys:

    ft/view/<e>              {"epoch", "members": [uid, ...] in rank order, "step",
                              "joined": [uid, ...], "removed": [uid, ...]}; written once
                              (compare-and-set from absent), never changed
    ft/alive/<e>/<uid>       a member of epoch e-1 that takes part in forming epoch e
    ft/join/<uid>            a joiner waiting to be admitted
    ft/live/<uid>            ephemeral: gone the moment the process's store connection
                             closes (it died, even by SIGKILL)
    ft/ready/<e>/<uid>       a member of epoch e about to connect its mesh
    ft/commit/<e>/<r>/votes     how many members voted in commit round r (an add counter)
    ft/commit/<e>/<r>/decision  "commit", "commit+grow" or "rollback"; first writer wins
                                (the keys of round r-2 are deleted once r is decided)

Forming epoch e+1: every member that takes part posts `alive`; the coordinator (the
lowest uid that posted) waits until every member not known dead (its `live` key gone,
or its heartbeat stopped) has posted, or a join window passed, then writes the view: the survivors in their old order, then the
joiners. The survivors must be a strict majority of the members not known dead and at
least `min_size`. A member left out (it came after the window) is told so.

Committing: the r-th `should_commit` of epoch e is commit round r on every member (a
step rolled back without a new epoch is tried again in round r+1). Every member votes
(counts itself in); the last vote
writes the decision, commit, unless one was written already: a member that votes "no"
writes "rollback" before it counts itself, and a member whose group failed before the
decision was written writes "rollback" instead. The decision is
written once, so every member, and a member that looks later, reads the same one: a
step is committed everywhere or nowhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from kiln.distributed.errors import GroupAborted, RendezvousError, StoreError, StoreTimeout

COMMIT, COMMIT_GROW, ROLLBACK = "commit", "commit+grow", "rollback"
_POLL = 0.005  # how often a waiting member looks at the store again (grows to _POLL_MAX)
_POLL_MAX = 0.05


@dataclass(frozen=True)
class View:
    """The membership of one epoch."""

    epoch: int
    members: tuple[int, ...]
    step: int = 0  # the last committed step when the epoch began
    joined: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()

    def rank_of(self, uid: int) -> int:
        return self.members.index(uid)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": list(self.members), "step": self.step,
                           "joined": list(self.joined), "removed": list(self.removed)})

    @classmethod
    def from_json(cls, raw: bytes) -> "View":
        d = json.loads(raw)
        return cls(int(d["epoch"]), tuple(d["members"]), int(d.get("step", 0)),
                   tuple(d.get("joined", ())), tuple(d.get("removed", ())))


class Membership:
    """The store side of the protocol for one process (uid `me`)."""

    def __init__(self, store, me: int):
        self.store = RetryingStore(store, on_reconnect=self._reannounce)
        self.me = me
        self._announced = False

    def _reannounce(self) -> None:
        if self._announced:  # the dropped connection took the live key along
            self.announce()

    def close(self) -> None:
        """Leave: the live key goes with the connection."""
        self.store._store.close()

    def drop_connection(self) -> None:
        """Close the store connection (a simulated network blip: see elastic.drop-conn);
        the next operation reconnects and announces this process again."""
        self.store._store.close()

    def announce(self) -> None:
        """Mark this process live: an ephemeral key on this client's connection, which
        the store deletes the moment the process dies (its socket closes), so peers
        need not wait for a heartbeat deadline to know."""
        self.store.set("ft/live/%d" % self.me, "1", ephemeral=True)
        self._announced = True

    def live(self) -> set[int]:
        return self._uids("ft/live/")

    # -- views ---------------------------------------------------------------------
    def publish_first(self, view: View) -> None:
        """The first epoch (written by rank 0 of the initial world); joiners' uids start
        after it."""
        self.store.compare_and_set("ft/view/%d" % view.epoch, None, view.to_json())
        self.store.compare_and_set("ft/next_uid", None, str(max(view.members) + 1))

    def view(self, epoch: int) -> View | None:
        key = "ft/view/%d" % epoch
        if not self.store.check([key]):
            return None
        return View.from_json(self.store.get(key))

    def latest(self, start: int = 0) -> View | None:
        """The newest view at or after epoch `start`."""
        found, epoch = None, start
        while True:
            v = self.view(epoch)
            if v is None:
                return found
            found, epoch = v, epoch + 1

    def form_next(self, current: View, *, committed: int, window: float,
                  min_size: int, deadline: float, heartbeat_dead=lambda: set()) -> View:
        """Take part in forming the epoch after `current`; returns its view (this
        member is in it) or raises GroupAborted (left out, or too few survivors)."""
        e = current.epoch + 1
        self.announce()  # again: a dropped store connection took the first one along
        self.store.set("ft/alive/%d/%d" % (e, self.me), json.dumps({"step": committed}))
        began, poll = time.monotonic(), _POLL
        while True:
            view = self.view(e)
            if view is not None:
                if self.me not in view.members:
                    raise GroupAborted(
                        "uid %d was left out of epoch %d (members %s): it came after the join "
                        "window" % (self.me, e, list(view.members)),
                        hint="start the process again as a joiner (KILN_JOIN=1)")
                return view
            now = time.monotonic()
            if now > deadline:
                raise StoreTimeout("forming epoch %d: no view was written in time" % e)
            alive = self._uids("ft/alive/%d/" % e) & set(current.members)
            gone = set(current.members) - self.live()  # exited or killed: no live key
            # only the store's word (a closed connection) or a stopped heartbeat makes a
            # member dead: a peer's EOF or goodbye may come from a live member that left
            # the epoch on purpose, or whose link alone broke
            dead = (heartbeat_dead() | gone) - alive
            expected = set(current.members) - dead
            if min(alive - dead, default=self.me) == self.me and (
                    alive >= expected or now - began > window):
                self._write(current, e, alive, dead, committed, min_size)
                continue  # written (by us or a racing coordinator): read it back
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX)

    def await_members(self, view: View, deadline: float) -> set[int]:
        """Before connecting `view`'s mesh: wait until every member said it is ready;
        returns the members that died meanwhile (no live key), empty when all are
        ready. A member that dies after the view was written would otherwise cost the
        whole connect deadline."""
        prefix = "ft/ready/%d/" % view.epoch
        self.store.set(prefix + str(self.me), "1")
        poll = _POLL
        while True:
            ready = self._uids(prefix)
            if ready >= set(view.members):
                return set()
            gone = set(view.members) - ready - self.live()
            if gone:
                return gone
            if time.monotonic() > deadline:
                raise StoreTimeout("epoch %d: members %s never got ready to connect"
                                   % (view.epoch, sorted(set(view.members) - ready)))
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX)

    def _write(self, current: View, e: int, alive: set, dead: set, committed: int,
               min_size: int) -> None:
        """As the coordinator: write epoch e's view (compare-and-set: a racing
        coordinator's view may win), or raise GroupAborted when it may not form."""
        survivors = [u for u in current.members if u in alive]
        live = [u for u in current.members if u not in dead]
        if 2 * len(survivors) <= len(live):
            raise GroupAborted("epoch %d: only %d of the %d live members %s took part; a new "
                               "epoch needs a majority" % (e, len(survivors), len(live), live))
        joiners = self.pending_joins()
        members = survivors + joiners
        if len(members) < min_size:
            raise GroupAborted("epoch %d would have %d members, fewer than min_size=%d"
                               % (e, len(members), min_size),
                               hint="start replacements (kiln launch --on-failure replace) or "
                               "lower min_size")
        view = View(e, tuple(members), committed, tuple(joiners),
                    tuple(u for u in current.members if u not in alive))
        for uid in joiners:  # before the view: rank 0 looks for these once it sees it
            self.store.set("ft/needs_state/%d" % uid, str(e))
        text = view.to_json()
        if self.store.compare_and_set("ft/view/%d" % e, None, text) == text.encode():
            for uid in joiners:
                self.store.delete("ft/join/%d" % uid)

    def _uids(self, prefix: str) -> set[int]:
        return {int(k[len(prefix):]) for k in self.store.list_keys(prefix)}

    # -- joins ---------------------------------------------------------------------
    def new_uid(self, deadline: float) -> int:
        """A uid no member ever had (waits for the first epoch to exist)."""
        try:
            self.store.wait(["ft/next_uid"], timeout=max(deadline - time.monotonic(), 0.01))
        except StoreTimeout:
            raise RendezvousError("no fault-tolerant group to join in this store",
                                  hint="the first processes must call init_process_group("
                                  "fault_tolerant=True)") from None
        return self.store.add("ft/next_uid", 1) - 1

    def post_join(self, info: dict) -> None:
        self.store.set("ft/join/%d" % self.me, json.dumps(info))

    def pending_joins(self) -> list[int]:
        """Joiners waiting to be admitted (and still alive)."""
        joins = self._uids("ft/join/")
        return sorted(joins & self.live()) if joins else []

    def wait_admitted(self, deadline: float) -> View:
        """Block until a view admits this joiner; returns it."""
        epoch, poll = 0, _POLL
        while True:
            self.announce()  # cheap, and survives a dropped store connection
            view = self.latest(epoch)
            if view is not None:
                if self.me in view.members:
                    return view
                epoch = view.epoch + 1
            if time.monotonic() > deadline:
                self.store.delete("ft/join/%d" % self.me)
                raise RendezvousError(
                    "uid %d was not admitted: the group formed no new epoch in time" % self.me,
                    hint="the group admits joiners at its next step commit (should_commit) "
                    "or pg.grow()")
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX)

    # -- step commit ---------------------------------------------------------------
    def decide(self, view: View, round: int, ok: bool, *, failed, deadline: float) -> str:
        """This member's vote in commit round `round` of `view`'s epoch (the round-th
        should_commit of the epoch, the same on every member); returns the decision.

        `failed()` says whether this member's group failed meanwhile: then, if no
        decision was written yet, the step is rolled back."""
        prefix = _round_prefix(view.epoch, round)
        key = prefix + "decision"
        if not ok:  # decide before voting: the last vote then finds this decision
            decision = self._decide(key, ROLLBACK)
            self._vote(prefix)
            return decision
        try:
            votes = self._vote(prefix)
        except StoreError:  # the vote may or may not have counted: roll back, unless decided
            return self._decide(key, ROLLBACK)
        if votes == len(view.members):  # the last vote decides
            decision = self._decide(key, COMMIT_GROW if self.pending_joins() else COMMIT)
            if round >= 2:  # keep the store small: nobody looks back two rounds
                self.store.delete_prefix(_round_prefix(view.epoch, round - 2))
            return decision
        while True:
            try:
                return self.store.get(key, timeout=_POLL_MAX).decode()
            except StoreTimeout:
                if failed() or time.monotonic() > deadline:
                    return self._decide(key, ROLLBACK)

    def _vote(self, prefix: str) -> int:
        return self.store.add(prefix + "votes", 1)

    def decision(self, epoch: int, round: int, default: str = ROLLBACK) -> str:
        """The decision of commit round `round` of `epoch`, writing `default` if there is
        none yet."""
        return self._decide(_round_prefix(epoch, round) + "decision", default)

    def _decide(self, key: str, value: str) -> str:
        got = self.store.compare_and_set(key, None, value)
        return (got or value.encode()).decode()


def _round_prefix(epoch: int, round: int) -> str:
    return "ft/commit/%d/%d/" % (epoch, round)


class RetryingStore:
    """A store client whose idempotent operations survive a dropped connection: the
    client reconnects on the next call, so the operation is simply made again (`add`
    is not idempotent and is never retried). After any reconnect, `on_reconnect()`
    runs: ephemeral keys died with the old connection."""

    _IDEMPOTENT = frozenset({"set", "get", "check", "wait", "list_keys", "compare_and_set",
                             "delete", "delete_prefix"})

    def __init__(self, store, attempts: int = 3, on_reconnect=None):
        self._store, self._attempts = store, attempts
        self.on_reconnect = on_reconnect  # e.g. set the ephemeral keys again
        self._generation = store.generation

    def __getattr__(self, name):
        fn = getattr(self._store, name)
        if name not in self._IDEMPOTENT:
            return fn

        def retried(*args, **kwargs):
            for i in range(self._attempts):
                try:
                    result = fn(*args, **kwargs)
                except StoreTimeout:
                    raise
                except StoreError:
                    if i == self._attempts - 1:
                        raise
                    continue
                if self._store.generation != self._generation:  # reconnected, maybe quietly
                    self._generation = self._store.generation
                    if self.on_reconnect is not None:
                        self.on_reconnect()
                return result
        return retried
