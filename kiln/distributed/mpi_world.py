"""The MPI side of a kiln job: starting from `mpirun`, and one communicator per group and epoch.

`init_process_group("mpi")` calls `from_mpi` first: rank and world size are the MPI
job's; the store and token come from KILN_STORE/KILN_TOKEN (set by `kiln launch
--engine mpi`), or else rank 0 hosts a store and sends its address and a fresh token
to the others over MPI, so a plain `mpirun -np 4 python train.py` needs no setup.

Communicators. Every process knows the other processes by their kiln uid (the MPI
rank in the first epoch, a fresh number for a joiner) as one-process MPI groups; a
group of kiln members is the union of theirs, in rank order, and its communicator is
made with `MPI_Comm_create_from_group` — collective over those members only. So a new
epoch's communicator is formed by the survivors alone, whatever became of the others:
a dead process (ULFM sees it), and a hung one (SIGSTOP: MPI does not see it, and a
`Shrink` or any call on the old communicator would wait for it forever). Measured here:
1-2 ms for 3 of 4 ranks after a SIGKILL. Sub-groups re-derived at a new epoch find
their members' uids in the store (`<prefix>/mpi/uid/<rank>`); `split` makes its
sub-groups on the parent's communicator instead (MpiBackend.split_backend).

Grow. Joiners of epoch e are processes of another MPI job in the same Open MPI
runtime: replacements that rank 0 spawned (`MPI_Comm_spawn`, under `kiln launch
--engine mpi --on-failure replace`). Rank 0 of the survivors opens an MPI port and
publishes it in the store; the survivors `Accept` the joiners one at a time (in the
view's order), each joiner `Connect`s when its turn is posted, and every merged
process learns the others' uids; then the epoch's communicator is made as above.

One thread in MPI while a communicator is made from a group. Open MPI 5.0's
`MPI_Comm_create_from_group` ends with a barrier over the new communicator itself,
whose first messages carry an extended CID; a message that another thread's progress
receives while the new communicator's PML state is being set up can be filed on ob1's
"no such communicator yet" list just after that list was searched, and is never
matched: both members wait in ompi_comm_activate for good (seen: 1 group in 8-130
hung, 2 members of a 3-rank job, more often under load; none in 2200 since; `split`
no longer takes this path at all: see MpiBackend.split_backend). So
`create_from_group` waits for kiln's background pollers to leave MPI and keeps them out
while it runs (`QUIET`): the watchers (idle probe, p2p tests) and a replacement's wait
for its release make no MPI call then. Not held back: user calls on other groups
while a fault-tolerant group forms a new epoch, and rank 0's spawn of replacements,
which runs on its thread while the shrunk world's communicator is made.

A blocking MPI call runs on a helper thread under the caller's deadline (`bounded`);
one still inside MPI at exit (its deadline passed, RendezvousError K210 raised) would
crash MPI_Finalize, so the process then leaves without it (`free_communicators`).
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import sys
import threading
import time

import numpy as np

from kiln.distributed.errors import (
    DistributedError, MpiUnavailable, RendezvousError, StoreError,
)
from kiln.distributed.membership import View

_MPI = None
_OPS = None
_PROCS: dict[int, object] = {}  # uid -> MPI.Group of that one process
_ME: list[int] = [0]  # this process's uid (set when the world's communicator is made)
_SPAWNED: list = []  # intercommunicators of the replacements this process spawned
_RESTARTS = [0]  # replacements spawned so far (rank 0 of a shrunk world)
_CONFIG_TAG = 7101  # the spawn intercommunicator's message: store address and token
_RELEASE_TAG = 7102  # ... and the parent's goodbye: the job ended, stop waiting to join
_JOINED = [False]  # this replacement made it into the group
_SPAWNING: list[threading.Thread] = []  # the threads that spawned replacements
_CONFIG_BYTES = 1024
_BACKENDS: list = []  # every MpiBackend of this process (closed at exit)
_DYNAMIC: list = []  # the other communicators kiln made to admit joiners (freed at exit)
_STUCK: list = []  # (thread, what) of bounded() calls still inside MPI past their deadline


def load_mpi():
    """mpi4py's MPI module (initializing MPI with full thread support), or K230."""
    global _MPI
    if _MPI is None:
        _skip_finalize_fence()
        try:
            from mpi4py import MPI
        except ImportError as err:
            raise MpiUnavailable("backend='mpi' needs mpi4py and an MPI library: %s" % err) \
                from None
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise MpiUnavailable("the MPI library gave thread level %d; kiln's progress and "
                                 "heartbeat threads need MPI_THREAD_MULTIPLE (%d)"
                                 % (MPI.Query_thread(), MPI.THREAD_MULTIPLE))
        MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
        MPI.COMM_SELF.Set_errhandler(MPI.ERRORS_RETURN)
        _MPI = MPI
        atexit.register(free_communicators)  # runs before mpi4py's MPI_Finalize
    return _MPI


