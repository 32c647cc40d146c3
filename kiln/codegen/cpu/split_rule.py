"""Which kernel launches split over threads: measured on the host, per launch.

A launch split over threads pays a region's fixed cost (waking the team, the join at its
end) and moves its data into another core's cache. On this project's 2-CPU machines
that cost 10-60 us a launch depending on the kernel (a column reduction over 256 outer
points lost 20 us split; an `exp` chain over 2^17 points gained 30), as much as a
32K-element kernel takes on one thread: a small-GPT training step (123 launches, most of
them 32K-128K elements) ran 1.3x slower on two threads than on one when every launch
the element-operation model called large was split.

So the model (`CpuOptions.parallel_threshold`, and for GEMMs the multiply-adds of
`BATCH_MACS` / `autotune.SPLIT_MACS`) only names the candidates. A candidate's first
call runs serial (it touches the pages and caches its data), then its calls alternate
split and serial, each timed around the native call. The first pair decides where it
leaves no doubt (`decisive`: the split took at most `QUICK_SPLIT` x the serial time, or
at least `QUICK_SERIAL` x and not so much slower that it may have waited for a core);
otherwise the trials go on until there are `TRIALS` of each, and the launch splits from
then on only where the best split time beat the best serial time by `WIN`. Best times,
and alternating, keep a load spike from choosing. A launch the model puts far above any
region's cost (`sure`: `SURE_WORK` element-operations, `SURE_MACS` multiply-adds, ~0.3-0.5
ms on one core) splits from its first call, unmeasured.

The verdict is kept per launch (kernel and sizes) until the thread count or the policy
changes (`epoch()`). After `REMEASURE_S` it is measured again only if the CPU time other
processes take changed by `LOAD_CHANGE` CPUs or more since it was taken (a verdict
taken in a quiet minute holds while the machine stays as it was), or if it was taken
on one pair and not yet confirmed (so a pair a load spike decided is not kept for
ever), and then without a warm-up call; a serial verdict of a large claimed split
(`LARGE_NS`: a GEMM's items or panels) is measured again sooner, on a doubling schedule
from `RECHECK_S`, and its trials run to `LARGE_TRIALS` pairs before it is given (another
library's threads spinning in this process after its calls take a trial's core for a
moment). A launch that cannot be measured (no CPU idle for `UNTRIED` of its calls)
runs serial for `RETRY_S`, then is tried again. A split call after the verdict is timed
too: one `SLOW` times its best split (a thread waited for a core, taken by another process
in a burst shorter than the load sampling, or by another library's threads spinning in
this process) makes regions back off to one thread for a while (`waited`: long where
other processes are busy, short and growing where they are not), and so does a split
trial `SLOW` times the launch's best serial one (the other trials wait: a launch that
cannot be measured runs serial); on kiln's team only where the call's regions did wait
`WORKER_WAIT_NS` for units a worker had claimed (`native_team.join_wait_ns`): a call
that was slow because its caller lost its own core would have been as slow serial.
`kiln.runtime.threads.set_split_policy("always" | "never")` replaces the measurement by
the model alone, or by no splits.

    >>> s = Split(claim=False, unit=64, max_threads=2)
    >>> threads, timed = s.next()        # the call's thread count, and whether to time it
    >>> s.report(threads, elapsed_ns)    # after a timed call
"""

from __future__ import annotations

import time

from kiln.codegen.cpu.native_team import join_wait_ns
from kiln.runtime.threads import (BACKOFF_S, back_off, get_num_threads, others_busy_cpus, parallel_threads,
                                  split_policy)

