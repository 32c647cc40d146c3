"""A caching allocator per device, with PyTorch's rounding, pools and statistics.

Memory is taken from the device in *segments* (`RawMemory.alloc`) and handed out as
*blocks* carved from them, as PyTorch's CUDA caching allocator does:

- a request is rounded up to a multiple of 512 bytes;
- requests up to 1 MiB come from the small pool (2 MiB segments), larger ones from the
  large pool (20 MiB segments below 10 MiB, else the size rounded up to 2 MiB);
- a free block is found best-fit; a block bigger than asked is split when the rest is
  worth keeping (>= 512 bytes small, > 1 MiB large); a freed block merges with free
  neighbours of its segment and stays cached for the next request;
- `empty_cache()` gives every wholly free segment back to the device;
- past the per-process limit (`set_fraction`), the cache is emptied and the request
  retried once (`num_alloc_retries`); still past it, K170 (`num_ooms`).

Memory kiln did not carve itself but holds on a device — an eager op's numpy result —
is *tracked*: counted as allocated and reserved while the array lives (a weakref
callback uncounts it), never cached. Statistics use PyTorch's `memory_stats()` keys.
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from kiln.memory_limits import KilnMemoryError, human

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # largest request served by the small pool
SMALL_BUFFER = 2 << 20  # small pool segment
LARGE_BUFFER = 20 << 20  # large pool segment for requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

_HINT = ("free cached blocks with kn.memory.empty_cache(), lower the batch size, or raise "
         "kn.memory.set_per_process_memory_fraction()")

_STATS = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes",
          "inactive_split_bytes", "allocation", "segment", "active", "inactive_split")


def round_size(nbytes: int) -> int:
    """A request's block size: a multiple of 512 bytes, at least 512."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """How much to take from the device for a rounded request nothing cached can serve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class RawMemory:
    """Where segments come from: host memory here; device kinds bring their own (the
    same three methods). `alloc` returns (handle, a writable uint8 numpy view, address)."""

    def alloc(self, nbytes: int):
        array = np.empty(nbytes, np.uint8)
        return array, array, array.ctypes.data

    def free(self, handle) -> None:
        del handle  # numpy gives the pages back when the last reference goes


@dataclass(eq=False)
class Segment:
    handle: object
    view: np.ndarray
    address: int
    size: int
    small: bool
    memory: memoryview = field(init=False)
    head: "Block | None" = None  # the block at offset 0: stable while the segment lives

    def __post_init__(self):
        self.memory = memoryview(self.view)


@dataclass(eq=False)
class Block:
    segment: Segment
    offset: int
    size: int
    requested: int = 0
    allocated: bool = False
    reused: bool = False  # handed out before (a cache hit when handed out again)
    prev: "Block | None" = None
    next: "Block | None" = None

    @property
    def address(self) -> int:
        return self.segment.address + self.offset


def _free_key(block: Block):
    return block.size, block.segment.address, block.offset


class _Lease(weakref.ref):
    """Frees its block when the last numpy view of the block's memory dies."""
    __slots__ = ("block",)


class _Tracked(weakref.ref):
    """Uncounts an eager result when its array dies."""
    __slots__ = ("key", "nbytes", "small")


class _Guard:
    """`with allocator._guard:` takes the lock and, on the way out, runs queued callbacks."""
    __slots__ = ("owner",)

    def __init__(self, owner: "CachingAllocator"):
        self.owner = owner

    def __enter__(self) -> None:
        self.owner._lock.acquire()

    def __exit__(self, *exc) -> bool:
        self.owner._unlock()
        return False


