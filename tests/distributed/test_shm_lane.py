"""The shared-memory lane between ranks on one host (kiln/distributed/shm_lane.py):
used for large payloads, bit-identical to TCP, KILN_TCP_SHM=0 turns it off, nothing
left in /dev/shm after a clean exit or a SIGKILL, and early messages filling every
slot do not deadlock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import check_all_ok, run_scenario

WORKERS = Path(__file__).with_name("shm_workers.py")


def _shm_room(nbytes: int = 256 << 20) -> bool:
    """Whether /dev/shm can hold the rings of a 4-rank job (6 pairs on a 2-core box)."""
    try:
        fd = os.open("/dev/shm/kiln-test-probe-%d" % os.getpid(),
                     os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink("/dev/shm/kiln-test-probe-%d" % os.getpid())


# without room the lane falls back to TCP (tested by the rest of tests/distributed)
pytestmark = pytest.mark.skipif(not _shm_room(), reason="needs POSIX shared memory: "
                                "/dev/shm with 256 MiB free for the same-host lane")


def job_files(prefix: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_lane_is_used_and_bit_identical_to_tcp(tmp_path, world):
    data = check_all_ok(run_scenario("shm_identical", world, tmp_path, workers=WORKERS,
                                     timeout=220))
    for d in data:
        assert set(d["moved"]) >= {"bfloat16/default", "bfloat16/150k", "float32/150k"}
        assert all(v > 0 for v in d["moved"].values())


@pytest.mark.timeout(60)
def test_env_zero_disables_the_lane(tmp_path):
    data = check_all_ok(run_scenario("shm_disabled", 3, tmp_path, workers=WORKERS,
                                     env={"KILN_TCP_SHM": "0"}))
    for d in data:
        assert d["lanes"] == [False, False] and d["files"] == []


@pytest.mark.timeout(60)
def test_pairs_agree_when_one_side_has_no_lane(tmp_path):
    data = check_all_ok(run_scenario("shm_mixed", 3, tmp_path, workers=WORKERS))
    assert data[0]["lanes"] == {"1": False, "2": True}
    assert data[1]["lanes"] == {"0": False, "2": False}
    assert data[2]["lanes"] == {"0": True, "1": False}
    assert data[0]["sent"]["2"] > 0 or data[2]["sent"]["0"] > 0
    assert all(d["files"] == [] for d in data)


@pytest.mark.timeout(60)
def test_no_file_or_mapping_left_after_destroy(tmp_path):
    data = check_all_ok(run_scenario("shm_cleanup", 3, tmp_path, workers=WORKERS))
    for d in data:
        assert d["used"] > 0 and d["mapped"] == 2, d  # two peers, one segment each
        assert d["during"]["files"] == []  # unlinked once both sides had them open
        assert d["after"] == {"files": [], "maps": []}, d


@pytest.mark.timeout(90)
def test_sigkill_mid_collective_fails_survivors_and_leaves_nothing(tmp_path):
    results = run_scenario("shm_kill", 4, tmp_path, workers=WORKERS, timeout=80)
    assert results[3]["returncode"] == -9, results[3]
    survivors = check_all_ok(results[:3])
    for d in survivors:
        assert d["type"] == "PeerFailure" and d["rank"] == 3, d
        assert d["elapsed"] < 20, d
        assert d["leftovers"]["files"] == []
    assert job_files(survivors[0]["prefix"]) == []


@pytest.mark.timeout(60)
def test_early_messages_in_every_slot_do_not_deadlock(tmp_path):
    data = check_all_ok(run_scenario("shm_exhaustion", 2, tmp_path, workers=WORKERS))
    assert data[1]["spilled"] > 0, data  # rank 1 had to copy early messages out
    assert data[0]["sent"] > 0 and data[1]["received"] > 0
