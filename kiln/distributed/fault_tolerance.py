"""In-place shrink and grow of a fault-tolerant world group, step commit, state transfer.

A group made with `init_process_group(fault_tolerant=True)` carries a `FaultTolerance`.
The membership protocol itself (views, votes, joins) lives in the store: see
`kiln.distributed.membership`. This module runs it for one process and swaps the
group's backend in place, so the user's `ProcessGroup` object (and its sub-groups)
go on at the new epoch.

When the group reconfigures. Only at a *sync point*, where every member's state is the
same committed state, so a failure never leaves members on different sides of an
update:

- `should_commit()` (the end of every step) when the group failed during the step:
  the step is rolled back (unless its commit was already decided), the survivors
  form epoch e+1 and the call returns False. Calls made after a failure and before
  that fail at once with the failure: nothing runs half in one epoch, half in the
  next.
- `should_commit()` of a step whose commit found joiners waiting ("commit+grow"):
  every member admits them there, so the next step runs on the new ranks; rank 0
  sends them the state at its next call, after it applied the step's update.
- `pg.shrink()` / `pg.grow()`, called by every member.

State for joiners. `pg.register_state(get_state, set_state)`; `get_state()` returns a
dict of arrays. Rank 0 of the new epoch sends it (at its next call, after it applied
the step's update, or in destroy_process_group when the job ends there) to every
joiner that has not received it yet; a joiner's
`register_state` (or `receive_state`) waits for it, loads it with `set_state`, and
learns the committed step. Mutate the state only after `should_commit()` returned True.
"""

from __future__ import annotations

import json
import time

import numpy as np

from kiln.distributed import membership as ms
from kiln.distributed.buffers import dtype_of
from kiln.distributed.errors import (
    DistributedError, GroupAborted, RendezvousError, StoreError,
)
from kiln.distributed.flight_recorder import recorder
from kiln.ir import dtypes as kd

STATE_TAG = 0xFFFFFF00  # the p2p tag of state transfer (user tags stay below: process_group)
_NEEDS_STATE = "ft/needs_state/"


