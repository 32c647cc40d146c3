"""The caching allocator against known allocation sequences: PyTorch's rounding and pools,
block reuse, splitting and merging, `empty_cache`, the fraction limit (K170 with the
figures), and the statistics' keys and values."""

import gc

import numpy as np
import pytest

from kiln.memory_limits import KilnMemoryError
from kiln.runtime.caching_allocator import (
    LARGE_BUFFER, SMALL_BUFFER, CachingAllocator, RawMemory, round_size, segment_size,
)

MiB = 1 << 20


class CountingMemory(RawMemory):
    """Host memory that records what the device was asked for and given back."""

    def __init__(self):
        self.allocs, self.frees = [], 0

    def alloc(self, nbytes):
        self.allocs.append(nbytes)
        return super().alloc(nbytes)

    def free(self, handle):
        self.frees += 1


def _allocator(total=1 << 30, fraction=1.0):
    raw = CountingMemory()
    return CachingAllocator("test", raw, total, fraction), raw


def test_rounding_and_segment_sizes_follow_pytorch():
    assert [round_size(n) for n in (0, 1, 512, 513, 4000)] == [512, 512, 512, 1024, 4096]
    assert segment_size(512) == SMALL_BUFFER == 2 * MiB
    assert segment_size(MiB) == 2 * MiB  # up to 1 MiB: the small pool
    assert segment_size(MiB + 512) == LARGE_BUFFER == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_blocks_are_carved_reused_and_merged():
    a, raw = _allocator()
    x = a.array((256,), np.float32)  # 1 KiB
    y = a.array((1000,), np.float32)  # 4000 B -> 4096
    assert a.memory_allocated() == 1024 + 4096 and a.memory_reserved() == 2 * MiB
    assert raw.allocs == [2 * MiB]  # one small segment serves both
    assert y.ctypes.data - x.ctypes.data == 1024  # carved one after the other
    x_address = x.ctypes.data
    view = x[::2]
    del x
    assert a.memory_allocated() == 1024 + 4096  # a view keeps the block
    del view
    assert a.memory_allocated() == 4096
    z = a.array((200,), np.float32)  # 800 B -> 1024: best fit is the freed block
    assert z.ctypes.data == x_address and raw.allocs == [2 * MiB]
    del y, z
    assert a.memory_allocated() == 0 and a.memory_reserved() == 2 * MiB
    (segment,) = a.snapshot()
    assert [b["state"] for b in segment["blocks"]] == ["inactive"]  # merged back into one


def test_empty_cache_returns_only_whole_free_segments():
    a, raw = _allocator()
    small = a.array((100,), np.float32)
    large = a.array((3 * MiB,), np.uint8)  # large pool, a 20 MiB segment
    assert a.memory_reserved() == 22 * MiB
    del large
    assert a.empty_cache() == 20 * MiB and raw.frees == 1
    assert a.memory_reserved() == 2 * MiB  # the small segment still holds `small`
    del small
    assert a.empty_cache() == 2 * MiB and a.memory_reserved() == 0
    stats = a.memory_stats()
    assert stats["segment.all.current"] == 0 and stats["num_device_free"] == 2
    assert stats["reserved_bytes.all.peak"] == 22 * MiB
    assert stats["reserved_bytes.large_pool.peak"] == 20 * MiB


def test_statistics_of_a_known_sequence():
    a, _ = _allocator()
    keep = [a.array((n,), np.uint8) for n in (100, 600, 2 * MiB)]  # 512, 1024, 2 MiB blocks
    stats = a.memory_stats()
    assert stats["allocated_bytes.all.current"] == 512 + 1024 + 2 * MiB
    assert stats["allocated_bytes.small_pool.current"] == 1536
    assert stats["allocated_bytes.large_pool.current"] == 2 * MiB
    assert stats["requested_bytes.all.current"] == 100 + 600 + 2 * MiB
    assert stats["allocation.all.current"] == 3 and stats["segment.all.current"] == 2
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]
    # the large segment (20 MiB) holds a 2 MiB block and an 18 MiB free split
    assert stats["inactive_split_bytes.large_pool.current"] == 18 * MiB
    del keep[2]
    stats = a.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 1536 + 2 * MiB
    assert stats["allocated_bytes.all.freed"] == 2 * MiB
    assert stats["allocated_bytes.all.allocated"] == 1536 + 2 * MiB
    a.reset_peak_memory_stats()
    assert a.max_memory_allocated() == 1536 and a.max_memory_reserved() == 22 * MiB
    del keep
    gc.collect()
    assert a.memory_allocated() == 0


