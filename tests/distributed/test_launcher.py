"""`kiln launch`: environment, success, and a failing worker reported and cleaned up."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO, reserved_port, worker_env
from kiln.distributed import launch_output

EXAMPLE = REPO / "examples" / "distributed_allreduce.py"


def launch(tmp_path: Path, *args: str, timeout: float = 50) -> subprocess.CompletedProcess:
    env = worker_env(tmp_path, "unused")
    env.pop("KILN_TOKEN")  # the launcher makes one
    return subprocess.run([sys.executable, "-m", "kiln.distributed", "launch", *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


@pytest.mark.timeout(60)
def test_two_workers_run_and_agree(tmp_path):
    proc = launch(tmp_path, "--nproc", "2", str(EXAMPLE))
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: all_reduce -> [1.0, 1.0, 1.0, 1.0]" in proc.stdout
    assert "[[0, 0], [1, 10]]" in proc.stdout


@pytest.mark.timeout(60)
def test_environment_given_to_workers(tmp_path):
    # each worker writes its view to its own file: the assertion does not depend on three
    # processes sharing one stdout pipe (a line from it went missing about once in 25 runs
    # on a loaded 2-core box, with every worker exiting 0; see the closing note of
    # 2026-11-30)
    script = tmp_path / "env.py"
    script.write_text("import os, sys\n"
                      "keys = ['KILN_RANK', 'KILN_WORLD_SIZE', 'KILN_LOCAL_RANK', 'KILN_STORE_HOSTED']\n"
                      "line = ' '.join(['ENV', *[os.environ[k] for k in keys], str(len(os.environ['KILN_TOKEN'])),"
                      " str(os.environ['KILN_STORE'].startswith('127.0.0.1:')), *sys.argv[1:]])\n"
                      "open('env%s.txt' % os.environ['KILN_RANK'], 'w').write(line)\n"
                      "print(line, flush=True)\n")
    proc = launch(tmp_path, "--nproc", "3", str(script), "a", "--b")
    assert proc.returncode == 0, proc.stderr
    lines = [(tmp_path / ("env%d.txt" % r)).read_text() for r in range(3)]
    assert lines == ["ENV %d 3 %d 1 64 True a --b" % (r, r) for r in range(3)]
    assert any(l.startswith("ENV ") for l in proc.stdout.splitlines())  # output reaches the caller


@pytest.mark.timeout(60)
def test_failing_worker_is_reported_and_the_rest_stopped(tmp_path):
    proc = launch(tmp_path, "--nproc", "2", "--grace", "2", str(EXAMPLE), "--fail-rank", "1")
    assert proc.returncode == 7, (proc.stdout, proc.stderr)
    assert "worker rank 1 (local rank 1, pid" in proc.stderr
    assert "failed: exit code 7" in proc.stderr
    assert "terminated the other workers" in proc.stderr


@pytest.mark.timeout(60)
def test_worker_killed_by_signal(tmp_path):
    script = tmp_path / "die.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['KILN_RANK'] == '0':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(30)\n")
    proc = launch(tmp_path, "--nproc", "2", "--grace", "1", str(script))
    assert proc.returncode == 128 + 9
    assert "worker rank 0" in proc.stderr and "killed by signal SIGKILL" in proc.stderr


@pytest.mark.timeout(60)
def test_two_nodes_on_one_machine(tmp_path):
    env = worker_env(tmp_path, "shared-secret")
    with reserved_port() as port:
        cmd = [sys.executable, "-m", "kiln.distributed", "launch", "--nnodes", "2", "--nproc",
               "1", "--rdzv", "127.0.0.1:%d" % port]
        nodes = [subprocess.Popen(cmd + ["--node-rank", str(i), str(EXAMPLE)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = [n.communicate(timeout=50) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert "rank 0: all_reduce -> [1.0, 1.0, 1.0, 1.0]" in outs[0][0]


def test_bad_configurations(tmp_path):
    proc = launch(tmp_path, "--nnodes", "2", "--nproc", "1", "x.py")
    assert proc.returncode == 2 and "--rdzv" in proc.stderr
    proc = launch(tmp_path, "--nnodes", "2", "--rdzv", "127.0.0.1:1", "x.py")
    assert proc.returncode == 2 and "KILN_TOKEN" in proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "kiln.distributed", "launch", "--help"],
                               capture_output=True, text=True).stdout
    assert "--nproc" in help_text and "KILN_RANK" in help_text


PRINTER = r'''
import os, signal, sys
rank = int(os.environ["KILN_RANK"])
for i in range(1000):
    # unbuffered, each print is several writes: ranks sharing a stream used to mix them
    print("rank", rank, "line", i, "payload", "x" * (i % 61))
    if i % 250 == 0:
        print("rank", rank, "warning", i, file=sys.stderr)
if rank == int(sys.argv[1]):
    print("LAST LINE of rank", rank)
    sys.stdout.write("no newline before the kill %d" % rank)
    os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.timeout(90)
def test_output_lines_stay_whole_and_attributed(tmp_path):
    script = tmp_path / "printer.py"
    script.write_text(PRINTER)
    env = worker_env(tmp_path, "unused", {"PYTHONUNBUFFERED": "1"})
    env.pop("KILN_TOKEN")
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "kiln.distributed", "launch", "--nproc", "4",
                           "--on-failure", "shrink", "--prefix", "--log-dir", str(logs),
                           str(script), "2"], env=env, capture_output=True, timeout=80,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    line = re.compile(rb"^\[rank (\d)\] rank (\d) line (\d+) payload (x*)$")
    seen: dict[int, list[int]] = {r: [] for r in range(4)}
    tail = []
    for text in proc.stdout.split(b"\n")[:-1]:
        m = line.match(text)
        if m is None:
            tail.append(text)
            continue
        head, rank, i, xs = int(m[1]), int(m[2]), int(m[3]), m[4]
        assert head == rank and len(xs) == i % 61, text
        seen[rank].append(i)
    assert all(seen[r] == list(range(1000)) for r in range(4)), {r: len(v) for r, v in seen.items()}
    # the killed worker's last lines made it, the one it never ended too
    assert sorted(tail) == [b"[rank 2] LAST LINE of rank 2",
                            b"[rank 2] no newline before the kill 2"], tail
    err = proc.stderr.decode().splitlines()
    for r in range(4):
        assert [l for l in err if l.startswith("[rank %d] " % r)] == [
            "[rank %d] rank %d warning %d" % (r, r, i) for i in (0, 250, 500, 750)]
    assert any(l.startswith("kiln launch: worker rank 2") for l in err)
    # one file per rank: its own lines only, both streams, no prefix
    for r in range(4):
        lines = (logs / ("rank%d.log" % r)).read_text().splitlines()
        assert [l for l in lines if " line " in l] == [
            "rank %d line %d payload %s" % (r, i, "x" * (i % 61)) for i in range(1000)]
        assert sum(" warning " in l for l in lines) == 4
        assert len(lines) == 1004 + 2 * (r == 2)
        # stdout and stderr are two pipes read by two threads: the file keeps each
        # stream's order, not an order between them (a warning may land after the
        # worker's last stdout line)
        out_lines = [l for l in lines if " warning " not in l]
        assert (r == 2) == (out_lines[-1] == "no newline before the kill 2")
        assert [l for l in lines if " warning " in l] == [
            "rank %d warning %d" % (r, i) for i in (0, 250, 500, 750)]


def test_log_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = launch(tmp_path, "--nproc", "1", "--log-dir", str(blocker / "logs"), "x.py")
    assert proc.returncode == 2
    assert "[K212] cannot write the workers' logs into --log-dir" in proc.stderr


class _Pipes:
    """Stands in for a Popen with stdout/stderr pipes: the test writes the worker's side."""

    def __init__(self):
        r1, self.out = os.pipe()
        r2, self.err = os.pipe()
        self.stdout, self.stderr = os.fdopen(r1, "rb"), os.fdopen(r2, "rb")

    def write(self, fd: int, data: bytes) -> None:
        os.write(fd, data)

    def exit(self) -> None:
        os.close(self.out)
        os.close(self.err)


