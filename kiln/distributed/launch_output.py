"""Worker output under `kiln launch`: every rank's stdout and stderr, line by line.

Each worker's stdout and stderr are pipes that the launcher reads, one thread per
stream. Every complete line is written whole to the launcher's own stdout or stderr —
one write under one process-wide lock, which the launcher's own messages take too — so
lines of different ranks never mix inside a line, even when workers write unbuffered
(`PYTHONUNBUFFERED=1` makes `print(a, b)` several writes, which used to interleave
mid-line when the ranks shared the launcher's terminal).

    [rank 0] step 10 loss 0.4127          (with --prefix)
    [rank 1] step 10 loss 0.4131

With a log directory, every line of rank N (stdout and stderr, in the order read) is
also appended to `<dir>/rank<N>.log` (a replacement in the slot appends to the same
file): torchrun's `--tee`. A worker's last lines are never lost: what it wrote sits in
the pipe after it died, and the reader takes everything up to end-of-file. A line
without its newline at the end (the worker died mid-line) is written with one added; a
line longer than MAX_LINE goes on as lines of MAX_LINE bytes (the last one shorter), so
memory stays bounded.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import BinaryIO

MAX_LINE = 1 << 20  # a longer line is passed on in pieces of this size
_READ = 1 << 16
_LOCK = threading.Lock()  # every whole-line write of the launcher process


def write_lines(stream: BinaryIO, data: bytes) -> bool:
    """Write `data` (whole lines) to `stream` under the launcher's output lock, flushed;
    False if the stream is gone (a closed pipe: the reader of `kiln launch` left)."""
    with _LOCK:
        try:
            stream.write(data)
            stream.flush()
            return True
        except (OSError, ValueError):
            return False


def unbuffered_on_terminal(env: dict) -> dict:
    """`env` with PYTHONUNBUFFERED=1 when the launcher writes to a terminal (and the user
    did not choose): workers write into pipes, which Python block-buffers, and on a
    terminal lines should appear as they are printed (whole, as ever)."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty and "PYTHONUNBUFFERED" not in env:
        env = dict(env, PYTHONUNBUFFERED="1")
    return env


def log_line(text: str) -> None:
    """One message of the launcher itself to its stderr, never inside a worker's line."""
    write_lines(_binary(sys.stderr), (text.rstrip("\n") + "\n").encode(errors="replace"))


def _binary(stream) -> BinaryIO:
    return getattr(stream, "buffer", stream)


class _Pump(threading.Thread):
    """Reads one pipe to end-of-file and passes its lines on."""

    def __init__(self, owner: "Output", rank: int, pipe: BinaryIO, dest: BinaryIO):
        super().__init__(name="kiln-launch-output-%d" % rank, daemon=True)
        self.owner, self.rank, self.pipe, self.dest = owner, rank, pipe, dest
        self.head = b"[rank %d] " % rank if owner.prefix else b""

    def run(self) -> None:
        fd, pending = self.pipe.fileno(), b""
        try:
            while True:
                try:
                    chunk = os.read(fd, _READ)
                except InterruptedError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                pending += chunk
                cut = pending.rfind(b"\n") + 1
                if not cut and len(pending) >= MAX_LINE:  # whole pieces of a long line
                    cut = len(pending) - len(pending) % MAX_LINE
                if cut:
                    self._emit(pending[:cut])
                    pending = pending[cut:]
            if pending:  # the worker ended mid-line: keep what it wrote
                self._emit(pending + b"\n")
        finally:
            self.pipe.close()

    def _emit(self, data: bytes) -> None:
        # only b"\n" ends a line: a progress bar's b"\r" stays inside its line
        lines = data.split(b"\n")
        if not lines[-1]:
            lines.pop()
        pieces = []
        for line in lines:
            pieces += [line[i:i + MAX_LINE] + b"\n" for i in range(0, len(line), MAX_LINE)] \
                or [b"\n"]
        self.owner.emit(self.rank, self.dest, self.head, pieces)


class Output:
    """The launcher's side of its workers' output: `attach` each worker as it starts,
    `close` at the end (waits, bounded, for every pipe's last bytes)."""

    def __init__(self, *, prefix: bool = False, log_dir: str | None = None,
                 stdout: BinaryIO | None = None, stderr: BinaryIO | None = None):
        self.prefix, self.log_dir = prefix, log_dir
        self.stdout = stdout or _binary(sys.stdout)
        self.stderr = stderr or _binary(sys.stderr)
        self._pumps: list[_Pump] = []
        self._files: dict[int, BinaryIO] = {}
        self._dead: set[int] = set()  # ids of destinations that failed: drained, not written

    def attach(self, rank: int, proc) -> None:
        """Start passing on the output of `proc` (Popen with stdout/stderr PIPE) as rank's."""
        if self.log_dir is not None and rank not in self._files:
            self._files[rank] = open(os.path.join(self.log_dir, "rank%d.log" % rank), "ab")
        for pipe, dest in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
            if pipe is not None:
                pump = _Pump(self, rank, pipe, dest)
                self._pumps.append(pump)
                pump.start()

    def emit(self, rank: int, dest: BinaryIO, head: bytes, lines: list[bytes]) -> None:
        """Pass whole lines of `rank` on to `dest` (prefixed) and to its log file."""
        if id(dest) not in self._dead:
            data = b"".join(head + line for line in lines) if head else b"".join(lines)
            if not write_lines(dest, data):
                self._dead.add(id(dest))  # keep draining the pipes: workers must not block
        log = self._files.get(rank)
        if log is not None and id(log) not in self._dead:
            if not write_lines(log, b"".join(lines)):
                self._dead.add(id(log))

    def close(self, timeout: float = 5.0) -> list[int]:
        """Wait until every pipe reached end-of-file (the workers, and anything they
        started that holds their output, have exited) — at most `timeout` s in all —
        and close the log files; the ranks whose output was still open then."""
        deadline = time.monotonic() + timeout
        for pump in self._pumps:
            pump.join(max(deadline - time.monotonic(), 0.0))
        open_ranks = sorted({p.rank for p in self._pumps if p.is_alive()})
        with _LOCK:
            for f in self._files.values():
                try:
                    f.close()
                except OSError:
                    pass
            self._files = {}
        return open_ranks