class FaultTolerance:
    """The fault-tolerance state of one process's world group (see the module doc)."""

    def __init__(self, group, membership: ms.Membership, view: ms.View, *, heartbeat=None,
                 min_size: int = 1, window: float = 2.0, joiner: bool = False):
        self.group = group
        self.membership = membership
        self.view = view
        self.committed_step = view.step
        self.heartbeat = heartbeat
        self.min_size = max(int(min_size), 1)
        self.window = window
        self.pending = False  # something must run before the group's next call
        self._send_state = False
        self._sends: list = []  # the Works of state sent to joiners
        self._state = None  # (get_state, set_state)
        self.needs_state = joiner
        self.history: list[dict] = []  # one entry per reconfiguration (for reports)
        self.rolled_back = 0  # steps that should_commit dropped
        self.round = 0  # should_commit calls in this epoch (membership's commit round)

    # -- step commit ---------------------------------------------------------------
    def should_commit(self, ok: bool = True, timeout: float | None = None) -> bool:
        pg = self.group
        self.before_call()
        step = self.committed_step + 1
        round, self.round = self.round, self.round + 1
        deadline = time.monotonic() + (pg.timeout if timeout is None else timeout)
        if pg.is_aborted:
            decision = self.membership.decision(self.view.epoch, round)
        else:
            decision = self.membership.decide(self.view, round, bool(ok),
                                              failed=lambda: pg.is_aborted, deadline=deadline)
        if decision != ms.ROLLBACK:
            self.committed_step = step
        else:
            self.rolled_back += 1
        if pg.is_aborted:
            self.reconfigure("failure during step %d" % step)
        elif decision == ms.COMMIT_GROW:
            # now, so that the next step already runs on the new ranks; the joiners get
            # the state at rank 0's next call, once the step's update is applied
            self.reconfigure("grow")
        return decision != ms.ROLLBACK

    def before_call(self) -> None:
        """Run what must happen before the group's next call: sending the state to the
        joiners (rank 0, after a reconfiguration that admitted some)."""
        if not self.pending:
            return
        self.pending = False
        if self._send_state:
            self._send_state = False
            self._send_state_to_joiners()

    # -- reconfiguration -----------------------------------------------------------
    def reconfigure(self, reason: str) -> ms.View:
        """Leave the current epoch and take part in forming the next; install it."""
        pg = self.group
        began, began_wall = time.monotonic(), time.time()
        failure, failed_at = pg._error, pg.failed_at
        deadline = began + max(pg.timeout, 2 * self.window + 5.0)
        _revoke_tree(pg, "reconfiguring group '%s' after epoch %d (%s)"
                     % (pg.name, self.view.epoch, reason))
        view, backend = connect_next(
            self.membership, self.view, name=pg.name, factory=pg._backend_factory,
            store=pg.store, token=pg._token, committed=self.committed_step,
            window=self.window, min_size=self.min_size, deadline=deadline,
            heartbeat_dead=self._hb_dead)
        agreed = time.monotonic()
        me = self.membership.me
        previous = self.view
        self.view, self.round = view, 0
        pg._install(backend, rank=view.rank_of(me), global_ranks=list(view.members),
                    epoch=view.epoch)
        if self.heartbeat is not None:
            self.heartbeat.watch(view.members)
        _rederive_children(pg, view)
        if self.needs_state is False and pg.rank == 0 and self._waiting_joiners(view):
            self._send_state = self.pending = True
        done = time.monotonic()
        entry = {"epoch": view.epoch, "reason": reason, "members": list(view.members),
                 "removed": list(view.removed), "joined": list(view.joined),
                 "connect_s": agreed - began, "total_s": done - began,
                 "began_at": began_wall, "failed_at": failed_at,
                 "failure": None if failure is None else str(getattr(failure, "message", failure))}
        self.history.append(entry)
        _note_epoch(pg, previous, view, reason, began)
        if view.removed:  # the dump taken at the failure predates the epoch change
            try:
                recorder().dump(reason="epoch %d of group '%s': removed %s after %s"
                                % (view.epoch, pg.name, list(view.removed), entry["failure"]))
            except OSError:
                pass
        return view

    def _hb_dead(self) -> set[int]:
        return set(self.heartbeat.dead) if self.heartbeat is not None else set()

    # -- state transfer --------------------------------------------------------------
    def register_state(self, get_state, set_state, timeout: float | None = None) -> None:
        self._state = (get_state, set_state)
        if self.needs_state:
            self.receive_state(timeout)

    def _waiting_joiners(self, view: ms.View) -> list[int]:
        try:
            keys = self.membership.store.list_keys(_NEEDS_STATE)
        except StoreError:
            return []
        uids = {int(k[len(_NEEDS_STATE):]) for k in keys}
        return [u for u in view.members if u in uids]

    def _send_state_to_joiners(self) -> None:
        pg = self.group
        arrays = {}
        if self._state is not None:
            # copies: the sends are nonblocking and the next commit updates the originals
            arrays = {str(k): np.array(np.asarray(v), copy=True, order="C")
                      for k, v in self._state[0]().items()}
        manifest = json.dumps({"step": self.committed_step, "epoch": self.view.epoch,
                               "arrays": [[k, dtype_of(a).short, list(a.shape)]
                                          for k, a in arrays.items()]}).encode()
        head = np.frombuffer(manifest, np.uint8)
        self._sends = [w for w in self._sends if not w.is_completed()]
        for uid in self._waiting_joiners(self.view):
            dst = self.view.rank_of(uid)
            for buf in [np.array([head.size], np.int64), head] + [a.reshape(-1) for a in
                                                                  arrays.values()]:
                self._sends.append(pg._p2p_call("send", buf, dst, STATE_TAG, None, True))

    def finish(self, timeout: float = 10.0) -> None:
        """Before the group is destroyed: joiners admitted at the last commit still get
        the state (rank 0 makes no further call), and it leaves before the goodbye."""
        try:
            self.before_call()
            deadline = time.monotonic() + timeout
            for work in self._sends:
                work.wait(max(deadline - time.monotonic(), 0.0))
        except DistributedError:
            pass  # the joiner or the group failed: nothing more to hand over
        self._sends.clear()

    def receive_state(self, timeout: float | None = None) -> int:
        """(A joiner) wait for the state from rank 0, load it; the committed step.
        Rank 0 sends it at its next call, which may be a whole step away: the default
        deadline is max(6 * timeout, 60 s)."""
        pg = self.group
        deadline = time.monotonic() + (max(6 * pg.timeout, 60.0) if timeout is None else timeout)
        while True:
            try:
                return self._receive_state_once(max(deadline - time.monotonic(), 0.1))
            except DistributedError:
                if time.monotonic() > deadline:
                    raise
            # the group failed before the state arrived: reform, then wait for the new rank 0
            self.reconfigure("failure while receiving state")

    def _receive_state_once(self, timeout: float) -> int:
        pg = self.group
        n = np.zeros(1, np.int64)
        pg._p2p_call("recv", n, 0, STATE_TAG, timeout, True).wait()
        head = np.zeros(int(n[0]), np.uint8)
        pg._p2p_call("recv", head, 0, STATE_TAG, timeout, True).wait()
        manifest = json.loads(head.tobytes())
        arrays = {}
        for name, short, shape in manifest["arrays"]:
            a = np.empty(shape, kd.from_short(short).np_dtype)
            pg._p2p_call("recv", a.reshape(-1), 0, STATE_TAG, timeout, True).wait()
            arrays[name] = a
        if self._state is not None:
            self._state[1](arrays)
        self.committed_step = int(manifest["step"])
        self.needs_state = False
        try:
            self.membership.store.delete(_NEEDS_STATE + str(self.membership.me))
        except StoreError:
            pass
        return self.committed_step


