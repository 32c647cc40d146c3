"""Progress bars for long work (autotuning, large compiles, checkpoint writes): tqdm on a
terminal, silent otherwise.

A bar appears only when stderr is a terminal (or `KILN_PROGRESS=1` forces it; `=0`
turns bars off everywhere), tqdm is installed, and the work is still running after
`DELAY_S` seconds — short work never draws anything, and logs, pipes and CI output stay
clean.

    >>> for kernel in progress(kernels, desc="autotuning", unit="kernel"):
    ...     tune(kernel)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
DELAY_S = 0.5  # a bar shows only for work that lasts longer than this
POLL_S = 0.1


def enabled(stream=None) -> bool:
    """Whether bars are drawn: KILN_PROGRESS=1/0 forces, else only on a terminal."""
    forced = os.environ.get("KILN_PROGRESS", "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return False
    if forced not in ("1", "true", "yes", "on"):
        stream = stream or sys.stderr
        try:
            if not stream.isatty():
                return False
        except (AttributeError, ValueError):  # a closed or unusual stream
            return False
    try:  # only where a bar may show: importing tqdm costs ~17 ms (a cold compile's)
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _bar(total, desc: str, unit: str, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, delay=DELAY_S, leave=False, file=sys.stderr,
                dynamic_ncols=True, **kwargs)


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it") -> Iterator[T]:
    """`iterable`, with a bar while it is consumed (when `enabled()`)."""
    if not enabled():
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    bar = _bar(total, desc, unit)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()


def write_with_progress(write: Callable[[str], None], path: str, total_bytes: int, desc: str) -> None:
    """Run `write(path)` (which fills the file at `path`) with a byte bar that follows the
    file's size; without a bar it is just `write(path)`. Errors of `write` propagate."""
    if not enabled():
        write(path)
        return
    error: list[BaseException] = []

    def run():
        try:
            write(path)
        except BaseException as e:  # handed to the caller's thread below
            error.append(e)

    worker = threading.Thread(target=run, name="kiln-write", daemon=True)
    bar = _bar(total_bytes, desc, "B", unit_scale=True, unit_divisor=1024)
    try:
        worker.start()
        while worker.is_alive():  # ends when the writer does: each wait is bounded
            worker.join(timeout=POLL_S)
            try:
                size = os.path.getsize(path)
            except OSError:
                size = 0
            bar.update(max(min(size, total_bytes) - bar.n, 0))
        if not error:
            bar.update(max(total_bytes - bar.n, 0))
    finally:
        bar.close()
    if error:
        raise error[0]


@contextmanager
def working(desc: str) -> Iterator[None]:
    """A bar showing the elapsed time while the block runs, for work without a count (a
    large compile: LLVM optimizes one module); nothing when the block ends within
    `DELAY_S` or bars are off. The ticking thread ends with the block (bounded join)."""
    if not enabled():
        yield
        return
    start = time.monotonic()
    stop = threading.Event()
    bar = []

    def tick():
        while not stop.wait(POLL_S):
            if time.monotonic() - start >= DELAY_S:
                if not bar:
                    bar.append(_bar(None, desc, "s", bar_format="{desc}: {elapsed}"))
                bar[0].refresh()

    ticker = threading.Thread(target=tick, name="kiln-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join(timeout=1.0)
        if bar:
            bar[0].close()
