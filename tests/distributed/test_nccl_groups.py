"""NcclGroups over the fake NCCL (ranks as threads): a group's next epoch is derived in
place from its previous communicator (ncclCommShrink in abort mode, ncclCommGrow with
the id through the store) instead of re-initialized, and falls back to a fresh init
where the ranks cannot derive; ProcessGroup.split is one ncclCommSplit."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from kiln.distributed import nccl_api as api
from kiln.distributed.errors import RendezvousError
from kiln.distributed.nccl_groups import NcclGroups, _survivors
from kiln.distributed.process_group import ProcessGroup
from kiln.distributed.store import Store, StoreServer
from tests.distributed.fake_nccl import FakeNccl, FakeWorld
from tests.distributed.test_nccl_backend import run_ranks


@pytest.fixture
def server():
    token = secrets.token_hex(16)
    srv = StoreServer("127.0.0.1", 0, token)
    yield srv, token
    srv.close()


def _ranks(server, world, n):
    srv, token = server
    apis = [FakeNccl(world) for _ in range(n)]
    groups = [NcclGroups(a) for a in apis]
    stores = [Store(srv.address, token) for _ in range(n)]
    return apis, groups, stores, token


def _sum_check(backends, values):
    """all_reduce through the backends' communicators; every rank gets sum(values)."""
    bufs = [np.array([v], np.float64) for v in values]
    run_ranks(len(backends), lambda r: backends[r].comm.all_reduce(
        bufs[r].ctypes.data, bufs[r].ctypes.data, 1, np.float64).wait(timeout=10))
    assert [float(b[0]) for b in bufs] == [float(sum(values))] * len(values)


def test_dead_rank_then_shrink_in_place_then_grow_a_joiner(server):
    world = FakeWorld(init_polls=1)
    apis, groups, stores, token = _ranks(server, world, 4)
    e0 = run_ranks(4, lambda r: groups[r].rendezvous(stores[r], "pg/world/e0", r, 4, token,
                                                     10.0, 0))
    _sum_check(e0, [1, 2, 3, 4])
    world.kill(e0[2].comm.handle)  # uid 2's process dies
    for b in (e0[0], e0[1], e0[3]):  # the group's failure handling: revoke, keep
        b.abort(RuntimeError("peer 2 died"))
    assert all(not b.comm.aborted for b in (e0[0], e0[1], e0[3]))
    # the store-agreed epoch 1: uids 0, 1, 3 as ranks 0, 1, 2
    olds = [0, 1, 3]
    e1 = run_ranks(3, lambda i: groups[olds[i]].rendezvous(
        stores[olds[i]], "pg/world/e1", i, 3, token, 10.0, 1))
    assert [b.rank for b in e1] == [0, 1, 2] and all(b.world_size == 3 for b in e1)
    for u in olds:
        assert apis[u].log.count("ncclCommInitRankConfig") == 1  # no re-initialization
        assert "ncclCommShrink" in apis[u].log
        assert groups[u].history[-1]["how"] == "shrink"
    assert all(b.comm.aborted for b in (e0[0], e0[1], e0[3]))  # the parents are freed
    _sum_check(e1, [10, 20, 30])
    # epoch 2: a replacement joins as rank 3 through ncclCommGrow
    joiner_api = FakeNccl(world)
    joiner = NcclGroups(joiner_api)
    jstore = Store(server[0].address, token)
    who = [(groups[0], stores[0]), (groups[1], stores[1]), (groups[3], stores[3]),
           (joiner, jstore)]
    e2 = run_ranks(4, lambda r: who[r][0].rendezvous(who[r][1], "pg/world/e2", r, 4, token,
                                                     10.0, 2))
    assert [b.rank for b in e2] == [0, 1, 2, 3]
    assert "ncclCommGrow" in joiner_api.log and "ncclCommInitRankConfig" not in joiner_api.log
    assert apis[0].log.count("ncclCommGetUniqueId") == 1  # rank 0 made the grow id
    assert [g.history[-1]["how"] for g, _ in who] == ["shrink (none excluded) + grow"] * 3 + [
        "join"]
    _sum_check(e2, [1, 2, 3, 4])


def test_survivors_out_of_order_fall_back_to_a_fresh_init(server):
    world = FakeWorld()
    apis, groups, stores, token = _ranks(server, world, 3)
    e0 = run_ranks(3, lambda r: groups[r].rendezvous(stores[r], "pg/g/e0", r, 3, token,
                                                     10.0, 0))
    for b in e0:
        b.close()  # a deliberate end of epoch (an explicit shrink): kept as parents
    assert not any(b.comm.aborted for b in e0)
    order = [2, 0, 1]  # an order a shrink cannot give: every rank re-initializes
    e1 = run_ranks(3, lambda i: groups[order[i]].rendezvous(
        stores[order[i]], "pg/g/e1", i, 3, token, 10.0, 1))
    for u in range(3):
        assert apis[u].log.count("ncclCommInitRankConfig") == 2
        assert "ncclCommShrink" not in apis[u].log
    assert all(b.comm.aborted for b in e0)
    _sum_check(e1, [1, 2, 3])


