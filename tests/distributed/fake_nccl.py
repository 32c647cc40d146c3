"""A fake NCCL: `NcclApi` simulated in one process, N ranks as N `FakeNccl` objects
(one per thread) sharing a `FakeWorld`, buffers in host memory (numpy addresses).

What it models, as NCCL does: nonblocking management calls (init, split, shrink, grow)
return ncclInProgress and finish once every participant arrived (plus `init_polls`
extra polls of ncclCommGetAsyncError); collectives are enqueued without blocking and
complete when all ranks enqueued theirs, seen through events; a dead rank (`kill`,
ncclCommAbort) leaves its peers' pending work incomplete and their async error
ncclRemoteError; NCCL_SHRINK_ABORT drops the old communicator's pending work; revoke
makes later calls fail with ncclInvalidUsage. Every call is logged per rank.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading

import ml_dtypes
import numpy as np

from kiln.distributed import nccl_api as api

_DT = {code: np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
       for name, code in api.DTYPES.items()}
_RED = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}


def view(addr: int, count: int, dtype: int) -> np.ndarray:
    dt = _DT[dtype]
    raw = (ctypes.c_byte * (count * dt.itemsize)).from_address(addr)
    return np.frombuffer(raw, dtype=dt)


def _drop(c: "Comm") -> None:
    """Abort, revoke, shrink-abort: the comm's kernels end without a result, so its
    stream moves on (events recorded after them complete)."""
    for op in c.ops:
        op.done = op.dropped = True
    c.ops.clear()


class Op:
    """One rank's part of one call; `done` once the call completed."""

    def __init__(self, kind: str, rank: int, **args):
        self.kind, self.rank, self.args, self.done = kind, rank, args, False
        self.dropped = False  # ended without a result (abort, revoke, shrink-abort)


class Clique:
    """The ranks of one communicator."""

    def __init__(self, nranks: int):
        self.nranks = nranks
        self.handles: dict[int, int] = {}  # rank -> comm handle
        self.dead: set[int] = set()
        self.rounds: dict[int, dict[int, Op]] = {}  # collective seq -> rank -> op
        self.mailbox: dict[tuple[int, int], list[Op]] = {}  # (src, dst) -> sends
        self.pending_recv: dict[tuple[int, int], list[Op]] = {}
        self.mgmt: dict[tuple, dict[int, tuple]] = {}  # management round -> rank -> args
        self.grow_uid: bytes | None = None
        # the n-th window registered on the clique -> rank -> (address, bytes)
        self.windows: dict[int, dict[int, tuple[int, int]]] = {}
        self.signals: dict[tuple[int, int, int], int] = {}  # (target, origin, sig) -> arrived


class Comm:
    def __init__(self, clique: Clique | None, rank: int, polls: int):
        self.clique, self.rank, self.polls = clique, rank, polls
        self.seq = 0
        self.ready = False
        self.revoked = self.aborted = False
        self.error = api.SUCCESS
        self.ops: list[Op] = []
        self.nwin = 0  # windows registered on this comm
        self.win_pending: set[int] = set()  # registrations not every rank made yet


class FakeWorld:
    """State shared by the fake ranks; `init_polls` extra IN_PROGRESS polls per init."""

    def __init__(self, init_polls: int = 0):
        self.lock = threading.Lock()
        self.init_polls = init_polls
        self.comms: dict[int, Comm] = {}
        self.by_uid: dict[bytes, Clique] = {}
        self._ids = itertools.count(1)
        self.events: dict[int, list[Op]] = {}
        self.wins: dict[int, tuple[Clique, int]] = {}  # window handle -> (clique, n-th)
        self.memory: dict[int, np.ndarray] = {}  # mem_alloc'd "device" buffers

    def kill(self, comm_handle: int) -> None:
        """The process owning `comm_handle` dies: its rank is dead in its clique."""
        with self.lock:
            comm = self.comms[comm_handle]
            comm.aborted = True
            comm.clique.dead.add(comm.rank)


