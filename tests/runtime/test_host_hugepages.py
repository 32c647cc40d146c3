"""Host segments of the caching allocator: 2 MiB-aligned mappings advised to use
transparent huge pages (fewer first-touch faults) with KILN_HOST_HUGEPAGES=1, plain
pages by default or with 0; both hand out correct, writable, independent memory."""

import mmap
import sys

import numpy as np
import pytest

from kiln.runtime.caching_allocator import HUGE_PAGE, SEGMENT_ALIGN, CachingAllocator, RawMemory

linux_thp = pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")),
                               reason="transparent huge pages are a Linux madvise feature")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_thp
@pytest.mark.parametrize("nbytes", [HUGE_PAGE, 20 << 20, 3 * HUGE_PAGE + 4096])
def test_a_large_host_segment_is_aligned_and_advised(nbytes, monkeypatch):
    monkeypatch.setenv("KILN_HOST_HUGEPAGES", "1")
    handle, view, address = RawMemory().alloc(nbytes)
    assert view.dtype == np.uint8 and view.shape == (nbytes,) and view.flags.writeable
    assert address == view.ctypes.data and address % HUGE_PAGE == 0
    assert "hg" in _vm_flags(address)  # MADV_HUGEPAGE applied to the mapping
    view[:] = 7
    view[-1] = 9
    assert int(view[:-1].sum()) == 7 * (nbytes - 1) and view[-1] == 9
    RawMemory().free(handle)


@linux_thp
@pytest.mark.parametrize("setting", [None, "0"])
def test_hugepages_off_maps_plain_pages(setting, monkeypatch):
    if setting is None:  # the default
        monkeypatch.delenv("KILN_HOST_HUGEPAGES", raising=False)
    else:
        monkeypatch.setenv("KILN_HOST_HUGEPAGES", setting)
    handle, view, address = RawMemory().alloc(HUGE_PAGE)
    # kiln maps nothing itself: a page-aligned view of an ordinary np.empty (whose heap
    # mapping may carry 'hg' anyway: numpy advises huge pages for its own large arrays)
    assert type(view.base) is np.ndarray and view.base.base is None and view.base.dtype == np.uint8
    assert address == view.ctypes.data and address % SEGMENT_ALIGN == 0 and handle is view
    view[:] = 1
    assert int(view.sum()) == HUGE_PAGE


def test_small_requests_keep_plain_numpy_memory(monkeypatch):
    monkeypatch.setenv("KILN_HOST_HUGEPAGES", "1")
    handle, view, address = RawMemory().alloc(64 << 10)
    assert view.shape == (64 << 10,) and address == view.ctypes.data
    assert view.base.base is None and address % SEGMENT_ALIGN == 0  # a page of an ordinary np.empty


def test_plain_segments_start_on_a_page_and_blocks_on_512_bytes():
    """numpy's large arrays start 16 bytes past a page; a segment is moved to the page
    (the slack is never touched), so every block is 512-byte aligned: no vector load or
    store of a kernel splits a cache line at a row's start."""
    allocator = CachingAllocator("cpu", RawMemory(), total_memory=1 << 30)
    arrays = [allocator.array((n,), np.float32) for n in (100, 3000, 300_000, 3_000_000)]
    for i, a in enumerate(arrays):
        assert a.ctypes.data % 512 == 0
        a[:] = i
    assert [float(a.sum()) for a in arrays] == [0.0, 3000.0, 600_000.0, 9_000_000.0]


@pytest.mark.parametrize("setting", ["1", "0"])
def test_blocks_from_huge_page_segments_hold_their_values(setting, monkeypatch):
    monkeypatch.setenv("KILN_HOST_HUGEPAGES", setting)
    allocator = CachingAllocator("cpu", RawMemory(), total_memory=1 << 30)
    rng = np.random.default_rng(0)
    arrays, wants = [], []
    for n in (100, 300_000, 3_000_000, 50, 1 << 20):  # small and large pools
        a = allocator.array((n,), np.float32)
        want = rng.standard_normal(n).astype(np.float32)
        a[...] = want
        arrays.append(a)
        wants.append(want)
    for a, want in zip(arrays, wants):  # no block overlaps another
        np.testing.assert_array_equal(a, want)
    del arrays, a
    assert allocator.empty_cache() > 0  # the segments go back once nothing holds them
