"""`NcclGroups`: how one process (one rank) makes the NCCL communicators of its groups,
and reconfigures them in place when a fault-tolerant group changes epoch.

It is the `backend_factory` of a `ProcessGroup` on backend "nccl": the group calls
`rendezvous(store, "pg/<name>/e<epoch>", rank, size, token, timeout, epoch)` for its
first epoch, for every later epoch (kiln.distributed.fault_tolerance.connect_next) and
for its sub-groups' epochs. Each group's newest `NcclBackend` stays registered here, so
the next epoch is derived from its communicator instead of re-initialized:

1. Every rank of the new epoch publishes, under the epoch's prefix in the store, the
   communicator it still holds for this group: its epoch and its rank in it, or none
   (a joiner, or a rank whose communicator was freed).
2. Every rank reads all of them, so every rank computes the same plan. The survivors
   `S` are the ranks that hold a communicator of the newest epoch seen. When they are
   ranks 0..|S|-1 of the new epoch in their old order (kiln's membership lists
   survivors first, in order, then joiners), the survivors call
   `ncclCommShrink(NCCL_SHRINK_ABORT)` excluding the old ranks that are gone (their
   communicator was revoked at the failure, never aborted: abort frees it), and, when
   joiners follow, `ncclCommGrow`: rank 0 publishes `ncclCommGetUniqueId`'s id through
   the store, members grow, joiners join with that id and their new rank.
3. Otherwise (no survivor, another order, or a derive that failed), a fresh
   `ncclCommInitRankConfig` with a unique id from rank 0 through the store.

A failed derive frees the old communicator and raises `RendezvousError`, so that
connect_next forms the next epoch and the next attempt initializes afresh.

`destroy_process_group` frees every communicator kept this way (a hook this module
registers with `kiln.distributed.rendezvous.on_destroy`).

`ProcessGroup.split` on nccl calls `NcclBackend.split_backend`: `ncclCommSplit` on every
rank of the parent, eagerly (color: the smallest parent rank of the sub-group, key:
the rank in it).

    groups = NcclGroups(nccl_api)     # one per process; NcclGroups() uses libnccl
    backend = groups.rendezvous(store, "pg/world/e0", rank, size, token, 60.0)
"""

from __future__ import annotations

import json
import threading
import time

from kiln.distributed import nccl_api as api
from kiln.distributed.errors import DistributedError, NcclError, RendezvousError
from kiln.distributed.nccl_backend import NcclBackend
from kiln.distributed.nccl_comm import NcclComm
from kiln.distributed.rendezvous import on_destroy

_DEFAULT: "NcclGroups | None" = None
_DEFAULT_LOCK = threading.Lock()


def set_nccl_api(nccl: api.NcclApi | None) -> "NcclGroups":
    """Make `nccl` the NcclApi of this process's nccl groups (None: the real libnccl).
    Tests and simulators use it before `init_process_group("nccl")`; groups made
    earlier keep theirs."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        _DEFAULT = NcclGroups(nccl)
        return _DEFAULT


def default_groups() -> "NcclGroups":
    """This process's NcclGroups (over libnccl unless `set_nccl_api` said otherwise)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = NcclGroups()
        return _DEFAULT


def _split_prefix(prefix: str) -> tuple[str, int]:
    """"pg/world.s0/e3" -> ("pg/world.s0", 3)."""
    head, _, tail = prefix.rpartition("/e")
    try:
        return head, int(tail)
    except ValueError:
        return prefix, 0


