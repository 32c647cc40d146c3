"""`with kn.profile() as p:` — every kernel launch and collective, with time, bytes and FLOPs.

While a profile is open, each compiled program runs a timed copy of its steps (the
executor picks it once per run, so a program run outside a profile pays one global
read and nothing per kernel). A launch records its kernel's name, stage (`kernel`
for a fused loop nest, `gemm` for a GEMM template, `extern`, `collective`, `control`),
the bytes of the buffers it read and wrote, its FLOPs (from the Kernel IR, see
`kiln.codegen.kernel_cost`), start and duration, and the thread. Collectives issued
through a process group (eager `pg.all_reduce` too) come from the Flight Recorder's
records within the profile's window.

    >>> with kn.profile() as p:
    ...     f(x)
    >>> print(p.table())
    >>> p.export_chrome_trace("trace.json")     # chrome://tracing, ui.perfetto.dev
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from kiln.errors import KilnProfilerError

ACTIVE: "Profile | None" = None  # read by the executor once per program run
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Event:
    """One launch (or collective): times in ns from the profile's start."""

    name: str
    stage: str
    bytes: int
    flops: int
    start_ns: int
    duration_ns: int
    thread_id: int
    thread_name: str
    program: str = ""
    args: dict = field(default_factory=dict)


class Profile:
    """The record of one `with kn.profile():` block; read it after the block ends."""

    _SORT_KEYS = ("total", "calls", "mean", "bytes", "flops", "name")

    def __init__(self, collectives: bool = True):
        self.events: list[Event] = []
        self._collectives = collectives
        self._start_perf = self._start_wall = 0
        self._end_perf = None
        self._entered = False

    def __enter__(self) -> "Profile":
        global ACTIVE
        with _LOCK:
            if self._entered:
                raise KilnProfilerError("kn.profile(): this profile was already entered; "
                                        "open a new kn.profile() for another window")
            if ACTIVE is not None:
                raise KilnProfilerError("kn.profile(): another profile is open; profiles do not "
                                        "nest (close the outer one first)")
            self._entered = True
            self._start_wall = time.time_ns()
            self._start_perf = time.perf_counter_ns()
            ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        global ACTIVE
        with _LOCK:
            self._end_perf = time.perf_counter_ns()
            if ACTIVE is self:
                ACTIVE = None
        if self._collectives:
            self.events.extend(_flight_recorder_events(self._start_wall, self._start_perf,
                                                       self._end_perf))
        self.events.sort(key=lambda e: e.start_ns)

    # -- recording (the executor's timed steps call this) ---------------------------------

    def add(self, name: str, stage: str, nbytes: int, flops: int, t0: int, t1: int,
            program: str = "") -> None:
        thread = threading.current_thread()
        # list.append is atomic: threads of the runtime's pool record without a lock
        self.events.append(Event(name, stage, nbytes, flops, t0 - self._start_perf, t1 - t0,
                                 thread.ident or 0, thread.name, program))

    # -- reading ----------------------------------------------------------------------------

    def _finished(self, what: str) -> None:
        if self._end_perf is None:
            raise KilnProfilerError(f"Profile.{what}: the profile is still open (or was never "
                                    "entered); call it after the `with kn.profile()` block")

    def key_averages(self, sort_by: str = "total") -> list[dict]:
        """One row per (name, stage): calls, total/mean/max time, bytes, FLOPs, throughput."""
        self._finished("key_averages()")
        if sort_by not in self._SORT_KEYS:
            raise KilnProfilerError(f"Profile.table: sort_by={sort_by!r}; use one of "
                                    f"{', '.join(self._SORT_KEYS)}")
        rows: dict[tuple, dict] = {}
        for e in self.events:
            row = rows.setdefault((e.name, e.stage), {"name": e.name, "stage": e.stage, "calls": 0,
                                                      "total_ns": 0, "max_ns": 0, "bytes": 0,
                                                      "flops": 0})
            row["calls"] += 1
            row["total_ns"] += e.duration_ns
            row["max_ns"] = max(row["max_ns"], e.duration_ns)
            row["bytes"] += e.bytes
            row["flops"] += e.flops
        for row in rows.values():
            row["mean_ns"] = row["total_ns"] / row["calls"]
            seconds = row["total_ns"] / 1e9
            row["gb_per_s"] = row["bytes"] / seconds / 1e9 if seconds else 0.0
            row["gflop_per_s"] = row["flops"] / seconds / 1e9 if seconds else 0.0
        key = {"total": lambda r: -r["total_ns"], "calls": lambda r: -r["calls"],
               "mean": lambda r: -r["mean_ns"], "bytes": lambda r: -r["bytes"],
               "flops": lambda r: -r["flops"], "name": lambda r: r["name"]}[sort_by]
        return sorted(rows.values(), key=key)

    def table(self, sort_by: str = "total", row_limit: int = 20) -> str:
        """The top kernels as a text table (sorted by total time by default)."""
        rows = self.key_averages(sort_by)
        total = sum(r["total_ns"] for r in rows) or 1
        header = (f"{'name':<34} {'stage':<10} {'calls':>6} {'total ms':>10} {'%':>6} "
                  f"{'mean us':>10} {'MB':>9} {'GB/s':>7} {'GFLOP/s':>8}")
        lines = [header, "-" * len(header)]
        for r in rows[:row_limit]:
            lines.append(f"{r['name'][:34]:<34} {r['stage']:<10} {r['calls']:>6} "
                         f"{r['total_ns'] / 1e6:>10.3f} {100 * r['total_ns'] / total:>6.1f} "
                         f"{r['mean_ns'] / 1e3:>10.1f} {r['bytes'] / 1e6:>9.2f} "
                         f"{r['gb_per_s']:>7.2f} {r['gflop_per_s']:>8.2f}")
        if len(rows) > row_limit:
            lines.append(f"... {len(rows) - row_limit} more")
        lines.append(f"{len(self.events)} events, {total / 1e6:.3f} ms in all")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        """The profile in the Trace Event Format (a JSON object with `traceEvents`)."""
        self._finished("chrome_trace()")
        pid = os.getpid()
        events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                               "args": {"name": f"kiln ({os.path.basename(sys.argv[0]) or 'python'})"}}]
        named: dict[int, str] = {}
        for e in self.events:
            if e.thread_id not in named:
                named[e.thread_id] = e.thread_name
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": e.thread_id,
                               "args": {"name": e.thread_name}})
            args = {"stage": e.stage, "bytes": e.bytes, "flops": e.flops, **e.args}
            if e.program:
                args["program"] = e.program
            events.append({"ph": "X", "name": e.name, "cat": e.stage, "pid": pid,
                           "tid": e.thread_id, "ts": e.start_ns / 1e3,
                           "dur": max(e.duration_ns, 1) / 1e3, "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"producer": "kiln.profile", "version": 1}}

    def export_chrome_trace(self, path: str | os.PathLike) -> str:
        """Write the trace for chrome://tracing or ui.perfetto.dev; returns the path."""
        trace = self.chrome_trace()
        path = os.fspath(path)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(trace, f)
        os.replace(tmp, path)
        return path


def profile(collectives: bool = True) -> Profile:
    """Open a profile: `with kn.profile() as p: ...`, then `p.table()`,
    `p.export_chrome_trace(path)`, `p.events`.

    >>> with kn.profile() as p:
    ...     f(x)
    >>> p.events[0].name, p.events[0].stage
    ('mlp_gemm_0', 'gemm')
    """
    return Profile(collectives)


def _flight_recorder_events(start_wall: int, start_perf: int, end_perf: int) -> list[Event]:
    """The collectives this process issued inside the window, from the Flight Recorder
    (only when the distributed layer is in use: it is never imported from here)."""
    module = sys.modules.get("kiln.distributed.flight_recorder")
    if module is None:
        return []
    end_wall = start_wall + (end_perf - start_perf)
    snapshot = module.recorder().snapshot("profile")
    events = []
    for rec in snapshot["records"]:
        created = rec.get("time_created_ns") or 0
        if not start_wall <= created <= end_wall:
            continue
        begin = rec.get("time_started_ns") or created
        done = rec.get("time_completed_ns") or end_wall
        nbytes = sum(_nbytes(s, d) for s, d in zip(rec.get("input_sizes") or [],
                                                    rec.get("input_dtypes") or []))
        events.append(Event(rec["op"], "collective", nbytes, 0, begin - start_wall,
                            max(done - begin, 0), -1, "collectives",
                            args={"group": rec.get("group"), "seq": rec.get("seq"),
                                  "epoch": rec.get("epoch"), "state": rec.get("state")}))
    return events


def _nbytes(shape, dtype_name) -> int:
    import numpy as np

    try:
        itemsize = np.dtype(str(dtype_name)).itemsize
    except TypeError:
        itemsize = 1
    count = 1
    for n in shape or ():
        count *= int(n)
    return count * itemsize


# -- the executor's side -------------------------------------------------------------------


def timed_step(step_fn, name: str, stage: str, slots: tuple, flops, program: str):
    """A copy of an executor step closure that records an Event when a profile is open.
    `flops` is a function of the size binding (or None)."""
    perf = time.perf_counter_ns

    def run(env, sizes, arena):
        t0 = perf()
        step_fn(env, sizes, arena)
        t1 = perf()
        prof = ACTIVE
        if prof is not None:
            nbytes = 0
            for s in slots:
                a = env[s]
                nbytes += getattr(a, "nbytes", 0) if a is not None else 0
            prof.add(name, stage, nbytes, flops(sizes) if flops is not None else 0, t0, t1, program)

    return run
