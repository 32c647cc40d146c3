"""kiln's own native thread team: split regions that never wait for a sleeping thread.

A region on GNU OpenMP (`GOMP_parallel`) ends at a barrier that every thread of the team
must reach. A thread that slept (libgomp's threads sleep ~0.3-1 ms after their last
region) takes 0.1-2.5 ms to wake on this project's VMs, and a thread whose core another
process holds waits a time slice: the region waits for it, whatever the work was. A
program that alternates with other work (a training loop that also logs, loads data or
runs another model) finds its threads asleep at every step and pays a wake-up for its
first regions, and on a loaded machine every region waited ~2.2 ms for its second
thread (benchmarks/results/cpu.md, split_warmup).

Here a region is a set of units claimed from one atomic word, and its caller waits only
for units that a thread actually claimed:

- the caller publishes the region (its fields, then the claim word: a 24-bit tag of the
  region's sequence number, the unit count and the next unit), bumps the sequence word
  (a futex), wakes sleeping workers, then claims and runs units itself;
- a worker that sees a new sequence number claims units with compare-and-swap on the
  claim word; a claim succeeds only while the word still carries its region's tag, so a
  worker that arrives after the region ended (or never woke) claims nothing, runs
  nothing, and nobody waits for it;
- the caller returns once every unit is done: the units it ran and those that running
  workers claimed (a count each worker adds to as it finishes a unit).

A static cut (a loop kernel's range in near-equal chunks, multiples of `unit`) is one
unit per thread, and `claim` mode is units of `unit` points (GEMM panels, batch items).
With no worker awake, the caller runs every unit itself: the region costs what the
serial call costs, plus a few atomic operations. Workers spin `SPIN_US` after their
last region (`pause`), then sleep on the futex (a bounded wait: 100 ms, then they check
again); after a quiet region (`threads | QUIET_WORKERS`: one run while other processes
keep the CPUs busy) they sleep at once, holding no core between calls. `wake()` at the
start of a prepared call bumps the sequence number so that sleeping workers wake while
the first launches run serial, and first keeps the workers off the caller's CPU
(`steer`: a woken worker placed on its waker's CPU spun there beside it), as does a
split launch called from Python (`steer_workers`, from native_pool's `parallel_for` and
`parallel_claim`). One caller at a time holds the team (a lock word); a second caller,
concurrent on another Python thread, runs its region on its own thread.

`join_wait_ns()` is the time callers waited for workers' units (a running total), which
tells a slow split call that waited for a worker without a core from one whose caller
lost its own core (kiln/codegen/cpu/split_rule.py).

`start_trace()` / `stop_trace()` record a timeline of the regions (when published, when
the caller's own units were done, when every unit was, how many units the caller ran,
when a worker first claimed one) and of `wake()`s: what a step pays for sleeping
workers (benchmarks/bench_wakeups.py). Off, it costs one load of a null pointer per
region and per claimed unit.

Linux only (futex; x86-64 and AArch64 syscall numbers); elsewhere `available()` is
False and split launches use GNU OpenMP or kiln's Python pool. A child forked after the
team started has no workers (threads do not survive `fork`): it starts a team of its own
at its first split.

    >>> engine = jit.glue_module(native_team_ir.team_ir())
    >>> team = publish(engine, workers=1)    # the process's team, its worker started
    >>> engine.address("kiln_team_for")      # fn(entry, bufs, sizes, total, unit, threads)
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading

from kiln.codegen.cpu.native_team_ir import _FUTEX, _WORDS, JOIN_WAIT, SPIN_US, TRACE_WORDS, WAKE_KIND


def available() -> bool:
    """Can this host run the team (Linux with a known futex syscall number)?"""
    return sys.platform.startswith("linux") and platform.machine().lower() in _FUTEX \
        and os.environ.get("KILN_NATIVE_TEAM", "1") != "0"


WORKER_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
VOID_FN = ctypes.CFUNCTYPE(None)
STOP_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Team:
    """One team: its memory (64-byte aligned words) and its worker threads, each a
    Python thread that calls the native `kiln_team_worker` once (the GIL released for
    its whole life) and returns when the team stops."""

    def __init__(self, engine):
        self._engine = engine
        self._memory = (ctypes.c_int64 * _WORDS)()
        self.address = (ctypes.addressof(self._memory) + 63) & ~63
        self._worker = WORKER_FN(engine.address("kiln_team_worker"))
        self._stop = STOP_FN(engine.address("kiln_team_stop"))
        self.threads: list[threading.Thread] = []
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self.join_wait = ctypes.c_int64.from_address(self.address + 8 * JOIN_WAIT)

    def grow(self, workers: int, spin_us: int | None = None) -> None:
        """Start workers until there are `workers` (a region's caller is one more thread),
        each spinning `spin_us` (default SPIN_US) after a region that is not quiet."""
        spin_ns = (SPIN_US if spin_us is None else spin_us) * 1000
        with self._lock:
            while len(self.threads) < workers:
                index = len(self.threads)
                t = threading.Thread(target=self._worker, args=(self.address, index, spin_ns),
                                     name=f"kiln-team-{index}", daemon=True)
                t.start()
                self.threads.append(t)

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the workers (bounded wait); True when every one returned. The team must
        no longer be the published one (`kiln_team_ptr`)."""
        self._stop(self.address)
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)


_lock = threading.Lock()
_state: dict = {}  # "team": the published Team; "publish", "wake": the glue's functions