def free_communicators() -> None:
    """Close every kiln group's backend and free the communicators kiln made (at exit,
    before MPI_Finalize). Open MPI's MPI_Finalize disconnects every communicator that
    spans two MPI jobs (a replacement's spawn or port connection, and every group with
    a joiner in it): it exchanges a message with each remote process and waits for all
    of them, for good when one of them is dead or gone (seen: rank 0 of a job whose
    replacements were killed or had left stayed in ompi_dpm_dyn_finalize). Freed
    communicators are not in that list; freeing is local in Open MPI. A process that
    never shared a communicator with another job leaves them all to MPI_Finalize."""
    MPI = _MPI
    if MPI is None or MPI.Is_finalized():
        return
    stuck = [what for thread, what in _STUCK if thread.is_alive()]
    if stuck:
        _leave_without_finalize(stuck)
    parent = MPI.Comm.Get_parent()
    if not (_DYNAMIC or _SPAWNED or parent != MPI.COMM_NULL):
        return
    comms = []
    while _BACKENDS:
        backend = _BACKENDS.pop()
        backend.close()
        comms += backend.communicators()
    comms += [inter for inter, _ in _SPAWNED] + _DYNAMIC
    _SPAWNED.clear()
    _DYNAMIC.clear()
    if parent != MPI.COMM_NULL:
        comms.append(parent)
    seen = set()
    for comm in comms:
        if id(comm) in seen or comm == MPI.COMM_NULL or comm in (MPI.COMM_WORLD, MPI.COMM_SELF):
            continue
        seen.add(id(comm))
        try:
            comm.Free()
        except MPI.Exception:
            pass  # freed already, or MPI refuses: Finalize copes with what is left