TRIALS = 3  # timed calls of each kind before the verdict, where the first pair leaves doubt
WIN = 0.9  # split where its best time is below 0.9 x the best serial time
# the first timed pair decides at once where the split took at most QUICK_SPLIT x the
# serial time, or at least QUICK_SERIAL x (and less than SLOW x and SLOW_NS more: a split
# that much slower may have waited for a core, a load spike, and the trials go on).
# Measured here (bench_split_warmup.py): splits that win do so by 0.5-0.6x (large
# elementwise and reduction launches, GEMM panels), launches that lose by 1.4-3x.
QUICK_SPLIT = 0.6
QUICK_SERIAL = 1.3
# ... and splits at once only where the serial call took QUICK_MIN_NS or more: below, one
# pair is noise (the small-GPT step, its ~40 launches of 20-150 us decided on one pair,
# ran its rounds after a pause 1.15x slower by median than with three pairs)
QUICK_MIN_NS = 300_000
# a batched GEMM of at least this many multiply-adds (~20 us on one core) is a candidate
# for splitting by whole batch items; the measurement decides
BATCH_MACS = 1 << 20
# a launch this large splits without being measured (a region costs 10-60 us, its work
# ~0.5 ms: 8M element-operations of an `exp` chain measured 510 us on one thread)
SURE_WORK = 1 << 23
SURE_MACS = 1 << 24
REMEASURE_S = 60.0  # a verdict this old is measured again, if the load changed since
LOAD_CHANGE = 0.5  # CPUs of other processes' load that make a verdict worth measuring again
UNTRIED = 4  # calls that could not be measured (no idle CPU) before a serial verdict
# a split call this many times slower than the launch's best split, and at least SLOW_NS
# slower, waited for a core another process took: regions back off (threads.back_off)
SLOW = 3.0
SLOW_NS = 200_000
# ... where the call's regions waited that long for units a worker had claimed (kiln's
# team counts it: native_team.join_wait_ns). A slow split call whose regions did not wait
# so was slow on its caller's side: the caller lost its own core (in a process where
# torch's, OpenBLAS's and jax's threads spin after their calls, any call may wait a time
# slice, a serial one alike), and backing off would not have helped it. Beside them the
# batched GEMM of bench_call.py backed off after 1 in ~20 of its split calls and ran
# serial most of the time, though its regions waited for a worker in 2 of 600.
WORKER_WAIT_NS = SLOW_NS
RETRY_S = 1.0  # a launch that could not be measured is tried again after this long
# A claimed split (a GEMM's batch items or panels) whose serial call takes LARGE_NS or
# more is one the model expects to win (a region costs 10-60 us; a claimed one whose
# worker does not come costs its caller a few atomic operations more than serial). In a
# process that also runs torch or OpenBLAS their workers spin ~1-20 ms after each of their calls, and a
# trial whose worker finds its core taken by one runs no faster than serial: the batched
# GEMM of bench_call.py (16 x 32x64x256, ~110 us serial) split 51-68 us at best and
# 120-160 by median beside them, and kept a serial verdict taken on three unlucky
# trials for the rest of the run. So such a launch measures up to LARGE_TRIALS pairs
# before a serial verdict, and a serial verdict of it is measured again after
# RECHECK_S, then after twice as long each time a new measurement repeats it (up to
# REMEASURE_S), while other processes leave the CPUs idle (below LOAD_CHANGE). (With
# its B aligned the same GEMM takes 85-95 us serial: 50 us keeps it among them.)
LARGE_NS = 50_000
LARGE_TRIALS = 6
RECHECK_S = 1.0
RUN_WIN = 0.97  # a prepared call's whole run keeps its splits where they gain 3% or more
# How long regions back off after a split that waited for a core. Where other processes
# keep a CPU busy (LOAD_CHANGE or more over the last load window) the core is taken for
# good: BACKOFF_S at once. Where they do not, what took it is this process's own: another
# library's threads spinning after its calls (torch's OpenMP workers spin ~1-20 ms after
# each torch call, OpenBLAS's too), a burst that ends soon: SHORT_BACKOFF_S, doubled for
# each wait within RELAX_S of the back-off before, up to BACKOFF_S, unless a split ran
# without waiting since (`split_ran`): the burst that caused the wait had ended. (Beside
# torch 2t in one process, 200 calls a turn, the batched GEMM's first split of each kiln
# turn waited ~3 ms and the 0.5 s back-off kept every later turn serial: 120 us a call
# against 65. With the doubling alone, turns of ~0.13 s, torch's and kiln's in turn, still
# grew each kiln turn's one wait into a back-off over the whole turn by the fifth turn: a
# (32, 64, 56, 56) global average pool at 0.88 ms a call against 0.47 split.)
SHORT_BACKOFF_S = 0.02
RELAX_S = 1.0
_backoff = [SHORT_BACKOFF_S, float("-inf")]  # the last back-off's length, and when it began


def waited() -> float:
    """A split waited for a core: regions back off (`threads.back_off`) for as long as
    the cause calls for (above); returns that many seconds.

    >>> waited()   # no other process busy, no wait just before: SHORT_BACKOFF_S
    0.02
    """
    now = time.monotonic()
    length, began = _backoff
    if others_busy_cpus() >= LOAD_CHANGE:
        length = BACKOFF_S
    elif now - began < length + RELAX_S:
        length = min(2 * length, BACKOFF_S)
    else:
        length = SHORT_BACKOFF_S
    _backoff[:] = [length, now]
    back_off(length)
    return length


