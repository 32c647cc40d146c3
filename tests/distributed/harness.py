"""Runs a scenario of `workers.py` on N local processes and collects their results.

The store is hosted here, on 127.0.0.1 with an OS-chosen port; each worker writes
its result as JSON into pytest's tmp_path; every process is killed at
the deadline, so a broken scenario fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from kiln.distributed.store import StoreServer

WORKERS = Path(__file__).with_name("workers.py")
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def reserved_port():
    """A free 127.0.0.1 port, held for the block: bound with SO_REUSEADDR but never
    listening, so no other socket can take it (picking a port and closing the probe left
    a window where one could), while a server bound with SO_REUSEADDR, as every kiln
    store is, still binds it. Until one does, connecting to it is refused."""
    probe = socket.socket()
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", 0))
        yield probe.getsockname()[1]
    finally:
        probe.close()


def worker_env(tmp_path: Path, token: str, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({"KILN_TOKEN": token, "KILN_FR_DIR": str(tmp_path / "fr"),
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    for key in ("KILN_RANK", "KILN_WORLD_SIZE", "KILN_STORE", "KILN_STORE_HOSTED"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def run_scenario(name: str, world: int, tmp_path: Path, *, args: dict | None = None,
                 timeout: float = 45.0, env: dict | None = None,
                 expect_exit: dict[int, int] | None = None,
                 workers: Path | None = None) -> list[dict]:
    """Start `world` ranks of scenario `name` of `workers` (default: workers.py; another
    module that adds scenarios to workers.SCENARIOS and calls its main() works the
    same); return each rank's result dict.

    A result is {"ok": True, "data": ...} or {"ok": False, "type": ..., "error": ...};
    a rank that wrote nothing gets {"ok": False, "returncode": rc}.
    """
    token = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, token)
    out_dir = tmp_path / ("results_" + name)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for rank in range(world):
            cmd = [sys.executable, str(workers or WORKERS), name, str(rank), str(world),
                   server.address, str(out_dir / ("rank%d.json" % rank)), json.dumps(args or {})]
            procs.append(subprocess.Popen(cmd, env=worker_env(tmp_path, token, env),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, _ = proc.communicate()
                raise AssertionError("scenario %s: rank %d still running after %.0f s:\n%s"
                                     % (name, procs.index(proc), timeout, out.decode()[-3000:]))
            outputs.append(out.decode())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    results = []
    for rank, proc in enumerate(procs):
        path = out_dir / ("rank%d.json" % rank)
        res = json.loads(path.read_text()) if path.exists() else {"ok": False}
        res["returncode"], res["output"] = proc.returncode, outputs[rank]
        results.append(res)
    return results


def check_all_ok(results: list[dict]) -> list:
    """Assert every rank succeeded; return the ranks' data."""
    for rank, res in enumerate(results):
        assert res["ok"], "rank %d failed (rc %s):\n%s\n%s" % (
            rank, res.get("returncode"), res.get("error", ""), res.get("output", "")[-3000:])
    return [res.get("data") for res in results]
