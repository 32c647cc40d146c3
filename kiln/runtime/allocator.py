"""The CPU allocator: hands out numpy buffers, enforces a memory fraction, and tracks
the process's current and peak bytes (`kiln.runtime.memory_stats()`)."""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np

from kiln.errors import KilnError


class KilnMemoryError(KilnError, MemoryError):
    code = "K170"
    title = "allocation beyond the memory fraction"


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


class Allocator:
    """Counts bytes of buffers it allocated while they are alive (weakly tracked)."""

    def __init__(self, memory_fraction: float = 1.0):
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self.allocations = 0
        self.set_memory_fraction(memory_fraction)

    def set_memory_fraction(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise KilnError(f"memory fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.limit = int(_physical_memory() * fraction)

    def empty(self, shape, dtype, persistent: bool = False) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        with self._lock:
            if self.current + nbytes > self.limit:
                raise KilnMemoryError(
                    f"allocating {nbytes} bytes would use {self.current + nbytes} bytes, over the "
                    f"limit of {self.limit} ({self.fraction:.0%} of physical memory)",
                    hint="lower the batch size or raise kiln.runtime.set_memory_fraction()")
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.allocations += 1
        array = np.empty(shape, dtype)
        _release_on_collect(array, nbytes, self)
        return array

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes

    def stats(self) -> dict:
        return {"current_bytes": self.current, "peak_bytes": self.peak,
                "allocations": self.allocations, "limit_bytes": self.limit}

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current


def _release_on_collect(array: np.ndarray, nbytes: int, allocator: Allocator) -> None:
    # numpy arrays carry no attributes: a finalizer gives the bytes back when numpy frees them
    weakref.finalize(array, allocator._free, nbytes)


_DEFAULT = Allocator()


def default_allocator() -> Allocator:
    return _DEFAULT


def memory_stats() -> dict:
    """Current and peak bytes of buffers kiln's runtime allocated in this process."""
    return _DEFAULT.stats()


def set_memory_fraction(fraction: float) -> None:
    """Cap kiln's runtime allocations at `fraction` of physical memory."""
    _DEFAULT.set_memory_fraction(fraction)
