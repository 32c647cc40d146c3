"""The `metal` (and `mps`) device kinds: memory is shared-storage MTLBuffers.

On Apple silicon the CPU and GPU share memory: a buffer made with
MTLResourceStorageModeShared is one set of pages both see, so a segment of the caching
allocator is one such buffer and eager tensors on `metal:N` are numpy views of its
`contents()`. Memory statistics, peak tracking and the per-process fraction
(`kn.memory.set_per_process_memory_fraction(f, "metal:0")`) are the caching allocator's;
the fraction is of the device's `recommendedMaxWorkingSetSize`. On any other system the
kind is registered but not available: asking for `metal:0` is K381, whose message
carries K410's reason (a Mac with PyObjC's Metal bindings is needed).
"""

from __future__ import annotations

import numpy as np

from kiln.runtime.caching_allocator import RawMemory
from kiln.runtime.device import register_device_kind

_SHARED = 0  # MTLResourceStorageModeShared


class SharedMemory(RawMemory):
    """Segments of one Metal device: shared-storage buffers, viewed by numpy in place."""

    def __init__(self, index: int):
        self.index = index

    def alloc(self, nbytes: int):
        from kiln.codegen.metal.runtime import metal_device

        dev = metal_device(self.index)
        buf = dev.device.newBufferWithLength_options_(max(1, nbytes), _SHARED)
        view = np.frombuffer(buf.contents().as_buffer(max(1, nbytes)), np.uint8)[:nbytes]
        return buf, view, view.ctypes.data

    def free(self, handle) -> None:
        del handle  # the MTLBuffer is released with its last reference


def _count() -> int:
    from kiln.codegen.metal.runtime import _metal

    return len(list(_metal().MTLCopyAllDevices() or []))


def _total(index: int) -> int:
    from kiln.codegen.metal.runtime import metal_device

    return int(metal_device(index).device.recommendedMaxWorkingSetSize())


def _synchronize(index: int) -> None:
    from kiln.codegen.metal.runtime import metal_device

    cmd = metal_device(index).queue.commandBuffer()  # an empty buffer completes after all before it
    cmd.commit()
    cmd.waitUntilCompleted()


for _kind in ("metal", "mps"):
    register_device_kind(_kind, hardware="an Apple GPU with macOS and PyObjC's Metal bindings "
                                          "(pip install 'kiln[metal]')",
                         raw_memory=SharedMemory, total_memory=_total, available=lambda: _count() > 0,
                         count=_count, synchronize=_synchronize)
