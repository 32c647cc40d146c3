"""The end of a `kiln launch` job: the summary on stderr and the --events-json report.

The summary lists every membership event of this node (deaths, replacements, injected
faults, workers the group removed), the faults that never fired, and the result:

    kiln launch: summary (3 workers on this node, --on-failure shrink, 4.12 s):
      +  1.532 s  injected SIGKILL into rank 2 (pid 4242) at step 5 (kill:rank=2,step=5)
      +  1.533 s  rank 2 (pid 4242) died: killed by signal SIGKILL
      result: 2 of 3 workers finished, 1 died (--on-failure shrink) (exit code 0)
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass


@dataclass
class Failure:
    """A worker that died: who, and how (a negative returncode is a signal)."""

    rank: int
    local_rank: int
    pid: int
    returncode: int

    def how(self) -> str:
        if self.returncode < 0:
            return "killed by signal %s" % signal_name(-self.returncode)
        return "exit code %d" % self.returncode

    def describe(self) -> str:
        return "worker rank %d (local rank %d, pid %d) failed: %s" % (
            self.rank, self.local_rank, self.pid, self.how())

    @property
    def exit_code(self) -> int:
        return self.returncode if self.returncode > 0 else 128 - self.returncode


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def report(job, code: int, outcome: str, log) -> None:
    """Print `job`'s summary through `log` (when anything notable happened) and write
    its --events-json file; `job` is the launcher's `_Job`."""
    cfg = job.cfg
    duration = time.monotonic() - job.start
    notable = [e for e in job.events if e["kind"] != "exited"] or job.faults
    if notable:
        lines = ["summary (%d workers on this node, --on-failure %s, %.2f s):"
                 % (len(job.slots), cfg.on_failure, duration)]
        lines += ["  +%7.3f s  %s" % (e["since_start"], describe(e)) for e in job.events]
        lines += ["  never fired: %s" % f.spec for f in job.faults]
        lines.append("  result: %s (exit code %d)" % (outcome, code))
        log("\n".join(lines))
    if cfg.events_json:
        data = {"world_size": job.world, "node_rank": cfg.node_rank, "nproc": cfg.nproc,
                "on_failure": cfg.on_failure, "max_restarts": cfg.max_restarts,
                "min_size": cfg.min_size, "inject": list(cfg.inject),
                "start_time": job.start_wall, "duration": round(duration, 6),
                "exit_code": code, "outcome": outcome, "restarts": job.restarts,
                "events": job.events, "never_fired": [f.spec for f in job.faults]}
        try:
            with open(cfg.events_json, "w") as f:
                json.dump(data, f, indent=1)
        except OSError as err:
            log("cannot write --events-json %s: %s" % (cfg.events_json, err))


def describe(event: dict) -> str:
    """One line for one event (see kiln.distributed.launcher for the kinds)."""
    rank, pid, kind = event["rank"], event["pid"], event["kind"]
    if kind == "died":
        how = ("killed by signal %s" % event["signal"] if event["signal"]
               else "exit code %d" % event["exit_code"])
        if "removed_at_epoch" in event:
            how += " (by the launcher: the group removed it at epoch %d)" \
                % event["removed_at_epoch"]
        return "rank %d (pid %d) died: %s" % (rank, pid, how)
    if kind == "replaced":
        return "rank %d replaced by pid %d (KILN_RESTART_COUNT=%d)" % (
            rank, pid, event["restart_count"])
    if kind == "exited":
        return "rank %d (pid %d) finished" % (rank, pid)
    if kind == "reconnected":
        return "rank %d (pid %d) dropped and reopened its store connection" % (rank, pid)
    if kind == "released":
        return "rank %d (pid %d), a replacement still waiting to join, stopped: the job " \
               "had finished" % (rank, pid)
    what = {"kill": "SIGKILL", "stop": "SIGSTOP", "cont": "SIGCONT",
            "drop-conn": "drop-conn request"}[event["fault"]]
    at = " at step %d" % event["step"] if "step" in event else ""
    spec = " (%s)" % event["spec"] if "spec" in event else ""
    return "injected %s into rank %d (pid %d)%s%s" % (what, rank, pid, at, spec)