def test_fraction_limit_retries_after_emptying_the_cache_then_raises_K170():
    a, raw = _allocator(total=100 * MiB, fraction=0.25)  # 25 MiB allowed
    big = a.array((3 * MiB,), np.uint8)  # a 20 MiB segment
    del big  # cached, not returned
    assert a.memory_reserved() == 20 * MiB
    fits = a.array((12 * MiB,), np.uint8)  # served by the cached 20 MiB block
    assert a.memory_reserved() == 20 * MiB and raw.allocs == [20 * MiB]
    del fits
    again = a.array((22 * MiB,), np.uint8)  # a 22 MiB segment: 42 > 25, so empty, retry
    assert a.memory_stats()["num_alloc_retries"] == 1 and a.memory_reserved() == 22 * MiB
    keep = a.array((MiB,), np.uint8)  # small pool: a 2 MiB segment, 24 MiB reserved
    with pytest.raises(KilnMemoryError) as info:
        a.array((12 * MiB,), np.uint8, "the activations")
    message = str(info.value)
    assert message.startswith("[K170] test: the activations needs 12.0 MiB (12582912 bytes)")
    assert "23.0 MiB (24117248 bytes) in use" in message  # 22 MiB + the 1 MiB block
    assert "1.0 MiB (1048576 bytes) cached" in message  # the rest of the small segment
    assert "25.0 MiB (26214400 bytes) allowed (0.25 of test's 100.0 MiB" in message
    assert "empty_cache" in message
    assert a.memory_stats()["num_ooms"] == 1
    assert a.memory_allocated() == 23 * MiB  # the refused request took nothing
    del again, keep


def test_tracked_arrays_count_while_they_live():
    a, _ = _allocator()
    array = np.ones(1000)
    a.track(array)
    a.track(array)  # counted once
    assert a.memory_allocated() == 8000 == a.memory_reserved()
    del array
    assert a.memory_allocated() == 0 and a.memory_reserved() == 0
    assert a.max_memory_allocated() == 8000


def test_tracked_array_past_the_limit_is_K170():
    a, _ = _allocator(total=MiB, fraction=0.5)
    with pytest.raises(KilnMemoryError, match=r"K170.*an eager float64\[100000\] result"):
        a.track(np.ones(100_000))
    assert a.memory_allocated() == 0


def test_a_bad_fraction_is_refused():
    a, _ = _allocator()
    for bad in (0, 1.5, -1, True, "half"):
        with pytest.raises(Exception, match="K103.*fraction must be in"):
            a.set_fraction(bad)
    assert a.fraction == 1.0


def test_freed_blocks_of_other_sizes_merge_before_a_new_segment_is_taken():
    a, raw = _allocator()
    eighths = [a.array((256 << 10,), np.uint8) for _ in range(8)]  # fill a 2 MiB segment
    start = eighths[0].ctypes.data
    del eighths  # eight 256 KiB blocks wait, unmerged, for a request of their size
    whole = a.array((1 << 20,), np.uint8)  # none that size: they merge and serve it
    assert raw.allocs == [2 * MiB] and whole.ctypes.data == start
    del whole
    (segment,) = a.snapshot()
    assert len(segment["blocks"]) == 1  # all merged back into one free block


def test_threads_allocating_and_dropping_leave_consistent_figures():
    import threading

    a, _ = _allocator()
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            held = []
            for _ in range(400):
                n = int(rng.integers(1, 300_000))
                if rng.random() < 0.5:
                    held.append(a.array((n,), np.uint8))  # a block
                else:
                    held.append(np.ones(n // 8))  # an eager-style result, tracked
                    a.track(held[-1])
                if len(held) > 8:
                    held.pop(int(rng.integers(0, len(held))))
        except Exception as exc:  # reported below: a thread's failure fails the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    gc.collect()
    stats = a.memory_stats()
    assert a.memory_allocated() == 0 and stats["allocation.all.current"] == 0
    assert stats["requested_bytes.all.current"] == 0
    assert a.empty_cache() == stats["reserved_bytes.all.current"]
    assert a.memory_reserved() == 0 and a.memory_stats()["segment.all.current"] == 0


def test_batched_replay_of_tracked_events_equals_one_by_one():
    rng = np.random.default_rng(1)
    for _ in range(10):
        one, batch = _allocator()[0], _allocator()[0]
        live, events = [], []
        for _ in range(300):
            if live and rng.random() < 0.45:
                events.append(-live.pop(int(rng.integers(len(live)))))
            else:
                live.append(int(rng.choice([100, 5000, 600_000, 2 * MiB, 3 * MiB])))
                events.append(live[-1])
        for n in events:
            one._tracked_event(abs(n) <= MiB, n)
        batch._replay(np.array(events, np.int64))
        assert one._pools == batch._pools and one._all_peak == batch._all_peak
        assert (one.allocated, one.reserved) == (batch.allocated, batch.reserved)
        assert one.memory_stats() == batch.memory_stats()