def split_ran() -> None:
    """A split ran without waiting for a core: whatever took one before has let go, so
    the next wait backs off from SHORT_BACKOFF_S again instead of doubling."""
    if _backoff[1] != float("-inf"):
        _backoff[:] = [SHORT_BACKOFF_S, float("-inf")]


def epoch() -> tuple:
    """What a verdict was measured under: the thread count and the policy. A value, not a
    counter: back at a count, the verdicts measured at it hold (a program called at one
    thread and at two, call by call, is not measured anew each time). A prepared call
    lays its launches out again when it changes."""
    return get_num_threads(), split_policy()


def decisive(serial_ns: int, split_ns: int) -> bool | None:
    """The verdict one timed pair leaves no doubt about: True (split at most QUICK_SPLIT x
    a serial time of QUICK_MIN_NS or more), False (at least QUICK_SERIAL x, but not so
    much slower that it may have waited for a core), else None (measure on).

    >>> decisive(400_000, 220_000), decisive(100_000, 55_000), decisive(20_000, 40_000)
    (True, None, False)
    """
    if split_ns <= QUICK_SPLIT * serial_ns and serial_ns >= QUICK_MIN_NS:
        return True
    if QUICK_SERIAL * serial_ns <= split_ns < SLOW * serial_ns and split_ns < serial_ns + SLOW_NS:
        return False
    return None


