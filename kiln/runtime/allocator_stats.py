"""The statistics half of `CachingAllocator` (kiln/runtime/caching_allocator.py), with
PyTorch's `memory_stats()` keys: bytes allocated, reserved and requested, blocks and
segments, per pool (small, large), with peaks and running totals.

The allocator calls `_event` / `_tracked_event` / `_block_event` on every change; users
read the figures through the public methods. The mixin expects the allocator's lock
(`_guard`), free lists (`_free`), quick cache (`_quick`, `_flush_quick`) and `version`.
"""

from __future__ import annotations

_METRICS = ("allocated_bytes", "reserved_bytes", "requested_bytes", "allocation", "segment")
_ALIASES = {"allocated_bytes": ("allocated_bytes", "active_bytes"),
            "allocation": ("allocation", "active")}


def _bump(p: list, q: list, top: list, m: int, amount: int) -> None:
    """Metric m of pool p (the other pool q) changes by `amount`."""
    k = 4 * m
    p[k] += amount
    if amount > 0:
        p[k + 2] += amount
        if p[k] > p[k + 1]:
            p[k + 1] = p[k]
        if p[k] + q[k] > top[m]:
            top[m] = p[k] + q[k]
    else:
        p[k + 3] -= amount


class AllocatorStatistics:
    """PyTorch's allocator statistics, kept by one update call per change."""

    # -- statistics -----------------------------------------------------------------------

    # Statistics live in one flat list per pool: for metric m (_METRICS order) the four
    # figures current, peak, allocated (running total), freed sit at 4m .. 4m+3; the peak
    # of the two pools' sum per metric is kept apart. One `_event` call updates them all:
    # an eager op pays for one call per result it makes and one when the result dies.

    def _reset_stats(self) -> None:
        self._pools = {True: [0] * (4 * len(_METRICS)), False: [0] * (4 * len(_METRICS))}
        self._all_peak = [0] * len(_METRICS)
        self._split_peaks = {}  # inactive_split(_bytes) peaks, computed when asked
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.allocated = 0
        self.reserved = 0

    def _event(self, small: bool, nbytes: int, reserved: int, requested: int, blocks: int,
               segments: int) -> None:
        """Apply one change (negative amounts free) to every statistic of a pool."""
        p, q, top = self._pools[small], self._pools[not small], self._all_peak
        self.allocated += nbytes
        self.reserved += reserved
        self.version += 1
        if nbytes:
            _bump(p, q, top, 0, nbytes)
        if reserved:
            _bump(p, q, top, 1, reserved)
        if requested:
            _bump(p, q, top, 2, requested)
        if blocks:
            _bump(p, q, top, 3, blocks)
        if segments:
            _bump(p, q, top, 4, segments)
            if segments > 0:
                self.num_device_alloc += segments
            else:
                self.num_device_free -= segments

    def _tracked_event(self, small: bool, n: int) -> None:
        """`_event(small, n, n, n, 1, 1)` (or its negation when n < 0) written out: the one
        statistics update an eager result costs when made and when it dies."""
        p, q, top = self._pools[small], self._pools[not small], self._all_peak
        self.allocated += n
        self.reserved += n
        self.version += 1
        if n > 0:
            # bytes: allocated (0), reserved (4), requested (8); counts: blocks (12), segments (16)
            p[0] += n
            p[4] += n
            p[8] += n
            p[12] += 1
            p[16] += 1
            p[2] += n
            p[6] += n
            p[10] += n
            p[14] += 1
            p[18] += 1
            self.num_device_alloc += 1
            for k in (0, 4, 8, 12, 16):
                if p[k] > p[k + 1]:
                    p[k + 1] = p[k]
                if p[k] + q[k] > top[k >> 2]:
                    top[k >> 2] = p[k] + q[k]
        else:
            p[0] += n
            p[4] += n
            p[8] += n
            p[12] -= 1
            p[16] -= 1
            p[3] -= n
            p[7] -= n
            p[11] -= n
            p[15] += 1
            p[19] += 1
            self.num_device_free += 1

    def _block_event(self, small: bool, size: int, requested: int) -> None:
        """A block handed out (size > 0) or given back (size < 0): allocated (0), requested
        (8) and block count (12) change; written out, as a compiled call pays it per
        output."""
        p, q, top = self._pools[small], self._pools[not small], self._all_peak
        self.allocated += size
        self.version += 1
        if size > 0:
            p[0] += size
            p[2] += size
            p[8] += requested
            p[10] += requested
            p[12] += 1
            p[14] += 1
            for k in (0, 8, 12):
                if p[k] > p[k + 1]:
                    p[k + 1] = p[k]
                if p[k] + q[k] > top[k >> 2]:
                    top[k >> 2] = p[k] + q[k]
        else:
            p[0] += size
            p[3] -= size
            p[8] += requested
            p[11] -= requested
            p[12] -= 1
            p[15] += 1

    def memory_allocated(self) -> int:
        self.settle()
        return self.allocated

    def memory_reserved(self) -> int:
        self.settle()
        return self.reserved

    def max_memory_allocated(self) -> int:
        self.settle()
        return self._all_peak[0]

    def max_memory_reserved(self) -> int:
        self.settle()
        return self._all_peak[1]

    def reset_peak_memory_stats(self) -> None:
        """Peaks restart from the current figures, as torch.cuda.reset_peak_memory_stats."""
        with self._guard:
            small, large = self._pools[True], self._pools[False]
            for m in range(len(_METRICS)):
                for pool in (small, large):
                    pool[4 * m + 1] = pool[4 * m]
                self._all_peak[m] = small[4 * m] + large[4 * m]
            self._split_peaks.clear()

    def reset_accumulated_memory_stats(self) -> None:
        with self._guard:
            for pool in self._pools.values():
                for m in range(len(_METRICS)):
                    pool[4 * m + 2] = pool[4 * m + 3] = 0
            self.num_alloc_retries = self.num_ooms = 0
            self.num_device_alloc = self.num_device_free = 0

    def memory_stats(self) -> dict:
        """PyTorch's flat dict: "allocated_bytes.all.current", ".small_pool.peak", ...
        (active = allocated: kiln frees nothing late for other streams)."""
        with self._guard:
            self._flush_quick()
            small, large = self._pools[True], self._pools[False]
            out: dict = {}
            for m, name in enumerate(_METRICS):
                k = 4 * m
                rows = {"all": (small[k] + large[k], self._all_peak[m], small[k + 2] + large[k + 2],
                                small[k + 3] + large[k + 3]),
                        "small_pool": small[k:k + 4], "large_pool": large[k:k + 4]}
                for alias in _ALIASES.get(name, (name,)):
                    for pool, figures in rows.items():
                        for i, what in enumerate(("current", "peak", "allocated", "freed")):
                            out[f"{alias}.{pool}.{what}"] = figures[i]
            for small_pool in (True, False):
                count = nbytes = 0
                for block in self._free[small_pool]:
                    if block.prev is not None or block.next is not None:
                        count += 1
                        nbytes += block.size
                pool = "small_pool" if small_pool else "large_pool"
                for name, value in (("inactive_split", count), ("inactive_split_bytes", nbytes)):
                    peak = max(self._split_peaks.get((name, pool), 0), value)
                    self._split_peaks[name, pool] = peak
                    out[f"{name}.{pool}.current"], out[f"{name}.{pool}.peak"] = value, peak
            for name in ("inactive_split", "inactive_split_bytes"):
                out[f"{name}.all.current"] = (out[f"{name}.small_pool.current"]
                                              + out[f"{name}.large_pool.current"])
                out[f"{name}.all.peak"] = max(out[f"{name}.small_pool.peak"],
                                              out[f"{name}.large_pool.peak"],
                                              out[f"{name}.all.current"])
            out.update({"num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
                        "num_device_alloc": self.num_device_alloc,
                        "num_device_free": self.num_device_free,
                        "num_sync_all_streams": 0, "max_split_size": -1,
                        "limit_bytes": self.limit, "total_bytes": self.total_memory})
            return out
