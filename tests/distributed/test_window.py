"""RMA windows: put/get/accumulate/signal into a peer's buffer without the peer calling
anything; argument errors before anything is sent; a dead peer fails pending
operations; invalidation; a world of one; the MoE example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kiln as kn
import kiln.distributed as dist
from harness import REPO, check_all_ok, run_scenario, worker_env

WORKERS = Path(__file__).with_name("window_workers.py")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_window_operations_errors_and_invalidation(tmp_path, world):
    data = check_all_ok(run_scenario("window_ops", world, tmp_path, workers=WORKERS))
    for d in data:
        assert set(d["accumulates"]) >= {"float32", "bfloat16", "float8_e4m3fn", "int32"}
    # rank 1 served rank 0's get and put while it slept, without calling kiln
    assert data[1]["served_while_sleeping"]
    assert data[0]["round_trip_s"] < 5, data[0]
    errors = data[0]["errors"]
    assert "window.put: offset 12 + 8 elements exceeds rank 0's window of 16 float32" \
        in errors["bounds"]
    assert "window.get: offset 10 + 16 elements exceeds rank 0's window" in errors["get_bounds"]
    assert "data is float64 but window" in errors["dtype"] and "float32" in errors["dtype"]
    assert "dst=%d is not a rank" % world in errors["rank"]
    assert "offset=-1" in errors["negative"]
    assert "op='avg' is not an accumulate op; use one of sum, prod, min, max" in errors["avg"]
    assert "'mean'" in errors["op"]
    assert "out has 5 elements, count is 4" in errors["out"]
    assert "out is int32" in errors["out_dtype"]
    assert "slot=-1" in errors["slot"] and "value=0" in errors["value"]
    assert "not C-contiguous" in errors["noncontig"]
    # dtype disagreement at creation: every rank raises, naming ranks and dtypes
    for d in data:
        text = d["creation_dtype"]
        assert "[K205]" in text and "different dtypes" in text
        assert "float64" in text and "rank %d" % (world - 1) in text and "float32" in text
    inval = data[0]["invalidated"]
    assert "[K214] window" in inval["pending"] and \
        "invalidated while an operation on it was pending (test)" in inval["pending"]
    for op in ("put", "wait_signal", "signal"):
        assert "window.%s: window" % op in inval[op] and "pg.window(buffer)" in inval[op]
    assert "window.put to rank 1 refused: rank 1 of group 'world' has no window" \
        in inval["freed_remote"]


@pytest.mark.timeout(60)
def test_dead_peer_fails_pending_window_operations(tmp_path):
    results = run_scenario("window_death", 3, tmp_path, workers=WORKERS)
    assert results[2]["returncode"] == -9
    for rank in (0, 1):
        d = check_all_ok([results[rank]])[0]
        for what in ("wait_signal", "pending"):
            assert d[what] == {"type": "PeerFailure", "rank": 2}, d
        assert d["later"] == "PeerFailure"
        assert d["elapsed"] < 10, d


@pytest.mark.timeout(60)
def test_operation_past_its_deadline_times_out_and_aborts(tmp_path):
    data = check_all_ok(run_scenario("window_timeout", 2, tmp_path, workers=WORKERS))
    assert data[0]["error"] == "CollectiveTimeout" and data[0]["rank"] == 1, data[0]
    # its own 0.5 s deadline, well before the 20 s wait (slack for a loaded machine)
    assert "window.put" in data[0]["message"] and data[0]["elapsed"] < 10, data[0]
    assert data[0]["later"] == "CollectiveTimeout"  # the group is aborted: at once
    assert data[1]["aborted"]


@pytest.fixture
def world_of_one():
    pg = dist.init_process_group(rank=0, world_size=1, store="127.0.0.1:0", token="t",
                                 timeout=5.0)
    try:
        yield pg
    finally:
        dist.destroy_process_group()


def test_single_process_window(world_of_one):
    pg = world_of_one
    # the recorder is per process: earlier tests' RMA records (other groups, other peers)
    # may still be in it, so only records made from here on are checked
    first_id = max((r["id"] for r in dist.recorder().snapshot("t")["records"]), default=-1) + 1
    bf16 = ml_dtypes.bfloat16
    buf = np.zeros((2, 4), bf16)
    win = pg.window(buf)
    assert win.sizes == (8,) and win.local is buf and win.dtype == bf16
    win.put(0, np.arange(3).astype(bf16), offset=1).wait()
    win.accumulate(0, np.full(8, 2, bf16), op="sum").wait()
    win.accumulate(0, np.full(8, 3, bf16), op="max").wait()
    np.testing.assert_array_equal(buf.reshape(-1).astype(np.float32), [3, 3, 3, 4, 3, 3, 3, 3])
    work = win.get(0, 2, 3)
    work.wait()
    np.testing.assert_array_equal(work.result.astype(np.float32), [3, 4, 3])
    win.signal(0, slot=5, value=3).wait()
    win.wait_signal(slot=5, value=2)
    win.wait_signal(slot=5, value=1)
    with pytest.raises(dist.CollectiveTimeout, match="slot 5 .* is at 0"):
        win.wait_signal(slot=5, timeout=0.05)
    records = [r for r in dist.recorder().snapshot("t")["records"] if r.get("rma") and r["id"] >= first_id]
    assert {r["op"] for r in records} >= {"window.put", "window.get", "window.accumulate",
                                          "window.signal"}
    assert all(r["state"] == "completed" and r["peer"] == 0 for r in records)
    win.invalidate("the group was reconfigured")
    with pytest.raises(dist.WindowInvalidated, match="re-create it with pg.window"):
        win.get(0, 0, 1)
    assert isinstance(dist.WindowInvalidated("x"), dist.DistributedError)
    with pg.window(np.zeros(2, np.int32)) as again:
        assert again.id == win.id + 1
        again.put(0, kn.tensor(np.array([4, 5], np.int32))).wait()  # a kiln Tensor works
        assert again.local.tolist() == [4, 5]
    with pytest.raises(dist.WindowInvalidated, match="freed"):
        again.put(0, np.array([1], np.int32))


@pytest.mark.timeout(90)
def test_moe_example_routes_tokens_with_put_and_signal(tmp_path):
    env = worker_env(tmp_path, "unused")
    env.pop("KILN_TOKEN")  # the launcher makes one
    proc = subprocess.run([sys.executable, "-m", "kiln", "launch", "--nproc", "4",
                           str(REPO / "examples" / "moe_rma.py"), "--tokens", "64", "--steps", "2"],
                          env=env, capture_output=True, text=True, timeout=80, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "moe_rma: 4 ranks x 64 tokens, 8 experts, dim 64:" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout
