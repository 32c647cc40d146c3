"""backend "nccl" over the fake NCCL: ProcessGroups of N ranks (threads of this process)
whose NcclBackend exchanged the unique id through kiln's authenticated store; every
collective and p2p against numpy."""

from __future__ import annotations

import secrets
import threading

import ml_dtypes
import numpy as np
import pytest

from kiln.distributed import nccl_api as api
from kiln.distributed.errors import NcclError
from kiln.distributed.nccl_backend import NcclBackend
from kiln.distributed.process_group import ProcessGroup
from kiln.distributed.store import Store, StoreServer
from tests.distributed.fake_nccl import FakeNccl, FakeWorld


def run_ranks(n, fn, timeout=30.0):
    out, errs = [None] * n, [None] * n

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test thread
            errs[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish"
    for e in errs:
        if e is not None:
            raise e
    return out


@pytest.fixture
def groups():
    made = []

    def make(n):
        token = secrets.token_hex(16)
        server = StoreServer("127.0.0.1", 0, token)
        world = FakeWorld(init_polls=2)
        apis = [FakeNccl(world) for _ in range(n)]

        def join(r):
            store = Store(server.address, token)
            backend = NcclBackend.rendezvous(store, "pg/nccltest/e0", r, n, token, 20.0,
                                             nccl=apis[r])
            return ProcessGroup(backend, name="nccltest", rank=r, world_size=n,
                                global_ranks=list(range(n)), store=store, token=token,
                                timeout=20.0)

        pgs = run_ranks(n, join)
        made.append((server, pgs))
        return pgs, apis

    yield make
    for server, pgs in made:
        for pg in pgs:
            pg.backend.abort(RuntimeError("test over"))
        server.close()


def test_unique_id_goes_through_the_store(groups):
    pgs, apis = groups(3)
    assert apis[0].log.count("ncclGetUniqueId") == 1
    assert all(a.log.count("ncclGetUniqueId") == 0 for a in apis[1:])
    assert [pg.backend.rank for pg in pgs] == [0, 1, 2]
    for a in apis:  # nonblocking init: in progress twice after every rank arrived
        first = a.log.index("ncclCommInitRankConfig")
        assert a.log[first + 1:].count("ncclCommGetAsyncError") >= 3


def test_bfloat16_and_avg(groups):
    n = 2
    pgs, _ = groups(n)
    vals = [np.array([1.5, -2.0, 3.25], ml_dtypes.bfloat16) * (r + 1) for r in range(n)]

    def body(r):
        x = vals[r].copy()
        pgs[r].all_reduce(x, op="avg").wait()
        return x.astype(np.float32)

    for got in run_ranks(n, body):
        np.testing.assert_array_equal(got, np.array([2.25, -3.0, 4.875], np.float32))


def test_collectives_match_numpy(groups):
    n = 3
    pgs, apis = groups(n)
    rng = np.random.default_rng(1)
    data = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(n)]
    flags = [np.array([r == 1, False, True]) for r in range(n)]
    cplx = [(np.arange(4) + 1j * r).astype(np.complex64) for r in range(n)]

    def body(r):
        pg, res = pgs[r], {}
        x = data[r].copy()
        pg.all_reduce(x, op="max").wait()
        res["max"] = x
        f = flags[r].copy()
        pg.all_reduce(f).wait()  # bool sum is logical or
        res["or"] = f
        c = cplx[r].copy()
        pg.all_reduce(c).wait()
        res["complex"] = c
        b = data[r].copy()
        pg.broadcast(b, src=2).wait()
        res["bcast"] = b
        ag = np.zeros((n, 4, 5), np.float32)
        pg.all_gather(ag, data[r]).wait()
        res["ag"] = ag
        rs = np.zeros(2, np.int64)
        pg.reduce_scatter(rs, np.arange(2 * n, dtype=np.int64) * (r + 1)).wait()
        res["rs"] = rs
        pg.barrier().wait()
        return res

    res = run_ranks(n, body)
    for r in range(n):
        np.testing.assert_array_equal(res[r]["max"], np.max(data, axis=0))
        np.testing.assert_array_equal(res[r]["or"], [True, False, True])
        np.testing.assert_allclose(res[r]["complex"], np.sum(cplx, axis=0), rtol=1e-6)
        np.testing.assert_array_equal(res[r]["bcast"], data[2])
        np.testing.assert_array_equal(res[r]["ag"], np.stack(data))
        np.testing.assert_array_equal(res[r]["rs"], (np.arange(2 * n) * 6)[2 * r:2 * r + 2])
    assert "ncclAllReduce" in apis[0].log and "ncclReduceScatter" in apis[0].log