def _leave_without_finalize(stuck: list[str]) -> None:
    """End the process now, without MPI_Finalize: a helper thread is still inside a
    blocking MPI call whose deadline passed (K210 was raised for it), and MPI_Finalize
    beside it is erroneous (seen: Open MPI segfaulted). Under ULFM the other ranks see
    a process that left; they finalize without it. The world group says its goodbye
    first (the exit hook that would is later in line); exit hooks registered before MPI
    was loaded do not run. Exit status 1 after an uncaught exception, else 0 (the status
    of a SystemExit is not visible at exit)."""
    from kiln.distributed import rendezvous

    try:
        rendezvous.destroy_process_group()
    except DistributedError:
        pass  # the goodbye is a courtesy: peers then see a process that left
    print("kiln: leaving without MPI_Finalize: %s still inside MPI past its deadline"
          % "; ".join(stuck), file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed: nothing to flush
    os._exit(1 if getattr(sys, "last_value", None) is not None else 0)


def _skip_finalize_fence() -> None:
    """Under ULFM, leave out MPI_Finalize's runtime fence (before MPI starts: MCA variables
    are read by MPI_Init). Open MPI 5's MPI_Finalize with ULFM first shrinks COMM_WORLD to
    the live processes and runs a synchronous barrier among them (that flushes every
    message), then waits in a PMIx fence over *every* process of the job, the dead too;
    after a SIGKILL that fence sometimes never completes in PRRTE (seen here: 2 jobs of 3
    left their survivors in ompi_mpi_finalize's wait loop for good). The barrier makes the
    fence redundant, so kiln turns it off (`async_mpi_finalize`) unless the user set it."""
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes"):
        os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")


def ops():
    """The process-wide cache of MPI reduce ops (see mpi_backend._Ops)."""
    global _OPS
    if _OPS is None:
        from kiln.distributed.mpi_backend import _Ops
        _OPS = _Ops(load_mpi())
    return _OPS


def spawned() -> bool:
    """Whether this process is a replacement spawned into a running job (a joiner)."""
    MPI = load_mpi()
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def from_mpi(rank, world_size, store, token, joiner: bool, fault_tolerant: bool):
    """(rank, world_size, store, token, joiner, server) for init_process_group: the MPI
    job's rank and size, the store (hosted here by rank 0 when none is given: `server`)."""
    MPI = load_mpi()
    if fault_tolerant and os.environ.get("OMPI_MCA_mpi_ft_enable", "1") != "1":
        raise MpiUnavailable("fault_tolerant=True with backend='mpi' needs Open MPI's ULFM, "
                             "which this job was started without (OMPI_MCA_mpi_ft_enable=%s)"
                             % os.environ.get("OMPI_MCA_mpi_ft_enable"),
                             hint="start with `kiln launch --engine mpi` or `mpirun --with-ft "
                             "ulfm`")
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:  # a replacement spawned into the running job
        buf = np.zeros(_CONFIG_BYTES, np.uint8)
        parent.Recv(buf, source=0, tag=_CONFIG_TAG)
        store, token = buf.tobytes().rstrip(b"\0").decode().split("\n", 1)
        threading.Thread(target=_await_release, args=(parent,), daemon=True,
                         name="kiln-mpi-release").start()
        return 0, 1, store, token, True, None
    world = MPI.COMM_WORLD
    size, me = world.Get_size(), world.Get_rank()
    if joiner:
        return rank or 0, world_size or 1, store, token, True, None
    for name, given, actual in (("world_size", world_size, size), ("rank", rank, me)):
        if given is not None and given != actual:
            raise MpiUnavailable("%s=%r but this process is %s %d of the MPI job"
                                 % (name, given, name, actual),
                                 hint="with backend='mpi' leave rank and world_size out (or "
                                 "unset KILN_RANK/KILN_WORLD_SIZE): MPI gives them")
    server = None
    if store is None or token is None:
        store, token, server = _share_store(world, store, token)
    return me, size, store, token, False, server


def _share_store(world, store, token):
    """Rank 0 hosts the store (unless one is given) and sends its address and the token
    to every rank over MPI (a fixed-size byte buffer: nothing is unpickled)."""
    from kiln.distributed.store import StoreServer

    server = None
    buf = np.zeros(_CONFIG_BYTES, np.uint8)
    names = np.zeros((world.Get_size(), 256), np.uint8)
    here = np.zeros(256, np.uint8)
    host = socket.gethostname().encode()[:255]
    here[:len(host)] = np.frombuffer(host, np.uint8)
    world.Allgather(here, names)
    one_host = len({bytes(row) for row in names}) == 1
    if world.Get_rank() == 0:
        token = token or secrets.token_hex(16)
        if store is None:
            bind = "127.0.0.1" if one_host else "0.0.0.0"
            server = StoreServer(bind, 0, token)
            port = server.address.rsplit(":", 1)[1]
            addr = "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname())
            store = "%s:%s" % (addr, port)
        text = ("%s\n%s" % (store, token)).encode()
        buf[:len(text)] = np.frombuffer(text, np.uint8)
    world.Bcast(buf, root=0)
    store, token = buf.tobytes().rstrip(b"\0").decode().split("\n", 1)
    return store, token, server


# -- communicators ------------------------------------------------------------------------
def _group_of(uids) -> object:
    MPI = load_mpi()
    group = MPI.GROUP_EMPTY
    for uid in uids:
        group = MPI.Group.Union(group, _PROCS[uid])
    return group


def bounded(fn, deadline: float, what: str):
    """Run a blocking MPI call on a helper thread, waiting for it until `deadline`."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # re-raised on the caller's thread
            box["error"] = err

    thread = threading.Thread(target=run, name="kiln-mpi-connect", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.01))
    if thread.is_alive():
        _STUCK.append((thread, what))
        raise RendezvousError("%s: not every member took part within the deadline" % what)
    if "error" in box:
        err = box["error"]
        if isinstance(err, load_mpi().Exception):
            raise RendezvousError("%s failed in MPI: %s" % (what, err.Get_error_string())) \
                from None
        raise err
    return box["value"]


class _Quiet:
    """Keeps kiln's watchers out of MPI while a communicator is made from a group (see
    the module docstring): one maker at a time, and no watcher in MPI beside it. A maker
    past its deadline (K210 raised, the thread maybe stuck in MPI) no longer holds
    anything back, so a failed creation does not stop the watchers for good."""

    _TICK = 0.05  # how often a waiting maker looks again (a maker's deadline passing)

    def __init__(self):
        self._cond = threading.Condition()
        self._maker: tuple[int, float] | None = None  # the running maker: (ticket, deadline)
        self._tickets = 0
        self._waiting = 0  # makers waiting for their turn (no watcher enters meanwhile)
        self._watchers = 0  # watchers inside MPI now

    def _making(self) -> bool:
        return self._maker is not None and time.monotonic() < self._maker[1]

    def make(self, deadline: float) -> int:
        """Wait (until `deadline`) for the watchers to leave MPI and any other maker to
        finish: the ticket to pass to `made`, or 0 if they did not in time."""
        with self._cond:
            self._waiting += 1
            try:
                while self._watchers or self._making():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return 0
                    self._cond.wait(min(left, self._TICK))
            finally:
                self._waiting -= 1
            self._tickets += 1
            self._maker = (self._tickets, deadline)
            return self._tickets

    def made(self, ticket: int) -> None:
        """The maker with `ticket` left MPI (a late one, past its deadline, clears
        nothing of a later maker's)."""
        with self._cond:
            if self._maker is not None and self._maker[0] == ticket:
                self._maker = None
            self._cond.notify_all()

    def watch(self) -> bool:
        """A watcher may call MPI now (then `watched()` after): False while a maker runs."""
        with self._cond:
            if self._waiting or self._making():
                return False
            self._watchers += 1
            return True

    def watched(self) -> None:
        with self._cond:
            self._watchers -= 1
            self._cond.notify_all()


QUIET = _Quiet()


def create_from_group(uids, tag: str, deadline: float, what: str):
    """MPI_Comm_create_from_group of the processes `uids` (every one of them calls it
    with the same tag), bounded by `deadline`, with no other kiln thread in MPI meanwhile
    (QUIET: see the module docstring)."""
    MPI = load_mpi()

    def make():
        ticket = QUIET.make(deadline)
        if not ticket:
            raise RendezvousError("%s: another communicator was still being made at the "
                                  "deadline" % what)
        try:
            return MPI.Intracomm.Create_from_group(_group_of(uids), tag)
        finally:
            QUIET.made(ticket)
    return bounded(make, deadline, what)


def communicator(store, prefix: str, rank: int, world_size: int, token: str, timeout: float,
                 epoch: int):
    """The communicator of kiln group `prefix` ("pg/<name>/e<epoch>"): this process is
    `rank` of `world_size`. Every member calls it."""
    MPI = load_mpi()
    deadline = time.monotonic() + timeout
    world = prefix.startswith("pg/world/")
    if world and epoch == 0 and MPI.Comm.Get_parent() == MPI.COMM_NULL:
        if (MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()) != (world_size, rank):
            raise MpiUnavailable("the world group has %d ranks but the MPI job %d"
                                 % (world_size, MPI.COMM_WORLD.Get_size()))
        group = MPI.COMM_WORLD.Get_group()
        for r in range(world_size):
            _PROCS[r] = group.Incl([r])
        _ME[0] = rank
        comm = bounded(MPI.COMM_WORLD.Dup, deadline, "group '%s'" % prefix)
    else:
        if world:
            view = View.from_json(store.get("ft/view/%d" % epoch, timeout=timeout))
            _ME[0] = me = view.members[rank]
            if view.joined:
                _admit(store, prefix, view, me, deadline)
                _JOINED[0] = True
            uids = list(view.members)
            if view.removed and rank == 0:
                _replace(store, token, len(view.removed))
        else:
            uids = _member_uids(store, prefix, rank, world_size, deadline)
        comm = create_from_group(uids, prefix, deadline, "group '%s'" % prefix)
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


def _member_uids(store, prefix: str, rank: int, world_size: int, deadline: float) -> list[int]:
    keys = ["%s/mpi/uid/%d" % (prefix, r) for r in range(world_size)]
    try:
        store.set(keys[rank], str(_ME[0]))
        store.wait(keys, timeout=max(deadline - time.monotonic(), 0.01))
        return [int(store.get(k)) for k in keys]
    except StoreError as err:
        raise RendezvousError("group '%s': the members' MPI identities did not all arrive: %s"
                              % (prefix, err.message)) from None


def _admit(store, prefix: str, view: View, me: int, deadline: float) -> None:
    """Connect the joiners of `view` to its survivors (see the module docstring)."""
    MPI = load_mpi()
    joined = list(view.joined)
    survivors = [u for u in view.members if u not in joined]
    port_key, turn = "%s/mpi/port" % prefix, "%s/mpi/turn/%%d" % prefix
    left = lambda: max(deadline - time.monotonic(), 0.01)  # noqa: E731
    if me in survivors:
        comm = create_from_group(survivors, prefix + "/survivors", deadline,
                                 "group '%s' (survivors)" % prefix)
        _DYNAMIC.append(comm)
        port = MPI.Open_port() if comm.Get_rank() == 0 else None
        if port is not None:
            store.set(port_key, port)
        first = 0
    else:
        port = store.get(port_key, timeout=left()).decode()
        k = joined.index(me)
        store.wait([turn % k], timeout=left())
        inter = bounded(lambda: MPI.COMM_SELF.Connect(port, root=0), deadline,
                         "joiner %d connecting to group '%s'" % (me, prefix))
        _DYNAMIC.append(inter)
        comm = _merge(inter, True, deadline)
        first = k + 1
    for k in range(first, len(joined)):
        if comm.Get_rank() == 0:
            store.set(turn % k, "1")
        inter = bounded(lambda: comm.Accept(port, root=0), deadline,
                         "group '%s' admitting joiner %d" % (prefix, joined[k]))
        _DYNAMIC.append(inter)
        comm = _merge(inter, False, deadline)
    if port is not None and me in survivors:
        MPI.Close_port(port)


def _merge(inter, high: bool, deadline: float):
    """Merge an intercommunicator; every process learns the uids of the merged ones."""
    MPI = load_mpi()
    comm = bounded(lambda: inter.Merge(high=high), deadline, "merging a joiner")
    _DYNAMIC.append(comm)
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    uids = np.zeros(comm.Get_size(), np.int64)
    bounded(lambda: comm.Allgather(np.array([_ME[0]], np.int64), uids), deadline,
             "exchanging uids with a joiner")
    group = comm.Get_group()
    for i, uid in enumerate(uids.tolist()):
        _PROCS[uid] = group.Incl([i])
    return comm


def _replace(store, token: str, count: int) -> None:
    """Under `kiln launch --engine mpi --on-failure replace` (KILN_ON_FAILURE=replace):
    spawn replacements for the removed members, within KILN_MAX_RESTARTS in all."""
    if os.environ.get("KILN_ON_FAILURE") != "replace":
        return
    budget = int(os.environ.get("KILN_MAX_RESTARTS", "3")) - _RESTARTS[0]
    count = min(count, budget)
    if count > 0:
        _RESTARTS[0] += count
        spawn_replacements(count, store.address, token)


def spawn_replacements(count: int, store: str, token: str) -> None:
    """Start `count` replacements of this script in the running MPI job (they join the
    group at its next step commit); called on rank 0 after a shrink. Nonblocking: the
    spawn (about 1.5-2.5 s here) runs on a thread."""
    MPI = load_mpi()
    argv = list(getattr(sys, "orig_argv", [sys.executable] + sys.argv))

    def run() -> None:
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())
        try:
            inter = MPI.COMM_SELF.Spawn(sys.executable, args=argv[1:], maxprocs=count,
                                        info=info)
        except MPI.Exception as err:
            print("kiln: spawning %d replacement(s) failed: %s" % (count, err.Get_error_string()),
                  file=sys.stderr)
            return
        text = ("%s\n%s" % (store, token)).encode()
        buf = np.zeros(_CONFIG_BYTES, np.uint8)
        buf[:len(text)] = np.frombuffer(text, np.uint8)
        for child in range(count):
            inter.Send(buf, dest=child, tag=_CONFIG_TAG)
        _SPAWNED.append((inter, count))

    if not _SPAWNING:
        atexit.register(_release_children)
    thread = threading.Thread(target=run, name="kiln-mpi-spawn", daemon=True)
    _SPAWNING.append(thread)
    thread.start()


