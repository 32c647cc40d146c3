"""`init_process_group`: from environment or arguments to a connected world group.

Under `kiln launch` no argument is needed: rank, world size, store address and job
token come from KILN_RANK, KILN_WORLD_SIZE, KILN_STORE and KILN_TOKEN, and the
launcher hosts the store (KILN_STORE_HOSTED=1). Otherwise rank 0 hosts the store
in-process on a thread, at the address given.
"""

from __future__ import annotations

import atexit
import os
import time

from kiln.distributed.dump_requests import (
    DumpWatcher, flush_dump_requests, linger, linger_seconds,
)
from kiln.distributed.errors import DistributedError, RendezvousError
from kiln.distributed.flight_recorder import install_signal_handler, recorder
from kiln.distributed.fault_tolerance import FaultTolerance, connect_next
from kiln.distributed.heartbeat import Heartbeat, intervals
from kiln.distributed.membership import Membership, View
from kiln.distributed.process_group import ProcessGroup
from kiln.distributed.protocol import check_timeout, parse_address
from kiln.distributed.store import Store, StoreServer
from kiln.distributed.tcp_backend import TcpBackend

BACKENDS = {"tcp": TcpBackend}
_WORLD: ProcessGroup | None = None
_SERVER: StoreServer | None = None
_WATCHER: "DumpWatcher | None" = None
_LINGER = 5.0  # KILN_FR_LINGER: how long a store host waits for dump requests to be read
_HEARTBEAT: Heartbeat | None = None
# the least the first rendezvous waits for every rank to arrive (see init_process_group)
START_TIMEOUT = 60.0
_DESTROY_HOOKS: list = []  # backends' release hooks (nccl: the communicators it keeps)


def on_destroy(hook) -> None:
    """Have `destroy_process_group` call `hook()` once the world group is gone: a backend
    module registers how to free what it keeps past its groups (nccl: the communicators
    held as parents of a next epoch), so that this module never imports it."""
    if hook not in _DESTROY_HOOKS:
        _DESTROY_HOOKS.append(hook)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise RendezvousError("%s=%r is not an integer" % (name, value)) from None