class Split:
    """The split state of one launch (a kernel at one binding of its sizes): how it would
    split (`claim`: units claimed from a counter, else a static cut; `unit`: the claim
    unit or the cut's alignment), at most how many threads (None: kn.get_num_threads),
    and its verdict (None while measuring, then True or False)."""

    __slots__ = ("claim", "unit", "max_threads", "sure", "win", "verdict", "_serial", "_split",
                 "_warm", "_untried", "_untried_at", "_generation", "_decided_at", "_load_at", "_best",
                 "_quick", "_last", "_recheck_s", "_wait0")

    def __init__(self, claim: bool, unit: int, max_threads: int | None, sure: bool = False,
                 win: float = WIN):
        self.claim, self.unit, self.max_threads = claim, max(1, int(unit)), max_threads
        self.sure, self.win = sure, win
        self._last = None  # the verdict measured before the last reset
        self._decided_at = None
        self._recheck_s = RECHECK_S  # when a large launch's serial verdict is measured again
        self._wait0 = None  # the team's join wait when the timed split call began
        self._reset()

    def _reset(self, warm: bool = False) -> None:
        # (measured again at the same count: the verdict a new pair may confirm)
        self._last = self.verdict if warm and self._decided_at is not None else None
        self.verdict: bool | None = True if self.sure else None
        self._quick = False  # decided on one pair, not yet confirmed
        self._serial: list[int] = []
        self._split: list[int] = []
        self._best: int | None = None  # the best split time seen (trials and after)
        self._warm = warm  # (measured again: the pages are touched, no warm-up call)
        self._untried = 0
        self._untried_at = None  # when a serial verdict was given unmeasured
        self._decided_at = None  # when a measured verdict was taken, and the load then
        self._load_at = 0.0
        self._generation = epoch()

    def _expired(self) -> bool:
        """Is a measured verdict over REMEASURE_S old and either taken on one pair and not
        yet confirmed, or the load other processes put on the machine changed by
        LOAD_CHANGE CPUs since? (Old, confirmed and taken under today's load: kept, for
        another REMEASURE_S.)"""
        if self._decided_at is None:
            return False
        age = time.monotonic() - self._decided_at
        if self.verdict is False and age >= self._recheck_s and self._large() \
                and others_busy_cpus() < LOAD_CHANGE:
            # a serial verdict the model doubts, while no other process holds a CPU (one
            # that does takes the core for good: the verdict stands): measured again
            return True
        if age < REMEASURE_S:
            return False
        if not self._quick and abs(others_busy_cpus() - self._load_at) < LOAD_CHANGE:
            self._decided_at = time.monotonic()
            return False
        return True

    def _large(self) -> bool:
        """Is this a claimed split whose serial call took LARGE_NS or more (one the model
        expects to win, measured longer and its serial verdict again on schedule)?"""
        return self.claim and bool(self._serial) and min(self._serial) >= LARGE_NS

    def _stale(self) -> bool:
        """Is the verdict to be measured anew: a new epoch, an unmeasured verdict over
        RETRY_S old, or a measured one expired (`_expired`)?"""
        return self._generation != epoch() or (
            self._untried_at is not None and time.monotonic() - self._untried_at > RETRY_S) or \
            self._expired()

    @property
    def provisional(self) -> bool:
        """A serial verdict given because the launch could not be measured."""
        return self._untried_at is not None

    def cap(self) -> int:
        """Threads the launch may use now: its compiled count, kn.set_num_threads and
        the CPUs other processes leave idle (`parallel_threads`)."""
        n = parallel_threads()
        if self.max_threads is not None:
            n = min(n, self.max_threads, get_num_threads())
        return n

    def next(self) -> tuple[int, bool]:
        """(threads, timed) for the next call: threads 1 runs it serial; timed asks the
        caller to `report` the call's duration."""
        threads, timed = self._next()
        if timed and threads > 1:
            self._wait0 = join_wait_ns()
        return threads, timed

    def _next(self) -> tuple[int, bool]:
        policy = split_policy()
        if policy == "never" or get_num_threads() <= 1:  # nothing to split: the verdict
            return 1, False  # measured at more threads is kept for when they are back
        if policy == "measure" and self._stale():
            # a new epoch warms up again (another count, new caches); an expired verdict
            # or a retried unmeasured one does not
            self._reset(warm=self._generation == epoch())
        n = self.cap()
        if policy == "always":
            return n, False
        if self.verdict is not None:  # a split call is timed: `report` watches for waits
            return (n, n > 1) if self.verdict else (1, False)
        if n <= 1:  # other processes hold the CPUs: nothing to measure
            self._untried += 1
            if self._untried >= UNTRIED:  # unmeasured: serial, measured again after RETRY_S
                self.verdict, self._untried_at = False, time.monotonic()
            return 1, False
        if not self._warm:  # the first call: pages and caches, timed by nobody
            self._warm = True
            return 1, False
        return (1 if len(self._split) > len(self._serial) else n), True

    def report(self, threads: int, ns: int) -> None:
        """A timed call's duration in nanoseconds (`threads` as `next` gave it)."""
        ns = int(ns)
        if self.verdict is not None:  # a split after the verdict: did it wait for a core?
            best = self._best
            if threads > 1:
                if best is not None and ns > SLOW * best and ns > best + SLOW_NS:
                    if self._worker_waited():
                        waited()
                else:
                    split_ran()
                    if best is None or ns < best:
                        self._best = ns
            return
        if threads > 1:
            self._split.append(ns)
            self._best = ns if self._best is None else min(self._best, ns)
            serial = min(self._serial) if self._serial else None
            if serial is not None and ns > SLOW * serial and ns > serial + SLOW_NS \
                    and self._worker_waited():
                waited()  # a trial that waited for a core: no more trials for a while
            elif serial is not None and ns <= SLOW * serial:
                split_ran()
        else:
            self._serial.append(ns)
        quick = len(self._split) == 1 and len(self._serial) == 1
        if quick:
            verdict = decisive(self._serial[0], self._split[0])
            if verdict is False and self._large():
                verdict = None  # one unlucky pair does not make a large launch serial
        elif len(self._split) >= TRIALS and len(self._serial) >= TRIALS:
            verdict = min(self._split) < self.win * min(self._serial)
            if not verdict and self._large() and len(self._serial) < LARGE_TRIALS:
                return  # one clean split (its worker had a core) among a few more pairs
        else:
            return
        if verdict is not None:
            # a large launch's serial verdict is measured again after RECHECK_S, and
            # after twice as long each time it repeats the one before
            self._recheck_s = RECHECK_S if verdict or self._last is not False else \
                min(2 * self._recheck_s, REMEASURE_S)
            # one pair's verdict is measured again (one pair) after REMEASURE_S whatever
            # the load, unless it repeats the verdict measured before
            self.verdict, self._quick = verdict, quick and self._last is not verdict
            self._decided_at, self._load_at = time.monotonic(), others_busy_cpus()

    def _worker_waited(self) -> bool:
        """Did the split call just reported wait WORKER_WAIT_NS or more for units its
        workers claimed (True too where nobody knows: libgomp, the Python pool)?"""
        w0, self._wait0 = self._wait0, None
        w1 = join_wait_ns() if w0 is not None else None
        return w1 is None or w1 - w0 >= WORKER_WAIT_NS

    def decided(self) -> bool:
        """Is the launch's way of running fixed (a verdict, or a policy that needs none)?"""
        if split_policy() != "measure" or get_num_threads() <= 1:
            return True
        if self._stale():
            return False
        return self.verdict is not None

    def splits(self) -> bool:
        """Would the next call split (thread count aside)? For a launch list, where the
        run's thread count is read once per call."""
        policy = split_policy()
        return policy == "always" or (policy == "measure" and bool(self.verdict)
                                      and self._generation == epoch())
