"""Scenarios of the shared-memory lane tests (see harness.py; run like workers.py).

    python shm_workers.py SCENARIO RANK WORLD STORE_ADDR RESULT_JSON ARGS_JSON
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import numpy as np

import kiln.distributed as dist
from kiln.ir import dtypes as kd
from workers import check, join, main, make, ref_reduce, scenario

DTYPES = ["float32", "bfloat16", "float16", "float64", "int32", "uint8"]


def lanes(pg) -> dict:
    return {p: link.shm for p, link in pg.backend.transport.links.items()}


def shm_bytes(pg) -> int:
    return sum(lane.bytes_sent for lane in lanes(pg).values() if lane is not None)


def token_prefix() -> str:
    """The start of every /dev/shm name this job's lanes use."""
    return "kiln-" + hashlib.sha256(os.environ["KILN_TOKEN"].encode()).hexdigest()[:16]


def leftovers() -> dict:
    """This job's files in /dev/shm, and this process's mappings of any of them."""
    prefix = token_prefix()
    maps = [line.strip() for line in open("/proc/self/maps") if "/dev/shm/" + prefix in line]
    return {"files": sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix)),
            "maps": maps}


def run_ops(pg, dt: kd.DType, count: int, seed: int, oracle: bool = True) -> dict:
    """all_reduce (sum, max), reduce_scatter, all_gather and broadcast of `count`
    elements per rank; with `oracle`, each result is checked against numpy; returns
    their bytes. (Without: for a run whose bytes are compared with a checked run's.)"""
    n, r = pg.world_size, pg.rank

    def verify(got, want, what):
        if oracle:
            check(got, want(), dt, what)

    out = {}
    for op in ("sum", "max"):
        x = make(dt, (count,), seed * 31 + r, op)
        pg.all_reduce(x, op=op).wait(timeout=60)
        verify(x, lambda: ref_reduce([make(dt, (count,), seed * 31 + q, op)
                                      for q in range(n)], op, dt), "all_reduce " + op)
        out["all_reduce_" + op] = x.tobytes()
    rs = np.empty(count, dt.np_dtype)
    pg.reduce_scatter(rs, make(dt, (n * count,), seed * 37 + r)).wait(timeout=60)
    mine = slice(r * count, (r + 1) * count)  # elementwise: reduce this rank's part only
    verify(rs, lambda: ref_reduce([make(dt, (n * count,), seed * 37 + q)[mine]
                                   for q in range(n)], "sum", dt), "reduce_scatter")
    out["reduce_scatter"] = rs.tobytes()
    ag = np.empty((n, count), dt.np_dtype)
    pg.all_gather(ag, make(dt, (count,), seed * 41 + r)).wait(timeout=60)
    verify(ag, lambda: np.stack([make(dt, (count,), seed * 41 + q) for q in range(n)]),
           "all_gather")
    out["all_gather"] = ag.tobytes()
    b = make(dt, (count,), seed * 43 + r)
    pg.broadcast(b, src=n - 1).wait(timeout=60)
    verify(b, lambda: make(dt, (count,), seed * 43 + n - 1), "broadcast")
    out["broadcast"] = b.tobytes()
    return out


@scenario
def shm_identical(rank, world, addr, args):
    """The same calls on the world group (shared-memory lanes) and on a copy of it
    made with KILN_TCP_SHM=0 (TCP only): every result bit-identical."""
    pg = join(rank, world, addr, timeout=60.0)
    os.environ["KILN_TCP_SHM"] = "0"
    tcp = pg.split(list(range(world)))
    os.environ.pop("KILN_TCP_SHM")
    assert all(lane is not None for lane in lanes(pg).values()), lanes(pg)
    assert all(lane is None for lane in lanes(tcp).values())
    slot = next(iter(lanes(pg).values())).slot_bytes
    defaults = (pg.backend.segment_bytes, pg.backend.ring_segment_scale,
                pg.backend.halving_bytes)
    sizes = {}
    for di, name in enumerate(args.get("dtypes", DTYPES)):
        dt = kd.dtype(name)
        # 1 MiB and a bit per rank: past the ring threshold (256 KiB)
        count = (1 << 20) // dt.itemsize + 1000 * di + 3
        # the default segments (halving-doubling on 4 ranks), then 150 KiB ones and
        # the ring only: several segments per chunk, each over the lane's minimum
        for grain in ("default", "150k"):
            for group in (pg, tcp):
                group.backend.segment_bytes, group.backend.ring_segment_scale, \
                    group.backend.halving_bytes = defaults if grain == "default" else \
                    (150 << 10, 1, 0)
            before = shm_bytes(pg)
            got = run_ops(pg, dt, count, seed=di)
            moved = shm_bytes(pg) - before
            # the same calls over TCP only, compared bit for bit with the checked ones
            want = run_ops(tcp, dt, count, seed=di, oracle=False)
            for what in got:
                assert got[what] == want[what], "%s %s (%s) differs" % (name, what, grain)
            assert moved > 0, (name, grain)
            sizes["%s/%s" % (name, grain)] = moved
    assert shm_bytes(tcp) == 0
    tcp.destroy()
    return {"slot_bytes": slot, "moved": sizes}


