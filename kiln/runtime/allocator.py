"""The CPU allocator: hands out numpy buffers, enforces a memory fraction, and tracks
kiln's working memory (`kiln.runtime.memory_stats()`).

Arena buffers (intermediates the memory plan reuses) stay allocated while their
compiled program lives, and count until then; outputs count while the call that
makes them runs, after which they belong to the caller. `peak_bytes` is the most
kiln held at once. Tracking costs a counter update, not a finalizer per array.
"""

from __future__ import annotations

import threading

import numpy as np

from kiln.memory_limits import KilnMemoryError, check_request, limit_for, nbytes_of, \
    set_process_fraction

__all__ = ["Allocator", "KilnMemoryError", "default_allocator", "memory_stats",
           "set_memory_fraction"]


class Allocator:
    """Counts the bytes kiln's runtime holds; refuses to go past the memory fraction."""

    def __init__(self, memory_fraction: float = 1.0):
        self._lock = threading.Lock()
        self.persistent = 0  # arena bytes
        self.transient = 0  # outputs of calls in flight
        self.peak = 0
        self.allocations = 0
        self.set_memory_fraction(memory_fraction)

    def set_memory_fraction(self, fraction: float) -> None:
        self.limit = limit_for(fraction)
        self.fraction = fraction

    def empty(self, shape, dtype, persistent: bool = False) -> np.ndarray:
        """A buffer of `shape`, refused (K170, nothing allocated) past the limit."""
        nbytes = nbytes_of(shape, np.dtype(dtype).itemsize)
        with self._lock:
            current = self.persistent + self.transient + nbytes
            check_request(f"allocating a {np.dtype(dtype).name} buffer of shape {tuple(shape)}",
                          nbytes, self.persistent + self.transient, self.limit, self.fraction)
            array = np.empty(shape, dtype)
            if persistent:
                self.persistent += nbytes
            else:
                self.transient += nbytes
            self.peak = max(self.peak, current)
            self.allocations += 1
        return array

    def end_call(self, nbytes: int) -> None:
        """Outputs of a finished call are the caller's now."""
        with self._lock:
            self.transient = max(0, self.transient - nbytes)

    def release_persistent(self, nbytes: int) -> None:
        with self._lock:
            self.persistent = max(0, self.persistent - nbytes)

    def stats(self) -> dict:
        return {"current_bytes": self.persistent + self.transient, "arena_bytes": self.persistent,
                "peak_bytes": self.peak, "allocations": self.allocations, "limit_bytes": self.limit}

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.persistent + self.transient


_DEFAULT = Allocator()


def default_allocator() -> Allocator:
    return _DEFAULT


def memory_stats() -> dict:
    """Bytes of kiln's runtime buffers in this process: current, arena, peak."""
    return _DEFAULT.stats()


def set_memory_fraction(fraction: float) -> None:
    """Cap kiln's runtime allocations, and every eager result, at `fraction` of physical
    memory."""
    _DEFAULT.set_memory_fraction(fraction)
    set_process_fraction(fraction)
