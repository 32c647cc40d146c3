"""Heartbeats: a hung (SIGSTOPped) peer is declared dead well before a collective's own
deadline; a slow but alive peer still gets the whole timeout (see test_flight_recorder's
hang scenario, which must keep ending in CollectiveTimeout)."""

import time
from types import SimpleNamespace

import pytest

from harness import check_all_ok, run_scenario
from kiln.distributed.heartbeat import Heartbeat, intervals
from kiln.distributed.store import Store, StoreServer


def test_the_timeout_hierarchy_follows_the_group_timeout():
    assert intervals(10.0) == (0.2, 2.5)
    assert intervals(1.5) == (0.05, 2.0)
    interval, dead = intervals(600.0)
    assert interval == 0.5 and dead == 10.0
    for timeout in (0.1, 1.0, 5.0, 30.0, 120.0):
        interval, dead = intervals(timeout)
        assert dead >= 5 * interval


@pytest.mark.timeout(60)
def test_a_stopped_peer_fails_the_call_with_peer_failure(tmp_path):
    data = check_all_ok(run_scenario("hung_peer", 3, tmp_path, args={"timeout": 8.0}))
    assert data[2] == {"resumed": True}
    for outcome in data[:2]:
        assert outcome["error"] == "PeerFailure" and outcome["rank"] == 2
        assert "stopped heartbeating" in outcome["message"]
        # dead after 2 s of silence (timeout 8 s / 4), checked every 0.16 s: far below 30 s
        assert outcome["elapsed"] < 6.0, outcome


def test_the_goodbye_to_a_store_that_went_away_is_bounded():
    """A member whose store host left must not spend a whole store timeout (30 s here)
    saying goodbye at exit: the beat's own call and the goodbye are both bounded."""
    server = StoreServer("127.0.0.1", 0, token="t")
    store = Store(server.address, "t", timeout=30.0)
    group = SimpleNamespace(name="world", timeout=30.0, global_ranks=[0, 1], rank=0,
                            children=[], is_aborted=False, _fail=lambda *a: None)
    beat = Heartbeat(store, group)
    deadline = time.monotonic() + 10
    while store.add("hb/0", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.add("hb/0", 0) >= 2  # it beats
    server.close()  # the host left
    time.sleep(1.5)  # the beat notices (its calls fail, then reconnect for up to 30 s)
    start = time.monotonic()
    beat.stop()
    assert time.monotonic() - start < 15  # join (<= 2 s) + goodbye (<= 2 s), not 30 s
    store.close()
