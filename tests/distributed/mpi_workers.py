"""The scenarios of workers.py (and ft_workers.py), run by every rank of an `mpirun` job
on the mpi backend (see mpi_harness.py).

    mpirun ... python mpi_workers.py SCENARIO WORLD STORE_ADDR RESULT_PATTERN ARGS_JSON

The rank comes from MPI; RESULT_PATTERN holds "{rank}". workers.join is replaced by
one that asks for backend="mpi", so the same scenarios check the same answers against
numpy on both backends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import numpy as np

import kiln.distributed as dist
import workers
from workers import SCENARIOS, check, scenario
from kiln.ir import dtypes as kd


def join(rank, world, addr, timeout=20.0, **kw):
    return dist.init_process_group("mpi", store=addr, token=os.environ.get("KILN_TOKEN"),
                                   timeout=timeout, host_store=kw.pop("host_store", False), **kw)


workers.join = join  # the scenarios look it up at call time


@scenario
def no_store(rank, world, addr, args):
    """A bare `mpirun python job.py`: no store or token given; rank 0 hosts the store and
    shares it over MPI. Also: tags past MPI's limit, bfloat16 sums (a user-defined op)."""
    pg = dist.init_process_group("mpi", timeout=20)
    assert (pg.rank, pg.world_size) == (rank, world) and pg.backend.name == "mpi"
    x = np.full(7, pg.rank + 1, np.int64)
    pg.all_reduce(x).wait()
    assert np.all(x == world * (world + 1) // 2), x
    n = pg.world_size
    out = np.empty(3, np.float32)
    works = [pg.send(np.full(3, rank, np.float32), dst=(rank + 1) % n, tag=(1 << 31) + 5),
             pg.recv(out, src=(rank - 1) % n, tag=(1 << 31) + 5)]
    for w in works:
        w.wait(timeout=20)
    assert np.all(out == (rank - 1) % n), out
    b = np.full(1000, 0.5 + rank, kd.bfloat16.np_dtype)
    pg.all_reduce(b, op="avg").wait()
    check(b, np.full(1000, 0.5 + (n - 1) / 2), kd.bfloat16, "bfloat16 avg")
    # large messages (MPI's rendezvous protocol), in place
    x = np.arange(3_000_017, dtype=np.float32) * (rank + 1)
    pg.all_reduce(x).wait()
    check(x, np.arange(3_000_017, dtype=np.float64) * n * (n + 1) / 2, kd.float32, "large")
    y = np.full(1_000_003, rank, np.float64)
    pg.broadcast(y, src=n - 1).wait()
    assert np.all(y == n - 1)
    # zero-copy: MPI receives straight into the user's memory, a view of a larger array
    # changes and nothing around it does
    base = np.zeros(10, np.float64)
    view = base[2:6]
    view[:] = rank + 1
    pg.all_reduce(view).wait()
    assert np.all(base[2:6] == world * (world + 1) / 2) and np.all(base[:2] == 0) and \
        np.all(base[6:] == 0), base
    return {"store": pg.store.address}


@scenario
def large_all_reduce(rank, world, addr, args):
    """all_reduce from 1 MB takes kiln's ring over MPI p2p (mpi_ring.py): every dtype
    class and reduce op against numpy, sizes that split unevenly over the ranks and the
    2 MB segments, a view of a larger array, identical bytes on every rank."""
    import hashlib

    from kiln.distributed import mpi_ring

    pg = join(rank, world, addr, timeout=60.0)
    ring = pg.backend._ring
    assert ring.comm is not pg.backend.comm  # its messages match no user's
    digests = []
    cases = [("float32", "sum", 1_300_001), ("float64", "avg", 700_013),
             ("int8", "sum", 2_500_003), ("int64", "max", 262_147),
             ("bool", "sum", 3_000_001), ("complex64", "sum", 300_007),
             ("bfloat16", "avg", 1_100_009), ("float32", "prod", 600_001),
             # from here chunks of 2 segments or more: adds on the helper thread
             ("int32", "min", 5 * mpi_ring.SEGMENT // 4 + 3),
             ("float32", "sum", 1_300_001, 64 << 10), ("bfloat16", "avg", 1_100_009, 64 << 10)]
    for i, (name, op, n, *segment) in enumerate(cases):
        ring._scratch.clear()
        mpi_ring.SEGMENT = segment[0] if segment else 2 << 20
        dt = kd.dtype(name)
        assert n * np.dtype(dt.np_dtype).itemsize >= mpi_ring.MIN_BYTES, name
        per_rank = []
        for r in range(world):  # every rank makes every rank's input: the oracle
            g = np.random.default_rng([7, r, n])
            if dt.is_bool:
                per_rank.append(g.random(n) < 0.2)
            elif dt.is_integer:
                per_rank.append(g.integers(-100, 100, n).astype(dt.np_dtype))
            elif dt.is_complex:
                per_rank.append((g.standard_normal(n) + 1j * g.standard_normal(n))
                                .astype(dt.np_dtype))
            elif op == "prod":
                per_rank.append(g.uniform(0.5, 1.5, n).astype(dt.np_dtype))
            else:
                per_rank.append(np.round(g.standard_normal(n) * 8).astype(dt.np_dtype))
        x = per_rank[rank].copy()
        pg.all_reduce(x, op=op).wait(timeout=60)
        wide = [a.astype(np.complex128 if dt.is_complex else np.float64) for a in per_rank]
        if dt.is_bool:
            want = np.logical_or.reduce(per_rank)
        elif op in ("sum", "avg"):
            want = sum(wide) / (world if op == "avg" else 1)
            if dt.is_integer:  # sums wrap, as numpy's do
                want = sum(a.astype(np.int64) for a in per_rank).astype(dt.np_dtype)
        else:
            want = {"max": np.maximum, "min": np.minimum,
                    "prod": np.multiply}[op].reduce(wide)
        check(x, np.asarray(want).astype(x.dtype) if dt.is_integer or dt.is_bool else want,
              dt, "%s %s of %d" % (name, op, n))
        digests.append(hashlib.sha256(x.tobytes()).hexdigest())
        # chunks of one segment add inline, longer ones on the helper thread
        assert (ring._pool is not None) == (i >= 8), (name, segment)
    mpi_ring.SEGMENT = 2 << 20
    ring._scratch.clear()
    base = np.zeros(2_000_000, np.float32)  # a view in the middle: reduced in place
    view = base[500_000:1_800_000]
    view[:] = rank + 1
    pg.all_reduce(view).wait(timeout=60)
    assert np.all(view == world * (world + 1) / 2) and not base[:500_000].any() \
        and not base[1_800_000:].any()
    # a two-rank sub-group (one chunk each way) and a one-rank one (no ring: MPI's call)
    sub = pg.split(color=int(rank >= 2), timeout=30)
    y = np.full(1_000_001, rank + 1.5, np.float64)
    sub.all_reduce(y, op="max").wait(timeout=60)
    members = [r for r in range(world) if (r >= 2) == (rank >= 2)]
    assert np.all(y == max(members) + 1.5), (y[:4], members)
    return {"digests": digests}


@scenario
def every_collective(rank, world, addr, args):
    """workers.collectives without its tcp-only second pass (forced ring segments)."""
    pg = join(rank, world, addr)
    dts = [kd.dtype(n) for n in args.get("dtypes", [d.name for d in kd.ALL_DTYPES])]
    return {"works": workers.run_collectives(pg, dts, args.get("sizes", [0, 1, 21, 1003]), 0)}


@scenario
def many_groups(rank, world, addr, args):
    """Groups made again and again while every earlier group's watcher polls MPI:
    pg.split(color=rank >= 2) (MPI_Comm_create_group on the parent), each sub-group's
    all_reduce against numpy; then ranks 0 and 1 make 2-member groups from a group
    (MPI_Comm_create_from_group, as a new epoch does), rank 2 waiting in a barrier."""
    from kiln.distributed.mpi_backend import MpiBackend

    pg = join(rank, world, addr, timeout=60.0)
    members = [r for r in range(world) if (r >= 2) == (rank >= 2)]
    for i in range(args["splits"]):
        sub = pg.split(color=int(rank >= 2), timeout=20)
        x = np.full(5, rank + i, np.int64)
        sub.all_reduce(x).wait(timeout=20)
        assert np.all(x == sum(r + i for r in members)), (i, x, members)
    made = []
    if rank < 2:
        token = os.environ["KILN_TOKEN"]
        for i in range(args["groups"]):
            made.append(MpiBackend.rendezvous(pg.store, "pg/pair%d/e0" % i, rank, 2, token,
                                              20.0, 0))
            assert made[-1].world_size == 2 and made[-1].rank == rank
    pg.barrier(timeout=60).wait(timeout=60)
    for backend in made:
        backend.close()
    return {"splits": args["splits"], "groups": len(made), "children": len(pg.children)}


@scenario
def lonely_group(rank, world, addr, args):
    """Rank 0 makes a 2-member group that rank 1 never joins: K210 at the deadline, the
    MPI call left inside MPI; the process then leaves without MPI_Finalize."""
    from kiln.distributed import mpi_world

    pg = join(rank, world, addr)
    if rank != 0:
        return {"error": None}
    pg.store.set("pg/lonely/e0/mpi/uid/1", "1")  # rank 1's identity, so only MPI waits
    try:
        mpi_world.communicator(pg.store, "pg/lonely/e0", 0, 2, os.environ["KILN_TOKEN"],
                               args["timeout"], 0)
    except dist.RendezvousError as err:
        return {"error": str(err)}
    return {"error": None}


@scenario
def killed(rank, world, addr, args):
    """workers.death, with the victim SIGKILLed instead of exiting with status 3: under
    mpirun a rank that exits with an error status ends the whole job (mpirun's policy);
    a crash is what ULFM survives."""
    os._exit = lambda status: os.kill(os.getpid(), signal.SIGKILL)
    return workers.death(rank, world, addr, args)


def _ft_init(backend="tcp", **kw):
    """ft_workers' init_process_group, on the mpi backend: rank and world size from MPI."""
    kw.pop("rank", None)
    kw.pop("world_size", None)
    kw.pop("join", None)  # a replacement spawned into the job knows it is one
    return _INIT("mpi", **kw)


_INIT = dist.init_process_group


def main() -> None:
    name, world, addr, pattern, args = sys.argv[1:6]
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if name == "trainer":  # ft_workers' data-parallel loop (test_fault_tolerance.py)
        import ft_workers  # noqa: F401  adds the scenario
        from kiln.distributed.mpi_world import load_mpi

        MPI = load_mpi()
        dist.init_process_group = _ft_init
        if MPI.Comm.Get_parent() != MPI.COMM_NULL:  # a replacement: rank -1, its own file
            rank = -1
            pattern = pattern.format(rank="joiner%d" % os.getpid())
        with open(os.path.join(os.path.dirname(pattern), "pid%s" % (
                rank if rank >= 0 else "joiner%d" % os.getpid())), "w") as f:
            f.write(str(os.getpid()))
    try:
        data = SCENARIOS[name](rank, int(world), addr, json.loads(args))
        result = {"ok": True, "data": data}
    except BaseException as err:  # reported to the test, which fails with it
        result = {"ok": False, "type": type(err).__name__, "error": traceback.format_exc()}
    with open(pattern.format(rank=rank) if "{rank}" in pattern else pattern, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
