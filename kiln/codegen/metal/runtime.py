"""Running generated MSL on macOS through PyObjC's Metal bindings (imported lazily).

`metal_device(n)` opens the n-th Metal device (MTLCopyAllDevices) with one command queue;
`MetalKernel` compiles an `EmittedKernel`'s source at run time (newLibraryWithSource),
and each call copies the inputs into shared-storage buffers (unified memory: the CPU and
GPU see the same pages), encodes one dispatch of `groups` threadgroups x `threads`
threads, waits for the command buffer (a GPU-side error is K410 with the driver's message) and copies the outputs back. On any other
system, or without `pyobjc-framework-Metal`, opening a device is K410: generating and
checking MSL (`kiln dump --target metal`) needs no Mac, running it does.
"""

from __future__ import annotations

import sys
from functools import lru_cache

import numpy as np

from kiln.codegen.metal.errors import KilnMetalBuildError, KilnMetalUnavailableError

_SHARED = 0  # MTLResourceStorageModeShared


def _metal():
    if sys.platform != "darwin":
        raise KilnMetalUnavailableError(
            f"metal backend: running Metal kernels needs macOS on Apple hardware; this is {sys.platform}",
            hint="generate and inspect the MSL here (`kiln dump --target metal --stage source`), run it on a "
                 "Mac (`pip install 'kiln[metal]'`), or use backend='cpu'")
    try:
        import Metal  # pyobjc-framework-Metal
    except ImportError:
        raise KilnMetalUnavailableError("metal backend: PyObjC's Metal bindings are not installed",
                                        hint="pip install 'kiln[metal]' (pyobjc-framework-Metal)") from None
    return Metal


class _Device:
    def __init__(self, mtl, index: int):
        devices = list(mtl.MTLCopyAllDevices() or [])
        if index >= len(devices):
            raise KilnMetalUnavailableError(f"metal backend: metal:{index} asked for, but this Mac has "
                                            f"{len(devices)} Metal device(s)")
        self.mtl, self.device = mtl, devices[index]
        self.queue = self.device.newCommandQueue()
        self.name = str(self.device.name())


@lru_cache(maxsize=None)
def metal_device(index: int = 0) -> _Device:
    """The `index`-th Metal device and its command queue (K410 where there is none)."""
    return _Device(_metal(), index)


class MetalKernel:
    """A compiled kernel: `fn(arrays, sizes)` runs it on contiguous numpy arrays in place."""

    def __init__(self, emitted, dev: _Device, fast_math: bool = False):
        self.emitted, self.dev = emitted, dev
        opts = dev.mtl.MTLCompileOptions.new()
        opts.setFastMathEnabled_(bool(fast_math))
        lib, err = dev.device.newLibraryWithSource_options_error_(emitted.source, opts, None)
        if lib is None:
            raise KilnMetalBuildError(f"metal backend: the Metal compiler rejected {emitted.name}: {err}",
                                      hint="a kiln bug: report it with `kiln dump --target metal --stage source`")
        fn = lib.newFunctionWithName_(emitted.name)
        self.pipeline, err = dev.device.newComputePipelineStateWithFunction_error_(fn, None)
        if self.pipeline is None:
            raise KilnMetalBuildError(f"metal backend: no pipeline for {emitted.name}: {err}")

    def __call__(self, arrays, sizes) -> None:
        mtl, device = self.dev.mtl, self.dev.device
        bufs = []
        for a in arrays:
            a = np.ascontiguousarray(a)
            bufs.append(device.newBufferWithBytes_length_options_(a.tobytes(), max(1, a.nbytes), _SHARED))
        cmd = self.dev.queue.commandBuffer()
        enc = cmd.computeCommandEncoder()
        enc.setComputePipelineState_(self.pipeline)
        for i, b in enumerate(bufs):
            enc.setBuffer_offset_atIndex_(b, 0, i)
        for j, s in enumerate(self.emitted.sizes):
            enc.setBytes_length_atIndex_(np.int64(sizes[s]).tobytes(), 8, len(bufs) + j)
        groups = self.emitted.group_count(sizes)
        if groups > 0:
            enc.dispatchThreadgroups_threadsPerThreadgroup_(mtl.MTLSizeMake(groups, 1, 1),
                                                            mtl.MTLSizeMake(self.emitted.threads, 1, 1))
        enc.endEncoding()
        cmd.commit()
        cmd.waitUntilCompleted()
        if cmd.error() is not None:
            raise KilnMetalUnavailableError(f"metal backend: {self.emitted.name} failed on {self.dev.name}: "
                                            f"{cmd.error()}")
        for a, b in zip(arrays, bufs):
            if a.flags.writeable and a.nbytes:
                view = b.contents().as_buffer(a.nbytes)
                a.reshape(-1)[...] = np.frombuffer(view, dtype=a.dtype, count=a.size)
