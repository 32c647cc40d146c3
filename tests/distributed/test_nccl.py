"""The NCCL layer: NcclComm's protocol over the fake NCCL (N ranks as threads, results
against numpy, call sequences, nonblocking polling, failures, shrink/grow/split/revoke),
and symbol/version checks against the real libnccl where one loads."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from kiln.distributed import nccl_api as api
from kiln.distributed.errors import CollectiveTimeout, NcclError, NcclUnavailable
from kiln.distributed.nccl_comm import NcclComm
from tests.distributed.fake_nccl import FakeNccl, FakeWorld


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def run_ranks(n: int, fn, timeout: float = 20.0) -> list:
    """Run fn(rank) on n threads; return results, re-raising the first exception."""
    out: list = [None] * n
    errs: list = [None] * n

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errs[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a fake rank did not finish"
    for e in errs:
        if e is not None:
            raise e
    return out


def make_comms(n: int, world: FakeWorld, timeout: float = 10.0):
    apis = [FakeNccl(world) for _ in range(n)]
    _, uid = apis[0].get_unique_id()  # rank 0's id, handed out through kiln's store
    comms = run_ranks(n, lambda r: NcclComm.init(apis[r], n, uid, r, timeout=timeout))
    return apis, comms


def test_nonblocking_init_polls_until_every_rank_arrived():
    world = FakeWorld(init_polls=3)
    apis, comms = make_comms(3, world)
    assert [c.rank for c in comms] == [0, 1, 2] and all(c.size == 3 for c in comms)
    for a in apis:
        polls = a.log.count("ncclCommGetAsyncError")
        assert polls >= 4, polls  # 3 in-progress answers, then success
        assert a.log[a.log.index("ncclCommInitRankConfig") + 1] == "ncclCommGetAsyncError"


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "avg"])
def test_all_reduce_matches_numpy(op):
    n = 4
    apis, comms = make_comms(n, FakeWorld())
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(37).astype(np.float32) for _ in range(n)]
    outs = [np.zeros(37, np.float32) for _ in range(n)]
    run_ranks(n, lambda r: comms[r].all_reduce(ptr(data[r]), ptr(outs[r]), 37,
                                               np.float32, op).wait())
    ref = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod,
           "avg": np.mean}[op](np.stack(data), axis=0)
    for o in outs:
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-6)


def test_every_collective_results_and_call_sequence():
    n = 3
    apis, comms = make_comms(n, FakeWorld())
    base = [np.arange(6, dtype=np.int64) * (r + 1) for r in range(n)]
    results = {}

    def body(r):
        c, x = comms[r], base[r]
        inplace = x.copy()
        c.all_reduce(ptr(inplace), ptr(inplace), 6, np.int64).wait()
        bc = x.copy()
        c.broadcast(ptr(bc), ptr(bc), 6, np.int64, root=2).wait()
        red = np.zeros(6, np.int64)
        c.reduce(ptr(x), ptr(red), 6, np.int64, "max", root=1).wait()
        ag = np.zeros(6 * n, np.int64)
        c.all_gather(ptr(x), ptr(ag), 6, np.int64).wait()
        rs = np.zeros(2, np.int64)
        c.reduce_scatter(ptr(x), ptr(rs), 2, np.int64).wait()
        recv = np.zeros(6, np.int64)
        c.send_recv([(ptr(x), 6, (r + 1) % n)], [(ptr(recv), 6, (r - 1) % n)], np.int64).wait()
        results[r] = (inplace, bc, red, ag, rs, recv)

    run_ranks(n, body)
    total = np.sum(base, axis=0)
    for r in range(n):
        inplace, bc, red, ag, rs, recv = results[r]
        np.testing.assert_array_equal(inplace, total)
        np.testing.assert_array_equal(bc, base[2])
        np.testing.assert_array_equal(red, np.max(base, axis=0) if r == 1 else 0)
        np.testing.assert_array_equal(ag, np.concatenate(base))
        np.testing.assert_array_equal(rs, total[2 * r:2 * r + 2])
        np.testing.assert_array_equal(recv, base[(r - 1) % n])
        calls = [c for c in apis[r].log if c.startswith("nccl") and "Async" not in c]
        assert calls[-9:] == ["ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
                              "ncclReduceScatter", "ncclGroupStart", "ncclSend", "ncclRecv",
                              "ncclGroupEnd"]


def test_work_is_pending_until_every_rank_enqueued():
    apis, comms = make_comms(2, FakeWorld())
    a, b = np.ones(4, np.float32), np.full(4, 2, np.float32)
    w0 = comms[0].all_reduce(ptr(a), ptr(a), 4, np.float32)
    assert not w0.is_completed()  # rank 1 has not enqueued yet
    comms[1].all_reduce(ptr(b), ptr(b), 4, np.float32).wait()
    assert w0.is_completed()
    np.testing.assert_array_equal(a, 3)


def test_dead_peer_fails_pending_work_then_shrink_abort_continues():
    n = 4
    world = FakeWorld()
    apis, comms = make_comms(n, world)
    world.kill(comms[3].handle)  # rank 3's process dies
    bufs = [np.full(5, r + 1, np.float64) for r in range(n)]
    errors = run_ranks(3, lambda r: _expect(NcclError, lambda: comms[r].all_reduce(
        ptr(bufs[r]), ptr(bufs[r]), 5, np.float64).wait(timeout=5)))
    for e in errors:
        assert e.result == api.REMOTE_ERROR and "ncclRemoteError" in str(e) and e.code == "K250"
    # revoked, not aborted: an aborted communicator is freed and could not be shrunk
    assert all(c.revoked and not c.aborted for c in comms[:3])
    assert all("ncclCommRevoke" in a.log and "ncclCommAbort" not in a.log for a in apis[:3])
    # the store agreed that rank 3 is gone: survivors shrink in abort mode
    small = run_ranks(3, lambda r: comms[r].shrink([3]))
    assert [c.rank for c in small] == [0, 1, 2] and all(c.size == 3 for c in small)
    assert all("ncclCommShrink" in a.log for a in apis[:3])
    run_ranks(3, lambda r: small[r].all_reduce(ptr(bufs[r]), ptr(bufs[r]), 5,
                                               np.float64).wait())
    for b in bufs[:3]:
        np.testing.assert_array_equal(b, 6.0)


def _expect(cls, fn):
    with pytest.raises(cls) as info:
        fn()
    return info.value


def test_shrink_keeps_order_of_survivors():
    n = 4
    world = FakeWorld()
    apis, comms = make_comms(n, world)
    world.kill(comms[1].handle)
    small = run_ranks(3, lambda i: comms[[0, 2, 3][i]].shrink([1]))
    assert [c.rank for c in small] == [0, 1, 2]
    vals = [np.array([10.0 * (i + 1)]) for i in range(3)]
    outs = [np.zeros(3) for _ in range(3)]
    run_ranks(3, lambda i: small[i].all_gather(ptr(vals[i]), ptr(outs[i]), 1,
                                               np.float64).wait())
    for o in outs:
        np.testing.assert_array_equal(o, [10.0, 20.0, 30.0])


def test_grow_admits_a_joiner():
    world = FakeWorld()
    apis, comms = make_comms(2, world)
    grow_id = comms[0].grow_id()  # published through the store for the joiner
    joiner = FakeNccl(world)

    def body(r):
        if r < 2:
            return comms[r].grow(3)
        return NcclComm.join(joiner, 3, grow_id, 2, timeout=10)

    big = run_ranks(3, body)
    assert [c.rank for c in big] == [0, 1, 2]
    bufs = [np.array([r + 1], np.int32) for r in range(3)]
    run_ranks(3, lambda r: big[r].all_reduce(ptr(bufs[r]), ptr(bufs[r]), 1, np.int32).wait())
    assert [int(b[0]) for b in bufs] == [6, 6, 6]
    assert "ncclCommGrow" in joiner.log and "ncclCommGetUniqueId" in apis[0].log


def test_split_by_color_and_key():
    n = 4
    apis, comms = make_comms(n, FakeWorld())
    # even ranks in reverse key order; rank 3 takes no part
    colors = [0, 1, 0, api.SPLIT_NOCOLOR]
    keys = [5, 0, 1, 0]
    places = {0: (1, 2), 1: (0, 1), 2: (0, 2), 3: (-1, 0)}
    subs = run_ranks(n, lambda r: comms[r].split(colors[r], keys[r], rank=places[r][0],
                                                 size=places[r][1]))
    assert subs[3] is None
    vals = [np.array([r + 1.0]) for r in range(n)]
    out = {0: np.zeros(2), 2: np.zeros(2)}
    run_ranks(2, lambda i: subs[[0, 2][i]].all_gather(ptr(vals[[0, 2][i]]), ptr(out[[0, 2][i]]),
                                                      1, np.float64).wait())
    np.testing.assert_array_equal(out[0], [3.0, 1.0])  # rank 2 (key 1) before rank 0 (key 5)


def test_revoke_stops_later_calls():
    apis, comms = make_comms(2, FakeWorld())
    comms[0].revoke()
    x = np.ones(2, np.float32)
    err = _expect(NcclError, lambda: comms[0].all_reduce(ptr(x), ptr(x), 2, np.float32))
    assert err.result == api.INVALID_USAGE and "ncclAllReduce" in str(err)
    assert comms[0].revoked and not comms[0].aborted


def test_an_aborted_communicator_cannot_be_shrunk():
    apis, comms = make_comms(2, FakeWorld())
    comms[0].abort()
    err = _expect(NcclError, lambda: comms[0].shrink([1]))
    assert "ncclCommShrink on rank 0" in str(err) and "aborted" in str(err)
    assert "ncclCommShrink" not in apis[0].log  # refused before reaching NCCL


def test_missing_peer_times_out_and_aborts():
    apis, comms = make_comms(2, FakeWorld(), timeout=0.3)
    x = np.ones(2, np.float32)
    work = comms[0].all_reduce(ptr(x), ptr(x), 2, np.float32)
    err = _expect(CollectiveTimeout, work.wait)
    assert "ncclAllReduce on rank 0" in str(err) and err.code == "K203"
    assert comms[0].revoked and "ncclCommRevoke" in apis[0].log and "revoked" in str(err)


def test_init_times_out_when_a_rank_never_arrives():
    world = FakeWorld()
    fake = FakeNccl(world)
    _, uid = fake.get_unique_id()
    err = _expect(CollectiveTimeout, lambda: NcclComm.init(fake, 2, uid, 0, timeout=0.2))
    assert "ncclCommInitRankConfig" in str(err) and "ncclCommAbort" in fake.log


def test_bad_dtype_and_reduce_op_are_numbered_errors():
    apis, comms = make_comms(1, FakeWorld())
    x = np.ones(2, np.complex64)
    err = _expect(NcclError, lambda: comms[0].all_reduce(ptr(x), ptr(x), 2, np.complex64))
    assert "complex64" in str(err) and err.code == "K250"
    y = np.ones(2, np.float32)
    err = _expect(NcclError, lambda: comms[0].all_reduce(ptr(y), ptr(y), 2, np.float32, "xor"))
    assert "'xor'" in str(err)


# -- the real library (nvidia-nccl-cu12/-cu13 wheel or KILN_NCCL_LIBRARY) -------------------
def _real():
    from kiln.distributed.nccl_lib import LibNccl
    try:
        return LibNccl()
    except NcclUnavailable as exc:
        pytest.skip("needs libnccl.so.2 >= 2.29 (pip install nvidia-nccl-cu12, 350 MB, or "
                    "KILN_NCCL_LIBRARY): %s" % exc)


def test_real_library_symbols_version_and_unique_id():
    lib = _real()
    assert lib.get_version() >= api.MIN_VERSION
    assert all(hasattr(lib.lib, s) for s in api.REQUIRED_SYMBOLS)
    r1, a = lib.get_unique_id()
    r2, b = lib.get_unique_id()
    assert r1 == r2 == api.SUCCESS and len(a) == 128 and a != b
    assert "remote" in lib.get_error_string(api.REMOTE_ERROR)


def test_communicator_without_a_gpu_names_the_hardware():
    from kiln.distributed import nccl_lib
    lib = _real()
    try:
        nccl_lib.require_gpu()
        pytest.skip("this machine has a CUDA GPU")
    except NcclUnavailable:
        pass
    _, uid = lib.get_unique_id()
    err = _expect(NcclUnavailable, lambda: NcclComm.init(lib, 1, uid, 0, timeout=5.0))
    assert err.code == "K251" and "NVIDIA CUDA GPU" in str(err)


def test_config_struct_matches_the_232_header():
    from kiln.distributed.nccl_lib import Config, make_config
    # sizeof/offsetof(ncclConfig_t) compiled against the 2.32.3 wheel's nccl.h
    assert ctypes.sizeof(Config) == 120
    assert Config.commName.offset == 48 and Config.nvlsHostMode.offset == 112
    cfg = make_config(blocking=False)
    assert cfg.blocking == 0 and cfg.magic == 0xCAFEBEEF and cfg.minCTAs == -(2 ** 31)


def test_missing_library_is_a_numbered_error(monkeypatch, tmp_path):
    from kiln.distributed import nccl_lib
    monkeypatch.setattr(nccl_lib, "library_candidates", lambda: [str(tmp_path / "nope.so")])
    err = _expect(NcclUnavailable, nccl_lib.load_library)
    assert err.code == "K251" and "nope.so" in str(err)
