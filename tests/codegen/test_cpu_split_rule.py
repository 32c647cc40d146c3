"""Which launches split over threads is measured per launch (kiln/codegen/cpu/split_rule.py):
the verdict from timed serial and split calls (durations injected here, so the tests
decide nothing by the clock), at once where the first pair leaves no doubt, the
policies, stale verdicts measured again (only where the load changed), and end to end:
a compiled program's results against numpy while its launches are measured, after the
verdict (a prepared call's trampoline entering the region natively), with kn.set_num_threads,
for the GEMMs claimed on OpenMP threads, and in a forked child."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import compiled as cc
from kiln.codegen.cpu import native_pool, split_rule
from kiln.codegen.cpu.split_rule import TRIALS, Split
from kiln.errors import KilnArgumentError
from kiln.runtime import threads

from tests.codegen.test_cpu_native_pool import _in_child, split_runs

needs_gomp = pytest.mark.skipif(native_pool.parallel_for() is None,
                                reason="needs libgomp (GNU OpenMP runtime, Debian package libgomp1)")


@pytest.fixture
def two_threads(monkeypatch):
    """2 threads, the measured policy, no other process's load counted; what a split's
    regions waited for workers unknown (as on libgomp: a slow split is taken to have
    waited for a core; `_waits` injects it)."""
    before, policy = kn.get_num_threads(), threads.split_policy()
    kn.set_num_threads(2)
    threads.set_split_policy("measure")
    monkeypatch.setattr(threads, "_dynamic", False)
    monkeypatch.setattr(split_rule, "join_wait_ns", lambda: None)
    yield
    kn.set_num_threads(before)
    threads.set_split_policy(policy)


def _measure(s: Split, serial_ns: int, split_ns: int) -> list[int]:
    """Drive `s` through its trials with fixed durations; the thread counts it chose."""
    chosen = []
    for _ in range(2 * TRIALS + 1):
        n, timed = s.next()
        chosen.append(n)
        if timed:
            s.report(n, split_ns if n > 1 else serial_ns)
    return chosen


def test_the_first_call_is_serial_then_split_and_serial_alternate(two_threads):
    s = Split(False, 64, 2)
    chosen = _measure(s, serial_ns=100_000, split_ns=80_000)  # 0.8x: not decisive
    assert chosen == [1] + [2, 1] * TRIALS  # warm-up, then alternating, timed
    assert s.verdict is True and s.decided() and s.splits()
    assert [s.next() for _ in range(3)] == [(2, True)] * 3  # decided: timed only to catch waits


@pytest.mark.parametrize("split_ns,verdict", [(95_000, False), (89_000, True), (400_000, False),
                                              (61_000, True), (129_000, False)])
def test_a_launch_splits_only_where_splitting_was_faster(two_threads, split_ns, verdict):
    s = Split(False, 1, 2)
    _measure(s, serial_ns=100_000, split_ns=split_ns)
    assert s.verdict is verdict  # WIN = 0.9: 5% faster is not enough, 11% is
    assert s.next() == ((2, True) if verdict else (1, False))


@pytest.mark.parametrize("serial_ns,split_ns,verdict", [
    (400_000, 240_000, True),  # 0.6x of 0.4 ms: split at once
    (100_000, 50_000, None),  # 0.5x of 0.1 ms: too short to trust one pair
    (20_000, 45_000, False),  # 2.25x, 25 us more: serial at once
    (100_000, 130_000, False),
])
def test_a_wide_margin_decides_after_one_pair(two_threads, serial_ns, split_ns, verdict):
    s = Split(False, 1, 2)
    assert s.next() == (1, False)  # the warm-up
    assert s.next() == (2, True)
    s.report(2, split_ns)
    assert s.verdict is None and s.next() == (1, True)
    s.report(1, serial_ns)
    assert s.verdict is verdict and s.decided() is (verdict is not None)
    if verdict is not None:
        assert s.next() == ((2, True) if verdict else (1, False))


@pytest.mark.parametrize("serial_ns,split_ns", [
    (100_000, 330_000),  # 3.3x: SLOW, it may have waited for a core
    (150_000, 400_000),  # 2.7x, but 250 us more (SLOW_NS): a time slice's wait, maybe
])
def test_a_split_that_may_have_waited_for_a_core_does_not_decide_at_once(two_threads, serial_ns, split_ns):
    s = Split(False, 1, 2)
    s.next()  # the warm-up
    for n in (2, 1):
        assert s.next() == (n, True)
        s.report(n, split_ns if n > 1 else serial_ns)
    assert s.verdict is None  # measured on: the best times decide
    _measure(s, serial_ns, serial_ns // 2)
    assert s.verdict is True


def test_a_load_spike_in_one_trial_does_not_decide(two_threads):
    s = Split(False, 1, 2)
    durations = iter([2_500_000, 20_000, 21_000])  # one split waited a time slice for a core
    for _ in range(2 * TRIALS + 1):
        n, timed = s.next()
        if timed:
            s.report(n, next(durations) if n > 1 else 40_000)
    assert s.verdict is True  # the best times decide


def test_policies_and_large_launches(two_threads):
    s = Split(False, 1, 2)
    threads.set_split_policy("never")
    assert s.next() == (1, False) and s.decided() and not s.splits()
    threads.set_split_policy("always")
    assert s.next() == (2, False) and s.decided() and s.splits()
    threads.set_split_policy("measure")
    assert s.next() == (1, False) and not s.decided()  # the warm-up call
    sure = Split(True, 4, None, sure=True)  # far above a region's cost: split unmeasured
    assert sure.next() == (2, True) and sure.decided() and sure.splits()
    with pytest.raises(KilnArgumentError, match="set_split_policy"):
        threads.set_split_policy("sometimes")


def test_a_verdict_is_measured_again_at_another_thread_count_or_after_a_while(two_threads, monkeypatch):
    s = Split(False, 1, 2)
    _measure(s, 100_000, 10_000)
    assert s.verdict is True
    kn.set_num_threads(1)
    assert s.next() == (1, False)  # one thread: serial, nothing timed
    assert s.decided() and not s.splits()  # nothing to measure at one thread
    kn.set_num_threads(2)  # back at the count it was measured at: the verdict holds
    assert s.decided() and s.splits() and s.next() == (2, True)
    s.report(2, 10_000)
    kn.set_num_threads(3)  # another count: stale, a new warm-up, then trials
    assert not s.decided() and s.next() == (1, False)
    _measure(s, 100_000, 80_000)  # 0.8x: three pairs (a verdict on one pair: below)
    assert s.decided() and s.verdict is True
    # REMEASURE_S later: measured again only where other processes' load changed since
    now = split_rule.time.monotonic()
    monkeypatch.setattr(split_rule.time, "monotonic", lambda: now + split_rule.REMEASURE_S)
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: s._load_at + 0.2)
    assert s.decided() and s.verdict is True and s.next() == (2, True)  # kept
    monkeypatch.setattr(split_rule.time, "monotonic", lambda: now + 2 * split_rule.REMEASURE_S + 1)
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: s._load_at + split_rule.LOAD_CHANGE)
    assert not s.decided()
    assert s.next() == (2, True) and s.verdict is None  # a trial at once: no warm-up call


def _exp_program():
    return kn.compile(lambda x: kn.exp(x) * 2.0 + 1.0)


def _want(x):
    return (np.exp(x.astype(np.float64)) * 2.0 + 1.0).astype(np.float32)


def _fake_clock(monkeypatch, launch_ratio: float, run_ratio: float = 0.5, launch_serial: int = 10_000,
                run_serial: int = 10_000) -> dict:
    """Every timed call reports a serial time (`launch_serial` ns for a launch,
    `run_serial` for a prepared call's whole run) and a split one `launch_ratio` x or
    `run_ratio` x that; the thread counts of the timed calls seen, per kind."""
    seen = {"launch": [], "run": []}
    real = Split.report

    def report(self, n, ns):
        kind = "run" if self.win == split_rule.RUN_WIN else "launch"
        if self.verdict is None:  # a trial (after the verdict, splits are timed too)
            seen[kind].append(n)
        ratio, serial = (launch_ratio, launch_serial) if kind == "launch" else (run_ratio, run_serial)
        real(self, n, int(serial * ratio) if n > 1 else serial)

    monkeypatch.setattr(Split, "report", report)
    return seen


def _trampoline_threads(f, monkeypatch) -> list:
    """(threads, loose) each of f's prepared native runs is entered with, from now on:
    the threads of its sure splits and of its measured ones."""
    seen = []
    for call in f._fast.values():
        for part in call.plan._parts if call else ():
            if part[0] == "launches" and part[3] is not None:
                real = part[3][0]
                part[3] = (lambda *a, real=real: (seen.append(a[4:6]), real(*a))[1],) + part[3][1:]
    return seen


@needs_gomp
@pytest.mark.parametrize("ratio,serial,pairs", [(0.1, 400_000, 1), (0.1, 10_000, TRIALS), (2.0, 10_000, 1),
                                                (0.8, 10_000, TRIALS), (10.0, 10_000, TRIALS)])
def test_a_compiled_program_is_right_while_measured_and_after(two_threads, monkeypatch, ratio, serial, pairs):
    split_faster = ratio < 1
    seen = _fake_clock(monkeypatch, ratio, launch_serial=serial)
    f = _exp_program()
    n = (1 << 18) + 3  # 2^20 element-operations: a candidate, below SURE_WORK
    rng = np.random.default_rng(0)
    for call in range(2 * TRIALS + 4):
        x = rng.standard_normal(n).astype(np.float32)
        np.testing.assert_allclose(f(kn.tensor(x)).numpy(), _want(x), rtol=2e-6, atol=1e-6)
    # trials bounded (one pair where it decides), then decided
    assert sorted(seen["launch"]) == [1] * pairs + [2] * pairs
    # the prepared call laid its launches out again once the verdict was in: the
    # split launch is a record of its native run (entered by the trampoline), or serial
    assert split_runs(f) == ([True] if split_faster else [])  # one serial launch: no list
    from kiln.runtime.fast_call import FastPlan

    layouts = []
    real_lay_out = FastPlan._lay_out
    monkeypatch.setattr(FastPlan, "_lay_out", lambda self: (layouts.append(1), real_lay_out(self))[1])
    for call in range(6):  # one thread, then two, call by call (a benchmark's 1t column)
        kn.set_num_threads(1 + call % 2)  # one thread: the same results, nothing split or timed
        x = rng.standard_normal(n).astype(np.float32)
        np.testing.assert_allclose(f(kn.tensor(x)).numpy(), _want(x), rtol=2e-6, atol=1e-6)
    # nothing measured again, and the plan runs its two-thread layout at one thread
    assert len(seen["launch"]) == 2 * pairs and layouts == []
    assert split_runs(f) == ([True] if split_faster else [])


@needs_gomp
@pytest.mark.parametrize("run_ratio,pairs", [(0.8, TRIALS), (1.05, TRIALS), (0.5, 1)])
def test_a_prepared_call_keeps_its_splits_only_where_its_whole_run_is_faster(two_threads, monkeypatch,
                                                                                  run_ratio, pairs):
    run_faster = run_ratio < split_rule.RUN_WIN
    seen = _fake_clock(monkeypatch, 0.1, run_ratio, launch_serial=400_000, run_serial=400_000)
    f = _exp_program()
    n = (1 << 18) + 3
    rng = np.random.default_rng(1)

    def call():
        x = rng.standard_normal(n).astype(np.float32)
        np.testing.assert_allclose(f(kn.tensor(x)).numpy(), _want(x), rtol=2e-6, atol=1e-6)

    for _ in range(2 * TRIALS + 2):  # the launch's verdict: split
        call()
    assert split_runs(f) == [True]
    for _ in range(2 * TRIALS + 1):  # the whole run's trials: a warm-up run, then alternating
        call()
    assert sorted(seen["run"]) == [1] * pairs + [2] * pairs
    entered = _trampoline_threads(f, monkeypatch)
    for _ in range(3):
        call()
    # loose 1: the trampoline runs the measured split serial
    assert entered == [(2, 2 if run_faster else 1)] * 3


@needs_gomp
def test_a_run_of_sure_splits_is_not_measured(two_threads, monkeypatch):
    """A launch far above a region's cost splits unmeasured, and a prepared call whose
    split launches are all such runs no whole-run trials: every native run splits."""
    seen = _fake_clock(monkeypatch, 10.0, 10.0)  # were anything measured, it would not split
    f = _exp_program()
    n = 1 << 20  # ~12 element-operations a point: above SURE_WORK
    rng = np.random.default_rng(2)
    entered = None
    for call in range(8):
        x = rng.standard_normal(n).astype(np.float32)
        np.testing.assert_allclose(f(kn.tensor(x)).numpy(), _want(x), rtol=2e-6, atol=1e-6)
        if entered is None and split_runs(f) == [True]:  # the prepared call's plan is made
            entered = _trampoline_threads(f, monkeypatch)
    assert seen == {"launch": [], "run": []}
    assert split_runs(f) == [True]
    assert entered and all(e[0] == 2 for e in entered)


@needs_gomp
def test_claimed_gemm_splits_match_numpy_in_prepared_calls_and_a_forked_child(two_threads):
    """Batched products split by whole batch items claimed on OpenMP threads (kiln's
    micro-kernel for float32, BLAS for float64) and a large product's row panels: the
    same results as numpy on the general path, in prepared calls (the trampoline's
    claimed records), and in a child forked after the regions ran."""
    threads.set_split_policy("always")
    rng = np.random.default_rng(3)
    cases = []
    for dtype, tol in ((np.float32, 1e-4), (np.float64, 1e-10)):
        a = rng.standard_normal((16, 32, 256)).astype(dtype)
        b = rng.standard_normal((16, 256, 64)).astype(dtype)
        cases.append((kn.compile(lambda a, b: a @ b), a, b, tol))
    a = rng.standard_normal((1024, 128)).astype(np.float32)  # 2^24 multiply-adds: panels
    b = rng.standard_normal((128, 128)).astype(np.float32)
    cases.append((kn.compile(lambda a, b: kn.relu(a @ b)), a, b, 1e-4))

    def check() -> bool:
        for f, a, b, tol in cases:
            want = np.matmul(a.astype(np.float64), b.astype(np.float64))
            if f is cases[-1][0]:
                want = np.maximum(want, 0)
            for _ in range(3):  # the general path, then prepared calls
                np.testing.assert_allclose(f(kn.tensor(a), kn.tensor(b)).numpy(), want, rtol=tol, atol=tol)
        return True

    check()
    assert all(split_runs(f) == [True] for f, *_ in cases)
    assert _in_child(check) == 0


def test_a_launch_that_cannot_be_measured_runs_serial(two_threads, monkeypatch):
    s = Split(False, 1, 2)
    monkeypatch.setattr(split_rule, "parallel_threads", lambda: 1)  # another process holds a CPU
    for _ in range(split_rule.UNTRIED):
        assert not s.decided() and s.next() == (1, False)
    assert s.decided() and s.verdict is False  # a prepared call runs it natively, serial
    monkeypatch.setattr(split_rule, "parallel_threads", lambda: 2)
    assert s.next() == (1, False)  # until RETRY_S has passed


def test_an_unmeasured_serial_verdict_is_tried_again(two_threads, monkeypatch):
    s = Split(False, 1, 2)
    monkeypatch.setattr(split_rule, "parallel_threads", lambda: 1)
    for _ in range(split_rule.UNTRIED):
        s.next()
    assert s.decided() and s.provisional
    now = split_rule.time.monotonic()
    monkeypatch.setattr(split_rule.time, "monotonic", lambda: now + split_rule.RETRY_S + 0.1)
    monkeypatch.setattr(split_rule, "parallel_threads", lambda: 2)
    assert not s.decided()  # a prepared call lays its launches out again
    assert s.next() == (2, True) and not s.provisional  # trials (its pages are warm)


def test_a_split_that_waited_for_a_core_backs_off(two_threads, monkeypatch):
    """A split call several times slower than the launch's best split (another process
    took the core in a burst the load sampling missed): regions run on one thread for
    BACKOFF_S, then split again."""
    monkeypatch.setattr(threads, "_dynamic", True)
    monkeypatch.setattr(threads, "others_busy_cpus", lambda: 0.0)
    monkeypatch.setattr(threads, "_backoff_until", 0.0)
    s = Split(False, 1, 2)
    _measure(s, serial_ns=100_000, split_ns=50_000)
    n, timed = s.next()
    assert (n, timed) == (2, True)
    s.report(n, 120_000)  # slower, but within SLOW x best or SLOW_NS: no back-off
    assert s.next() == (2, True)
    s.report(2, 2_700_000)  # a time slice's wait
    assert threads.parallel_threads() == 1 and s.next() == (1, False)
    now = threads.time.monotonic()
    monkeypatch.setattr(threads.time, "monotonic", lambda: now + threads.BACKOFF_S + 0.1)
    assert threads.parallel_threads() == 2


@needs_gomp
def test_the_whole_run_check_runs_only_its_measured_splits_serial(two_threads, monkeypatch):
    """A run with a sure split and a measured one: the whole-run check's serial trials,
    and a verdict against the measured split, keep the sure one split (the trampoline's
    threads 2, loose 1); results as numpy throughout."""
    seen = _fake_clock(monkeypatch, 0.1, 1.05)  # the launch wins alone, the run does not
    f = kn.compile(lambda x, y: (kn.exp(x) * 2.0 + 1.0, kn.tanh(y) * 3.0))
    rng = np.random.default_rng(4)
    x = rng.standard_normal(1 << 20).astype(np.float32)  # sure
    y = rng.standard_normal((1 << 18) + 3).astype(np.float32)  # a measured candidate
    entered = None
    for call in range(4 * TRIALS + 6):
        a, b = f(kn.tensor(x), kn.tensor(y))
        np.testing.assert_allclose(a.numpy(), _want(x), rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(b.numpy(), np.tanh(y.astype(np.float64)) * 3.0, rtol=2e-6, atol=1e-6)
        if entered is None and seen["run"]:  # the run's trials began: watch them
            entered = _trampoline_threads(f, monkeypatch)
    assert sorted(seen["run"]) == [1] * TRIALS + [2] * TRIALS
    assert entered and all(threads == 2 for threads, _ in entered)  # the sure split, always
    assert [loose for _, loose in entered][-3:] == [1, 1, 1]  # the measured one: serial
    assert 1 in [loose for _, loose in entered[:-3]]  # (and in the serial trials)


def test_a_split_trial_that_waited_for_a_core_backs_off(two_threads, monkeypatch):
    """A split trial far slower than the launch's serial one (a time slice's wait for a
    core): regions run on one thread for a while, so the next trials wait too."""
    monkeypatch.setattr(threads, "_dynamic", True)
    monkeypatch.setattr(threads, "others_busy_cpus", lambda: 0.0)
    monkeypatch.setattr(threads, "_backoff_until", 0.0)
    s = Split(False, 1, 2)
    assert s.next() == (1, False)  # the warm-up
    assert s.next() == (2, True)
    s.report(2, 60_000)
    assert s.next() == (1, True)
    s.report(1, 50_000)
    assert s.verdict is None and threads.parallel_threads() == 2  # 1.2x: no sign of a wait
    assert s.next() == (2, True)
    s.report(2, 2_500_000)  # 50x the serial time, 2.45 ms more
    assert threads.parallel_threads() == 1 and s.verdict is None
    assert s.next() == (1, False)  # no trial while regions back off


@needs_gomp
def test_a_prepared_call_wakes_the_team_only_when_it_splits(two_threads, monkeypatch):
    """A prepared call with a split launch wakes sleeping workers as it starts, where it
    will split; at one thread (another process holds the other CPU) it wakes nobody."""
    wakes = []
    monkeypatch.setattr(native_pool, "wake", lambda: wakes.append(1))
    f = _exp_program()
    x = np.random.default_rng(5).standard_normal(1 << 20).astype(np.float32)  # a sure split
    for _ in range(4):
        np.testing.assert_allclose(f(kn.tensor(x)).numpy(), _want(x), rtol=2e-6, atol=1e-6)
    assert split_runs(f) == [True] and wakes
    wakes.clear()
    monkeypatch.setattr(split_rule, "parallel_threads", lambda: 1)
    for _ in range(3):
        np.testing.assert_allclose(f(kn.tensor(x)).numpy(), _want(x), rtol=2e-6, atol=1e-6)
    assert wakes == []


def test_a_verdict_taken_on_one_pair_is_checked_once_more(two_threads, monkeypatch):
    """A one-pair verdict is measured again after REMEASURE_S even at the same load (one
    pair, no warm-up call); once a pair repeats it, it is kept while the load stays."""
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: 0.3)
    clock = [split_rule.time.monotonic()]
    monkeypatch.setattr(split_rule.time, "monotonic", lambda: clock[0])
    s = Split(False, 1, 2)

    def pair(split_ns: int, serial_ns: int) -> None:
        for n in (2, 1):
            assert s.next() == (n, True)
            s.report(n, split_ns if n > 1 else serial_ns)

    assert s.next() == (1, False)  # the warm-up
    pair(200_000, 400_000)  # 0.5x of 0.4 ms: split on one pair
    assert s.verdict is True and s.decided()
    clock[0] += split_rule.REMEASURE_S
    assert not s.decided()  # same load, but a one-pair verdict: measured again
    pair(220_000, 400_000)  # no warm-up call; the same verdict: confirmed
    assert s.verdict is True
    clock[0] += split_rule.REMEASURE_S
    assert s.decided() and s.next() == (2, True)  # kept: same load, confirmed


def _pairs(s: Split, times: list[tuple[int, int]]) -> None:
    """Report (split, serial) trial pairs to `s`, in the order it asks for them."""
    for split_ns, serial_ns in times:
        for n in (2, 1):
            assert s.next() == (n, True)
            s.report(n, split_ns if n > 1 else serial_ns)


def test_a_large_claimed_split_measures_more_pairs_before_a_serial_verdict(two_threads, monkeypatch):
    """A GEMM's claimed split whose serial call takes LARGE_NS or more: three unlucky
    split trials (its worker's core held by another library's spinning threads) do not
    give the serial verdict; a clean one among the next pairs splits it. A small launch,
    or a loop kernel's, decides on three pairs as before."""
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: 0.0)
    unlucky = [(140_000, 110_000)] * TRIALS
    s = Split(True, 4, None)
    assert s.next() == (1, False)  # the warm-up
    _pairs(s, unlucky)
    assert s.verdict is None  # measured on
    assert s.next() == (2, True)
    s.report(2, 60_000)  # a clean split: the verdict at once
    assert s.verdict is True and s.next() == (2, True)
    s = Split(True, 4, None)
    s.next()
    _pairs(s, unlucky + [(140_000, 110_000)] * (split_rule.LARGE_TRIALS - TRIALS))
    assert s.verdict is False  # LARGE_TRIALS pairs, none a win: serial
    s = Split(True, 4, None)
    s.next()
    _pairs(s, [(150_000, 110_000)])  # 1.36x: serial at once for a small launch, not here
    assert s.verdict is None
    for large, small in ((Split(True, 4, None), (45_000, 40_000)),
                         (Split(False, 64, None), (140_000, 110_000))):
        large.next()
        _pairs(large, [small] * TRIALS)
        assert large.verdict is False


