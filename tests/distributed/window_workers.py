"""Scenarios of the RMA window tests (see harness.py; run like workers.py).

    python window_workers.py SCENARIO RANK WORLD STORE_ADDR RESULT_JSON ARGS_JSON

Every rank can rebuild every rank's data from the seeds, so each checks its own
window and what it read against numpy.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import kiln.distributed as dist
from kiln.ir import dtypes as kd
from workers import check, expecter, join, main, scenario

DTYPES = ["float32", "int32", "bfloat16", "float64", "float8_e4m3fn", "uint8"]


def size_of(rank: int) -> int:
    return 16 + 4 * rank  # ranks register different sizes


def small(dt: kd.DType, n: int, seed: int) -> np.ndarray:
    """Small integers in dt: the accumulated sums stay exact in every dtype (float8
    holds the integers up to 16 exactly: 0 or 1 there)."""
    high = 2 if dt.name.startswith("float8") else 4
    return np.random.default_rng(seed).integers(0, high, n).astype(dt.np_dtype)


def numerics(pg, dt: kd.DType, base: int) -> int:
    """put, get, accumulate (all ranks at once into the same elements), signal."""
    n, r = pg.world_size, pg.rank
    init = [small(dt, size_of(q), base + q) for q in range(n)]
    win = pg.window(init[r].copy())
    assert win.sizes == tuple(size_of(q) for q in range(n)) and win.dtype == dt.np_dtype
    # 1. every rank puts 2 elements into every window (itself included) at 2 * rank,
    # then signals; the owner sees all of it once it saw every signal
    for dst in range(n):
        win.put(dst, small(dt, 2, 1000 * base + 10 * r + dst), offset=2 * r)
        win.signal(dst, slot=1)
    win.wait_signal(slot=1, value=n)
    want = init[r].copy()
    for src in range(n):
        want[2 * src:2 * src + 2] = small(dt, 2, 1000 * base + 10 * src + r)
    check(win.local, want, dt, "put %s" % dt.name)
    pg.barrier().wait(timeout=20)
    # 2. get every peer's whole window (they are final now), into a new array and `out`
    for src in range(n):
        theirs = init[src].copy()
        for q in range(n):
            theirs[2 * q:2 * q + 2] = small(dt, 2, 1000 * base + 10 * q + src)
        work = win.get(src, 0, size_of(src))
        work.wait(timeout=20)
        check(work.result, theirs, dt, "get %s from %d" % (dt.name, src))
        out = np.zeros((2, 3), dt.np_dtype)
        win.get(src, 4, 6, out=out).wait(timeout=20)
        check(out, theirs[4:10].reshape(2, 3), dt, "get(out) %s from %d" % (dt.name, src))
    pg.barrier().wait(timeout=20)
    # 3. accumulate: every rank, several times, into the same elements of every window
    ops, reps = ["sum", "max", "min"], 2 if dt.name.startswith("float8") else 5
    region = {"sum": 0, "max": 4, "min": 8}
    works = []
    for dst in range(n):
        for op in ops:
            for i in range(reps):
                works.append(win.accumulate(dst, small(dt, 4, base * 77 + 7 * r + i),
                                            offset=region[op], op=op))
    for w in works:
        w.wait(timeout=20)
    win.signal((r + 1) % n, slot=2).wait(timeout=20)
    pg.barrier().wait(timeout=20)
    before = want
    for op in ops:
        k = region[op]
        parts = [small(dt, 4, base * 77 + 7 * q + i) for q in range(n) for i in range(reps)]
        acc = before[k:k + 4].astype(np.float64)
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
        for p in parts:
            acc = fn(acc, p.astype(np.float64))
        check(win.local[k:k + 4], acc.astype(dt.np_dtype), dt, "accumulate %s %s" % (op, dt.name))
    win.wait_signal(slot=2, value=1, timeout=20)
    win.free()
    return len(works)


@scenario
def window_ops(rank, world, addr, args):
    pg = join(rank, world, addr)
    n = pg.world_size
    counts = {dt: numerics(pg, kd.dtype(dt), 10 + i) for i, dt in enumerate(DTYPES)}
    out = {"accumulates": counts}
    # a large put (through the sender thread) followed at once by a signal: the
    # signal is applied after the put, so the data is there when the signal is seen
    big = np.zeros(300_000, np.float32)
    win = pg.window(big)
    dst = (rank + 1) % n
    if n > 1:
        put = win.put(dst, np.full(300_000, rank + 1.0, np.float32))
        win.signal(dst)
        win.wait_signal()
        assert np.all(big == (rank - 1) % n + 1.0), big[:4]
        put.wait(timeout=20)
        pg.barrier().wait(timeout=20)
        # large replies and payloads (through the sender threads), and empty operations
        got = win.get(dst, 0, 300_000)
        acc = win.accumulate(dst, np.full(300_000, 0.5, np.float32), op="sum")
        empty = [win.put(dst, np.empty(0, np.float32), offset=300_000), win.get(dst, 7, 0)]
        for w in [got, acc] + empty:
            w.wait(timeout=20)
        assert np.all(got.result == rank + 1.0) and empty[1].result.size == 0
        pg.barrier().wait(timeout=20)
        assert np.all(big == (rank - 1) % n + 1.5), big[:4]
    pg.barrier().wait(timeout=20)
    # a busy rank serves puts and gets while it sleeps (it calls nothing of kiln)
    if n > 1:
        if rank == 1:
            big[:4] = 7.0
            pg.barrier().wait(timeout=20)
            deadline = time.monotonic() + 15
            while big[-1] != 42.0:  # rank 0's marker lands without any call here
                assert time.monotonic() < deadline, "the marker never arrived"
                time.sleep(0.01)
            out["served_while_sleeping"] = True
        else:
            pg.barrier().wait(timeout=20)
        if rank == 0:
            start = time.monotonic()
            got = win.get(1, 0, 4)
            got.wait(timeout=20)
            assert np.all(got.result == 7.0), got.result
            win.put(1, np.array([42.0], np.float32), offset=299_999).wait(timeout=20)
            out["round_trip_s"] = time.monotonic() - start
        pg.barrier().wait(timeout=20)
    out["errors"] = argument_errors(pg, win)
    out["creation_dtype"] = creation_dtype_mismatch(pg)
    out["invalidated"] = invalidation(pg, win)
    pg.barrier().wait(timeout=20)
    return out


def argument_errors(pg, win) -> dict:
    """Bad calls raise CollectiveArgumentError at once; nothing is sent or recorded."""
    n, r = pg.world_size, pg.rank
    errors = {}
    small_win = pg.window(np.zeros(size_of(r), np.float32))
    last = n - 1  # rank n-1 has the largest window; rank 0 the smallest

    expect = expecter(errors)

    records = len(dist.recorder().snapshot("x")["records"])
    f32 = np.ones(8, np.float32)
    # fits into the largest window, not into rank 0's: the target's size counts
    expect("bounds", lambda: small_win.put(0, f32, offset=size_of(0) - 4))
    small_win.put(last, f32, offset=size_of(last) - 8).wait(timeout=20)
    expect("get_bounds", lambda: small_win.get(0, 10, size_of(0)))
    expect("dtype", lambda: small_win.put(0, np.ones(2, np.float64)))
    expect("rank", lambda: small_win.put(n, f32))
    expect("negative", lambda: small_win.accumulate(0, f32, offset=-1))
    expect("avg", lambda: small_win.accumulate(0, f32, op="avg"))
    expect("op", lambda: small_win.accumulate(0, f32, op="mean"))
    expect("out", lambda: small_win.get(0, 0, 4, out=np.zeros(5, np.float32)))
    expect("out_dtype", lambda: small_win.get(0, 0, 4, out=np.zeros(4, np.int32)))
    expect("slot", lambda: small_win.signal(0, slot=-1))
    expect("value", lambda: small_win.wait_signal(value=0))
    expect("noncontig", lambda: small_win.put(0, np.ones((4, 4), np.float32)[:, 1]))
    records_after = len(dist.recorder().snapshot("x")["records"])
    assert records_after == records + 1, "a bad call was recorded (%d new records)" % (
        records_after - records)
    pg.barrier().wait(timeout=20)
    small_win.free()
    return errors


def creation_dtype_mismatch(pg) -> str:
    dtype = np.float64 if pg.rank == pg.world_size - 1 else np.float32
    try:
        pg.window(np.zeros(4, dtype))
    except dist.CollectiveArgumentError as err:
        return str(err)
    raise AssertionError("no dtype mismatch error")


def invalidation(pg, win) -> dict:
    """A pending operation and every later call fail with WindowInvalidated; a peer's
    operation on a freed window fails; a new window works."""
    n, r = pg.world_size, pg.rank
    out = {}
    if n > 1:
        # rank 1 holds its window's lock, so rank 0's get stays pending until it is
        # invalidated (then rank 1's late reply is dropped)
        if r == 1:
            win._memory.lock.acquire()
        pg.barrier().wait(timeout=20)
        if r == 0:
            pending = win.get(1, 0, 4)
            time.sleep(0.2)
            assert not pending.is_completed(), pending
            win.invalidate("test")
            try:
                pending.wait(timeout=5)
            except dist.WindowInvalidated as err:
                out["pending"] = str(err)
        pg.barrier().wait(timeout=20)
        if r == 1:
            win._memory.lock.release()
    win.invalidate("test")  # a second call (rank 0) changes nothing
    for name, call in (("put", lambda: win.put(0, np.ones(1, np.float32))),
                       ("wait_signal", lambda: win.wait_signal(timeout=1)),
                       ("signal", lambda: win.signal(0))):
        try:
            call()
        except dist.WindowInvalidated as err:
            out[name] = str(err)
    # a new window works; rank 1 frees its part, then rank 0's put to it is refused
    fresh = pg.window(np.zeros(4, np.int64))
    if n > 1:
        if r == 1:
            fresh.free()
        pg.barrier().wait(timeout=20)
        if r == 0:
            try:
                fresh.put(1, np.ones(4, np.int64)).wait(timeout=20)
            except dist.WindowInvalidated as err:
                out["freed_remote"] = str(err)
            fresh.put(n - 1 if n > 2 else 0, np.arange(4, dtype=np.int64)).wait(timeout=20)
            fresh.signal(n - 1 if n > 2 else 0).wait(timeout=20)
        if r == (n - 1 if n > 2 else 0):
            fresh.wait_signal(timeout=20)
            assert np.array_equal(fresh.local, np.arange(4)), fresh.local
        pg.barrier().wait(timeout=20)
    with fresh:
        pass
    assert fresh not in pg._windows
    return out


@scenario
def window_death(rank, world, addr, args):
    """The last rank dies (SIGKILL) while the others have an operation pending on it and
    wait for its signal: both fail with PeerFailure naming it, nothing hangs."""
    victim = world - 1
    pg = join(rank, world, addr, timeout=20.0)
    win = pg.window(np.zeros(16, np.float32))
    if rank == victim:
        win._memory.lock.acquire()  # its receiver thread stalls on our puts until death
        pg.barrier().wait(timeout=20)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    pg.barrier().wait(timeout=20)
    start = time.monotonic()
    pending = win.put(victim, np.ones(16, np.float32))
    result = {}
    try:
        win.wait_signal(timeout=20)  # the victim never signals
    except dist.DistributedError as err:
        result["wait_signal"] = {"type": type(err).__name__, "rank": getattr(err, "rank", None)}
    try:
        pending.wait(timeout=20)
    except dist.DistributedError as err:
        result["pending"] = {"type": type(err).__name__, "rank": getattr(err, "rank", None)}
    try:
        win.get(victim, 0, 4).wait(timeout=20)
    except dist.DistributedError as err:
        result["later"] = type(err).__name__
    result["elapsed"] = time.monotonic() - start
    return result


@scenario
def window_timeout(rank, world, addr, args):
    """2 ranks: rank 1's window is stuck (its lock held), so rank 0's put misses its
    deadline: CollectiveTimeout naming rank 1, and the group is aborted, as for p2p."""
    pg = join(rank, world, addr, timeout=20.0)
    win = pg.window(np.zeros(16, np.float32))
    if rank == 1:
        win._memory.lock.acquire()
        pg.barrier().wait(timeout=20)
        time.sleep(2.0)  # past rank 0's deadline
        win._memory.lock.release()  # its receiver thread reads on: rank 0's abort notice
        deadline = time.monotonic() + 15
        while not pg.is_aborted:
            assert time.monotonic() < deadline, "rank 0's abort never arrived"
            time.sleep(0.02)
        return {"aborted": True}
    pg.barrier().wait(timeout=20)
    start = time.monotonic()
    try:
        win.put(1, np.ones(16, np.float32), timeout=0.5).wait(timeout=20)
    except dist.CollectiveTimeout as err:
        out = {"error": "CollectiveTimeout", "rank": err.rank, "message": str(err),
               "elapsed": time.monotonic() - start}
    try:
        win.signal(1).wait(timeout=5)
    except dist.DistributedError as err:
        out["later"] = type(err).__name__
    return out


if __name__ == "__main__":
    main()
