"""Host symmetric memory on 2 and 4 processes: direct peer reads and writes, signal
pads, all_reduce against numpy, no /dev/shm segment left after a SIGKILL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import check_all_ok, run_scenario

WORKERS = Path(__file__).with_name("symmetric_workers.py")


def sym_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if "-sym-" in f and f.startswith("kiln-")}


@pytest.mark.parametrize("world", [2, 4])
def test_direct_access_signals_and_all_reduce(tmp_path, world):
    before = sym_files()
    data = check_all_ok(run_scenario("sym_basic", world, tmp_path, workers=WORKERS,
                                     timeout=90))
    assert all(d["left"] == [] for d in data)
    assert len({tuple(sorted(d["sums"].items())) for d in data}) == 1  # all ranks agree
    assert sym_files() - before == set()


def test_sigkill_of_a_rank_leaves_no_segment(tmp_path):
    before = sym_files()
    results = run_scenario("sym_kill", 4, tmp_path, workers=WORKERS, timeout=90)
    assert results[3]["returncode"] == -9
    data = check_all_ok(results[:3])
    assert all(d["left"] == [] for d in data)
    assert sym_files() - before == set()


def test_bad_arguments_are_numbered_errors():
    import kiln.distributed as dist

    class OneRank:  # the allocation checks its arguments before any collective
        rank, world_size, timeout = 0, 1, 1.0

    with pytest.raises(dist.errors.SymmetricMemoryError) as info:
        dist.symmetric_memory((2, -1), "float32", OneRank())
    assert info.value.code == "K252" and "(2, -1)" in str(info.value)
    with pytest.raises(dist.errors.SymmetricMemoryError):
        dist.symmetric_memory(4, object, OneRank())