def test_a_large_launch_serial_verdict_is_measured_again_on_a_doubling_schedule(two_threads, monkeypatch):
    """While no other process holds a CPU: a large claimed split's serial verdict is
    measured again after RECHECK_S, after twice as long once that repeats it, and from
    RECHECK_S again after a split verdict; not while another process holds a CPU; a
    small launch's serial verdict is kept until REMEASURE_S (and then only where the
    load changed)."""
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: 0.0)
    clock = [1000.0]
    monkeypatch.setattr(split_rule.time, "monotonic", lambda: clock[0])
    lose = [(140_000, 110_000)] * split_rule.LARGE_TRIALS
    s = Split(True, 4, None)
    s.next()
    _pairs(s, lose)
    assert s.verdict is False
    clock[0] += split_rule.RECHECK_S * 0.9
    assert s.decided()
    clock[0] += split_rule.RECHECK_S * 0.2
    assert not s.decided()
    _pairs(s, lose)  # no warm-up call; the same verdict: the next check twice as late
    assert s.verdict is False
    clock[0] += split_rule.RECHECK_S * 1.5
    assert s.decided()
    clock[0] += split_rule.RECHECK_S * 0.6
    assert not s.decided()
    _pairs(s, [(60_000, 110_000)] * TRIALS)
    assert s.verdict is True
    clock[0] += split_rule.RECHECK_S * 10
    assert s.decided() and s.next() == (2, True)  # a split verdict: kept
    busy = Split(True, 4, None)  # another process holds a CPU: the serial verdict stands
    busy.next()
    _pairs(busy, lose)
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: split_rule.LOAD_CHANGE)
    clock[0] += split_rule.RECHECK_S * 1.5
    assert busy.decided() and busy.next() == (1, False)
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: 0.0)
    small = Split(True, 4, None)
    small.next()
    _pairs(small, [(45_000, 40_000)] * TRIALS)
    assert small.verdict is False
    clock[0] += split_rule.REMEASURE_S * 0.9
    assert small.decided() and small.next() == (1, False)


