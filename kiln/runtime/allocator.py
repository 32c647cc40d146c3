"""The runtime's view of its buffers: hands out numpy buffers from the CPU device's
caching allocator, enforces the memory fraction, and tracks kiln's working memory
(`kiln.runtime.memory_stats()`).

Buffers are blocks of the CPU caching allocator (kiln/runtime/caching_allocator.py):
a buffer's block returns to the cache when the last view of it dies, so a compiled
function whose caller dropped its last result gets the same (already paged-in) memory
on the next call. The allocator's figures are `kn.memory.memory_stats("cpu")`; the
runtime's own counters below stay as documented: arena buffers (intermediates the
memory plan reuses) count while their compiled program lives, outputs while the call
that makes them runs; `peak_bytes` is the most kiln's runtime held at once.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from kiln.memory_limits import KilnMemoryError, check_request, limit_for, set_process_fraction
from kiln.runtime.caching_allocator import CachingAllocator, RawMemory

__all__ = ["Allocator", "KilnMemoryError", "default_allocator", "memory_stats",
           "set_memory_fraction"]


class Allocator:
    """Counts the bytes kiln's runtime holds; refuses to go past the memory fraction.

    `device_allocator` is where the memory comes from: the CPU device's caching
    allocator for the default instance, a private one otherwise.
    """

    def __init__(self, memory_fraction: float = 1.0,
                 device_allocator: CachingAllocator | None = None):
        from kiln.memory_limits import physical_memory

        self._lock = threading.Lock()
        self.persistent = 0  # arena bytes
        self.transient = 0  # outputs of calls in flight
        self.peak = 0
        self.allocations = 0  # buffers not served from memory a dropped buffer gave back
        self.device_allocator = device_allocator or CachingAllocator("cpu", RawMemory(),
                                                                     physical_memory())
        self.set_memory_fraction(memory_fraction)

    def set_memory_fraction(self, fraction: float) -> None:
        self.limit = limit_for(fraction)
        self.fraction = fraction

    def empty(self, shape, dtype, persistent: bool = False) -> np.ndarray:
        """A buffer of `shape`, refused (K170, nothing allocated) past the limit."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(map(int, shape)) * dtype.itemsize  # Python ints: no overflow
        with self._lock:
            current = self.persistent + self.transient + nbytes
            if current > self.limit:
                check_request(f"allocating a {dtype.name} buffer of shape {tuple(shape)}", nbytes,
                              self.persistent + self.transient, self.limit, self.fraction)
            device = self.device_allocator
            block = device.malloc(nbytes, (dtype, shape))
            array = device.view_of(block, shape, dtype, nbytes // dtype.itemsize)
            if persistent:
                self.persistent += nbytes
            else:
                self.transient += nbytes
            if current > self.peak:
                self.peak = current
            if not block.reused:
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


_DEFAULT: Allocator | None = None


def default_allocator() -> Allocator:
    """The runtime allocator every compiled program uses: it carves the CPU device's
    caching allocator (the one `kn.memory` reports)."""
    global _DEFAULT
    if _DEFAULT is None:
        from kiln.runtime.device import allocator_for

        _DEFAULT = Allocator(device_allocator=allocator_for("cpu"))
    return _DEFAULT


def memory_stats() -> dict:
    """Bytes of kiln's runtime buffers in this process: current, arena, peak."""
    return default_allocator().stats()


def set_memory_fraction(fraction: float) -> None:
    """Cap kiln's runtime allocations, and every eager result, at `fraction` of physical
    memory (the CPU device's `kn.memory.set_per_process_memory_fraction` too)."""
    from kiln.runtime.device import allocator_for

    default_allocator().set_memory_fraction(fraction)
    set_process_fraction(fraction)
    allocator_for("cpu").set_fraction(fraction)