def test_send_recv_ring_does_not_block_on_the_receiver(groups):
    n = 3
    pgs, _ = groups(n)

    def body(r):
        out = np.zeros(7, np.float64)
        # every rank sends first, a temporary: the backend keeps it alive until sent
        s = pgs[r].send(np.full(7, r, np.float64), dst=(r + 1) % n)
        rw = pgs[r].recv(out, src=(r - 1) % n)
        s.wait()
        rw.wait()
        return out

    outs = run_ranks(n, body)
    for r in range(n):
        np.testing.assert_array_equal(outs[r], (r - 1) % n)


def test_gather_scatter_reduce_all_to_all(groups):
    n = 3
    pgs, _ = groups(n)

    def body(r):
        res = {}
        g = np.zeros((n, 2), np.int32) if r == 1 else None
        pg = pgs[r]
        pg.gather(np.array([r, 10 * r], np.int32), g, dst=1).wait()
        res["gather"] = g
        out = np.zeros(2, np.int16)
        src = np.arange(2 * n, dtype=np.int16).reshape(n, 2) if r == 0 else None
        pg.scatter(out, src, src=0).wait()
        res["scatter"] = out
        red = np.full(3, r + 1, np.float64)
        pg.reduce(red, dst=2, op="prod").wait()
        res["reduce"] = red
        a2a_in = np.arange(n * 2, dtype=np.float32) + 100 * r
        a2a_out = np.zeros(n * 2, np.float32)
        pg.all_to_all(a2a_out, a2a_in).wait()
        res["a2a"] = a2a_out
        return res

    res = run_ranks(n, body)
    np.testing.assert_array_equal(res[1]["gather"], [[0, 0], [1, 10], [2, 20]])
    for r in range(n):
        np.testing.assert_array_equal(res[r]["scatter"], [2 * r, 2 * r + 1])
        want = np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * s for s in range(n)])
        np.testing.assert_array_equal(res[r]["a2a"], want)
    np.testing.assert_array_equal(res[2]["reduce"], 6.0)


def test_dead_rank_fails_the_collective_with_a_numbered_error(groups):
    pgs, apis = groups(2)
    apis[1].world.kill(pgs[1].backend.comm.handle)
    x = np.ones(3, np.float32)
    with pytest.raises(NcclError) as info:
        pgs[0].all_reduce(x, timeout=5.0).wait()
    assert info.value.code == "K250" and "ncclAllReduce on rank 0 of 2" in str(info.value)
    assert info.value.result == api.REMOTE_ERROR
    assert "ncclCommRevoke" in apis[0].log


def test_init_process_group_nccl_without_a_gpu_names_the_hardware():
    import kiln.distributed as dist
    from kiln.distributed.errors import NcclUnavailable
    from kiln.distributed.nccl_lib import require_gpu

    try:
        require_gpu()
        pytest.skip("this machine has a CUDA GPU")
    except NcclUnavailable:
        pass
    token = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, token)
    try:
        with pytest.raises(NcclUnavailable) as info:
            dist.init_process_group("nccl", rank=0, world_size=1, store=server.address,
                                    token=token, timeout=10.0, host_store=False)
        assert info.value.code == "K251" and "GPU" in str(info.value)
    finally:
        dist.destroy_process_group()
        server.close()
