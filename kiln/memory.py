"""`kn.memory`: each device's caching allocator, with PyTorch's names and meanings.

>>> import kiln as kn
>>> x = kn.ones(1024)                        # eager tensors count while they live
>>> kn.memory.memory_allocated("cpu") >= x.numpy().nbytes
True

`device=None` is the CPU (kiln has no "current device" to default to; pass
`"cuda:0"` and so on for the others). Figures are bytes, for this process.
"""

from __future__ import annotations

from kiln.runtime.device import allocator_for


def memory_allocated(device=None) -> int:
    """Bytes held by live tensors and runtime buffers on `device`."""
    return allocator_for(device).memory_allocated()


def max_memory_allocated(device=None) -> int:
    """The peak of `memory_allocated` since start or `reset_peak_memory_stats`."""
    return allocator_for(device).max_memory_allocated()


def memory_reserved(device=None) -> int:
    """Bytes the caching allocator holds from the device: allocated plus cached."""
    return allocator_for(device).memory_reserved()


def max_memory_reserved(device=None) -> int:
    """The peak of `memory_reserved` since start or `reset_peak_memory_stats`."""
    return allocator_for(device).max_memory_reserved()


def memory_cached(device=None) -> int:
    """Old name of `memory_reserved` (as torch.cuda.memory_cached was)."""
    return memory_reserved(device)


def reset_peak_memory_stats(device=None) -> None:
    """Restart every peak from the current figures."""
    allocator_for(device).reset_peak_memory_stats()


def reset_accumulated_memory_stats(device=None) -> None:
    """Zero the running totals (".allocated", ".freed", retries, OOMs)."""
    allocator_for(device).reset_accumulated_memory_stats()


def empty_cache(device=None) -> int:
    """Give the device every cached segment no tensor uses; returns the bytes freed
    (torch returns None; the figure is handy and harmless)."""
    return allocator_for(device).empty_cache()


def memory_stats(device=None) -> dict:
    """A flat dict with torch.cuda.memory_stats's keys: "allocated_bytes.all.current",
    "reserved_bytes.all.peak", "active_bytes.small_pool.freed", "num_alloc_retries",
    "num_ooms", ... plus "limit_bytes" and "total_bytes"."""
    return allocator_for(device).memory_stats()


def memory_snapshot(device=None) -> list[dict]:
    """The segments of the device's allocator and the blocks in each."""
    return allocator_for(device).snapshot()


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """Allow this process at most `fraction` of the device's memory: an allocation past it
    (after the cache is emptied and the request retried) raises K170 with the figures.
    On the CPU this is also `kiln.runtime.set_memory_fraction`."""
    allocator = allocator_for(device)
    if allocator.device == "cpu":
        from kiln.runtime.allocator import set_memory_fraction

        allocator.set_fraction(fraction)  # validates before anything changes
        set_memory_fraction(fraction)
    else:
        allocator.set_fraction(fraction)


def get_per_process_memory_fraction(device=None) -> float:
    return allocator_for(device).fraction


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes for this process: the limit less what is reserved, and the
    device's memory (as torch.cuda.mem_get_info, but seen through the fraction)."""
    allocator = allocator_for(device)
    return max(0, allocator.limit - allocator.memory_reserved()), allocator.total_memory


__all__ = ["empty_cache", "get_per_process_memory_fraction", "max_memory_allocated",
           "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_cached",
           "memory_reserved", "memory_snapshot", "memory_stats", "reset_accumulated_memory_stats",
           "reset_peak_memory_stats", "set_per_process_memory_fraction"]
