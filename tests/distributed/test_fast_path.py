"""The small-collective fast path (process_group, tcp_transport): a call started by
the caller and finished by whichever thread waits keeps every rank's call order and
fails like any other call."""

from __future__ import annotations

import json

import pytest

from harness import check_all_ok, run_scenario


@pytest.mark.timeout(60)
def test_order_with_large_calls_and_every_way_to_finish(tmp_path):
    data = check_all_ok(run_scenario("fast_order", 2, tmp_path))
    for d in data:
        assert d["records"] >= 84  # every call recorded
        assert d["states"] == ["completed"], d
        assert {fn for fn, _ in d["where"]} == {"fast_order"}, d["where"]
        assert ["fast_order", "pg.all_reduce"] in d["where"], d["where"]


@pytest.mark.timeout(60)
def test_mismatch_and_timeout_on_the_fast_path(tmp_path):
    data = check_all_ok(run_scenario("fast_errors", 2, tmp_path))
    for rank, outcomes in enumerate(data):
        for kind in ("size", "dtype", "op", "lanes"):
            error, elapsed, later = outcomes[kind]
            assert error == "CollectiveMismatch", (rank, kind, outcomes[kind])
            assert elapsed < 5, (rank, kind, outcomes[kind])  # found, not timed out
            assert later in ("CollectiveMismatch", "GroupAborted"), (rank, kind, later)
    error, elapsed, later = data[0]["lanes_peek"]  # rank 1, the root, was done at once
    assert error == "CollectiveMismatch" and elapsed < 5 and later, data[0]["lanes_peek"]
    assert data[1]["lanes_peek"][2] == "CollectiveMismatch", data[1]["lanes_peek"]
    for kind in ("timeout", "timeout_unwatched"):
        error, elapsed, later = data[0][kind]
        assert error == "CollectiveTimeout" and 0.9 < elapsed < 4, (kind, data[0][kind])
        assert later == "CollectiveTimeout"
    dumps = {json.loads(p.read_text())["rank"] for p in (tmp_path / "fr").glob("*.json")}
    assert dumps == {0, 1}


@pytest.mark.timeout(60)
def test_dead_peer_fails_parked_and_queued_calls(tmp_path):
    results = run_scenario("fast_death", 2, tmp_path)
    assert results[1]["returncode"] == 3
    data = check_all_ok([results[0]])[0]
    for error in data["errors"]:
        assert error is not None and error["type"] == "PeerFailure" and error["rank"] == 1, error
    assert "rank 1" in data["errors"][0]["message"]
    assert data["elapsed"] < 10
