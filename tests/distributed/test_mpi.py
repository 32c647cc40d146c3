"""The mpi backend on 4-rank `mpirun` jobs: the collective contract of the tcp backend
(the same scenarios, checked against numpy), splits, p2p with tags, the Flight
Recorder, compiled programs, failures, and `kiln launch --engine mpi`."""

from __future__ import annotations

import json

import pytest

from harness import check_all_ok
from mpi_harness import needs_mpi, run_mpi

pytestmark = [needs_mpi, pytest.mark.timeout(120)]


def test_every_collective_every_dtype_on_four_ranks(tmp_path):
    """All ops outstanding at once, every kiln dtype and reduce op, uneven and empty
    sizes, all_to_all with uneven splits, send/recv: against numpy."""
    data = check_all_ok(run_mpi("every_collective", 4, tmp_path, timeout=100))
    assert all(d["works"] > 250 for d in data)


def test_bare_mpirun_big_tags_bfloat16_large_and_zero_copy_buffers(tmp_path):
    """No store or token given (rank 0 hosts the store and shares it over MPI); tags
    past MPI's 2**31 limit; bfloat16 avg (a user-defined MPI op); 12 MB messages; a
    view of a larger array reduced in place, its neighbours untouched."""
    data = check_all_ok(run_mpi("no_store", 4, tmp_path, store=False))
    assert len({d["store"] for d in data}) == 1  # rank 0's store, shared over MPI


def test_large_all_reduce_rides_kiln_ring_every_dtype_against_numpy(tmp_path):
    """From 1 MB all_reduce runs kiln's ring over MPI p2p (Open MPI's nonblocking
    all_reduce is a binomial tree there): the right answer for every dtype class and op
    on 3 ranks (then on sub-groups of 2 and 1), and the same bytes on every rank."""
    data = check_all_ok(run_mpi("large_all_reduce", 3, tmp_path, timeout=100))
    assert len({tuple(d["digests"]) for d in data}) == 1


def test_groups_made_while_the_watchers_poll(tmp_path):
    """Open MPI's create-from-group barrier lost a message that another thread's
    progress (a watcher's idle probe) received while the new communicator was set up:
    1 group in 8-130 hung for good. 80 splits on 3 ranks, each sub-group checked, then
    60 groups made from a group by 2 ranks, with every earlier group's watcher polling."""
    data = check_all_ok(run_mpi("many_groups", 3, tmp_path,
                                args={"splits": 80, "groups": 60}, timeout=100))
    assert data == [{"splits": 80, "groups": 60, "children": 80}] * 2 + \
        [{"splits": 80, "groups": 0, "children": 80}]


def test_watchers_stay_out_of_mpi_while_a_group_is_made():
    """mpi_world.QUIET: a maker waits for the watcher inside MPI to leave, no watcher
    enters while a maker waits or runs, and they may again once it is done."""
    import threading
    import time

    from kiln.distributed.mpi_world import _Quiet

    quiet = _Quiet()
    assert quiet.watch()  # a watcher inside MPI
    got = []
    maker = threading.Thread(target=lambda: got.append(quiet.make(time.monotonic() + 60)))
    maker.start()
    end = time.monotonic() + 60
    while not quiet._waiting and time.monotonic() < end:  # until the maker waits
        time.sleep(0.001)
    assert quiet._waiting and not quiet.watch() and got == []  # no watcher jumps the queue
    quiet.watched()
    maker.join(60)
    assert got and got[0] > 0 and not quiet.watch()  # the maker runs: watchers stay out
    quiet.made(got[0])
    assert quiet.watch()
    quiet.watched()


def test_a_maker_past_its_deadline_holds_nothing_back():
    """A creation stuck in MPI past its deadline (K210 raised) no longer keeps the
    watchers out or the next maker waiting, and its late end clears nothing of the next
    maker's; a maker that cannot get in by its deadline gets no ticket."""
    import time

    from kiln.distributed.mpi_world import _Quiet

    quiet = _Quiet()
    first = quiet.make(time.monotonic() + 0.05)
    assert first and not quiet.watch()
    time.sleep(0.1)  # past the first maker's deadline
    second = quiet.make(time.monotonic() + 60)
    assert second and second != first
    quiet.made(first)  # the stuck call returned at last
    assert not quiet.watch()  # the second maker still keeps the watchers out
    quiet.made(second)
    assert quiet.watch()  # a watcher inside MPI now ...
    assert quiet.make(time.monotonic() + 0.05) == 0  # ... that never leaves: no ticket
    quiet.watched()


