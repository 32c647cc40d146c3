"""`kiln mem` sees another kiln process's memory: a second Python process holds a 4 MiB
eager tensor, publishes its figures, and the command lists them; its file goes at exit,
and stale or malformed files are ignored."""

import json
import os
import select
import subprocess
import sys
import time

import pytest

from kiln.cli import main
from kiln.runtime.memory_tracking import FORMAT, read_processes

_CHILD = """
import sys
import kiln as kn
x = kn.ones(1 << 20)          # 4 MiB on the cpu, held until stdin says go
print("ready", flush=True)
sys.stdin.readline()
"""


def _wait_line(proc, timeout=60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child process did not start in time"
    return proc.stdout.readline().strip()


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def child(tmp_path):
    env = {**os.environ, "KILN_MEM_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert _wait_line(proc) == "ready"
        yield proc, tmp_path
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _record(folder, pid):
    return next((r for r in read_processes(str(folder)) if r["pid"] == pid), None)


def test_kiln_mem_lists_another_process(child, capsys):
    proc, folder = child
    record = _wait_for(lambda: (r := _record(folder, proc.pid)) is not None
                       and r["devices"].get("cpu", {}).get("allocated", 0) >= 4 << 20 and r)
    assert record, "the child's figures never appeared"
    cpu = record["devices"]["cpu"]
    assert cpu["allocated"] >= 4 << 20 and cpu["reserved"] >= cpu["allocated"]
    assert cpu["peak_allocated"] >= cpu["allocated"] and cpu["limit"] > 0

    assert main(["mem", "--dir", str(folder), "--json"]) == 0
    listed = {r["pid"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed[proc.pid]["devices"]["cpu"]["allocated"] >= 4 << 20
    assert main(["mem", "--dir", str(folder)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.split()[:1] == [str(proc.pid)])
    assert " cpu " in row and "MiB" in row

    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 0
    assert not (folder / f"{proc.pid}.json").exists()  # withdrawn at exit


def test_stale_and_malformed_files_are_ignored(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)  # its pid is free now
    record = {"format": FORMAT, "pid": gone.pid, "start_time": None, "command": "x",
              "devices": {"cpu": {"allocated": 1}}}
    (tmp_path / f"{gone.pid}.json").write_text(json.dumps(record))
    (tmp_path / f"{os.getpid()}.json").write_text("{not json")
    (tmp_path / "123.json").write_bytes(b"\x80\x04pickle")
    assert read_processes(str(tmp_path)) == []
    assert main(["mem", "--dir", str(tmp_path)]) == 0
    assert "no kiln process" in capsys.readouterr().out
