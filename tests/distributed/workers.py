"""Scenarios run by each rank of a multiprocess test (see harness.py).

    python workers.py SCENARIO RANK WORLD STORE_ADDR RESULT_JSON ARGS_JSON

Each scenario checks its results against numpy on the rank itself (every rank can
rebuild every rank's input from the seed) and returns JSON-able data for the test.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import ml_dtypes
import numpy as np

import kiln.distributed as dist
from kiln.ir import dtypes as kd

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def join(rank, world, addr, timeout=20.0, **kw):
    return dist.init_process_group(rank=rank, world_size=world, store=addr,
                                   token=os.environ["KILN_TOKEN"], timeout=timeout,
                                   host_store=kw.pop("host_store", False), **kw)


def expecter(errors: dict):
    """expect(name, fn): fn() must raise CollectiveArgumentError; its text goes to errors."""
    def expect(name, fn):
        try:
            fn()
        except dist.CollectiveArgumentError as err:
            errors[name] = str(err)
        else:
            raise AssertionError("%s: no error" % name)
    return expect


# -- inputs and references ---------------------------------------------------------------
LOWP = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float16"}


def make(dt: kd.DType, shape, seed: int, op: str = "sum") -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    if dt.is_bool:
        vals = rng.integers(0, 2, size).astype(bool)
    elif dt.is_integer:
        info = np.iinfo(dt.np_dtype)
        vals = rng.integers(info.min, info.max, size, endpoint=True, dtype=dt.np_dtype)
    elif dt.name in LOWP:  # small integers: every partial sum/product is exact
        choices = [-1.0, 1.0, 2.0] if op == "prod" else [-1.0, 0.0, 1.0]
        vals = rng.choice(choices, size)
    elif dt.is_complex:
        vals = rng.standard_normal(size) + 1j * rng.standard_normal(size)
    else:
        vals = rng.standard_normal(size)
    return np.asarray(vals).astype(dt.np_dtype).reshape(shape)


def ref_reduce(arrays, op: str, dt: kd.DType) -> np.ndarray:
    """Sequential reduction in rank order (integers wrap exactly as numpy does)."""
    if dt.is_bool:
        fn = {"sum": np.logical_or, "max": np.logical_or, "prod": np.logical_and,
              "min": np.logical_and}[op]
        acc = arrays[0].copy()
        for a in arrays[1:]:
            fn(acc, a, out=acc)
        return acc
    if dt.is_integer:
        fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        acc = arrays[0].copy()
        for a in arrays[1:]:
            fn(acc, a, out=acc)
        return acc
    wide = np.complex128 if dt.is_complex else np.float64
    stack = np.stack([a.astype(wide) for a in arrays])
    out = {"sum": stack.sum(0), "avg": stack.mean(0), "prod": stack.prod(0),
           "min": stack.min(0) if not dt.is_complex else None,
           "max": stack.max(0) if not dt.is_complex else None}[op]
    return out


def check(got: np.ndarray, want: np.ndarray, dt: kd.DType, what: str) -> None:
    assert got.dtype == dt.np_dtype, (what, got.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if dt.is_bool or dt.is_integer:
        if not np.array_equal(got, want):
            raise AssertionError("%s: got %s want %s" % (what, got.ravel()[:8], want.ravel()[:8]))
        return
    wide = np.complex128 if dt.is_complex else np.float64
    eps = {"float32": 1e-5, "float64": 1e-12, "complex64": 1e-5}.get(dt.name)
    if eps is None:  # low precision: exact inputs; avg may round once
        eps = float(ml_dtypes.finfo(dt.np_dtype).eps)
    g, w = got.astype(wide), np.asarray(want).astype(wide)
    if not np.allclose(g, w, rtol=2 * eps, atol=2 * eps):
        raise AssertionError("%s: got %s want %s" % (what, g.ravel()[:8], w.ravel()[:8]))


def ops_for(dt: kd.DType) -> list[str]:
    ops = ["sum", "prod", "min", "max"]
    if dt.is_complex:
        ops = ["sum", "prod"]
    if dt.is_inexact:
        ops.append("avg")
    return ops


# -- scenarios ---------------------------------------------------------------------------
def run_collectives(pg, dts, sizes, seed, tag=""):
    """Every collective and reduce op, all outstanding at once, then checked."""
    n, r = pg.world_size, pg.rank
    checks, works = [], []
    for di, dt in enumerate(dts):
        for size in sizes:
            shape = (size,) if size != 21 else (3, 7)
            base = seed * 1000 + di * 10 + sizes.index(size)
            what = "%s%s size %d" % (tag, dt.name, size)
            for op in ops_for(dt):
                x = make(dt, shape, base * 31 + r, op)
                want = ref_reduce([make(dt, shape, base * 31 + q, op) for q in range(n)], op, dt)
                works.append(pg.all_reduce(x, op=op))
                checks.append((x, want, "all_reduce %s %s" % (op, what)))
            b = make(dt, shape, base + r)
            works.append(pg.broadcast(b, src=n - 1))
            checks.append((b, make(dt, shape, base + n - 1), "broadcast " + what))
            dst = 1 % n
            x = make(dt, shape, base + 7 + r)
            works.append(pg.reduce(x, dst=dst, op="max" if not dt.is_complex else "sum"))
            inputs = [make(dt, shape, base + 7 + q) for q in range(n)]
            want = ref_reduce(inputs, "max" if not dt.is_complex else "sum", dt) if r == dst \
                else inputs[r]
            checks.append((x, want, "reduce " + what))
            inputs = [make(dt, shape, base + 11 + q) for q in range(n)]
            out = np.empty((n,) + shape, dt.np_dtype)
            works.append(pg.all_gather(out, inputs[r]))
            checks.append((out, np.stack(inputs), "all_gather " + what))
            outs = [np.empty(shape, dt.np_dtype) for _ in range(n)]
            works.append(pg.all_gather(outs, inputs[r]))
            for q in range(n):
                checks.append((outs[q], inputs[q], "all_gather(list) %s slot %d" % (what, q)))
            gout = np.empty((n,) + shape, dt.np_dtype) if r == 0 else None
            works.append(pg.gather(inputs[r], gout, dst=0))
            if r == 0:
                checks.append((gout, np.stack(inputs), "gather " + what))
            chunks = make(dt, (n,) + shape, base + 13)
            sout = np.empty(shape, dt.np_dtype)
            works.append(pg.scatter(sout, chunks if r == n - 1 else None, src=n - 1))
            checks.append((sout, chunks[r], "scatter " + what))
            rs_op = "avg" if dt.is_inexact else "sum"
            big = [make(dt, (n,) + shape, base * 17 + q, rs_op) for q in range(n)]
            rout = np.empty(shape, dt.np_dtype)
            works.append(pg.reduce_scatter(rout, big[r], op=rs_op))
            checks.append((rout, ref_reduce([b[r] for b in big], rs_op, dt),
                           "reduce_scatter %s %s" % (rs_op, what)))
            rows = lambda src, dst: (src + dst + size) % 3  # noqa: E731 uneven, some empty
            a2a_in = [make(dt, (sum(rows(q, j) for j in range(n)), 2), base + 19 + q)
                      for q in range(n)]
            a2a_out = np.empty((sum(rows(i, r) for i in range(n)), 2), dt.np_dtype)
            works.append(pg.all_to_all(a2a_out, a2a_in[r], [rows(i, r) for i in range(n)],
                                       [rows(r, j) for j in range(n)]))
            pieces = []
            for i in range(n):
                start = sum(rows(i, j) for j in range(r))
                pieces.append(a2a_in[i][start:start + rows(i, r)])
            checks.append((a2a_out, np.concatenate(pieces), "all_to_all " + what))
            p2p_in = make(dt, shape, base + 23 + r)
            p2p_out = np.empty(shape, dt.np_dtype)
            works.append(pg.send(p2p_in, dst=(r + 1) % n, tag=di))
            works.append(pg.recv(p2p_out, src=(r - 1) % n, tag=di))
            checks.append((p2p_out, make(dt, shape, base + 23 + (r - 1) % n), "send/recv " + what))
        works.append(pg.barrier())
    for w in works:
        w.wait(timeout=30)
    for got, want, what in checks:
        check(got, want, kd.from_numpy(got.dtype), what)
    return len(works)


@scenario
def collectives(rank, world, addr, args):
    pg = join(rank, world, addr)
    dts = [kd.dtype(n) for n in args.get("dtypes", [d.name for d in kd.ALL_DTYPES])]
    count = 0
    for mode, (ring, seg) in enumerate([(256 << 10, 1 << 20), (64, 40)]):
        # mode 1 forces the ring/chain algorithms with many small pipeline segments
        pg.backend.ring_bytes, pg.backend.segment_bytes = ring, seg
        count += run_collectives(pg, dts, args.get("sizes", [0, 1, 21, 1003]), mode,
                                 tag="mode%d " % mode)
    return {"works": count}


@scenario
def large(rank, world, addr, args):
    """Sizes past the default thresholds (ring, chain, pipelined segments)."""
    pg = join(rank, world, addr)
    n = pg.world_size
    x = np.arange(3_000_017, dtype=np.float32) * (rank + 1)
    pg.all_reduce(x).wait()
    check(x, np.arange(3_000_017, dtype=np.float64) * n * (n + 1) / 2, kd.float32, "ring")
    y = np.full(1_000_003, rank, np.float64)
    pg.broadcast(y, src=n - 1).wait()
    assert np.all(y == n - 1)
    z = np.full(500_001, rank + 1, np.int64)
    pg.reduce(z, dst=0, op="prod").wait()
    want = np.prod(np.arange(1, n + 1)) if rank == 0 else rank + 1
    assert np.all(z == want)
    inp = np.arange(n * 400_000, dtype=np.float32) + rank
    out = np.empty(400_000, np.float32)
    pg.reduce_scatter(out, inp).wait()
    seg = np.arange(rank * 400_000, (rank + 1) * 400_000, dtype=np.float64)
    check(out, seg * n + n * (n - 1) / 2, kd.float32, "reduce_scatter ring")
    gat = np.empty((n, 300_000), np.float32)
    pg.all_gather(gat, np.full(300_000, rank, np.float32)).wait()
    assert all(np.all(gat[q] == q) for q in range(n))
    # just below the ring threshold: the direct lanes' largest messages (read in parts)
    m = np.full(60_000, rank + 1.0, np.float32)
    b = np.full(64_000, rank, np.int32)
    works = [pg.all_reduce(m), pg.broadcast(b, src=n - 1), pg.all_reduce(m, op="max")]
    for w in works:
        w.wait(timeout=30)
    assert np.all(m == n * (n + 1) / 2) and np.all(b == n - 1), (m[:4], b[:4])
    return {}


@scenario
def basic(rank, world, addr, args):
    """Bad input, splits, the SIGUSR1 dump and sequence numbers on 2..4 ranks."""
    pg = join(rank, world, addr)
    errors = {}
    expect = expecter(errors)

    f32 = np.zeros(8, np.float32)
    records_before = len(dist.recorder().snapshot("x")["records"])
    expect("dtype", lambda: pg.all_reduce(np.zeros(3, "U2")))
    expect("noncontig", lambda: pg.all_reduce(np.zeros((4, 4), np.float32)[:, 1]))
    expect("readonly", lambda: pg.broadcast(np.frombuffer(b"\0" * 16, np.float32)))
    expect("rank", lambda: pg.broadcast(f32, src=world))
    expect("avg_int", lambda: pg.all_reduce(np.zeros(3, np.int32), op="avg"))
    expect("min_complex", lambda: pg.all_reduce(np.zeros(3, np.complex64), op="min"))
    expect("bad_op", lambda: pg.all_reduce(f32, op="mean"))
    expect("gather_size", lambda: pg.all_gather(np.zeros(3, np.float32), f32))
    expect("gather_dtype", lambda: pg.all_gather(np.zeros(8 * world, np.float64), f32))
    expect("rs_size", lambda: pg.reduce_scatter(f32, np.zeros(5, np.float32)))
    expect("a2a_split", lambda: pg.all_to_all(f32, f32, [8] + [0] * (world - 1), [1] * world))
    expect("send_self", lambda: pg.send(f32, dst=rank))
    expect("tag", lambda: pg.send(f32, dst=(rank + 1) % world, tag=-1))
    expect("tag_reserved", lambda: pg.recv(f32, src=(rank + 1) % world, tag=0xFFFFFF00))
    expect("split", lambda: pg.split([0, 0]))
    assert len(dist.recorder().snapshot("x")["records"]) == records_before, "a bad call recorded"
    # nothing was sent: the first real collective still lines up (seq 0 on every rank)
    x = np.full(5, rank + 1.0, np.float32)
    w = pg.all_reduce(x)
    assert w.seq == 0, w.seq
    w.wait(timeout=10)
    assert np.all(x == world * (world + 1) / 2), x
    # splits: explicit ranks, color/key (reversed order), and nesting
    evens = pg.split(list(range(0, world, 2)))
    assert (evens is None) == (rank % 2 == 1)
    by_color = pg.split(color=rank % 2, key=-rank)
    assert by_color.world_size == len(range(rank % 2, world, 2))
    assert by_color.global_ranks == sorted(range(rank % 2, world, 2), reverse=True)
    works = []
    if evens is not None:
        y = np.array([rank], np.int64)
        works.append((evens.all_reduce(y), y, sum(range(0, world, 2))))
        solo = evens.split(color=0 if evens.rank == 0 else None)
        if solo is not None:
            z = np.array([7], np.int64)
            works.append((solo.all_reduce(z), z, 7))
    c = np.array([rank + 10], np.int64)
    works.append((by_color.all_reduce(c, op="max"), c, max(range(rank % 2, world, 2)) + 10))
    w2 = np.array([1], np.int64)
    works.append((pg.all_reduce(w2), w2, world))
    for work, buf, want in works:
        work.wait(timeout=10)
        assert buf[0] == want, (buf, want)
    # a SIGUSR1 dump
    os.kill(os.getpid(), signal.SIGUSR1)
    path = os.path.join(os.environ["KILN_FR_DIR"], "kiln_fr_rank%d.json" % rank)
    deadline = time.monotonic() + 5
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    dump = json.load(open(path))
    pg.barrier().wait(timeout=10)
    return {"errors": errors, "dump_reason": dump["reason"], "groups": sorted(dump["groups"]),
            "ops": [r["op"] for r in dump["records"]]}


def _slow_watcher(delay: float) -> None:
    """This process's dump watcher notices a request only `delay` s after it was posted
    (as a CPU-starved one would): reading it then needs the store still up."""
    from kiln.distributed import dump_requests

    read = dump_requests.DumpWatcher._next_request

    def late(self):
        if not self._store.check([dump_requests.REQUEST_KEY % self._next]):
            time.sleep(0.05)
            return None
        time.sleep(delay)
        return read(self)

    dump_requests.DumpWatcher._next_request = late


@scenario
def hang(rank, world, addr, args):
    """Rank 1 never calls the third all_reduce: the others time out, all ranks dump.
    The ranks that time out leave at once. With `own_store`, rank 0 hosts the store
    (at args["address"]; under MPI, shared over MPI): it must stay until rank 1 has read
    the dump request from it (the store host's linger, kiln/distributed/dump_requests.py)."""
    own = args.get("own_store", False)
    if rank == 1 and args.get("slow_watcher"):
        _slow_watcher(args["slow_watcher"])
    # the short deadline is the third call's own: the first two calls (and the heartbeat,
    # paced by the group's timeout) must not trip on a loaded machine
    pg = join(rank, world, args.get("address") if own else addr, host_store=None if own else False,
              timeout=20.0)
    x = np.ones(4, np.float32)
    for _ in range(2):  # these must succeed even on a loaded machine
        pg.all_reduce(x, timeout=20).wait(timeout=30)
    if rank == 1:
        path = os.path.join(os.environ["KILN_FR_DIR"], "kiln_fr_rank1.json")
        deadline = time.monotonic() + 15
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)  # stuck in "user code"; the dump comes from the watcher
        return {"dumped": os.path.exists(path)}
    start = time.monotonic()
    work = pg.all_reduce(x, timeout=args.get("timeout", 1.5))
    try:
        work.wait(timeout=20)
    except dist.CollectiveTimeout as err:
        result = {"error": "CollectiveTimeout", "elapsed": time.monotonic() - start,
                  "message": str(err)}
    else:
        raise AssertionError("no timeout")
    return result


