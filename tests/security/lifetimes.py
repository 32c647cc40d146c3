"""Helpers of the process-lifetime tests (test_lifetimes_*.py): run `kiln launch` on a
small worker script, find the processes it started by pid, and make sure none of them
outlives the test, whatever happens.

Every worker writes `pid_<rank>_<pid>` into the job's output folder as it starts; a pid
counts as one of ours only while its command line names that job's script, so a
recycled pid is never killed by mistake.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# modes: idle (never touches kiln or the store, ignores SIGTERM), selfstop (rank 1
# SIGSTOPs itself, the others exit 0), train (a fault-tolerant
# loop whose result is known: sum(1..steps)), early (train, but rank 1's first process
# exits before the first rendezvous), leak (rank 1 dies; rank 0 makes 10,000 calls on the
# failed group and measures its memory)
WORKER = r'''
import json, os, signal, sys, time
out, cfg = sys.argv[1], json.loads(sys.argv[2])
rank = int(os.environ["KILN_RANK"])
open(os.path.join(out, "pid_%d_%d" % (rank, os.getpid())), "w").close()
mode = cfg["mode"]
if mode == "idle":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end = time.monotonic() + 120  # bounded even if everything else fails
    while time.monotonic() < end:
        time.sleep(0.05)
    sys.exit(0)
if mode == "selfstop":  # no group: rank 1 stops itself (as Ctrl-Z would), the rest finish
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)
    sys.exit(0)
if mode == "early" and rank == 1 and os.environ["KILN_RESTART_COUNT"] == "0":
    sys.exit(3)  # dies before init_process_group: the group never formed
import numpy as np
import kiln.distributed as dist

pg = dist.init_process_group(fault_tolerant=True, timeout=cfg.get("timeout", 20))
result = {"pid": os.getpid(), "rank": rank}
if mode == "leak":
    import gc, traceback, tracemalloc
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    buf = np.ones(4, np.float32)
    deadline = time.monotonic() + 60
    while True:  # until the group saw the death
        try:
            pg.all_reduce(buf).wait()
        except dist.DistributedError:
            break
        if time.monotonic() > deadline:
            sys.exit("the group never saw rank 1 die")
        time.sleep(0.01)

    def fail(n):
        errors = []
        for _ in range(n):
            try:
                pg.all_reduce(buf).wait()
            except dist.DistributedError as err:
                errors[:] = [err]
            else:
                sys.exit("a call on the failed group succeeded")
        return errors[0]

    tracemalloc.start()
    first = fail(1000)  # also fills the Flight Recorder's ring (KILN_FR_BUFFER_SIZE)
    gc.collect()
    at_1k = tracemalloc.get_traced_memory()[0]
    last = fail(9000)
    gc.collect()
    at_10k = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    result.update(at_1k=at_1k, at_10k=at_10k, message=str(last), type=type(last).__name__,
                  same=first is last, peer=getattr(last, "rank", None),
                  frames_1k=len(traceback.extract_tb(first.__traceback__)),
                  frames_10k=len(traceback.extract_tb(last.__traceback__)))
    result["committed"] = pg.should_commit()  # as the message says: the group shrinks
    buf[:] = 2.0
    pg.all_reduce(buf, op="sum").wait()
    result.update(after=buf.tolist(), world=pg.world_size)
else:
    steps_log = open(os.path.join(out, "steps_%d_%d" % (rank, os.getpid())), "w", buffering=1)
    x = 0.0
    while pg.committed_step < cfg["steps"]:
        step = pg.committed_step + 1
        g = np.full(4, float(step))
        try:
            pg.all_reduce(g, op="avg").wait()
        except dist.DistributedError:
            pass
        if pg.should_commit():
            x += float(g[0])
            steps_log.write("%d\n" % step)
        time.sleep(cfg.get("sleep", 0.02))
    result.update(x=x, committed=pg.committed_step, members=list(pg.global_ranks),
                  epoch=pg.epoch)
with open(os.path.join(out, "done_%d_%d.json" % (rank, os.getpid())), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
'''


def env(tmp_path: Path, **extra: str) -> dict:
    """The environment of a launcher started by a test: kiln importable, no job token."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["KILN_FR_DIR"] = str(tmp_path / "fr")
    for key in ("KILN_TOKEN", "KILN_RANK", "KILN_WORLD_SIZE", "KILN_STORE", "KILN_STORE_HOSTED",
                "KILN_LAUNCHER", "KILN_JOIN"):
        e.pop(key, None)
    e.update(extra)
    return e