def test_a_wait_for_a_core_backs_off_briefly_unless_other_processes_are_busy(two_threads, monkeypatch):
    """A split that waited for a core while no other process keeps a CPU busy (another
    library's threads spinning in this process, a burst): regions back off
    SHORT_BACKOFF_S, doubled per repeated wait within RELAX_S, up to BACKOFF_S, and short
    again after a quiet spell; where other processes are busy, BACKOFF_S at once."""
    others = [0.0]
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: others[0])
    clock = [5000.0]
    monkeypatch.setattr(split_rule.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads, "_dynamic", True)
    monkeypatch.setattr(threads, "others_busy_cpus", lambda: 0.0)
    monkeypatch.setattr(threads, "_backoff_until", 0.0)
    monkeypatch.setattr(split_rule, "_backoff", [split_rule.SHORT_BACKOFF_S, float("-inf")])
    lengths = []
    for _ in range(8):
        lengths.append(split_rule.waited())
        assert threads.parallel_threads() == 1
        clock[0] += lengths[-1] + 0.01
        assert threads.parallel_threads() == 2  # over: split again
    short = split_rule.SHORT_BACKOFF_S
    assert lengths[:3] == [short, 2 * short, 4 * short] and lengths[-1] == threads.BACKOFF_S
    assert all(b == min(2 * a, threads.BACKOFF_S) for a, b in zip(lengths, lengths[1:]))
    clock[0] += split_rule.RELAX_S + 0.1  # a quiet spell
    assert split_rule.waited() == short
    others[0] = 1.0  # another process holds a CPU: the core is taken for good
    clock[0] += split_rule.RELAX_S + 1.0
    assert split_rule.waited() == threads.BACKOFF_S