@scenario
def late_rank(rank, world, addr, args):
    """The last rank starts `delay` s after the others, longer than the group's timeout:
    the first rendezvous waits for it (its own deadline, 60 s at least)."""
    if rank == world - 1:
        time.sleep(args["delay"])
    pg = join(rank, world, addr, timeout=args["timeout"])
    x = np.full(3, rank + 1, np.int64)
    pg.all_reduce(x).wait(timeout=30)
    assert np.all(x == world * (world + 1) // 2), x
    return {"timeout": pg.timeout}


@scenario
def death(rank, world, addr, args):
    """Rank `victim` dies mid-job; the others' Works fail with PeerFailure naming it."""
    victim = args.get("victim", world - 1)
    pg = join(rank, world, addr, timeout=15.0)
    x = np.ones(1000, np.float32)
    pg.all_reduce(x).wait(timeout=10)
    if rank == victim:
        time.sleep(0.2)
        os._exit(3)
    start = time.monotonic()
    works = [pg.all_reduce(np.ones(args.get("size", 1000), np.float32)) for _ in range(3)]
    result = []
    for w in works:
        try:
            w.wait(timeout=20)
            result.append(None)
        except dist.DistributedError as err:
            result.append({"type": type(err).__name__, "rank": getattr(err, "rank", None),
                           "message": str(err)})
    return {"errors": result, "elapsed": time.monotonic() - start}


@scenario
def mismatch(rank, world, addr, args):
    """Three sub-groups; in each, rank 1 gets one collective wrong (size, dtype, op)."""
    pg = join(rank, world, addr, timeout=30.0)
    outcomes = {}
    for kind in ("size", "dtype", "op"):
        sub = pg.split(color=0, timeout=20)
        size = 1004 if (kind == "size" and rank == 1) else 1000
        dtype = np.int32 if (kind == "dtype" and rank == 1) else np.float32
        sub.all_reduce(np.ones(8, np.float32), timeout=10).wait(timeout=30)  # a good one first
        if kind == "op" and rank == 1:
            work = sub.broadcast(np.ones(size, dtype), src=0, timeout=10)
        else:
            work = sub.all_reduce(np.ones(size, dtype), timeout=10)
        try:
            work.wait(timeout=40)
            outcomes[kind] = None
        except dist.DistributedError as err:
            outcomes[kind] = type(err).__name__
        pg.barrier().wait(timeout=40)
    pg.dump_flight_recorder()
    pg.barrier().wait(timeout=40)
    return outcomes


@scenario
def rank0_store(rank, world, addr, args):
    """Rank 0 hosts the store itself at the address every rank was given."""
    pg = join(rank, world, args["address"], host_store=None)
    x = np.full(3, rank, np.int64)
    pg.all_reduce(x).wait(timeout=10)
    assert np.all(x == sum(range(world)))
    pg.barrier().wait(timeout=10)
    return {}


@scenario
def compiled_collectives(rank, world, addr, args):
    """A kn.compile'd step with collectives and compute; checked against numpy."""
    import kiln as kn

    C = kn.collectives
    pg = join(rank, world, addr)
    xs = [np.random.default_rng(100 + r).standard_normal((4, 6)).astype(np.float32)
          for r in range(world)]
    w = np.random.default_rng(7).standard_normal((6, 6)).astype(np.float32)

    def step(x, w):
        g = C.all_reduce(x * 2.0, op="sum")
        h = kn.tanh(x @ w)  # independent of g: runs while the all_reduce is in flight
        return (g + h, C.all_gather(h, dim=0), C.reduce_scatter(h, op="max", dim=1),
                C.broadcast(x, src=world - 1), C.all_to_all(x, split_dim=0, concat_dim=1))

    compiled = kn.compile(step)
    hs = [np.tanh(x.astype(np.float64) @ w) for x in xs]
    k = 6 // world
    want = [sum(2.0 * x.astype(np.float64) for x in xs) + hs[rank], np.concatenate(hs, 0),
            np.max(np.stack(hs), 0)[:, rank * k:(rank + 1) * k], xs[world - 1],
            np.concatenate([x[rank * 4 // world:(rank + 1) * 4 // world] for x in xs], 1)]
    for _ in range(2):  # the second call reuses the cached program and its buffers
        got = [t.numpy() for t in compiled(xs[rank], w)]
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape, (i, a.shape, b.shape)
            assert np.allclose(a, b, rtol=1e-4, atol=1e-5), (i, np.abs(a - b).max())
    eager = [t.numpy() for t in step(kn.tensor(xs[rank]), kn.tensor(w))]
    for a, b in zip(eager, want):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5)
    program = compiled.compiled_graphs()[0].program.format()
    pg.barrier().wait(timeout=10)
    return {"program": program, "collectives": recorder_ops()}


# -- the fast path: small calls started by the caller (process_group's docstring) -------
def _eager(pg, op, *bufs) -> bool:
    return pg.backend.eager(op, *bufs) is not None


@scenario
def fast_order(rank, world, addr, args):
    """Small (eager) and large (ring) calls interleaved, blocking and nonblocking, and
    every way of finishing a parked call; results checked, so a call that ran out of
    order would show up as a wrong sum or a mismatch."""
    pg = join(rank, world, addr)
    n = pg.world_size
    small = np.full(256, rank + 1.0, np.float32)
    assert _eager(pg, "all_reduce", small), "a 1 KB all_reduce should start eagerly"
    big = np.arange(300_000, dtype=np.float32) + rank
    assert not _eager(pg, "all_reduce", big)
    tri = n * (n + 1) / 2  # sum of rank + 1 over ranks
    # 1. alternating, each waited at once
    for i in range(20):
        x = np.full(100 + i, rank + 1.0, np.float32)
        pg.all_reduce(x).wait()
        assert np.all(x == tri), (i, x[:4])
        y = np.arange(300_000 + i, dtype=np.float64) * (rank + 1)
        pg.all_reduce(y).wait()
        check(y, np.arange(300_000 + i, dtype=np.float64) * tri, kd.float64, "big %d" % i)
    # 2. all outstanding at once: the first starts eagerly, the others queue behind it
    works, checks = [], []
    for i in range(30):
        if i % 3 == 2:
            y = np.arange(70_000, dtype=np.float32) + rank + i  # 280 KB: ring
            works.append(pg.all_reduce(y, op="max"))
            checks.append((y, np.arange(70_000, dtype=np.float32) + n - 1 + i))
        else:
            x = np.full(64, float(rank * 10 + i), np.float64)
            works.append(pg.all_reduce(x, op="sum"))
            checks.append((x, np.full(64, float(10 * n * (n - 1) / 2 + n * i))))
    b = np.full(32, rank, np.int64)
    works.append(pg.broadcast(b, src=n - 1))
    out = np.empty((n, 8), np.int32)
    works.append(pg.all_gather(out, np.full(8, rank, np.int32)))
    for w in reversed(works):  # the last first: runs every earlier one, in order
        w.wait(timeout=30)
    for got, want in checks:
        assert np.array_equal(got, want), (got[:4], want[:4])
    assert np.all(b == n - 1) and all(np.all(out[q] == q) for q in range(n))
    # 3. a parked call finished by polling, by a bounded wait, by the next call, by a
    # callback (the progress thread adopts it) and by nobody (adopted after a tick)
    x = np.full(16, rank + 1.0, np.float32)
    w = pg.all_reduce(x)
    deadline = time.monotonic() + 20
    while not w.is_completed():
        assert time.monotonic() < deadline
    assert w.exception() is None and np.all(x == tri)
    x[:] = rank + 1.0
    w = pg.all_reduce(x)
    while True:
        try:
            w.wait(timeout=0.001)
            break
        except dist.CollectiveTimeout:
            assert time.monotonic() < deadline
    assert np.all(x == tri)
    x[:] = rank + 1.0
    w1 = pg.all_reduce(x)
    z = np.full(16, 2.0 * (rank + 1), np.float32)
    pg.all_reduce(z).wait()
    assert w1.is_completed() and np.all(x == tri) and np.all(z == 2 * tri)
    x[:] = rank + 1.0
    seen = []
    pg.all_reduce(x).add_done_callback(lambda work: seen.append(work.exception()))
    while not seen:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert seen == [None] and np.all(x == tri)
    x[:] = rank + 1.0
    w = pg.all_reduce(x)
    while not w._done:  # nobody waits (or polls): the progress thread finishes it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert np.all(x == tri), (w, x[:4])
    # 4. the largest direct-lane messages (240 KB), parked and read in parts
    m = np.full(60_000, rank + 1.0, np.float32)
    assert _eager(pg, "all_reduce", m)
    w = pg.all_reduce(m)
    pg.all_reduce(m, op="max").wait()
    assert w._done and np.all(m == tri), m[:4]
    # 5. every other small collective on the fast path, and an empty one
    g = np.empty((n, 3), np.float32)
    r = np.empty(3, np.float32)
    s = np.empty(3, np.float32)
    works = [pg.barrier(), pg.all_gather(g, np.full(3, rank, np.float32)),
             pg.reduce_scatter(r, np.full((n, 3), rank + 1.0, np.float32)),
             pg.scatter(s, np.arange(3 * n, dtype=np.float32).reshape(n, 3) if rank == 0
                        else None, src=0),
             pg.all_reduce(np.empty(0, np.float32)), pg.barrier()]
    for w in works:
        w.wait(timeout=20)
    assert all(np.all(g[q] == q) for q in range(n)) and np.all(r == tri)
    assert np.all(s == np.arange(3 * rank, 3 * rank + 3))
    records = [rec for rec in dist.recorder().snapshot("t")["records"]
               if rec["group"] == "world"]
    # started here or queued, every record names this function and its line as caller
    where = {(rec["frames"][0]["function"], rec["frames"][0]["source"].split("(")[0])
             for rec in records}
    return {"records": len(records), "states": sorted({rec["state"] for rec in records}),
            "where": sorted(where)}


@scenario
def fast_errors(rank, world, addr, args):
    """2 ranks, a fresh sub-group per case: the fast path's failures."""
    pg = join(rank, world, addr, timeout=30.0)
    outcomes = {}

    def outcome(work, timeout=None):
        try:
            work.wait() if timeout is None else work.wait(timeout=timeout)
            return None
        except dist.DistributedError as err:
            return type(err).__name__
    for kind in ("size", "dtype", "op", "lanes", "lanes_peek", "timeout", "timeout_unwatched"):
        sub = pg.split(color=0, timeout=20)
        sub.timeout = 1.0 if kind.startswith("timeout") else 10.0
        x = np.ones(8, np.float32)
        sub.all_reduce(x).wait(timeout=30)  # a good one first
        assert x[0] == 2
        odd = rank == 1
        start = time.monotonic()
        if kind == "size":
            work = sub.all_reduce(np.ones(1004 if odd else 1000, np.float32))
        elif kind == "dtype":
            work = sub.all_reduce(np.ones(1000, np.int32 if odd else np.float32))
        elif kind == "op":
            work = sub.broadcast(np.ones(1000, np.float32), src=0) if odd else \
                sub.all_reduce(np.ones(1000, np.float32))
        elif kind == "lanes":  # a direct-lane call against a ring one: same seq
            work = sub.all_reduce(np.ones(400_000 if odd else 1000, np.float32))
        elif kind == "lanes_peek":  # the root sends on the direct lane and is done; rank
            # 0 waits on the threaded lane for a chain broadcast and must look there
            work = sub.broadcast(np.ones(1000 if odd else 400_000, np.float32), src=1)
        elif odd:  # rank 1 never joins; rank 0 times out, then meets it here
            pg.barrier().wait(timeout=30)
            continue
        else:
            work = sub.all_reduce(np.ones(1000, np.float32))
            while kind == "timeout_unwatched" and not work._done:
                # nobody waits: the progress thread adopts it and fails it at its deadline
                assert time.monotonic() < start + 10, work
                time.sleep(0.01)
        outcomes[kind] = [outcome(work, timeout=20 if kind == "op" else None),
                          round(time.monotonic() - start, 2)]
        later = sub.all_reduce(np.ones(4, np.float32))  # the group is aborted now
        outcomes[kind].append(outcome(later, timeout=5))
        pg.barrier().wait(timeout=30)
    return outcomes


@scenario
def fast_death(rank, world, addr, args):
    """2 ranks: rank 1 dies while rank 0 has small calls parked and queued."""
    pg = join(rank, world, addr, timeout=15.0)
    x = np.ones(256, np.float32)
    pg.all_reduce(x).wait(timeout=10)
    if rank == 1:
        time.sleep(0.3)
        os._exit(3)
    start = time.monotonic()
    works = [pg.all_reduce(np.ones(256, np.float32)) for _ in range(3)]
    result = []
    for i, w in enumerate(works):
        try:
            w.wait() if i == 0 else w.wait(timeout=20)
            result.append(None)
        except dist.DistributedError as err:
            result.append({"type": type(err).__name__, "rank": getattr(err, "rank", None),
                           "message": str(err)})
    return {"errors": result, "elapsed": time.monotonic() - start}


def recorder_ops():
    """The ops of this rank's Flight Recorder records, in issue order."""
    from kiln.distributed.flight_recorder import recorder

    return [r["op"] for r in recorder().snapshot("test")["records"]]


@scenario
def hung_peer(rank, world, addr, args):
    """Rank `victim` stops itself (SIGSTOP) mid-job; the others' long-deadline call fails
    with PeerFailure from the heartbeat, long before its own 30 s deadline."""
    import signal

    victim = args.get("victim", world - 1)
    pg = join(rank, world, addr, timeout=args.get("timeout", 8.0))
    x = np.ones(4, np.float32)
    pg.all_reduce(x).wait(timeout=30)
    if rank == victim:
        import subprocess

        # a watchdog wakes this process once the others must have given up on it
        subprocess.Popen(["sh", "-c", "sleep %s; kill -CONT %d" % (args.get("stopped_for", 7),
                                                                   os.getpid())])
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"resumed": True}
    start = time.monotonic()
    work = pg.all_reduce(x, timeout=30)
    try:
        work.wait(timeout=40)
    except dist.PeerFailure as err:
        return {"error": "PeerFailure", "rank": err.rank, "elapsed": time.monotonic() - start,
                "message": str(err)}
    raise AssertionError("the hung peer was not detected")


def main() -> None:
    name, rank, world, addr, out, args = sys.argv[1:7]
    try:
        data = SCENARIOS[name](int(rank), int(world), addr, json.loads(args))
        result = {"ok": True, "data": data}
    except BaseException as err:  # reported to the test, which fails with it
        result = {"ok": False, "type": type(err).__name__, "error": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

