"""kiln's native thread team (kiln/codegen/cpu/native_team.py): a region's units are
claimed from one atomic word and its caller waits only for units a thread claimed. Here
a tiny native kernel adds 1 to out[i] for each i of its range, so every point must end
at exactly 1 (a unit run twice, or skipped, shows): static cuts and claimed units, unit
counts past the claim word's 20 bits, more threads asked than workers, a team with no
worker at all (the caller runs every unit; nothing waits), concurrent callers, waking
sleeping workers, stopping a team, and GNU OpenMP where the team is turned off."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kiln.codegen.cpu import jit, native_pool, native_team, native_team_ir

pytestmark = pytest.mark.skipif(not native_team.available(),
                                reason="kiln's native team needs Linux (futex) on x86-64 or AArch64")

# fn(bufs, sizes, lo, hi): out = bufs[0] (int64), out[i] += 1 for i in [lo, hi)
_KERNEL_IR = """
define void @count(ptr %bufs, ptr %sizes, i64 %lo, i64 %hi) {
entry:
  %out = load ptr, ptr %bufs
  br label %head
head:
  %i = phi i64 [ %lo, %entry ], [ %i1, %body ]
  %more = icmp slt i64 %i, %hi
  br i1 %more, label %body, label %exit
body:
  %p = getelementptr i64, ptr %out, i64 %i
  %v = load i64, ptr %p
  %v1 = add i64 %v, 1
  store i64 %v1, ptr %p
  %i1 = add i64 %i, 1
  br label %head
exit:
  ret void
}
"""


@pytest.fixture(scope="module")
def kernel():
    engine = jit.glue_module(_KERNEL_IR)
    return engine, engine.address("count")


def _run(kernel, split, total: int, unit: int, threads: int) -> np.ndarray:
    out = np.zeros(max(total, 1), np.int64)
    bufs = (native_pool.ctypes.c_void_p * 1)(out.ctypes.data)
    sizes = (native_pool.ctypes.c_int64 * 1)(0)
    split(kernel[1], bufs, sizes, total, unit, threads)
    return out[:total]


@pytest.mark.parametrize("mode", ["for", "claim"])
@pytest.mark.parametrize("total,unit,threads", [
    (1000, 64, 2), (1000, 1, 2), (7, 64, 2), (1, 1, 2), (100_003, 64, 3), (4096, 64, 8),
    ((1 << 21) + 5, 1, 2),  # claimed: 2M units of 1 coarsened to < 2^20
])
def test_every_point_runs_exactly_once(kernel, mode, total, unit, threads):
    native_pool._built()  # the team published, its workers started
    split = native_pool.parallel_claim() if mode == "claim" else native_pool.parallel_for()
    for _ in range(3):  # workers awake, then asleep or spinning: the same result
        np.testing.assert_array_equal(_run(kernel, split, total, unit, threads), 1)


def test_a_team_without_workers_never_waits(kernel):
    """A region whose workers never arrive (here: none exists) is run by its caller,
    unit by unit, and returns: nobody waits for a thread that did not come."""
    built = native_pool._built()
    engine = built["engine"]
    lonely = native_team.Team(engine)  # no worker started
    publish = native_team.STOP_FN(engine.address("kiln_team_publish"))
    publish(lonely.address)
    try:
        for mode in ("fn", "claim"):
            np.testing.assert_array_equal(_run(kernel, built[mode], 100_000, 64, 2), 1)
    finally:
        publish(native_team._state["team"].address)


def test_concurrent_callers_each_get_their_result(kernel):
    """Two Python threads splitting at once: one holds the team, the other runs its
    region on its own thread (the team's lock word), both right."""
    split = native_pool.parallel_for()
    results, errors = [], []

    def caller():
        try:
            for _ in range(50):
                results.append(bool(np.all(_run(kernel, split, 50_000, 64, 2) == 1)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    callers = [threading.Thread(target=caller) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert not errors and len(results) == 100 and all(results)


def _word(team, k: int) -> int:
    return native_pool.ctypes.c_int64.from_address(team.address + 8 * k).value


@contextlib.contextmanager
def _spare_team(kernel, spin_us: int):
    """A published team of one worker spinning `spin_us` after a region, that has taken
    part in a region (it runs, and no wake of an earlier test is still on its way to it);
    the process's team is published again after."""
    built = native_pool._built()
    spare = native_team.Team(built["engine"])
    spare.grow(1, spin_us=spin_us)
    publish = native_team.STOP_FN(built["engine"].address("kiln_team_publish"))
    publish(spare.address)
    try:
        deadline, joined = time.monotonic() + 10, False
        while not joined and time.monotonic() < deadline:
            assert native_team.start_trace()
            _run(kernel, built["claim"], 100_000, 64, 2)
            joined = native_team.stop_trace()[0]["by_caller"] < -(-100_000 // 64)
        assert joined
        saved = native_team._state["team"]
        native_team._state["team"] = spare  # wake() and steer() act on it
        try:
            yield spare
        finally:
            native_team._state["team"] = saved
    finally:
        publish(native_team._state["team"].address)
        assert spare.stop(timeout=10)


def _asleep(team, timeout: float = 10.0) -> int:
    """The team's sleeping workers, once one sleeps or `timeout` has passed (the workers
    spin after their last region, then sleep)."""
    deadline = time.monotonic() + timeout
    while _word(team, native_team_ir.SLEEPERS) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return _word(team, native_team_ir.SLEEPERS)


def test_wake_bumps_the_sequence_of_sleeping_workers(kernel):
    with _spare_team(kernel, spin_us=1000) as team:
        assert _asleep(team) > 0
        seq = _word(team, native_team_ir.SEQ) & 0xFFFFFFFF
        native_pool.wake()
        assert _word(team, native_team_ir.SEQ) & 0xFFFFFFFF == (seq + 1) & 0xFFFFFFFF


def test_a_stopped_team_ends_its_threads(kernel):
    engine = native_pool._built()["engine"]
    spare = native_team.Team(engine)
    spare.grow(2)
    assert all(t.is_alive() for t in spare.threads)
    assert spare.stop(timeout=10)
    assert not any(t.is_alive() for t in spare.threads)


def test_gnu_openmp_where_the_team_is_off():
    """KILN_NATIVE_TEAM=0: split launches on libgomp's threads, as before the team."""
    if native_pool.openmp_runtime() is None:
        pytest.skip("needs libgomp (GNU OpenMP runtime, Debian package libgomp1)")
    code = ("import numpy as np, kiln as kn\n"
            "from kiln.runtime import threads\n"
            "from kiln.codegen.cpu import native_pool\n"
            "kn.set_num_threads(2); threads.set_dynamic_threads(False); threads.set_split_policy('always')\n"
            "f = kn.compile(lambda x: kn.exp(x) * 2.0 + 1.0)\n"
            "x = np.random.default_rng(0).standard_normal((1 << 20) + 37).astype(np.float32)\n"
            "for _ in range(3):\n"
            "    np.testing.assert_allclose(f(kn.tensor(x)).numpy(),\n"
            "        (np.exp(x.astype(np.float64)) * 2 + 1).astype(np.float32), rtol=2e-6, atol=1e-6)\n"
            "assert native_pool._built()['team'] is False\n"
            "print('ok')\n")
    env = dict(os.environ, KILN_NATIVE_TEAM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_team_grows_with_set_num_threads(kernel):
    import kiln as kn

    before = kn.get_num_threads()
    kn.set_num_threads(max(3, before))
    try:
        split = native_pool.parallel_for()  # the team grown to kn.get_num_threads() - 1 workers
        assert len(native_team._state["team"].threads) >= kn.get_num_threads() - 1
        np.testing.assert_array_equal(_run(kernel, split, 100_003, 64, kn.get_num_threads()), 1)
    finally:
        kn.set_num_threads(before)


def test_the_timeline_records_each_region(kernel):
    """`start_trace`/`stop_trace`: one record per region (its units, the caller's share,
    timestamps in order on CLOCK_MONOTONIC), one per wake of sleeping workers, nothing
    once stopped; the regions' results are unchanged while tracing."""
    native_pool._built()
    assert native_team.stop_trace() == []  # never started
    assert native_team.start_trace(capacity=16)
    before = time.monotonic_ns()
    np.testing.assert_array_equal(_run(kernel, native_pool.parallel_for(), 100_000, 64, 2), 1)
    np.testing.assert_array_equal(_run(kernel, native_pool.parallel_claim(), 1000, 64, 2), 1)
    regions = native_team.stop_trace()
    after = time.monotonic_ns()
    assert [r["kind"] for r in regions] == ["cut", "claim"]
    assert [r["units"] for r in regions] == [2, 16]  # 1000 points claimed 64 at a time
    for r in regions:
        assert before <= r["start"] <= r["own_done"] <= r["end"] <= after
        assert 0 <= r["by_caller"] <= r["units"]
        # a worker's first claim, where one claimed, falls inside the region
        assert r["first_claim"] == 0 or r["start"] <= r["first_claim"] <= r["end"]
        if r["by_caller"] < r["units"]:  # a worker ran the rest
            assert r["first_claim"] > 0
    # the buffer holds at most `capacity` records; stopped, nothing more is recorded
    assert native_team.start_trace(capacity=2)
    for _ in range(5):
        _run(kernel, native_pool.parallel_for(), 10_000, 64, 2)
    assert len(native_team.stop_trace()) == 2
    _run(kernel, native_pool.parallel_for(), 10_000, 64, 2)
    assert native_team.stop_trace() == []


# fn(bufs, sizes, lo, hi): as @count, but the unit starting at 0 first spins 2 ms and
# the one at 1 20 ms (CLOCK_MONOTONIC): the caller claims unit 0 first, a running worker
# then claims unit 1, which keeps the caller waiting
_SLOW_LAST_IR = """
declare i32 @clock_gettime(i32, ptr)

define internal i64 @now() {
entry:
  %ts = alloca [2 x i64]
  call i32 @clock_gettime(i32 1, ptr %ts)
  %s = load i64, ptr %ts
  %pn = getelementptr i64, ptr %ts, i64 1
  %ns = load i64, ptr %pn
  %a = mul i64 %s, 1000000000
  %r = add i64 %a, %ns
  ret i64 %r
}

define void @slow_last(ptr %bufs, ptr %sizes, i64 %lo, i64 %hi) {
entry:
  %out = load ptr, ptr %bufs
  %slow = icmp ult i64 %lo, 2
  br i1 %slow, label %start, label %head
start:
  %t0 = call i64 @now()
  %first = icmp eq i64 %lo, 0
  %long = select i1 %first, i64 2000000, i64 20000000
  %until = add i64 %t0, %long
  br label %spin
spin:
  %t = call i64 @now()
  %more_time = icmp slt i64 %t, %until
  br i1 %more_time, label %spin, label %head
head:
  %i = phi i64 [ %lo, %entry ], [ %lo, %spin ], [ %i1, %body ]
  %more = icmp slt i64 %i, %hi
  br i1 %more, label %body, label %exit
body:
  %p = getelementptr i64, ptr %out, i64 %i
  %v = load i64, ptr %p
  %v1 = add i64 %v, 1
  store i64 %v1, ptr %p
  %i1 = add i64 %i, 1
  br label %head
exit:
  ret void
}
"""


def test_the_join_wait_counts_what_callers_waited_for_workers(kernel):
    """`join_wait_ns` grows by what a region's caller waited, after its own units, for a
    unit a worker claimed: ~20 ms where the worker ran the slow unit, little where the
    caller ran it itself (it waited inside its own units, not for a worker)."""
    slow = jit.glue_module(_SLOW_LAST_IR)
    fn = slow.address("slow_last")
    claim = native_pool._built()["claim"]
    with _spare_team(kernel, spin_us=500_000):
        seen = set()
        for _ in range(50):  # (a worker without its core now and then: the caller runs both)
            before = native_team.join_wait_ns()
            assert native_team.start_trace()
            np.testing.assert_array_equal(_run((slow, fn), claim, 2, 1, 2), 1)
            region = native_team.stop_trace()[0]
            waited = native_team.join_wait_ns() - before
            tail = region["end"] - region["own_done"]
            assert 0 <= waited <= tail  # measured inside the caller's join
            if region["by_caller"] < 2 and tail >= 15_000_000:  # a worker ran the slow unit
                assert waited >= tail // 2
                seen.add("worker")
            elif region["own_done"] - region["start"] >= 15_000_000:  # the caller ran it
                assert waited < 15_000_000
                seen.add("caller")
            if "worker" in seen:
                break
        assert "worker" in seen


def test_the_timeline_shows_a_wake_of_sleeping_workers(kernel):
    with _spare_team(kernel, spin_us=1000) as team:
        assert _asleep(team) > 0
        assert native_team.start_trace()
        native_pool.wake()
        regions = native_team.stop_trace()
    assert [r["kind"] for r in regions] == ["wake"] and regions[0]["units"] == 0


def test_a_quiet_region_lets_its_workers_sleep_at_once(kernel):
    """A region whose thread count carries QUIET_WORKERS is split as any other (every
    point once), and its workers sleep right after it: here a team whose worker would
    spin 10 minutes after an ordinary region is asleep (a bounded wait) after a quiet
    one, and the trace marks the region quiet."""
    built = native_pool._built()
    with _spare_team(kernel, spin_us=600_000_000) as spare:
        assert native_team.start_trace()
        quiet = 2 | native_team_ir.QUIET_WORKERS
        for mode in ("fn", "claim"):
            np.testing.assert_array_equal(_run(kernel, built[mode], 100_000, 64, quiet), 1)
        regions = native_team.stop_trace()
        assert [r["quiet"] for r in regions] == [True, True]
        assert [r["units"] for r in regions] == [2, -(-100_000 // 64)]  # 2 threads, not 65538
        assert _asleep(spare) == 1  # asleep long before its spin ends
        # an ordinary region wakes it again; its results are right
        np.testing.assert_array_equal(_run(kernel, built["fn"], 100_000, 64, 2), 1)


def test_waking_steers_sleeping_workers_off_the_callers_cpu(kernel):
    """wake() of sleeping workers first sets each worker's affinity to the caller's
    allowed CPUs minus the one it runs on (a woken worker placed on its waker's CPU would
    spin beside it); the regions after are right."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs this process may use")
    built = native_pool._built()
    with _spare_team(kernel, spin_us=1000) as team:
        assert _asleep(team) > 0
        native_pool.wake()
        key = native_team._state.get("steered")
        assert key is not None and key[0] == id(team)
        for t in team.threads:
            assert os.sched_getaffinity(t.native_id) == allowed - {key[1]}
        np.testing.assert_array_equal(_run(kernel, built["fn"], 100_000, 64, 2), 1)


def test_a_split_launch_from_python_steers_the_workers_first(kernel):
    """A split launch called from Python (`parallel_claim()`/`parallel_for()`, not a
    prepared call's `wake`) steers the workers off the caller's CPU too: a sleeping worker
    its region wakes would otherwise land on the caller's CPU and hold it."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs this process may use")
    with _spare_team(kernel, spin_us=1000) as team:
        native_team._state.pop("steered", None)
        for t in team.threads:  # as a worker started before any steering
            os.sched_setaffinity(t.native_id, allowed)
        for get in (native_pool.parallel_claim, native_pool.parallel_for):
            split = get()
            key = native_team._state.get("steered")
            assert key is not None and key[0] == id(team)
            for t in team.threads:
                assert os.sched_getaffinity(t.native_id) == allowed - {key[1]}
            np.testing.assert_array_equal(_run(kernel, split, 100_000, 64, 2), 1)
            native_team._state.pop("steered", None)
