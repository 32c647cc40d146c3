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
split and serial, each timed around the native call, until there are `TRIALS` of each;
from then on it splits only where the best split time beat the best serial time by
`WIN`. Best times, and alternating, keep a load spike from choosing; the verdict is kept
per launch (kernel and sizes) until the thread count or the policy changes, or for
`REMEASURE_S` at most (a verdict taken while another process held a core is not kept
for ever): `epoch()`. A launch that cannot be measured (no CPU idle for `UNTRIED` of its
calls) runs serial for `RETRY_S`, then is tried again. A launch the model puts far above any region's cost (`sure`:
`SURE_WORK` element-operations, `SURE_MACS` multiply-adds, ~0.3-0.5 ms on one core)
splits from its first call, unmeasured. A split call after the verdict is timed too:
one `SLOW` times its best split (a thread waited for a core another process took, in a
burst shorter than the load sampling) makes regions back off to one thread for a while
(`threads.back_off`). `kiln.runtime.threads.set_split_policy("always"
| "never")` replaces the measurement by the model alone, or by no splits.

    >>> s = Split(claim=False, unit=64, max_threads=2)
    >>> threads, timed = s.next()        # the call's thread count, and whether to time it
    >>> s.report(threads, elapsed_ns)    # after a timed call
"""

from __future__ import annotations

import time

from kiln.runtime.threads import back_off, get_num_threads, parallel_threads, split_policy

TRIALS = 3  # timed calls of each kind before the verdict
WIN = 0.9  # split where its best time is below 0.9 x the best serial time
# a batched GEMM of at least this many multiply-adds (~20 us on one core) is a candidate
# for splitting by whole batch items; the measurement decides
BATCH_MACS = 1 << 20
# a launch this large splits without being measured (a region costs 10-60 us, its work
# ~0.5 ms: 8M element-operations of an `exp` chain measured 510 us on one thread)
SURE_WORK = 1 << 23
SURE_MACS = 1 << 24
REMEASURE_S = 60.0  # verdicts are measured again after this long
UNTRIED = 4  # calls that could not be measured (no idle CPU) before a serial verdict
# a split call this many times slower than the launch's best split, and at least SLOW_NS
# slower, waited for a core another process took: regions back off (threads.back_off)
SLOW = 3.0
SLOW_NS = 200_000
RETRY_S = 1.0  # a launch that could not be measured is tried again after this long
RUN_WIN = 0.97  # a prepared call's whole run keeps its splits where they gain 3% or more


def epoch() -> tuple:
    """What a verdict was measured under: the thread count, the policy and the current
    REMEASURE_S window. A value, not a counter: back at a count, the verdicts measured at
    it hold (a program called at one thread and at two, call by call, is not measured
    anew each time). A prepared call lays its launches out again when it changes."""
    return get_num_threads(), split_policy(), int(time.monotonic() // REMEASURE_S)


class Split:
    """The split state of one launch (a kernel at one binding of its sizes): how it would
    split (`claim`: units claimed from a counter, else a static cut; `unit`: the claim
    unit or the cut's alignment), at most how many threads (None: kn.get_num_threads),
    and its verdict (None while measuring, then True or False)."""

    __slots__ = ("claim", "unit", "max_threads", "sure", "win", "verdict", "_serial", "_split",
                 "_warm", "_untried", "_untried_at", "_generation")

    def __init__(self, claim: bool, unit: int, max_threads: int | None, sure: bool = False,
                 win: float = WIN):
        self.claim, self.unit, self.max_threads = claim, max(1, int(unit)), max_threads
        self.sure, self.win = sure, win
        self._reset()

    def _reset(self) -> None:
        self.verdict: bool | None = True if self.sure else None
        self._serial: list[int] = []
        self._split: list[int] = []
        self._warm = False
        self._untried = 0
        self._untried_at = None  # when a serial verdict was given unmeasured
        self._generation = epoch()

    def _stale(self) -> bool:
        """Is the verdict to be measured anew: a new epoch, or given unmeasured (no idle
        CPU) over RETRY_S ago?"""
        return self._generation != epoch() or (
            self._untried_at is not None and time.monotonic() - self._untried_at > RETRY_S)

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
        policy = split_policy()
        if policy == "never" or get_num_threads() <= 1:  # nothing to split: the verdict
            return 1, False  # measured at more threads is kept for when they are back
        if policy == "measure" and self._stale():
            self._reset()
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
        if self.verdict is not None:  # a split after the verdict: did it wait for a core?
            best = min(self._split) if self._split else None
            if threads > 1 and best is not None and ns > SLOW * best and ns > best + SLOW_NS:
                back_off()
            return
        (self._split if threads > 1 else self._serial).append(int(ns))
        if self.verdict is None and len(self._split) >= TRIALS and len(self._serial) >= TRIALS:
            self.verdict = min(self._split) < self.win * min(self._serial)

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