class FakeNccl(api.NcclApi):
    """One rank's NCCL over a `FakeWorld`; `log` lists the calls made."""

    name = "fake"

    def __init__(self, world: FakeWorld):
        self.world = world
        self.log: list[str] = []
        self.pending: list[Op] = []  # this rank's enqueued ops (its one stream)

    # -- helpers ----------------------------------------------------------------------------
    def _new_comm(self, clique: Clique | None, rank: int, polls: int = 0) -> int:
        handle = next(self.world._ids)
        self.world.comms[handle] = Comm(clique, rank, polls)
        if clique is not None:
            clique.handles[rank] = handle
        return handle

    def _mgmt(self, clique: Clique, key: tuple, rank: int, args: tuple, expected: int):
        """Post this rank's part of a management round; returns the round when full."""
        parts = clique.mgmt.setdefault(key, {})
        parts[rank] = args
        return parts if len(parts) == expected else None

    def _ready(self, clique: Clique) -> None:
        if len(clique.handles) == clique.nranks:
            for h in clique.handles.values():
                self.world.comms[h].ready = True

    # -- management -------------------------------------------------------------------------
    def get_version(self):
        return api.version_code(2, 32, 3)

    def get_unique_id(self):
        self.log.append("ncclGetUniqueId")
        return api.SUCCESS, os.urandom(api.UNIQUE_ID_BYTES)

    def get_error_string(self, result):
        return "fake: " + api.result_name(result)

    def comm_init_rank_config(self, nranks, unique_id, rank, blocking):
        self.log.append("ncclCommInitRankConfig")
        with self.world.lock:
            clique = self.world.by_uid.setdefault(unique_id, Clique(nranks))
            handle = self._new_comm(clique, rank, self.world.init_polls)
            self._ready(clique)
        return api.IN_PROGRESS, handle

    def comm_get_async_error(self, comm):
        self.log.append("ncclCommGetAsyncError")
        with self.world.lock:
            c = self.world.comms[comm]
            if c.error != api.SUCCESS:
                return api.SUCCESS, c.error
            if not c.ready or c.polls > 0:
                c.polls -= 1 if c.ready else 0
                return api.SUCCESS, api.IN_PROGRESS
            if c.clique.dead and any(not op.done for op in c.ops):
                c.error = api.REMOTE_ERROR
                return api.SUCCESS, c.error
            full = c.clique.nranks
            c.win_pending = {k for k in c.win_pending if len(c.clique.windows[k]) < full}
            return api.SUCCESS, api.IN_PROGRESS if c.win_pending else api.SUCCESS

    def comm_split(self, comm, color, key, blocking):
        self.log.append("ncclCommSplit")
        with self.world.lock:
            c = self.world.comms[comm]
            if c.aborted:  # freed by ncclCommAbort/Destroy: a use after free
                return api.INVALID_USAGE, 0
            handle = self._new_comm(None, -1) if color != api.SPLIT_NOCOLOR else 0
            full = self._mgmt(c.clique, ("split", c.seq), c.rank, (color, key, handle),
                              c.clique.nranks - len(c.clique.dead))
            c.seq += 1
            if full:
                for col in {a[0] for a in full.values()} - {api.SPLIT_NOCOLOR}:
                    members = sorted((a[1], r, a[2]) for r, a in full.items() if a[0] == col)
                    clique = Clique(len(members))
                    for new_rank, (_, _, h) in enumerate(members):
                        nc = self.world.comms[h]
                        nc.clique, nc.rank = clique, new_rank
                        clique.handles[new_rank] = h
                    self._ready(clique)
        return api.IN_PROGRESS, handle

    def comm_shrink(self, comm, exclude, flags, blocking):
        self.log.append("ncclCommShrink")
        with self.world.lock:
            c = self.world.comms[comm]
            if c.aborted:  # freed by ncclCommAbort/Destroy: a use after free
                return api.INVALID_USAGE, 0
            if flags == api.SHRINK_ABORT:
                _drop(c)
            handle = self._new_comm(None, -1)
            full = self._mgmt(c.clique, ("shrink", tuple(exclude)), c.rank, (handle,),
                              c.clique.nranks - len(exclude))
            if full:
                clique = Clique(len(full))
                for new_rank, old in enumerate(sorted(full)):
                    h = full[old][0]
                    nc = self.world.comms[h]
                    nc.clique, nc.rank = clique, new_rank
                    clique.handles[new_rank] = h
                self._ready(clique)
        return api.IN_PROGRESS, handle

    def comm_get_unique_id(self, comm):
        self.log.append("ncclCommGetUniqueId")
        with self.world.lock:
            clique = self.world.comms[comm].clique
            clique.grow_uid = clique.grow_uid or os.urandom(api.UNIQUE_ID_BYTES)
            return api.SUCCESS, clique.grow_uid

    def comm_grow(self, comm, nranks, unique_id, rank, blocking):
        self.log.append("ncclCommGrow")
        with self.world.lock:
            if comm:
                c = self.world.comms[comm]
                if c.aborted or c.clique.grow_uid is None or unique_id is not None:
                    return api.INVALID_USAGE, 0
                unique_id, rank = c.clique.grow_uid, c.rank
            clique = self.world.by_uid.setdefault(unique_id, Clique(nranks))
            handle = self._new_comm(clique, rank)
            self._ready(clique)
        return api.IN_PROGRESS, handle

    def comm_revoke(self, comm):
        self.log.append("ncclCommRevoke")
        with self.world.lock:
            c = self.world.comms[comm]
            c.revoked = True
            _drop(c)
        return api.SUCCESS

    def comm_abort(self, comm):
        self.log.append("ncclCommAbort")
        with self.world.lock:
            c = self.world.comms[comm]
            c.aborted = True
            _drop(c)
            if c.clique is not None:
                c.clique.dead.add(c.rank)
        return api.SUCCESS

    def comm_finalize(self, comm):
        self.log.append("ncclCommFinalize")
        return api.SUCCESS

    def comm_destroy(self, comm):
        self.log.append("ncclCommDestroy")
        with self.world.lock:
            self.world.comms[comm].aborted = True
        return api.SUCCESS

    # -- collectives --------------------------------------------------------------------------
    def _post(self, comm: int, kind: str, **args) -> int:
        self.log.append(kind)
        with self.world.lock:
            c = self.world.comms[comm]
            if c.revoked or c.aborted or not c.ready:
                return api.INVALID_USAGE
            op = Op(kind, c.rank, **args)
            c.ops.append(op)
            self.pending.append(op)
            if kind in ("ncclSend", "ncclRecv"):
                self._p2p(c, op)
            else:
                parts = c.clique.rounds.setdefault(c.seq, {})
                parts[c.rank] = op
                c.seq += 1
                if len(parts) == c.clique.nranks:
                    self._run(c.clique, parts)
        return api.SUCCESS

    def _p2p(self, c: Comm, op: Op) -> None:
        q = c.clique
        if op.kind == "ncclSend":
            key, other = (c.rank, op.args["peer"]), q.pending_recv
            mine = q.mailbox
        else:
            key, other = (op.args["peer"], c.rank), q.mailbox
            mine = q.pending_recv
        waiting = other.get(key)
        if waiting:
            peer = waiting.pop(0)
            snd, rcv = (op, peer) if op.kind == "ncclSend" else (peer, op)
            data = view(snd.args["buf"], snd.args["count"], snd.args["dtype"])
            view(rcv.args["buf"], rcv.args["count"], rcv.args["dtype"])[:] = data
            snd.done = rcv.done = True
        else:
            mine.setdefault(key, []).append(op)

    def _run(self, clique: Clique, parts: dict[int, Op]) -> None:
        ops = [parts[r] for r in range(clique.nranks)]
        kinds = {(o.kind, o.args["count"], o.args["dtype"]) for o in ops}
        if len(kinds) != 1:
            for o in ops:
                self.world.comms[clique.handles[o.rank]].error = api.INVALID_USAGE
            return
        kind, n, dt = kinds.pop()
        sends = [view(o.args["send"], n, dt).copy() for o in ops]
        recv = lambda o, k: view(o.args["recv"], k, dt)  # noqa: E731
        red = lambda: self._reduce(sends, ops[0].args.get("op", 0))  # noqa: E731
        if kind == "ncclAllReduce":
            total = red()
            for o in ops:
                recv(o, n)[:] = total
        elif kind == "ncclBroadcast":
            for o in ops:
                recv(o, n)[:] = sends[o.args["root"]]
        elif kind == "ncclReduce":
            root = ops[0].args["root"]
            recv(ops[root], n)[:] = red()
        elif kind == "ncclAllGather":
            for o in ops:
                recv(o, n * clique.nranks)[:] = np.concatenate(sends)
        elif kind == "ncclReduceScatter":
            total = self._reduce([view(o.args["send"], n * clique.nranks, dt).copy()
                                  for o in ops], ops[0].args["op"])
            for o in ops:
                recv(o, n)[:] = total[o.rank * n:(o.rank + 1) * n]
        for o in ops:
            o.done = True

    @staticmethod
    def _reduce(arrays: list[np.ndarray], op: int) -> np.ndarray:
        if op == api.REDUCE_OPS["avg"]:
            return (np.sum(arrays, axis=0) / len(arrays)).astype(arrays[0].dtype)
        out = arrays[0].copy()
        for a in arrays[1:]:
            _RED[op](out, a, out=out)
        return out

    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        return self._post(comm, "ncclAllReduce", send=send, recv=recv, count=count,
                          dtype=dtype, op=op)

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        return self._post(comm, "ncclBroadcast", send=send, recv=recv, count=count,
                          dtype=dtype, root=root)

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        return self._post(comm, "ncclReduce", send=send, recv=recv, count=count,
                          dtype=dtype, op=op, root=root)

    def all_gather(self, send, recv, send_count, dtype, comm, stream):
        return self._post(comm, "ncclAllGather", send=send, recv=recv, count=send_count,
                          dtype=dtype)

    def reduce_scatter(self, send, recv, recv_count, dtype, op, comm, stream):
        return self._post(comm, "ncclReduceScatter", send=send, recv=recv, count=recv_count,
                          dtype=dtype, op=op)

    def send(self, buf, count, dtype, peer, comm, stream):
        return self._post(comm, "ncclSend", buf=buf, count=count, dtype=dtype, peer=peer)

    def recv(self, buf, count, dtype, peer, comm, stream):
        return self._post(comm, "ncclRecv", buf=buf, count=count, dtype=dtype, peer=peer)

    # -- one-sided: a window is every rank's (addr, bytes); puts land at once -------------
    def comm_window_register(self, comm, buf, nbytes, flags):
        self.log.append("ncclCommWindowRegister")
        with self.world.lock:
            c = self.world.comms[comm]
            if c.revoked or c.aborted or not c.ready:
                return api.INVALID_USAGE, 0
            key, c.nwin = c.nwin, c.nwin + 1
            c.clique.windows.setdefault(key, {})[c.rank] = (buf, nbytes)
            c.win_pending.add(key)
            handle = next(self.world._ids)
            self.world.wins[handle] = (c.clique, key)
        return api.IN_PROGRESS, handle

    def comm_window_deregister(self, comm, win):
        self.log.append("ncclCommWindowDeregister")
        with self.world.lock:
            return api.SUCCESS if self.world.wins.pop(win, None) else api.INVALID_ARGUMENT

    def _signal_op(self, comm: int, kind: str, peer: int, sig: int, data=None) -> int:
        with self.world.lock:
            c = self.world.comms[comm]
            if c.revoked or c.aborted or not c.ready:
                return api.INVALID_USAGE
            if not 0 <= peer < c.clique.nranks:
                return api.INVALID_ARGUMENT
            if peer in c.clique.dead:
                c.error = api.REMOTE_ERROR
                return api.REMOTE_ERROR
            if data is not None:
                send, nbytes, win, offset = data
                place = self.world.wins.get(win)
                target = place[0].windows[place[1]].get(peer) if place else None
                if target is None or offset + nbytes > target[1]:
                    return api.INVALID_ARGUMENT
                ctypes.memmove(target[0] + offset, send, nbytes)
            key = (peer, c.rank, sig)
            c.clique.signals[key] = c.clique.signals.get(key, 0) + 1
            op = Op(kind, c.rank, peer=peer)
            op.done = True
            self.pending.append(op)
        return api.SUCCESS

    def put_signal(self, send, count, dtype, peer, win, offset, sig, ctx, comm, stream):
        self.log.append("ncclPutSignal")
        return self._signal_op(comm, "ncclPutSignal", peer, sig,
                               (send, count * _DT[dtype].itemsize, win, offset))

    def signal(self, peer, sig, ctx, comm, stream):
        self.log.append("ncclSignal")
        return self._signal_op(comm, "ncclSignal", peer, sig)

    def wait_signal(self, descs, comm, stream):
        self.log.append("ncclWaitSignal")
        with self.world.lock:
            c = self.world.comms[comm]
            if c.revoked or c.aborted or not c.ready:
                return api.INVALID_USAGE
            op = Op("ncclWaitSignal", c.rank, descs=list(descs))
            op.signals, op.me = c.clique.signals, c.rank
            c.ops.append(op)
            self.pending.append(op)
        return api.SUCCESS

    @staticmethod
    def _try_wait(op: Op) -> None:
        """A pending ncclWaitSignal completes (consuming) once every count arrived."""
        keys = [((op.me, peer, sig), cnt) for cnt, peer, sig, _ in op.args["descs"]]
        if all(op.signals.get(k, 0) >= cnt for k, cnt in keys):
            for k, cnt in keys:
                op.signals[k] -= cnt
            op.done = True

    def mem_alloc(self, nbytes):
        arr = np.zeros(max(nbytes, 1), np.uint8)
        self.world.memory[arr.ctypes.data] = arr
        return arr.ctypes.data

    def mem_free(self, addr):
        self.world.memory.pop(addr, None)

    def copy_to_host(self, addr, nbytes):
        return ctypes.string_at(addr, nbytes)

    def group_start(self):
        self.log.append("ncclGroupStart")
        return api.SUCCESS

    def group_end(self):
        self.log.append("ncclGroupEnd")
        return api.SUCCESS

    # -- events: one stream per rank here; an event covers every op not yet done -------------
    def event_record(self, stream):
        with self.world.lock:
            event = next(self.world._ids)
            self.pending = [op for op in self.pending if not op.done]
            self.world.events[event] = list(self.pending)
        return event

    def event_query(self, event):
        with self.world.lock:
            for op in self.world.events[event]:
                if not op.done and op.kind == "ncclWaitSignal":
                    self._try_wait(op)
            return all(op.done for op in self.world.events[event])

    def event_destroy(self, event):
        with self.world.lock:
            self.world.events.pop(event, None)