def init_process_group(backend: str = "tcp", *, rank: int | None = None,
                       world_size: int | None = None, store: str | Store | None = None,
                       token: str | None = None, timeout: float = 10.0,
                       fault_tolerant: bool = False, host_store: bool | None = None,
                       fr_dir: str | None = None, min_size: int | None = None,
                       join: bool | None = None,
                       start_timeout: float | None = None) -> ProcessGroup:
    """Join the world group; every rank calls it once. Returns the group.

        >>> pg = init_process_group()                       # under `kiln launch`
        >>> pg = init_process_group(rank=0, world_size=2, store="127.0.0.1:29500",
        ...                         token="secret")         # rank 0 hosts the store

    `store` is "host:port" or a connected `Store`; `host_store` overrides who hosts it
    (default: rank 0, unless launched by `kiln launch`). `timeout` is the default
    deadline of every collective and of later rendezvous (splits, new epochs).
    `start_timeout` bounds this first rendezvous, the wait for every rank to arrive
    (default: `timeout`, at least 60 s): the processes of one job start seconds apart
    on a busy machine, which says nothing about how long a collective may take.
    Flight Recorder dumps go to `fr_dir` or KILN_FR_DIR.

    `fault_tolerant=True`: a failure does not end the job. The survivors go on in
    place at the next epoch (see `ProcessGroup.should_commit`, `shrink`, `grow` and
    docs/fault-tolerance.md), never fewer than `min_size` (KILN_MIN_SIZE, default 1).
    A process started with `join=True` (KILN_JOIN=1, as `kiln launch --on-failure
    replace` starts replacements) skips the initial rendezvous and waits to be
    admitted into the running group's next epoch; its rank comes from that epoch.
    """
    global _WORLD, _SERVER, _WATCHER, _HEARTBEAT, _LINGER
    if _WORLD is not None and not _WORLD.is_aborted:
        raise RendezvousError("init_process_group was already called in this process",
                              hint="use the group it returned, or destroy_process_group() first")
    timeout = check_timeout(timeout, "init_process_group timeout")
    start = max(timeout, START_TIMEOUT) if start_timeout is None else check_timeout(
        start_timeout, "init_process_group start_timeout")
    if _HEARTBEAT is not None:  # a new world after an aborted one: the old beat ends
        _HEARTBEAT.stop()
        _HEARTBEAT = None
    joiner = (os.environ.get("KILN_JOIN") == "1") if join is None else bool(join)
    if joiner and not fault_tolerant:
        raise RendezvousError("this process was started to join a running group (KILN_JOIN=1 "
                              "or join=True), which needs fault_tolerant=True",
                              hint="init_process_group(..., fault_tolerant=True)")
    if backend == "mpi":  # rank, world size, store and token from the MPI job (mpi_world)
        from kiln.distributed.mpi_backend import MpiBackend
        from kiln.distributed.mpi_world import from_mpi
        BACKENDS["mpi"] = MpiBackend
        rank, world_size, store, token, joiner, _SERVER = from_mpi(
            rank, world_size, store if store is not None else os.environ.get("KILN_STORE"),
            token if token is not None else os.environ.get("KILN_TOKEN"), joiner, fault_tolerant)
        host_store = False if _SERVER is not None else host_store
    if backend == "nccl":  # GPU collectives (kiln.distributed.nccl_backend)
        from kiln.distributed.nccl_backend import NcclBackend
        BACKENDS["nccl"] = NcclBackend
    if backend not in BACKENDS:
        raise RendezvousError("unknown backend %r; available: %s" % (backend, ", ".join(
            sorted(set(BACKENDS) | {"mpi", "nccl"}))))
    rank = _env_int("KILN_RANK") if rank is None else rank
    world_size = _env_int("KILN_WORLD_SIZE") if world_size is None else world_size
    if min_size is None:
        min_size = _env_int("KILN_MIN_SIZE") or 1
    store = store if store is not None else os.environ.get("KILN_STORE")
    token = token if token is not None else os.environ.get("KILN_TOKEN")
    if joiner:  # its rank comes from the epoch that admits it
        rank, world_size = rank or 0, max(world_size or 1, (rank or 0) + 1)
    missing = [n for n, v in (("rank/KILN_RANK", rank), ("world_size/KILN_WORLD_SIZE", world_size),
                              ("store/KILN_STORE", store), ("token/KILN_TOKEN", token)) if v is None]
    if missing:
        raise RendezvousError("init_process_group needs %s" % ", ".join(missing),
                              hint="start the script with `kiln launch --nproc N script.py`, "
                              "or pass rank=, world_size=, store=, token=")
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not (
            0 <= rank < world_size):
        raise RendezvousError("rank=%r must be in [0, world_size=%r)" % (rank, world_size))
    _LINGER = linger_seconds()
    rec = recorder()
    rec.rank, rec.world_size = rank, world_size
    if fr_dir:
        rec.dump_dir = fr_dir
    if isinstance(store, str):
        if host_store is None:
            host_store = rank == 0 and not joiner and os.environ.get("KILN_STORE_HOSTED") != "1"
        if host_store:
            host, port = parse_address(store)
            try:
                _SERVER = StoreServer(host, port, token)
            except OSError as err:
                raise RendezvousError("rank %d cannot host the store at %s: %s"
                                      % (rank, store, err)) from None
            store = _SERVER.address if port == 0 else store
        store = Store(store, token, timeout=start)  # its host may start later
        store.timeout = max(timeout, 1.0)
    backend_cls = BACKENDS[backend]
    if fault_tolerant:
        _WORLD = _fault_tolerant_world(backend_cls, store, rank, world_size, token, timeout,
                                       min_size, joiner, start)
    else:
        be = backend_cls.rendezvous(store, "pg/world/e0", rank, world_size, token, start, 0)
        _WORLD = ProcessGroup(be, name="world", rank=rank, world_size=world_size,
                              global_ranks=range(world_size), store=store, token=token,
                              timeout=timeout, backend_factory=backend_cls)
    install_signal_handler()
    if rec.dump_dir:
        _WATCHER = DumpWatcher(store)
    if world_size > 1 and not fault_tolerant:
        _HEARTBEAT = Heartbeat(store, _WORLD)
    return _WORLD