@scenario
def shm_disabled(rank, world, addr, args):
    pg = join(rank, world, addr)
    x = np.ones(1 << 20, np.float32)
    pg.all_reduce(x).wait(timeout=30)
    assert np.all(x == world)
    return {"lanes": [lane is not None for lane in lanes(pg).values()],
            "files": leftovers()["files"]}


@scenario
def shm_mixed(rank, world, addr, args):
    """Rank 1 alone has KILN_TCP_SHM=0 (as a rank on another host could not open the
    segment): its pairs agree on having no lane, the others keep theirs; results
    are right and the offer rank 0 made to rank 1 is not left in /dev/shm."""
    if rank == 1:
        os.environ["KILN_TCP_SHM"] = "0"
    pg = join(rank, world, addr)
    dt = kd.float32
    run_ops(pg, dt, 300_001, seed=5)
    return {"lanes": {str(p): lane is not None for p, lane in lanes(pg).items()},
            "sent": {str(p): lane.bytes_sent for p, lane in lanes(pg).items() if lane},
            "files": leftovers()["files"]}


@scenario
def shm_cleanup(rank, world, addr, args):
    """Lanes in use, then the group destroyed: no file, no mapping left."""
    pg = join(rank, world, addr)
    during = leftovers()
    x = np.ones(3 << 20, np.float32)
    pg.all_reduce(x).wait(timeout=30)
    assert np.all(x == world)
    used = shm_bytes(pg)
    mapped = leftovers()["maps"]
    dist.destroy_process_group()
    deadline = time.monotonic() + 10
    while leftovers()["maps"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the links are closed by a reaper thread
    return {"during": during, "after": leftovers(), "used": used, "mapped": len(mapped)}


@scenario
def shm_kill(rank, world, addr, args):
    """The last rank SIGKILLs itself in the middle of large all_reduces; the others
    fail with PeerFailure naming it, and this job's files are gone."""
    victim = world - 1
    pg = join(rank, world, addr, timeout=30.0)
    x = np.ones(4 << 20, np.float32)
    pg.all_reduce(x).wait(timeout=30)
    pg.barrier().wait(timeout=30)
    if rank == victim:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(200):
            pg.all_reduce(x).wait(timeout=30)
    except dist.DistributedError as err:
        return {"type": type(err).__name__, "rank": getattr(err, "rank", None),
                "elapsed": time.monotonic() - start, "prefix": token_prefix(),
                "leftovers": leftovers()}
    raise AssertionError("200 all_reduces finished without the victim")


@scenario
def shm_exhaustion(rank, world, addr, args):
    """Rank 0 sends more large p2p messages than a lane has slots, then joins a ring
    all_reduce whose messages queue behind them; rank 1 receives the p2p messages
    only after the all_reduce, in reverse order. Early messages in every slot must
    not hold up the messages behind them (they are spilled)."""
    pg = join(rank, world, addr, timeout=30.0)
    slots = next(iter(lanes(pg).values())).slots
    k, count = 3 * slots, 100_000  # 400 KB each
    x = np.full(2 << 20, rank + 1.0, np.float32)
    if rank == 0:
        sends = [pg.send(np.full(count, i, np.float32), dst=1, tag=i) for i in range(k)]
        pg.all_reduce(x).wait(timeout=30)
        for w in sends:
            w.wait(timeout=30)
    else:
        time.sleep(0.5)  # let the p2p messages arrive first
        pg.all_reduce(x).wait(timeout=30)
        for i in reversed(range(k)):
            got = np.empty(count, np.float32)
            pg.recv(got, src=0, tag=i).wait(timeout=30)
            assert np.all(got == i), (i, got[:4])
    assert np.all(x == world * (world + 1) / 2)
    pg.barrier().wait(timeout=30)
    lane = lanes(pg)[1 - rank]
    return {"spilled": lane.spilled, "received": lane.bytes_received, "sent": lane.bytes_sent}


if __name__ == "__main__":
    main()
