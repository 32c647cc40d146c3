"""Staging memory for async saves: the snapshot taken at the call, by one copy.

`async_save` must return before the training loop changes its tensors, so it copies
this rank's blocks at the call and writes the copy in the background. The copy is the
whole stall the caller sees, so it goes into one reused buffer (PyTorch DCP's pinned
staging memory, on the CPU): a fresh allocation would take a page fault per 4 KiB page
on every save, about a third of the copy's time here. The buffer is handed back when
the background write ends and kept (one idle buffer per process, the largest) for the
next save; `clear()` frees it. Large copies are split over this process's share of
the cores (numpy releases the GIL while it copies).

    >>> views, lease = stage([np.arange(4.0)])
    >>> views[0].tolist(), lease.nbytes >= 32
    ([0.0, 1.0, 2.0, 3.0], True)
    >>> release(lease)
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numpy as np

_ALIGN = 64  # each block starts on a cache line
_SPLIT = 8 << 20  # copies are cut into pieces of at least this many bytes per thread

def _copy_threads() -> int:
    """Threads per copy: this process's share of the cores (the ranks of one host, as
    `kiln launch` gives KILN_LOCAL_WORLD_SIZE, copy at the same time), at most 4; extra
    threads on busy cores only add hand-offs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("KILN_LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(4, cores // local))


_THREADS = _copy_threads()


class _Pool:
    """Idle staging buffers (uint8 arrays), at most `keep` of them."""

    def __init__(self, keep: int = 1):
        self.keep, self.idle, self.lock = keep, [], threading.Lock()
        self.copier: concurrent.futures.ThreadPoolExecutor | None = None

    def take(self, nbytes: int) -> np.ndarray:
        with self.lock:
            fits = [b for b in self.idle if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self.idle.remove(buf)
                return buf
        return np.empty(max(nbytes, 1), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self.lock:
            self.idle.append(buf)
            self.idle.sort(key=lambda b: -b.nbytes)
            del self.idle[self.keep:]

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.lock:
            if self.copier is None:
                self.copier = concurrent.futures.ThreadPoolExecutor(
                    _THREADS, thread_name_prefix="kiln-ckpt-stage")
            return self.copier


_POOL = _Pool()


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges that cut a copy of `nbytes` over the copy threads."""
    if nbytes <= 0:
        return []
    parts = max(1, min(_THREADS, nbytes // _SPLIT))
    step = -(-nbytes // parts)
    return [(i, min(i + step, nbytes)) for i in range(0, nbytes, step)]


def stage(arrays: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Copies of `arrays` (C-ordered) in one staging buffer: (the copies, the buffer to
    hand back with `release` once they are written; None when there is nothing)."""
    arrays = [np.require(a, requirements="C") for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    if not arrays:
        return [], None
    lease = _POOL.take(total)
    views, jobs = [], []
    for a, start in zip(arrays, offsets):
        dst = lease[start:start + a.nbytes]
        src = a.reshape(-1).view(np.uint8)
        jobs += [(dst[lo:hi], src[lo:hi]) for lo, hi in _pieces(a.nbytes)]
        views.append(dst.view(a.dtype).reshape(a.shape))
    if len(jobs) > 1 and total >= 2 * _SPLIT:
        pool = _POOL.executor()
        for f in [pool.submit(np.copyto, d, s) for d, s in jobs]:
            f.result()
    else:
        for d, s in jobs:
            np.copyto(d, s)
    return views, lease


def release(lease: np.ndarray | None) -> None:
    """Hand a staging buffer back once nothing reads its copies any more."""
    if lease is not None:
        _POOL.give(lease)


_HELD: dict = {}  # id(array) -> [array, holds, was it writeable, copy-on-write holds]
_HELD_LOCK = threading.Lock()


def hold(arrays: list, *, cow: bool = False) -> list:
    """Make `arrays` read-only while a save writes them from their own memory; returns
    the token for `unhold`. Holds nest: an array becomes writeable again when its last
    hold ends, if it was before the first. `cow`: copy-on-write — the kiln paths that
    hand the array out for writing (`Tensor.numpy()`, `np.asarray(tensor)`,
    `DTensor.local_array()`, collectives on a tensor) first give its owner a fresh copy
    (`cow_copy`), so the owner sees its writes and the save keeps the values of the call;
    without it an in-place write raises (`async_save(copy=False)`)."""
    token = []
    with _HELD_LOCK:
        for a in arrays:
            entry = _HELD.get(id(a))
            if entry is None or entry[0] is not a:
                entry = _HELD[id(a)] = [a, 0, bool(a.flags.writeable), 0]
                a.flags.writeable = False
            entry[1] += 1
            entry[3] += bool(cow)
            token.append((a, bool(cow)))
    return token


def unhold(token: list) -> None:
    """End the holds `hold` returned `token` for."""
    with _HELD_LOCK:
        for a, cow in reversed(token):  # the bases of a view first
            entry = _HELD.get(id(a))
            if entry is None or entry[0] is not a:
                continue
            entry[1] -= 1
            entry[3] -= cow
            if entry[1] == 0:
                del _HELD[id(a)]
                if entry[2]:
                    try:
                        a.flags.writeable = True
                    except ValueError:  # its base is still held by another save
                        pass


def cow_copy(array: np.ndarray) -> np.ndarray | None:
    """A fresh, writeable copy of `array` when a copy-on-write hold is on it (its owner
    then takes the copy in its place, and the save keeps writing the original); None
    when the array is not held copy-on-write."""
    with _HELD_LOCK:
        entry = _HELD.get(id(array))
        held = entry is not None and entry[0] is array and entry[3] > 0
    return np.array(array, copy=True, order="K") if held else None


def clear() -> None:
    """Free the idle staging buffers (the next async save allocates again)."""
    with _POOL.lock:
        _POOL.idle.clear()


__all__ = ["clear", "cow_copy", "hold", "release", "stage", "unhold"]
