"""`kiln store` under file-descriptor exhaustion: run it in a subprocess with a low
RLIMIT_NOFILE, open several times more connections than the limit, and check that it
did not exit, said so in one line, and still serves a real client while the
strangers hang on."""

from __future__ import annotations

import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kiln.distributed import Store

REPO = Path(__file__).resolve().parents[2]
LIMIT = 64  # the server's RLIMIT_NOFILE
STRANGERS = 3 * LIMIT


def _limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def _wait_for(path: Path, text: str, proc: subprocess.Popen, seconds: float) -> str:
    """The file's content once it holds `text` (bounded; fails if the process ends)."""
    deadline = time.monotonic() + seconds
    while True:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        assert proc.poll() is None, "the store exited (rc %s):\n%s" % (proc.returncode, content)
        assert time.monotonic() < deadline, "no %r after %.0f s:\n%s" % (text, seconds, content)
        time.sleep(0.05)


def _connect_nowait(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))  # EINPROGRESS: the kernel completes it
    return sock


def test_store_survives_fd_exhaustion(tmp_path):
    token = secrets.token_hex(16)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = dict(os.environ, KILN_TOKEN=token,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(out, "w") as fout, open(err, "w") as ferr:
        proc = subprocess.Popen([sys.executable, "-m", "kiln.distributed", "store", "--port", "0"],
                                stdout=fout, stderr=ferr, env=env, preexec_fn=_limit_files)
    strangers: list[socket.socket] = []
    try:
        line = _wait_for(out, "\n", proc, 60).splitlines()[0]
        address = line.rsplit(" ", 1)[1]
        port = int(address.rsplit(":", 1)[1])
        strangers = [_connect_nowait(port) for _ in range(STRANGERS)]
        text = _wait_for(err, "EMFILE", proc, 30)
        lines = text.splitlines()  # one line per kind of trouble, not one per connection
        assert all(line.startswith("kiln store: ") for line in lines) and len(lines) <= 3
        # the strangers are still connected (idle, or queued in the backlog): a real
        # client gets its turn anyway, because the oldest handshakes are dropped
        store = Store(address, token, timeout=30)
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.add("n", 2) == 2
        assert proc.poll() is None
        for sock in strangers:
            sock.close()
        strangers = []
        store.close()
        again = Store(address, token, timeout=30)
        assert again.get("k") == b"v"
        again.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        for sock in strangers:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