class _Broken(io.BytesIO):
    def write(self, data):
        raise BrokenPipeError("the reader of kiln launch left")


def test_output_pieces_of_long_lines_and_a_reader_that_left(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_output, "MAX_LINE", 64)
    out, err = io.BytesIO(), _Broken()
    output = launch_output.Output(prefix=True, log_dir=str(tmp_path), stdout=out, stderr=err)
    worker = _Pipes()
    output.attach(3, worker)
    worker.write(worker.out, b"a" * 150)  # no newline for 150 bytes: passed on in pieces
    worker.write(worker.out, b"\nprogress 10%\rprogress 20%\n")
    # stderr's reader is gone: its lines are still drained, so the worker never blocks
    worker.write(worker.err, b"e" * 300_000 + b"\n")
    worker.write(worker.out, b"last, no newline")
    worker.exit()
    assert output.close(timeout=10) == []
    lines = out.getvalue().split(b"\n")
    assert lines[:3] == [b"[rank 3] " + b"a" * 64] * 2 + [b"[rank 3] " + b"a" * 22]
    assert lines[3:] == [b"[rank 3] progress 10%\rprogress 20%", b"[rank 3] last, no newline",
                         b""]
    # the log has both streams (their order between the two pipes is the reading order)
    log = (tmp_path / "rank3.log").read_bytes().split(b"\n")
    assert log.pop() == b""
    assert [line for line in log if line[:1] == b"a"] == [b"a" * 64] * 2 + [b"a" * 22]
    assert [line for line in log if line[:1] == b"e"] == [b"e" * 64] * 4687 + [b"e" * 32]
    assert [line for line in log if line[:1] not in (b"a", b"e")] == [
        b"progress 10%\rprogress 20%", b"last, no newline"]


def test_workers_are_unbuffered_only_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert "PYTHONUNBUFFERED" not in launch_output.unbuffered_on_terminal({})
    monkeypatch.setattr(sys, "stdout", Tty())
    assert launch_output.unbuffered_on_terminal({})["PYTHONUNBUFFERED"] == "1"
    assert launch_output.unbuffered_on_terminal({"PYTHONUNBUFFERED": ""}) == {
        "PYTHONUNBUFFERED": ""}  # the user's choice stays