class NcclGroups:
    """The NCCL communicators of one rank's groups (see the module docstring)."""

    def __init__(self, nccl: api.NcclApi | None = None):
        self._nccl = nccl
        self._live: dict[str, NcclBackend] = {}  # "pg/<name>" -> the group's newest backend
        self._lock = threading.Lock()
        self.history: list[dict] = []  # one entry per communicator made: how it was made

    @property
    def api(self) -> api.NcclApi:
        """The NcclApi in use; the real library is loaded on first use (after checking
        for a GPU, so that K251 names the hardware rather than the library)."""
        if self._nccl is None:
            from kiln.distributed.nccl_lib import LibNccl, require_gpu
            require_gpu()
            self._nccl = LibNccl()
        return self._nccl

    # -- the factory contract -------------------------------------------------------------
    def rendezvous(self, store, prefix: str, rank: int, world_size: int, token: str,
                   timeout: float, epoch: int = 0) -> NcclBackend:
        """The communicator of `world_size` ranks for the group and epoch in `prefix`:
        derived from this rank's previous one where every rank's plan says so, a fresh
        one otherwise (see the module docstring)."""
        key, _ = _split_prefix(prefix)
        deadline = time.monotonic() + timeout
        with self._lock:
            prev = self._live.get(key)
        if prev is not None and (prev.epoch >= epoch or not prev.comm.ready
                                 or prev.comm.aborted):
            prev = None
        if epoch == 0 and prev is None:
            comm, how = self._fresh(store, prefix, rank, world_size, deadline), "init"
        else:
            comm, how = self._next(store, prefix, rank, world_size, deadline, key, prev)
        return self._register(key, comm, epoch, how)

    def split(self, parent: NcclBackend, prefix: str | None, members: list[int] | None,
              timeout: float) -> NcclBackend | None:
        """ncclCommSplit of `parent` (every rank of it calls this): `members` are the
        parent ranks of this rank's sub-group in their new order, None for no group."""
        if members is None:
            parent.comm.split(api.SPLIT_NOCOLOR, 0, rank=-1, size=0)
            return None
        me = members.index(parent.rank)
        comm = parent.comm.split(min(members), me, rank=me, size=len(members))
        key, epoch = _split_prefix(prefix)
        return self._register(key, comm, epoch, "split")

    def release(self) -> None:
        """Free every communicator kept as the parent of a next epoch."""
        with self._lock:
            kept, self._live = list(self._live.values()), {}
        for backend in kept:
            backend.comm.free()

    # -- internals --------------------------------------------------------------------------
    def _register(self, key: str, comm: NcclComm, epoch: int, how: str) -> NcclBackend:
        backend = NcclBackend(comm, groups=self, key=key, epoch=epoch)
        with self._lock:
            old = self._live.get(key)
            self._live[key] = backend
        if old is not None and old.comm is not comm:
            old.comm.free()
        self.history.append({"group": key, "epoch": epoch, "how": how, "rank": comm.rank,
                             "size": comm.size})
        return backend

    def retains(self, backend: NcclBackend) -> bool:
        """True while `backend` is its group's newest: its communicator is kept (even
        after close or abort) as the parent of the group's next epoch."""
        with self._lock:
            return self._live.get(backend.key) is backend

    def _fresh(self, store, prefix: str, rank: int, world_size: int,
               deadline: float) -> NcclComm:
        key = "%s/nccl-uid" % prefix
        if rank == 0:
            res, uid = self.api.get_unique_id()
            if res != api.SUCCESS:
                raise NcclError("ncclGetUniqueId failed: %s" % api.result_name(res),
                                call="ncclGetUniqueId", result=res)
            store.set(key, uid)
        else:
            uid = store.get(key, timeout=_left(deadline))
        return NcclComm.init(self.api, world_size, uid, rank, timeout=_left(deadline))

    def _next(self, store, prefix: str, rank: int, world_size: int, deadline: float,
              key: str, prev: NcclBackend | None) -> tuple[NcclComm, str]:
        mine = {"epoch": prev.epoch, "rank": prev.rank, "size": prev.world_size} if prev \
            else {"epoch": -1}
        try:
            store.set("%s/nccl-from/%d" % (prefix, rank), json.dumps(mine))
            plans = [json.loads(store.get("%s/nccl-from/%d" % (prefix, r),
                                          timeout=_left(deadline))) for r in range(world_size)]
            survivors = _survivors(plans)
            if prev is not None and rank not in survivors:
                self._forget(key, prev)  # a stale communicator: this rank joins instead
                prev = None
            if not survivors:
                return self._fresh(store, prefix, rank, world_size, deadline), "init"
            return self._derive(store, prefix, rank, world_size, deadline, prev, plans,
                                survivors)
        except DistributedError as err:
            if prev is not None:
                self._forget(key, prev)
            if isinstance(err, RendezvousError):
                raise
            raise RendezvousError("rank %d could not make the NCCL communicator of %s: %s"
                                  % (rank, prefix, getattr(err, "message", err))) from err

    def _derive(self, store, prefix: str, rank: int, world_size: int, deadline: float,
                prev: NcclBackend | None, plans: list[dict],
                survivors: list[int]) -> tuple[NcclComm, str]:
        grow_key = "%s/nccl-grow-id" % prefix
        n = len(survivors)
        if prev is None:  # a joiner: the survivors publish the grow id
            grow_id = store.get(grow_key, timeout=_left(deadline))
            return NcclComm.join(self.api, world_size, grow_id, rank,
                                 timeout=_left(deadline)), "join"
        kept = {plans[r]["rank"] for r in survivors}
        gone = [r for r in range(plans[survivors[0]]["size"]) if r not in kept]
        small = prev.comm.shrink(gone, abort_pending=True)
        how = "shrink" if gone else "shrink (none excluded)"
        if world_size == n:
            self._forget(_split_prefix(prefix)[0], prev)
            return small, how
        try:
            if small.rank == 0:
                store.set(grow_key, small.grow_id())
            else:  # members grow after rank 0 asked for the id (ncclCommGetUniqueId first)
                store.get(grow_key, timeout=_left(deadline))
            big = small.grow(world_size)
        finally:
            small.free()
        self._forget(_split_prefix(prefix)[0], prev)
        return big, how + " + grow"

    def _forget(self, key: str, backend: NcclBackend) -> None:
        with self._lock:
            if self._live.get(key) is backend:
                del self._live[key]
        backend.comm.free()


def _survivors(plans: list[dict]) -> list[int]:
    """The new ranks that shrink their old communicator: those holding one of the newest
    epoch seen, provided they are the first ranks of the new epoch in their old order
    and their old ranks are valid; [] (a fresh init) otherwise."""
    newest = max(p["epoch"] for p in plans)
    if newest < 0:
        return []
    ranks = [r for r, p in enumerate(plans) if p["epoch"] == newest]
    old = [plans[r]["rank"] for r in ranks]
    sizes = {plans[r]["size"] for r in ranks}
    if ranks != list(range(len(ranks))) or old != sorted(set(old)) or len(sizes) != 1 or \
            old[-1] >= sizes.pop():
        return []
    return ranks


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.05)


def _release_default() -> None:
    """destroy_process_group's hook: free the communicators this process's groups keep
    as parents of a next epoch (the world's and its sub-groups')."""
    with _DEFAULT_LOCK:
        groups = _DEFAULT
    if groups is not None:
        groups.release()


on_destroy(_release_default)