def _release_children(timeout: float = 2.0) -> None:
    """At exit of the process that spawned replacements: tell them the job is over. One
    still waiting to be admitted then leaves (MPI_Finalize waits for every process
    connected to this one, so it must not wait for a join that never comes)."""
    MPI = load_mpi()
    for thread in _SPAWNING:  # a replacement still starting must finish its MPI_Init first
        thread.join(60.0)
    deadline = time.monotonic() + timeout
    for inter, count in _SPAWNED:
        for child in range(count):
            try:
                req = inter.Isend(np.zeros(1, np.uint8), dest=child, tag=_RELEASE_TAG)
                while not req.Test() and time.monotonic() < deadline:
                    time.sleep(0.01)
            except MPI.Exception:
                pass  # that replacement is gone already


def _test_quietly(req) -> bool:
    """req.Test(), as a watcher does: not while a communicator is being made (False)."""
    if not QUIET.watch():
        return False
    try:
        return req.Test()
    finally:
        QUIET.watched()


def _await_release(parent) -> None:
    """(A spawned replacement) leave quietly when the job ends before this process was
    admitted: finalize MPI (its parent's MPI_Finalize waits for it) and exit 0."""
    MPI = load_mpi()
    buf = np.zeros(1, np.uint8)
    try:
        req = parent.Irecv(buf, source=0, tag=_RELEASE_TAG)
        while not _test_quietly(req):  # until the job ends (a daemon thread)
            time.sleep(0.05)
    except MPI.Exception:
        return  # the parent died: the group admits this process or it times out
    if _JOINED[0]:
        return  # a member now: it ends with the group
    print("kiln: the job ended before this replacement was admitted; leaving",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    free_communicators()
    MPI.Finalize()
    os._exit(0)