class Job:
    """One `kiln launch` of WORKER in tmp_path (see `launched`)."""

    def __init__(self, tmp_path: Path, launcher: subprocess.Popen, script: Path):
        self.tmp_path, self.launcher, self.script = tmp_path, launcher, script
        self.out = tmp_path / "out"

    def pids(self) -> dict[int, list[int]]:
        """rank -> the pids of the processes started in that slot, oldest first."""
        found: dict[int, list[tuple[float, int]]] = {}
        for path in self.out.glob("pid_*"):
            _, rank, pid = path.name.split("_")
            found.setdefault(int(rank), []).append((path.stat().st_mtime, int(pid)))
        return {rank: [pid for _, pid in sorted(v)] for rank, v in found.items()}

    def all_pids(self) -> list[int]:
        return [pid for pids in self.pids().values() for pid in pids]

    def alive(self, pid: int) -> bool:
        """Whether `pid` is one of this job's workers and still running (a zombie, dead
        but not reaped yet by whoever inherited it, counts as gone)."""
        try:
            stat = Path("/proc/%d/stat" % pid).read_text()
            cmdline = Path("/proc/%d/cmdline" % pid).read_bytes()
        except OSError:
            return False
        state = stat.rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X") and str(self.script).encode() in cmdline

    def wait_for(self, what: str, ready, timeout: float = 60.0, poll: float = 0.05):
        """Poll `ready()` until it is true (returned) or `timeout` s passed (AssertionError)."""
        end = time.monotonic() + timeout
        while True:
            value = ready()
            if value:
                return value
            if self.launcher.poll() is not None:
                raise AssertionError("%s: the launcher exited first (code %d):\n%s" % (
                    what, self.launcher.returncode, self.launcher.stderr.read()[-3000:]))
            assert time.monotonic() < end, "%s: not within %.0f s" % (what, timeout)
            time.sleep(poll)

    def steps(self, rank: int) -> int:
        """The last step the newest process of slot `rank` committed (0: none yet)."""
        pids = self.pids().get(rank)
        path = self.out / ("steps_%d_%d" % (rank, pids[-1])) if pids else None
        if path is None or not path.exists():
            return 0
        lines = path.read_text().split()
        return int(lines[-1]) if lines else 0

    def results(self) -> dict[int, list[dict]]:
        found: dict[int, list[dict]] = {}
        for path in sorted(self.out.glob("done_*.json")):
            info = json.loads(path.read_text())
            found.setdefault(info["rank"], []).append(info)
        return found

    def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        """Wait for the launcher (bounded); its exit code and stderr."""
        _, err = self.launcher.communicate(timeout=timeout)
        return self.launcher.returncode, err

    def kill_leftovers(self) -> list[int]:
        """SIGKILL every worker of this job still running (stopped ones too); their pids."""
        left = [pid for pid in self.all_pids() if self.alive(pid)]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


@contextmanager
def launched(tmp_path: Path, *args: str, env_extra: dict | None = None, **cfg):
    """Start `kiln launch ARGS worker.py OUT CFG` (stderr captured, stdout discarded);
    yields the Job; on the way out (even failing) kills the launcher and every worker
    still running."""
    script = tmp_path / "lifetime_worker.py"
    script.write_text(WORKER)
    (tmp_path / "out").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "kiln.distributed", "launch", "--grace", "2", *args,
           str(script), str(tmp_path / "out"), json.dumps(cfg)]
    launcher = subprocess.Popen(cmd, env=env(tmp_path, **(env_extra or {})), cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    job = Job(tmp_path, launcher, script)
    try:
        yield job
    finally:
        try:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(timeout=10)
        finally:
            job.kill_leftovers()  # first of all, even if the launcher would not go
            launcher.stderr.close()  # a worker may hold its other end: never read to EOF