def connect_next(membership: ms.Membership, view: ms.View, *, name: str, factory, store,
                 token: str, committed: int, window: float, min_size: int,
                 deadline: float, heartbeat_dead=lambda: set(), form: bool = True):
    """Form the epoch after `view` (or, `form=False`, connect `view` itself, as a joiner
    admitted to it does) and connect its mesh; when a member never connects, form the
    next one without it. Returns (view, backend)."""
    me = membership.me
    while True:
        if form:
            view = membership.form_next(view, committed=committed,
                                        window=window, min_size=min_size, deadline=deadline,
                                        heartbeat_dead=heartbeat_dead)
        form = True
        if membership.await_members(view, deadline):
            continue  # a member died before connecting: form the next epoch without it
        try:
            # bounded by the join window too: a member that dies right now must not
            # hold the others for the whole deadline
            backend = factory.rendezvous(
                store, "pg/%s/e%d" % (name, view.epoch), view.rank_of(me), len(view.members),
                token, max(min(deadline - time.monotonic(), max(window, 5.0)), 0.5), view.epoch)
        except RendezvousError:
            if time.monotonic() > deadline:
                raise
            continue  # one died while connecting: its live key is gone, or soon will be
        return view, backend


def _revoke_tree(pg, reason: str) -> None:
    """End the current epoch of `pg` and its sub-groups locally, and wait until no call
    of it is left (they fail with the group's error)."""
    for child in pg.children:
        _revoke_tree(child, reason)
    pg._fail(GroupAborted(reason), None, deliberate=True)
    pg._drain()


def _rederive_children(pg, view: ms.View) -> None:
    """Sub-groups keep their surviving members, in their order (never joiners)."""
    for child in pg.children:
        uids = [u for u in child.global_ranks if u in view.members]
        me = pg.global_ranks[pg.rank]
        rank = uids.index(me)
        try:
            backend = child._backend_factory.rendezvous(
                child.store, "pg/%s/e%d" % (child.name, view.epoch), rank, len(uids),
                child._token, child.timeout, view.epoch)
        except RendezvousError as err:
            child._fail(err, None, deliberate=True)
            continue
        child._install(backend, rank=rank, global_ranks=uids, epoch=view.epoch)
        _rederive_children(child, view)


def _note_epoch(pg, previous: ms.View, view: ms.View, reason: str, began: float) -> None:
    rec = recorder()
    r = rec.record(group=pg.name, epoch=view.epoch, seq=-1, op="reconfigure", inputs=[],
                   outputs=[], timeout=pg.timeout, frames=[],
                   extra={"p2p": True, "from_epoch": previous.epoch,
                          "members": list(view.members), "removed": list(view.removed),
                          "joined": list(view.joined), "reason": reason,
                          "duration_s": round(time.monotonic() - began, 6)})
    rec.completed(r)