def _fault_tolerant_world(backend_cls, store: Store, rank: int, world_size: int, token: str,
                          timeout: float, min_size: int, joiner: bool,
                          start: float) -> ProcessGroup:
    """The world group with its FaultTolerance: the first epoch's members rendezvous
    as usual (uid = rank); a joiner is admitted into a later epoch."""
    global _HEARTBEAT
    window = intervals(timeout)[1]  # a member silent this long is dead: stop waiting for it
    membership = Membership(store.clone(), rank)
    if joiner:
        deadline = time.monotonic() + max(timeout, 60.0)
        membership.me = membership.new_uid(deadline)
        recorder().rank = membership.me  # its own dump file, never a dead member's
        membership.announce()
        membership.post_join({"pid": os.getpid(), "replaces": os.environ.get("KILN_REPLACES")})
        view = membership.wait_admitted(deadline)
        view, be = connect_next(membership, view, name="world", factory=backend_cls,
                                store=store, token=token, committed=view.step,
                                window=window, min_size=min_size, deadline=deadline,
                                form=False)
    else:
        view = View(0, tuple(range(world_size)))
        membership.announce()
        be = backend_cls.rendezvous(store, "pg/world/e0", rank, world_size, token, start, 0)
        if rank == 0:
            membership.publish_first(view)
    me = membership.me
    world = ProcessGroup(be, name="world", rank=view.rank_of(me), world_size=len(view.members),
                         global_ranks=view.members, store=store, token=token, timeout=timeout,
                         epoch=view.epoch, backend_factory=backend_cls)
    _HEARTBEAT = Heartbeat(store, world)
    world._ft = world._sync_ft = FaultTolerance(world, membership, view, heartbeat=_HEARTBEAT,
                                                min_size=min_size, window=window, joiner=joiner)
    return world


def get_world() -> ProcessGroup:
    """The world group of this process (after init_process_group)."""
    if _WORLD is None:
        raise RendezvousError("no process group: call kiln.distributed.init_process_group() first")
    return _WORLD


def is_initialized() -> bool:
    return _WORLD is not None


def destroy_process_group() -> None:
    """Leave the world group and its sub-groups cleanly; stop the hosted store."""
    global _WORLD, _SERVER, _WATCHER, _HEARTBEAT
    flush_dump_requests()
    if _SERVER is not None:
        # this process hosts the store: peers must read the posted dump requests first
        linger(_SERVER, _LINGER, dead=_HEARTBEAT.dead if _HEARTBEAT is not None else ())
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop()
        _HEARTBEAT = None
    if _WATCHER is not None:
        _WATCHER.stop()
        _WATCHER = None
    if _WORLD is not None:
        if _WORLD._ft is not None:
            _WORLD._ft.finish()
        _WORLD.destroy()
        if _WORLD.store is not None:
            _WORLD.store.close()
        if _WORLD._ft is not None:
            _WORLD._ft.membership.close()
        _WORLD = None
    for hook in list(_DESTROY_HOOKS):
        hook()
    if _SERVER is not None:
        _SERVER.close()
        _SERVER = None


def _at_exit() -> None:
    # a clean exit says goodbye, so peers report "left the group" rather than a crash
    try:
        destroy_process_group()
    except DistributedError:
        pass


atexit.register(_at_exit)
