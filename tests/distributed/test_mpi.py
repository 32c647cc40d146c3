"""The mpi backend on 4-rank `mpirun` jobs: the collective contract of the tcp backend
(the same scenarios, checked against numpy), splits, p2p with tags, the Flight
Recorder, compiled programs, failures, and `kiln launch --engine mpi`."""

from __future__ import annotations

import pytest

from harness import check_all_ok
from mpi_harness import needs_mpi, run_mpi

pytestmark = [needs_mpi, pytest.mark.timeout(120)]


def test_every_collective_every_dtype_on_four_ranks(tmp_path):
    """All ops outstanding at once, every kiln dtype and reduce op, uneven and empty
    sizes, all_to_all with uneven splits, send/recv: against numpy."""
    data = check_all_ok(run_mpi("collectives", 4, tmp_path, timeout=100))
    assert all(d["works"] > 500 for d in data)


def test_large_buffers(tmp_path):
    check_all_ok(run_mpi("large", 4, tmp_path))


def test_bare_mpirun_needs_no_store_big_tags_and_bfloat16(tmp_path):
    data = check_all_ok(run_mpi("no_store", 4, tmp_path, store=False))
    assert len({d["store"] for d in data}) == 1  # rank 0's store, shared over MPI


def test_buffers_are_zero_copy_views(tmp_path):
    check_all_ok(run_mpi("zero_copy", 4, tmp_path))
