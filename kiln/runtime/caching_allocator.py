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
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from kiln.memory_limits import KilnMemoryError, human
from kiln.runtime.allocator_stats import AllocatorStatistics

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # largest request served by the small pool
SMALL_BUFFER = 2 << 20  # small pool segment
LARGE_BUFFER = 20 << 20  # large pool segment for requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

_HINT = ("free cached blocks with kn.memory.empty_cache(), lower the batch size, or raise "
         "kn.memory.set_per_process_memory_fraction()")




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
    same three methods). `alloc` returns (handle, a writable uint8 numpy view, address).

    With `KILN_HOST_HUGEPAGES=1`, a host segment of 2 MiB or more is mapped 2 MiB-aligned
    and advised to use transparent huge pages where the kernel offers them (Linux
    `madvise` mode): 4 KiB pages cost one fault each on a program's first run (the GPT
    training step's 10 MiB arena: ~2750 faults against ~260; its warm first step 10.8 ->
    9.2 ms). Off by default: right after a cold compile (LLVM has just used and freed
    hundreds of MiB) the same first step stalled 30-94 ms in 4 of 6 runs with huge pages,
    against 6.6-9.8 ms in 6 of 6 without (alternating fresh processes, 2026-12-02)."""

    def alloc(self, nbytes: int):
        if nbytes >= HUGE_PAGE and _huge_pages_wanted():
            segment = _huge_page_segment(nbytes)
            if segment is not None:
                return segment
        # a page-aligned start: malloc's large chunks begin 16 bytes past a page, and then
        # every block (a multiple of 512 bytes in) split each 64-byte vector load and
        # store over two cache lines; the slack is address space, never touched
        array = np.empty(nbytes + SEGMENT_ALIGN, np.uint8)
        skip = -array.ctypes.data % SEGMENT_ALIGN
        view = array[skip:skip + nbytes]  # keeps `array` alive (numpy holds its base)
        return view, view, view.ctypes.data

    def free(self, handle) -> None:
        del handle  # numpy gives the pages back when the last reference goes


HUGE_PAGE = 2 << 20  # x86-64 and aarch64 (4 KiB base pages) transparent huge page size
SEGMENT_ALIGN = 4096  # where a host segment starts (a page; every block is then 512-byte aligned)


def _huge_pages_wanted() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("KILN_HOST_HUGEPAGES", "0") == "1"


def _huge_page_segment(nbytes: int):
    """(handle, view, address) of `nbytes` of fresh anonymous memory starting on a
    2 MiB boundary, advised MADV_HUGEPAGE; None if the mapping or the advice fails (the
    caller maps plain pages). The mapping is HUGE_PAGE larger than asked, so that an
    aligned start exists inside it; the slack is address space only, never touched."""
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    whole = np.frombuffer(mapping, np.uint8)
    offset = -whole.ctypes.data % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE)
    except OSError:  # THP compiled out or off: plain pages from this mapping
        pass
    view = whole[offset:offset + nbytes]
    # the view keeps the mapping alive (numpy holds its buffer); unmapped when it dies
    return view, view, view.ctypes.data


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
    quick: bool = False  # freed, waiting in the exact-size list (not merged yet)
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
    __slots__ = ("key", "nbytes")


class _Guard:
    """`with allocator._guard:` takes the lock and, on the way out, runs queued callbacks."""
    __slots__ = ("owner",)

    def __init__(self, owner: "CachingAllocator"):
        self.owner = owner

    def __enter__(self) -> None:
        owner = self.owner
        owner._lock.acquire()
        if owner._log:
            owner._settle()

    def __exit__(self, *exc) -> bool:
        self.owner._unlock()
        return False


class CachingAllocator(AllocatorStatistics):
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
        self._log: collections.deque = collections.deque()  # tracked arrays' +n / -n bytes
        self._unsettled = 0  # bytes charged to the log since it was last replayed
        # freed blocks by exact size, merged into the free lists only when a request finds
        # none of its size (or the cache is emptied, or figures are read): a compiled
        # function's next output is its last dropped one, for a dict lookup
        self._quick: dict[int, list[Block]] = {}
        self._leases: dict[int, _Lease] = {}  # weakrefs live until their callback
        self._lease_callback = self._lease_done  # one bound method, not one per lease
        self._untrack_callback = self._untrack
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

    # -- blocks ---------------------------------------------------------------------------

    def malloc(self, nbytes: int, what=None) -> Block:
        """A block of at least `nbytes`: cached if one fits, else from a new segment.
        `what` names the request in an out-of-memory error (a string, or a runtime
        buffer's (dtype, shape), formatted only then)."""
        nbytes = int(nbytes)
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        lock = self._lock
        lock.acquire()
        try:
            if self._log:  # tracked arrays' events first: the figures keep their order
                self._settle()
            quick = self._quick.get(size)
            if quick:
                block = quick.pop()
                block.quick = False
            else:
                block = self._take_free(size, small)
                if block is None and self._quick:
                    self._flush_quick()
                    block = self._take_free(size, small)
                if block is None:
                    block = self._new_segment(size, small, nbytes, what)
                self._split(block, size, small)
            block.allocated = True
            block.requested = nbytes
            self._block_event(small, block.size, nbytes)
        finally:
            lock.release()
        if self._pending and lock.acquire(blocking=False):
            self._unlock()
        return block

    def _take_free(self, size: int, small: bool) -> Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1), key=_free_key)
        if i == len(pool):
            return None
        return pool.pop(i)

    def _new_segment(self, size: int, small: bool, nbytes: int, what: str | None) -> Block:
        seg_size = segment_size(size)
        self._settle()  # the limit is checked against exact figures
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
        self._event(small, 0, seg_size, 0, 0, 1)
        segment.head = Block(segment, 0, seg_size)
        return segment.head

    def _oom(self, nbytes: int, what: str | None, seg_size: int, device_refused: bool = False):
        self.num_ooms += 1
        self.version += 1
        cached = self.reserved - self.allocated
        why = ("the device refused it" if device_refused else
               f"{human(self.limit)} allowed ({self.fraction:g} of {self.device}'s "
               f"{human(self.total_memory)})")
        if isinstance(what, tuple):  # (dtype, shape) of a runtime buffer
            what = f"allocating a {what[0].name} buffer of shape {tuple(what[1])}"
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
        if self._log:
            self._settle()
        block.allocated = False
        block.reused = True
        block.quick = True
        self._block_event(block.segment.small, -block.size, -block.requested)
        quick = self._quick.get(block.size)
        if quick is None:
            self._quick[block.size] = [block]
        else:
            quick.append(block)

    def _flush_quick(self) -> None:
        """Merge every block waiting in the exact-size lists into the free lists."""
        waiting = [b for blocks in self._quick.values() for b in blocks]
        self._quick.clear()
        for block in waiting:  # one by one: a block still waiting is no neighbour to merge
            block.quick = False
            self._merge_free(block)

    def _merge_free(self, block: Block) -> None:
        """Put a free block into its pool's free list, merged with free neighbours."""
        pool = self._free[block.segment.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and not neighbour.quick:
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
        self._flush_quick()
        released = 0
        for small in (True, False):
            keep = []
            for block in self._free[small]:
                if block.prev is None and block.next is None:  # the whole segment
                    segment = block.segment
                    self._segments.remove(segment)
                    self.raw.free(segment.handle)
                    self._event(small, 0, -segment.size, 0, 0, -1)
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
        lease = _Lease(flat.base, self._lease_callback)
        lease.block = block
        self._leases[id(lease)] = lease
        return flat if len(shape) == 1 else flat.reshape(shape)

    def _lease_done(self, lease: _Lease) -> None:
        self._leases.pop(id(lease), None)
        lock = self._lock
        if lock.acquire(blocking=False):
            self._free_locked(lease.block)
            if self._pending:
                self._unlock()
            else:
                lock.release()
        else:  # held (by this thread, inside a locked section, or another): queue it
            self._pending.append((self._free_locked, lease.block))
            if lock.acquire(blocking=False):
                self._unlock()

    def _unlock(self) -> None:
        """Run the work callbacks queued while the lock was held and replay the tracked
        arrays' log, then release the lock."""
        while True:
            while self._pending:
                work, item = self._pending.popleft()
                work(item)
            if self._log:
                self._settle()
            self._lock.release()
            # a callback on another thread may have queued after the last check
            if not self._pending or not self._lock.acquire(blocking=False):
                return

    # -- tracked (eager) arrays -------------------------------------------------------------

    def track(self, array: np.ndarray) -> None:
        """Count `array` (memory numpy allocated for kiln on this device) while it lives.

        The cheap path of every eager result: no lock. The charge is appended to an event
        log (a deque: atomic appends) that is replayed in order, under the lock, whenever
        figures are read or blocks change hands, so the counters and peaks are exact. The
        limit is checked against an estimate of the unreplayed growth, and precisely
        (under the lock) when the estimate comes near it."""
        known = self._tracked.get(id(array))
        if known is not None and known() is array:
            return
        self.track_new(array)

    def track_new(self, array: np.ndarray) -> None:
        """`track` for an array made just now (a ufunc's output), which cannot be counted
        already: the eager fast path's call (kiln/frontend/eager_path.py)."""
        key = id(array)
        tracked = self._tracked
        nbytes = array.nbytes
        unsettled = self._unsettled + nbytes
        if self.reserved + unsettled > self.limit:
            self._check_tracked(array, nbytes)
            unsettled = self._unsettled + nbytes  # the check may have replayed the log
        ref = _Tracked(array, self._untrack_callback)
        ref.key = key
        ref.nbytes = nbytes
        tracked[key] = ref
        log = self._log
        log.append(nbytes)
        self._unsettled = unsettled
        if len(log) > 4096 and self._lock.acquire(blocking=False):
            self._unlock()  # replays the log

    def _check_tracked(self, array: np.ndarray, nbytes: int) -> None:
        with self._guard:
            self._settle()
            if self.reserved + nbytes > self.limit:
                if self._release_cached():
                    self.num_alloc_retries += 1
                if self.reserved + nbytes > self.limit:
                    self._oom(nbytes, f"an eager {array.dtype.name}{list(array.shape)} result",
                              nbytes)

    def _untrack(self, ref: _Tracked) -> None:
        # runs when the array dies, before its id can be reused: no other thread can be
        # tracking an array with this id now
        if self._tracked.get(ref.key) is ref:  # counted (not refused at the limit)
            del self._tracked[ref.key]
            self._log.append(-ref.nbytes)

    def _settle(self) -> None:
        """Replay the tracked arrays' charges and releases, in order (lock held): one by
        one when few, else with running sums (numpy), which give the same peaks."""
        log = self._log
        if len(log) < 64:
            while log:
                n = log.popleft()
                self._tracked_event((n if n > 0 else -n) <= SMALL_SIZE, n)
        else:
            events = []
            while log:
                events.append(log.popleft())
            self._replay(np.array(events, np.int64))
        self._unsettled = 0

    def _replay(self, events: np.ndarray) -> None:
        """`_tracked_event` for every entry of `events`, in order, vectorized. Bytes
        (allocated, reserved, requested) move by the same amounts, and so do counts (blocks,
        segments): each group's running sums are computed once."""
        small = np.abs(events) <= SMALL_SIZE
        counts = np.sign(events)
        total = int(events.sum())
        self.allocated += total
        self.reserved += total
        self.version += 1
        grown = int(np.count_nonzero(counts > 0))
        self.num_device_alloc += grown
        self.num_device_free += len(events) - grown
        for metrics, values in (((0, 1, 2), events), ((3, 4), counts)):
            both = int(np.cumsum(values).max())  # the peak of the pools' sum, from its start
            per_pool = []
            for flag, mask in ((True, small), (False, ~small)):
                mine = np.where(mask, values, 0)
                per_pool.append((flag, int(np.cumsum(mine).max()), int(mine.sum()),
                                 int(mine[mine > 0].sum())))
            for m in metrics:
                k = 4 * m
                peak = self._pools[True][k] + self._pools[False][k] + both
                if peak > self._all_peak[m]:
                    self._all_peak[m] = peak
                for flag, running, net, grown_by in per_pool:
                    p = self._pools[flag]
                    if p[k] + running > p[k + 1]:
                        p[k + 1] = p[k] + running
                    p[k] += net
                    p[k + 2] += grown_by
                    p[k + 3] += grown_by - net  # the freed amount

    def settle(self) -> None:
        """Bring every figure up to date (what `kiln mem`'s publisher calls)."""
        with self._guard:
            pass

    def is_tracked(self, array: np.ndarray) -> bool:
        ref = self._tracked.get(id(array))
        return ref is not None and ref() is array

    def snapshot(self) -> list[dict]:
        """The segments and their blocks (torch.cuda.memory_snapshot's shape, abridged)."""
        with self._guard:
            self._flush_quick()
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