def test_a_failed_shrink_is_a_rendezvous_error_and_the_next_attempt_starts_afresh(server):
    world = FakeWorld()
    apis, groups, stores, token = _ranks(server, world, 3)
    e0 = run_ranks(3, lambda r: groups[r].rendezvous(stores[r], "pg/w/e0", r, 3, token,
                                                     5.0, 0))
    # epoch 1 planned with all three, but rank 2 dies after publishing its plan: the
    # shrink never completes on ranks 0 and 1 (bounded), which then free their parent
    stores[2].set("pg/w/e1/nccl-from/2", '{"epoch": 0, "rank": 2, "size": 3}')
    world.kill(e0[2].comm.handle)

    def attempt(r):
        with pytest.raises(RendezvousError) as info:
            groups[r].rendezvous(stores[r], "pg/w/e1", r, 3, token, 0.5, 1)
        return info.value

    errs = run_ranks(2, attempt)
    assert all("pg/w/e1" in str(e) and e.code.startswith("K2") for e in errs)
    assert e0[0].comm.aborted and e0[1].comm.aborted
    e2 = run_ranks(2, lambda r: groups[r].rendezvous(stores[r], "pg/w/e2", r, 2, token,
                                                     5.0, 2))
    assert [g.history[-1]["how"] for g in groups[:2]] == ["init", "init"]
    _sum_check(e2, [5, 6])


def test_survivor_plan_rules():
    p = lambda e, r, s: {"epoch": e, "rank": r, "size": s}  # noqa: E731
    assert _survivors([p(3, 0, 4), p(3, 2, 4), {"epoch": -1}]) == [0, 1]
    assert _survivors([{"epoch": -1}, {"epoch": -1}]) == []
    assert _survivors([p(3, 2, 4), p(3, 0, 4)]) == []  # order changed
    assert _survivors([{"epoch": -1}, p(3, 0, 4)]) == []  # a survivor after a joiner
    assert _survivors([p(2, 0, 3), p(3, 0, 2), p(3, 1, 2)]) == []  # stale first
    assert _survivors([p(3, 0, 2), p(3, 1, 2), p(2, 1, 3)]) == [0, 1]


def test_process_group_split_is_one_nccl_comm_split(server):
    srv, token = server
    n = 4
    world = FakeWorld()
    apis = [FakeNccl(world) for _ in range(n)]
    groups = [NcclGroups(a) for a in apis]

    def join(r):
        store = Store(srv.address, token)
        be = groups[r].rendezvous(store, "pg/sp/e0", r, n, token, 10.0, 0)
        return ProcessGroup(be, name="sp", rank=r, world_size=n, global_ranks=list(range(n)),
                            store=store, token=token, timeout=10.0, backend_factory=groups[r])

    pgs = run_ranks(n, join)
    try:
        def body(r):
            # odd ranks in reverse order; rank 0 in no group
            sub = pgs[r].split(color=(r % 2) if r else None, key=-r)
            if sub is None:
                return None
            x = np.array([float(r)])
            out = np.zeros(sub.world_size)
            sub.all_gather(out, x).wait()
            return sub.rank, sub.world_size, list(sub.global_ranks), out.tolist()

        res = run_ranks(n, body)
        assert res[0] is None
        assert res[1] == (1, 2, [3, 1], [3.0, 1.0]) and res[3] == (0, 2, [3, 1], [3.0, 1.0])
        assert res[2] == (0, 1, [2], [2.0])
        for a in apis:  # every rank split the parent; nobody initialized a second comm
            assert a.log.count("ncclCommSplit") == 1
            assert a.log.count("ncclCommInitRankConfig") == 1
        assert api.SPLIT_NOCOLOR == -1
    finally:
        for pg in pgs:
            pg.backend.abort(RuntimeError("test over"))
        for g in groups:
            g.release()


def test_destroy_process_group_frees_every_kept_communicator(server, monkeypatch):
    """The world's and a sub-group's communicators outlive their groups' close (kept as
    parents of a next epoch); destroy_process_group's hook frees them all."""
    import kiln.distributed as dist
    from kiln.distributed import nccl_groups

    srv, token = server
    world = FakeWorld()
    monkeypatch.setattr(nccl_groups, "_DEFAULT", None)
    nccl_groups.set_nccl_api(FakeNccl(world))
    pg = dist.init_process_group("nccl", rank=0, world_size=1, store=srv.address, token=token,
                                 timeout=10.0, host_store=False, fault_tolerant=True)
    try:
        sub = pg.split([0])
        buf = np.array([3.0])
        sub.all_reduce(buf).wait()
        assert buf[0] == 3.0 and len(world.comms) == 2  # the world's, the split's
        pg.destroy()  # closing the groups keeps both: a next epoch may shrink them
        assert not any(c.aborted for c in world.comms.values())
    finally:
        dist.destroy_process_group()
    assert len(world.comms) == 2 and all(c.aborted for c in world.comms.values())
    log = nccl_groups.default_groups().api.log
    assert log.count("ncclCommDestroy") + log.count("ncclCommAbort") == 2
    assert nccl_groups.default_groups()._live == {}
