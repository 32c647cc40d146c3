"""Bad input, sub-groups, timeouts, dead peers, mismatches and rank-0-hosted stores."""

from __future__ import annotations

import json
import time

import pytest

import kiln.distributed as dist
from harness import check_all_ok, reserved_port, run_scenario


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_splits_and_sigusr1_dump(tmp_path, world):
    data = check_all_ok(run_scenario("basic", world, tmp_path))
    errors = data[0]["errors"]
    # each message names the op, the operand and the rule
    assert "all_reduce" in errors["dtype"] and "<U2" in errors["dtype"]
    assert "not C-contiguous" in errors["noncontig"] and "float32[4]" in errors["noncontig"]
    assert "read-only" in errors["readonly"]
    assert "src=%d is not a rank" % world in errors["rank"]
    assert "avg" in errors["avg_int"] and "int32" in errors["avg_int"]
    assert "complex64" in errors["min_complex"]
    assert "'mean'" in errors["bad_op"]
    assert "world_size * input.size" in errors["gather_size"]
    assert "float64" in errors["gather_dtype"] and "float32" in errors["gather_dtype"]
    assert "reduce_scatter" in errors["rs_size"]
    assert "sum to 8" in errors["a2a_split"] or "sum to" in errors["a2a_split"]
    assert "cannot send itself" in errors["send_self"]
    assert "tag=-1" in errors["tag"]
    assert "kiln's own" in errors["tag_reserved"]
    assert "distinct" in errors["split"]
    for d in data:
        assert d["dump_reason"] == "SIGUSR1"
        assert "world" in d["groups"] and any(g.startswith("world.s") for g in d["groups"])
        assert "all_reduce" in d["ops"] and "all_gather" in d["ops"]  # split's exchange


@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_store", [False, True], ids=["harness_store", "rank0_store"])
def test_silent_peer_times_out_and_everyone_dumps(tmp_path, own_store):
    """The ranks that time out leave at once. With rank 0 hosting the store, it lingers
    at exit until rank 1 has read the dump request (without that, rank 1's late watcher
    lost the store with the request in it and never dumped: KILN_FR_LINGER=0 fails)."""
    args = {"timeout": 1.5}
    with reserved_port() as port:
        if own_store:  # and rank 1's watcher reads the request 2 s late
            args.update(own_store=True, address="127.0.0.1:%d" % port, slow_watcher=2.0)
        # the linger is bounded (KILN_FR_LINGER, 5 s); 30 s here: a loaded machine may
        # delay rank 1 past 5 s, while rank 0 leaves as soon as rank 1 acknowledged
        results = run_scenario("hang", 3, tmp_path, args=args, env={"KILN_FR_LINGER": "30"})
    data = check_all_ok(results)
    assert data[1]["dumped"], "the stuck rank did not dump on the store's request"
    for rank in (0, 2):
        assert data[rank]["error"] == "CollectiveTimeout"
        # the call's own 1.5 s deadline fired, not the 20 s wait around it (a loose bound:
        # a loaded 2-core machine can deschedule a rank for seconds)
        assert data[rank]["elapsed"] < 10, data[rank]
        assert "K203" in data[rank]["message"]
    for rank in range(3):
        dump = json.loads((tmp_path / "fr" / ("kiln_fr_rank%d.json" % rank)).read_text())
        assert dump["rank"] == rank
    assert dump_reason(tmp_path, 1).startswith("requested by rank ")


def dump_reason(tmp_path, rank: int) -> str:
    return json.loads((tmp_path / "fr" / ("kiln_fr_rank%d.json" % rank)).read_text())["reason"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1000, 3_000_000])
def test_dead_peer_fails_work_with_peer_failure_naming_it(tmp_path, size):
    results = run_scenario("death", 4, tmp_path, args={"victim": 2, "size": size})
    assert results[2]["returncode"] == 3
    for rank in (0, 1, 3):
        data = check_all_ok([results[rank]])[0]
        first = data["errors"][0]
        assert first is not None, "the collective succeeded without rank 2"
        assert first["type"] == "PeerFailure" and first["rank"] == 2, first
        assert "rank 2" in first["message"]
        # later calls fail at once too: the group is aborted, nothing hangs
        assert all(e is not None for e in data["errors"])
        assert data["elapsed"] < 10


@pytest.mark.timeout(60)
def test_rank0_hosts_the_store(tmp_path):
    with reserved_port() as port:
        check_all_ok(run_scenario("rank0_store", 2, tmp_path,
                                  args={"address": "127.0.0.1:%d" % port}))


@pytest.mark.timeout(60)
def test_a_rank_starting_later_than_the_timeout_still_joins(tmp_path):
    """The group's 1 s timeout bounds its collectives, not how far apart its processes
    start (a loaded machine starts them seconds apart): the first rendezvous waits
    `start_timeout`, 60 s by default (a K210 at epoch 0 once failed a CI-like run)."""
    data = check_all_ok(run_scenario("late_rank", 3, tmp_path,
                                     args={"delay": 3.0, "timeout": 1.0}))
    assert all(d["timeout"] == 1.0 for d in data)


def test_the_first_rendezvous_gives_up_at_start_timeout():
    start = time.monotonic()
    with pytest.raises(dist.RendezvousError, match="could not join") as info:
        dist.init_process_group(rank=0, world_size=2, store="127.0.0.1:0", token="t",
                                timeout=0.2, start_timeout=1.5)
    elapsed = time.monotonic() - start
    dist.destroy_process_group()  # the store this rank hosted
    assert info.value.code == "K210"
    assert elapsed >= 1.5  # its own deadline, not the collective timeout of 0.2 s
    with pytest.raises(dist.InvalidTimeout, match="start_timeout"):
        dist.init_process_group(rank=0, world_size=2, store="127.0.0.1:0", token="t",
                                start_timeout=-1)
