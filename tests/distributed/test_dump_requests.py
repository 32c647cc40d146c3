"""Flight Recorder dump requests through the store, in one process: watchers read and
acknowledge them, skip a request whose poster died half-way, and the store host's linger
waits for exactly the watchers still connected and behind (the multi-process case, a
store host leaving right after a timeout, is in test_groups_and_failures and test_mpi)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kiln.distributed import dump_requests as dr
from kiln.distributed.errors import RendezvousError
from kiln.distributed.flight_recorder import recorder
from kiln.distributed.store import Store, StoreServer


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, token="t")
    yield srv
    srv.close()


@pytest.fixture
def fr_dir(tmp_path):
    """The process-wide recorder dumps into tmp_path for the test, as before after."""
    rec = recorder()
    saved = rec.dump_dir
    rec.dump_dir = str(tmp_path)
    yield tmp_path
    rec.dump_dir = saved


def fake_watcher(server, rank: int, acked: int) -> Store:
    """A connection holding a watcher's acknowledgement key, as a peer's watcher would."""
    client = Store(server.address, "t", timeout=5)
    key = dr.WATCH_PREFIX + str(client.add(dr._WATCH_IDS, 1))
    client.set(key, json.dumps({"rank": rank, "acked": acked}), ephemeral=True)
    return client


def until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_watcher_dumps_for_each_request_and_acknowledges_it(server, fr_dir):
    store = Store(server.address, "t", timeout=5)
    watcher = dr.DumpWatcher(store)
    try:
        other = recorder().rank + 1
        assert dr.post_request(store, "CollectiveTimeout on rank %d" % other, other) == 1
        assert until(lambda: watcher.acked == 1)
        dump = json.loads((fr_dir / ("kiln_fr_rank%d.json" % recorder().rank)).read_text())
        assert dump["reason"] == "requested by rank %d: CollectiveTimeout on rank %d" % (
            other, other)
        # its own request: acknowledged, no second dump (the failing rank dumped already)
        (fr_dir / ("kiln_fr_rank%d.json" % recorder().rank)).unlink()
        dr.post_request(store, "mine", recorder().rank)
        assert until(lambda: watcher.acked == 2)
        assert not list(fr_dir.glob("kiln_fr_rank*.json"))
        [key] = store.list_keys(dr.WATCH_PREFIX)
        assert json.loads(store.get(key)) == {"rank": recorder().rank, "acked": 2}
        assert dr.linger(server, 0.0)
    finally:
        watcher.stop(wait=10)
    assert not watcher._thread.is_alive()
    # its acknowledgement key went with its connection: a host never waits for it
    assert until(lambda: store.list_keys(dr.WATCH_PREFIX) == [])


def test_a_request_numbered_but_never_written_is_skipped(server, fr_dir):
    """Its poster died between the two store operations: the requests after it are
    still served (the watcher used to wait for the missing one for good)."""
    store = Store(server.address, "t", timeout=5)
    watcher = dr.DumpWatcher(store)
    try:
        assert store.add(dr.GEN_KEY, 1) == 1  # numbered; `fr/dump/1` never comes
        dr.post_request(store, "after the gap", recorder().rank + 1)
        assert until(lambda: watcher.acked == 2, timeout=20)
        dump = json.loads((fr_dir / ("kiln_fr_rank%d.json" % recorder().rank)).read_text())
        assert dump["reason"].endswith("after the gap")
    finally:
        watcher.stop(wait=10)


def test_linger_waits_only_for_connected_watchers_behind(server):
    store = Store(server.address, "t", timeout=5)
    behind = fake_watcher(server, rank=1, acked=0)
    assert dr.linger(server, 0.2)  # no request posted: nothing to wait for
    dr.post_request(store, "x", rank=0)
    assert dr.pending_watchers(server.contents()) == [1]
    start = time.monotonic()
    assert not dr.linger(server, 0.3)  # bounded: gives up, and says so
    assert time.monotonic() - start >= 0.3
    assert dr.linger(server, 0.3, dead={1})  # the heartbeat declared it dead

    def acknowledge():
        [key] = behind.list_keys(dr.WATCH_PREFIX)
        behind.set(key, json.dumps({"rank": 1, "acked": 1}), ephemeral=True)

    timer = threading.Timer(0.2, acknowledge)
    timer.start()
    assert dr.linger(server, 30)  # returns once it acknowledged
    timer.join()
    # a second watcher behind, whose process then goes (its connection closes)
    gone = fake_watcher(server, rank=2, acked=1)
    dr.post_request(store, "y", rank=0)
    assert dr.pending_watchers(server.contents()) == [1, 2]
    behind.close()
    threading.Timer(0.2, gone.close).start()
    assert dr.linger(server, 30)


def test_linger_ends_when_the_store_closes(server):
    behind = fake_watcher(server, rank=1, acked=0)
    dr.post_request(Store(server.address, "t", timeout=5), "x", rank=0)
    assert not dr.linger(server, 0.1)
    start = time.monotonic()
    threading.Timer(0.2, server.close).start()
    dr.linger(server, 30)  # the closed store dropped the key: no watcher is left behind
    assert time.monotonic() - start < 20  # far below the 30 s it would otherwise wait
    behind.close()


def test_linger_seconds_from_the_environment(monkeypatch):
    monkeypatch.delenv("KILN_FR_LINGER", raising=False)
    assert dr.linger_seconds() == dr.DEFAULT_LINGER == 5.0
    monkeypatch.setenv("KILN_FR_LINGER", "0")
    assert dr.linger_seconds() == 0.0
    monkeypatch.setenv("KILN_FR_LINGER", "2.5")
    assert dr.linger_seconds() == 2.5
    for bad in ("soon", "-1", "nan", "1e9"):
        monkeypatch.setenv("KILN_FR_LINGER", bad)
        with pytest.raises(RendezvousError, match="KILN_FR_LINGER"):
            dr.linger_seconds()


def test_flush_waits_for_a_failure_still_being_handled(server):
    """A failing group holds from the moment its failure is visible until its request is
    posted: an exit (flush, then the host's linger) in between must wait for the post,
    or the linger sees no request and the store goes before the peers read it."""
    store = Store(server.address, "t", timeout=5)
    held = dr.Hold()

    def handle_failure():
        time.sleep(0.3)  # the backend's abort has woken the waiter, who is exiting
        dr.post_request_async(store, "CollectiveTimeout on rank 0", rank=0)
        held.release()

    thread = threading.Thread(target=handle_failure)
    thread.start()
    start = time.monotonic()
    dr.flush_dump_requests(timeout=5)
    assert 0.25 < time.monotonic() - start < 4
    assert int(server.contents()[dr.GEN_KEY]) == 1  # posted before flush returned
    thread.join(5)
    held.release()  # once only: a second release changes nothing
    start = time.monotonic()
    dr.flush_dump_requests(timeout=5)
    assert time.monotonic() - start < 0.2
    store.close()


def test_flush_is_bounded_by_a_hold_never_released():
    held = dr.Hold()
    start = time.monotonic()
    dr.flush_dump_requests(timeout=0.3)
    assert 0.25 < time.monotonic() - start < 2
    held.release()