def publish(engine, workers: int) -> Team:
    """The process's team on `engine`'s glue (built from `native_team_ir.team_ir()`), with at least
    `workers` workers started; made on first use, and again in a forked child."""
    team = _state.get("team")
    if team is None or team.pid != os.getpid():
        with _lock:
            team = _state.get("team")
            if team is None or team.pid != os.getpid():
                team = Team(engine)
                set_team = STOP_FN(engine.address("kiln_team_publish"))
                _state.update(team=team, publish=set_team, wake=VOID_FN(engine.address("kiln_team_wake")),
                              set_trace=STOP_FN(engine.address("kiln_team_set_trace")))
                team.grow(workers)
                set_team(team.address)
                return team
    if len(team.threads) < workers:
        team.grow(workers)
    return team


def join_wait_ns() -> int | None:
    """The nanoseconds this process's callers have waited, after running their own
    units, for units the team's workers claimed (a running total: the difference over a
    call is what its regions waited for workers; a worker that lost its core in the middle
    of a unit shows as a time slice, a caller that lost its own core does not). None where
    split regions do not run on a team of this process (libgomp, a forked child before its
    first split): then nobody knows what a region waited for."""
    team = _state.get("team")
    if team is None or team.pid != os.getpid() or not team.threads:
        return None
    return team.join_wait.value


def wake() -> None:
    """Wake the team's sleeping workers now (a prepared call with split launches calls
    this first: they are spinning by its first split region); nothing if none sleeps.
    The workers are first steered off the caller's CPU (`steer`)."""
    fn = _state.get("wake")
    if fn is None:
        return
    team = _state["team"]
    if team.pid == os.getpid():
        # steered at every call, asleep or not: a caller that moved onto a worker's CPU
        # would share it with a spinning worker held there (a sched_getcpu when it did not)
        steer(team)
        fn()


def steer_workers() -> None:
    """`steer` the process's team (where this process has one) before a split launch
    called from Python: a sleeping worker its region wakes stays off the caller's CPU."""
    team = _state.get("team")
    if team is not None and team.pid == os.getpid():
        steer(team)


# A worker woken from its futex is often placed by the scheduler on the CPU its waker runs
# on (the waker's cache is warm, the other CPU idle and its vCPU halted), where it spins
# beside the caller until a load balance moves it: the small-GPT step after a 0.2 s pause
# ran 9.5-9.7 ms with 23-32 of its regions joined by no worker and the worker's first claim
# 0.8-3.9 ms after the wake, against 4.8-5.5 ms, no such region and 0.5-0.7 ms with the
# workers kept off the caller's CPU (benchmarks/results/cpu.md, section `wakeups`)
_getcpu: list = []  # [libc's sched_getcpu] or [None]


def steer(team: Team) -> bool:
    """Keep `team`'s workers off the CPU the calling thread runs on: each worker's
    affinity becomes the caller's allowed CPUs minus that one (done again only when the
    caller's CPU or the workers changed). False where it cannot (one allowed CPU, no
    `sched_getcpu`, affinity refused: then nothing changes, for the rest of the process)."""
    if not _getcpu:
        try:
            fn = ctypes.CDLL(None).sched_getcpu
            fn.restype, fn.argtypes = ctypes.c_int, []
        except (OSError, AttributeError):
            fn = None
        _getcpu.append(fn)
    getcpu = _getcpu[0]
    if getcpu is None or not team.threads:
        return False
    cpu = getcpu()
    key = (id(team), cpu, len(team.threads))
    if _state.get("steered") == key:
        return True
    try:
        others = os.sched_getaffinity(0) - {cpu}
        if cpu < 0 or not others:
            return False
        for t in team.threads:
            if t.native_id is not None:
                os.sched_setaffinity(t.native_id, others)
    except (OSError, AttributeError):  # a container that refuses it: leave the workers be
        _getcpu[0] = None
        return False
    _state["steered"] = key
    return True


def start_trace(capacity: int = 1 << 16) -> bool:
    """Record a timeline of the team's regions from now on (a debugging and benchmarking
    aid; `stop_trace` returns it): up to `capacity` records. False where this process has
    no team (kiln's team unavailable, or no split glue built yet)."""
    set_trace = _state.get("set_trace")
    if set_trace is None or _state["team"].pid != os.getpid():
        return False
    buf = (ctypes.c_int64 * (2 + TRACE_WORDS * capacity))()
    buf[1] = capacity
    set_trace(None)
    _state["trace"] = buf
    set_trace(ctypes.addressof(buf))
    return True


def stop_trace() -> list[dict]:
    """Stop recording; the timeline since `start_trace`, one dict per region (or wake):
    `start`, `own_done`, `end` (CLOCK_MONOTONIC ns, as `time.monotonic_ns()`: the region
    published, the caller's own units done, every unit done), `units`, `by_caller`,
    `first_claim` (a worker's first claim, 0: none claimed), `kind` ("cut", "claim",
    "wake": a prepared call's `wake()` of sleeping workers), `quiet` (its workers sleep
    right after it: native_team_ir.QUIET_WORKERS).

    >>> native_team.start_trace(); step(); regions = native_team.stop_trace()
    """
    set_trace, buf = _state.get("set_trace"), _state.pop("trace", None)
    if set_trace is None or buf is None:
        return []
    set_trace(None)
    kinds = {0: "cut", 1: "claim", WAKE_KIND: "wake"}
    out = []
    for k in range(min(buf[0], buf[1])):
        r = buf[2 + k * TRACE_WORDS: 2 + (k + 1) * TRACE_WORDS]
        out.append({"start": r[0], "own_done": r[1], "end": r[2], "units": r[3], "by_caller": r[4],
                    "first_claim": r[5], "kind": kinds.get(r[6], str(r[6])), "quiet": bool(r[7])})
    return out


def _after_fork_in_child() -> None:
    # the team's workers did not come along: regions run serial until a new team starts
    _state.pop("steered", None)
    set_team = _state.get("publish")
    if set_team is not None:
        set_team(None)


os.register_at_fork(after_in_child=_after_fork_in_child)