def test_a_group_a_member_never_joins_fails_with_k210_and_exits_cleanly(tmp_path):
    """The MPI call that timed out is still inside MPI at exit: the rank leaves without
    MPI_Finalize (which would crash beside it), with status 0, and the job ends."""
    results = run_mpi("lonely_group", 2, tmp_path, args={"timeout": 2.0})
    data = check_all_ok(results)
    assert "K210" in data[0]["error"] and "pg/lonely/e0" in data[0]["error"], data[0]
    assert data[1] == {"error": None}
    output = results[0]["output"]
    assert results[0]["returncode"] == 0, output[-3000:]
    assert "leaving without MPI_Finalize: group 'pg/lonely/e0'" in output, output[-3000:]
    assert "Segmentation fault" not in output and "signal 11" not in output, output[-3000:]


def test_bad_input_splits_flight_recorder_and_sigusr1_dump(tmp_path):
    data = check_all_ok(run_mpi("basic", 4, tmp_path))
    errors = data[0]["errors"]
    assert "all_reduce" in errors["dtype"] and "<U2" in errors["dtype"]
    assert "tag=-1" in errors["tag"] and "kiln's own" in errors["tag_reserved"]
    for d in data:
        assert d["dump_reason"] == "SIGUSR1"
        assert "world" in d["groups"] and any(g.startswith("world.s") for g in d["groups"])
        assert "all_reduce" in d["ops"] and "all_gather" in d["ops"]


def test_mismatched_calls_fail_everywhere_with_collective_mismatch(tmp_path, capsys):
    from kiln.distributed.commands import main as dist_main

    data = check_all_ok(run_mpi("mismatch", 3, tmp_path))
    for outcome in data:  # MPI itself cannot tell: the signature check does, on every rank
        assert outcome == {"size": "CollectiveMismatch", "dtype": "CollectiveMismatch",
                           "op": "CollectiveMismatch"}
    assert dist_main(["fr", str(tmp_path / "fr"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    by_group = {m["group"]: m for m in report["mismatches"]}
    assert by_group["world.s0.c0"]["ranks"] == [1]
    assert by_group["world.s2.c0"]["call"].startswith("broadcast")


@pytest.mark.parametrize("own_store", [False, True], ids=["harness_store", "rank0_store"])
def test_silent_peer_times_out_and_everyone_dumps(tmp_path, own_store):
    """The ranks that time out leave at once; with `own_store`, a bare mpirun job's rank 0
    hosts the store, and lingers at exit until rank 1 (whose watcher is 2 s late) read
    the dump request from it."""
    args = {"timeout": 1.5, "own_store": True, "slow_watcher": 2.0} if own_store else \
        {"timeout": 1.5}
    data = check_all_ok(run_mpi("hang", 3, tmp_path, args=args, env={"KILN_FR_LINGER": "30"}))
    assert data[1]["dumped"]
    for rank in (0, 2):
        assert data[rank]["error"] == "CollectiveTimeout" and "K203" in data[rank]["message"]


def test_dead_peer_fails_work_with_peer_failure_naming_it(tmp_path):
    results = run_mpi("killed", 4, tmp_path, args={"victim": 2, "size": 3_000_000},
                      survivors=(0, 1, 3))
    for rank in (0, 1, 3):
        data = check_all_ok([results[rank]])[0]
        first = data["errors"][0]
        assert first is not None, "the collective succeeded without rank 2"
        assert first["type"] == "PeerFailure" and first["rank"] == 2, first
        assert "heartbeat" not in first["message"], first  # MPI (ULFM) saw it, at once
        assert all(e is not None for e in data["errors"])  # later calls fail at once


def test_a_stopped_peer_is_caught_by_the_heartbeat(tmp_path):
    """MPI does not see a SIGSTOPped rank; kiln's heartbeat does, and the revoke frees the
    survivors from the MPI call they were blocked in (its own deadline is 30 s)."""
    data = check_all_ok(run_mpi("hung_peer", 3, tmp_path, args={"timeout": 8.0}))
    assert data[2] == {"resumed": True}
    for outcome in data[:2]:
        assert outcome["error"] == "PeerFailure" and outcome["rank"] == 2
        assert "stopped heartbeating" in outcome["message"]


def test_collectives_inside_compiled_programs(tmp_path):
    data = check_all_ok(run_mpi("compiled_collectives", 2, tmp_path))
    for rank_data in data:
        assert "collective all_reduce_start" in rank_data["program"]
        ops = rank_data["collectives"]
        assert ops[:5] == ["all_reduce", "all_gather", "reduce_scatter", "broadcast",
                           "all_to_all"] and ops[:15] == ops[:5] * 3