class CachingAllocator:
    """Blocks of one device's memory, cached for reuse, with PyTorch's statistics.

    >>> a = CachingAllocator("cpu", RawMemory(), total_memory=1 << 30)
    >>> x = a.array((256,), np.float32)   # 1 KiB block from a 2 MiB segment
    >>> a.memory_allocated(), a.memory_reserved()
    (1024, 2097152)
    """

    def __init__(self, device: str, raw: RawMemory, total_memory: int, fraction: float = 1.0):
        self.device = str(device)
        self.raw = raw
        self.total_memory = int(total_memory)
        # a weakref callback may fire inside a locked section (the garbage collector runs
        # anywhere): callbacks queue their work, which whoever holds the lock drains
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._guard = _Guard(self)
        self._free: dict[bool, list[Block]] = {True: [], False: []}
        self._segments: list[Segment] = []
        self._tracked: dict[int, _Tracked] = {}
        self._leases: dict[int, _Lease] = {}  # weakrefs live until their callback
        self.version = 0  # bumped on every change: the publisher (memory_tracking) polls it
        self._reset_stats()
        self.set_fraction(fraction)

    # -- limit ----------------------------------------------------------------------------

    def set_fraction(self, fraction: float) -> None:
        if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
                and 0.0 < fraction <= 1.0):
            from kiln.errors import KilnArgumentError

            raise KilnArgumentError(f"set_per_process_memory_fraction: fraction must be in "
                                    f"(0, 1], got {fraction!r}")
        self.fraction = float(fraction)
        self.limit = int(self.total_memory * fraction)

    # -- statistics -----------------------------------------------------------------------

    def _reset_stats(self) -> None:
        # name -> pool (True small, False large) -> [current, peak, allocated, freed]
        self._stats = {name: {True: [0, 0, 0, 0], False: [0, 0, 0, 0]} for name in _STATS}
        self._peak = {name: 0 for name in _STATS}  # peak of the sum of both pools
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.allocated = 0
        self.reserved = 0

    def _add(self, name: str, small: bool, amount: int) -> None:
        stat = self._stats[name][small]
        stat[0] += amount
        if amount > 0:
            stat[2] += amount
            if stat[0] > stat[1]:
                stat[1] = stat[0]
            total = stat[0] + self._stats[name][not small][0]
            if total > self._peak[name]:
                self._peak[name] = total
        else:
            stat[3] -= amount

    def _count_alloc(self, small: bool, size: int, requested: int) -> None:
        self.allocated += size
        self._add("allocated_bytes", small, size)
        self._add("active_bytes", small, size)
        self._add("requested_bytes", small, requested)
        self._add("allocation", small, 1)
        self._add("active", small, 1)
        self.version += 1

    def _count_free(self, small: bool, size: int, requested: int) -> None:
        self.allocated -= size
        self._add("allocated_bytes", small, -size)
        self._add("active_bytes", small, -size)
        self._add("requested_bytes", small, -requested)
        self._add("allocation", small, -1)
        self._add("active", small, -1)
        self.version += 1

    def _count_segment(self, small: bool, size: int) -> None:
        self.reserved += size
        self._add("reserved_bytes", small, size)
        self._add("segment", small, 1 if size > 0 else -1)
        if size > 0:
            self.num_device_alloc += 1
        else:
            self.num_device_free += 1

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.reserved

    def max_memory_allocated(self) -> int:
        return self._peak["allocated_bytes"]

    def max_memory_reserved(self) -> int:
        return self._peak["reserved_bytes"]

    def reset_peak_memory_stats(self) -> None:
        """Peaks restart from the current figures, as torch.cuda.reset_peak_memory_stats."""
        with self._guard:
            for name, pools in self._stats.items():
                for stat in pools.values():
                    stat[1] = stat[0]
                self._peak[name] = pools[True][0] + pools[False][0]

    def reset_accumulated_memory_stats(self) -> None:
        with self._guard:
            for pools in self._stats.values():
                for stat in pools.values():
                    stat[2] = stat[3] = 0
            self.num_alloc_retries = self.num_ooms = 0
            self.num_device_alloc = self.num_device_free = 0

    def memory_stats(self) -> dict:
        """PyTorch's flat dict: "allocated_bytes.all.current", ".small_pool.peak", ..."""
        with self._guard:
            self._update_inactive_split()
            out: dict = {}
            for name, pools in self._stats.items():
                small, large = pools[True], pools[False]
                for pool, figures in (("all", None), ("small_pool", small), ("large_pool", large)):
                    if figures is None:
                        figures = [small[0] + large[0], self._peak[name], small[2] + large[2],
                                   small[3] + large[3]]
                    for i, what in enumerate(("current", "peak", "allocated", "freed")):
                        out[f"{name}.{pool}.{what}"] = figures[i]
            out.update({"num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
                        "num_device_alloc": self.num_device_alloc,
                        "num_device_free": self.num_device_free,
                        "num_sync_all_streams": 0, "max_split_size": -1,
                        "limit_bytes": self.limit, "total_bytes": self.total_memory})
            return out

    def _update_inactive_split(self) -> None:
        """Free bytes inside segments that also hold allocated blocks (fragmentation)."""
        for small in (True, False):
            count = nbytes = 0
            for block in self._free[small]:
                if block.prev is not None or block.next is not None:
                    count += 1
                    nbytes += block.size
            for name, value in (("inactive_split", count), ("inactive_split_bytes", nbytes)):
                stat = self._stats[name][small]
                self._add(name, small, value - stat[0])

    # -- blocks ---------------------------------------------------------------------------

    def malloc(self, nbytes: int, what: str | None = None) -> Block:
        """A block of at least `nbytes`: cached if one fits, else from a new segment."""
        nbytes = int(nbytes)
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        with self._guard:
            block = self._take_free(size, small)
            if block is None:
                block = self._new_segment(size, small, nbytes, what)
            self._split(block, size, small)
            block.allocated = True
            block.requested = nbytes
            self._count_alloc(small, block.size, nbytes)
            return block

    def _take_free(self, size: int, small: bool) -> Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1), key=_free_key)
        if i == len(pool):
            return None
        return pool.pop(i)

    def _new_segment(self, size: int, small: bool, nbytes: int, what: str | None) -> Block:
        seg_size = segment_size(size)
        if self.reserved + seg_size > self.limit:
            if self._release_cached():
                self.num_alloc_retries += 1
            if self.reserved + seg_size > self.limit:
                self._oom(nbytes, what, seg_size)
        try:
            handle, view, address = self.raw.alloc(seg_size)
        except MemoryError:
            self._oom(nbytes, what, seg_size, device_refused=True)
        segment = Segment(handle, view, address, seg_size, small)
        self._segments.append(segment)
        self._count_segment(small, seg_size)
        segment.head = Block(segment, 0, seg_size)
        return segment.head

    def _oom(self, nbytes: int, what: str | None, seg_size: int, device_refused: bool = False):
        self.num_ooms += 1
        self.version += 1
        cached = self.reserved - self.allocated
        why = ("the device refused it" if device_refused else
               f"{human(self.limit)} allowed ({self.fraction:g} of {self.device}'s "
               f"{human(self.total_memory)})")
        asked = f"{what} needs {human(nbytes)}" if what else f"allocating {human(nbytes)}"
        if seg_size != nbytes:
            asked += f" (taken as a {human(seg_size)} segment)"
        raise KilnMemoryError(
            f"{self.device}: {asked}: {human(self.allocated)} "
            f"in use, {human(cached)} cached, {why}", hint=_HINT)

    def _split(self, block: Block, size: int, small: bool) -> None:
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = Block(block.segment, block.offset + size, rest, reused=block.reused,
                         prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            bisect.insort(self._free[small], tail, key=_free_key)

    def free(self, block: Block) -> None:
        """Return a block to the cache, merged with its free neighbours."""
        with self._guard:
            self._free_locked(block)

    def _free_locked(self, block: Block) -> None:
        if not block.allocated:
            return
        small = block.segment.small
        block.allocated = False
        block.reused = True
        self._count_free(small, block.size, block.requested)
        pool = self._free[small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.pop(self._index(pool, neighbour))
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.reused = True
        bisect.insort(pool, block, key=_free_key)

    @staticmethod
    def _index(pool: list, block: Block) -> int:
        i = bisect.bisect_left(pool, _free_key(block), key=_free_key)
        while pool[i] is not block:
            i += 1
        return i

    def empty_cache(self) -> int:
        """Give every wholly free segment back to the device; returns the bytes freed."""
        with self._guard:
            return self._release_cached()

    def _release_cached(self) -> int:
        released = 0
        for small in (True, False):
            keep = []
            for block in self._free[small]:
                if block.prev is None and block.next is None:  # the whole segment
                    segment = block.segment
                    self._segments.remove(segment)
                    self.raw.free(segment.handle)
                    self._count_segment(small, -segment.size)
                    released += segment.size
                else:
                    keep.append(block)
            self._free[small] = keep
        if released:
            self.version += 1
        return released

    # -- arrays ---------------------------------------------------------------------------

    def array(self, shape, dtype, what: str | None = None) -> np.ndarray:
        """A numpy array over a fresh block; the block returns to the cache when the last
        view of it dies (for host-accessible memory)."""
        dtype = np.dtype(dtype)
        count = 1
        for d in shape:
            count *= int(d)
        block = self.malloc(count * dtype.itemsize, what)
        return self.view_of(block, shape, dtype, count)

    def view_of(self, block: Block, shape, dtype: np.dtype, count: int) -> np.ndarray:
        start = block.offset
        flat = np.frombuffer(block.segment.memory[start:start + block.size], dtype, count)
        lease = _Lease(flat.base, self._lease_done)
        lease.block = block
        self._leases[id(lease)] = lease
        return flat.reshape(shape)

    def _lease_done(self, lease: _Lease) -> None:
        self._leases.pop(id(lease), None)
        self._pending.append((self._free_locked, lease.block))
        if self._lock.acquire(blocking=False):
            self._unlock()

    def _unlock(self) -> None:
        """Run the work callbacks queued while the lock was held, then release it."""
        while True:
            while self._pending:
                work, item = self._pending.popleft()
                work(item)
            self._lock.release()
            # a callback on another thread may have queued after the last check
            if not self._pending or not self._lock.acquire(blocking=False):
                return

    # -- tracked (eager) arrays -------------------------------------------------------------

    def track(self, array: np.ndarray) -> None:
        """Count `array` (memory numpy allocated for kiln on this device) while it lives."""
        key = id(array)
        if key in self._tracked:
            return
        nbytes = array.nbytes
        small = nbytes <= SMALL_SIZE
        with self._guard:
            if self.reserved + nbytes > self.limit:
                if self._release_cached():
                    self.num_alloc_retries += 1
                if self.reserved + nbytes > self.limit:
                    self._oom(nbytes, f"an eager {array.dtype.name}{list(array.shape)} result",
                              nbytes)
            ref = _Tracked(array, self._untrack)
            ref.key, ref.nbytes, ref.small = key, nbytes, small
            self._tracked[key] = ref
            self._count_segment(small, nbytes)
            self._count_alloc(small, nbytes, nbytes)

    def _untrack(self, ref: _Tracked) -> None:
        self._pending.append((self._untrack_locked, ref))
        if self._lock.acquire(blocking=False):
            self._unlock()

    def _untrack_locked(self, ref: _Tracked) -> None:
        if self._tracked.get(ref.key) is ref:
            del self._tracked[ref.key]
        self._count_free(ref.small, ref.nbytes, ref.nbytes)
        self._count_segment(ref.small, -ref.nbytes)

    def is_tracked(self, array: np.ndarray) -> bool:
        ref = self._tracked.get(id(array))
        return ref is not None and ref() is array

    def snapshot(self) -> list[dict]:
        """The segments and their blocks (torch.cuda.memory_snapshot's shape, abridged)."""
        with self._guard:
            out = []
            for segment in self._segments:
                blocks, block = [], segment.head
                while block is not None:
                    blocks.append({"size": block.size, "requested_size": block.requested,
                                   "state": "active_allocated" if block.allocated else "inactive"})
                    block = block.next
                out.append({"address": segment.address, "total_size": segment.size,
                            "segment_type": "small" if segment.small else "large",
                            "blocks": blocks})
            return out