def test_a_split_that_ran_between_waits_keeps_the_back_off_short(two_threads, monkeypatch):
    """Waits with splits that ran in between (another library's threads spinning once
    per turn of a benchmark that alternates it with kiln, every ~0.13 s) each back off
    SHORT_BACKOFF_S: the burst had ended. Back to back, the wait still doubles. Through
    Split.report: a clean split after its verdict, and a trial no slower than SLOW x."""
    clock = [7000.0]
    monkeypatch.setattr(split_rule.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(split_rule, "others_busy_cpus", lambda: 0.0)
    monkeypatch.setattr(split_rule, "back_off", lambda seconds: None)
    monkeypatch.setattr(split_rule, "_backoff", [split_rule.SHORT_BACKOFF_S, float("-inf")])
    short = split_rule.SHORT_BACKOFF_S
    decided = split_rule.Split(claim=True, unit=1, max_threads=None)
    decided.verdict, decided._best = True, 100_000
    trial = split_rule.Split(claim=True, unit=1, max_threads=None)
    trial._serial = [200_000]
    for clean in (lambda: decided.report(2, 110_000), lambda: trial.report(2, 150_000)):
        for _ in range(5):
            assert split_rule.waited() == short
            clock[0] += 0.13
            clean()  # a split that did not wait: the next wait starts short again
        assert split_rule.waited() == short and split_rule.waited() == 2 * short  # back to back
        clean()


def _waits(monkeypatch) -> list[int]:
    """The team's running total of join waits, as the test sets it (ns)."""
    total = [0]
    monkeypatch.setattr(split_rule, "join_wait_ns", lambda: total[0])
    return total


def test_a_slow_split_whose_regions_did_not_wait_for_a_worker_does_not_back_off(two_threads, monkeypatch):
    """On kiln's team a slow split call backs off only where its regions waited for a
    worker's claimed units (a worker without a core); one that was slow on its caller's
    side (the caller lost its own core: a serial call would have waited as long) keeps
    splitting, after the verdict as in the trials."""
    monkeypatch.setattr(threads, "_dynamic", True)
    monkeypatch.setattr(threads, "others_busy_cpus", lambda: 0.0)
    monkeypatch.setattr(threads, "_backoff_until", 0.0)
    waits = _waits(monkeypatch)
    s = Split(True, 1, 2)
    assert s.next() == (1, False)  # the warm-up
    assert s.next() == (2, True)
    waits[0] += 10_000  # a worker's last unit ended a little after the caller's
    s.report(2, 60_000)
    assert s.next() == (1, True)
    s.report(1, 100_000)
    assert s.next() == (2, True)
    s.report(2, 2_500_000)  # a trial 25x the serial time, but no region waited
    assert threads.parallel_threads() == 2 and s.next() == (1, True)
    _measure(s, serial_ns=100_000, split_ns=50_000)
    assert s.verdict is True
    for _ in range(5):
        assert s.next() == (2, True)
        s.report(2, 3_000_000)  # slow on the caller's side
    assert threads.parallel_threads() == 2 and s.next() == (2, True)
    waits[0] += 2_900_000  # this one waited a time slice for a worker's unit
    s.report(2, 3_000_000)
    assert threads.parallel_threads() == 1 and s.next() == (1, False)


def test_a_split_that_waited_reports_through_the_back_off_rule(two_threads, monkeypatch):
    """Both places a wait is seen (a trial, a split after the verdict) back off through
    `waited`."""
    calls = []
    monkeypatch.setattr(split_rule, "waited", lambda: calls.append(1))
    s = Split(False, 1, 2)
    s.next()  # the warm-up
    _pairs(s, [(60_000, 50_000)])
    assert s.next() == (2, True)
    s.report(2, 3_000_000)  # a trial 60x the serial one
    assert calls == [1]
    s = Split(False, 1, 2)
    _measure(s, serial_ns=100_000, split_ns=50_000)
    assert s.next() == (2, True)
    s.report(2, 2_700_000)
    assert calls == [1, 1]
