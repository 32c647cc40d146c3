"""The `opencl` and `xpu` device kinds: memory is OpenCL shared virtual memory.

`opencl:N` is the N-th OpenCL device of any platform; `xpu:N` the N-th Intel GPU among
them (registered always, available only where one exists). Segments of the caching
allocator are fine-grained SVM buffers (`clSVMAlloc` with
CL_MEM_SVM_FINE_GRAIN_BUFFER): the host reads and writes them through the same
address (so eager tensors there are numpy arrays, as on every kiln device) and
kernels take the pointers directly, so compiled programs copy nothing between
kernels. Memory statistics and the per-process fraction are the caching allocator's
(`kn.memory.memory_stats("opencl:0")`, `set_per_process_memory_fraction`), the fraction
of the device's global memory size.
"""

from __future__ import annotations

import threading

import numpy as np

from kiln.runtime.caching_allocator import RawMemory
from kiln.runtime.device import register_device_kind

_SEGMENTS: dict[int, tuple[int, object]] = {}  # start address -> (end, DeviceContext)
_lock = threading.Lock()


class SvmMemory(RawMemory):
    """Fine-grained SVM segments of one OpenCL device."""

    def __init__(self, kind: str, index: int):
        self.kind, self.index = kind, index

    def alloc(self, nbytes: int):
        from kiln.codegen.opencl.errors import KilnOpenCLFeatureError
        from kiln.codegen.opencl.runtime import context

        ctx = context(self.kind, self.index)
        if not ctx.svm_fine:
            raise KilnOpenCLFeatureError(
                f"{self.kind}:{self.index} ({ctx.device.name}) has no fine-grained SVM buffers, which "
                "kiln's device memory needs (host-visible device memory)",
                hint="compile with backend='opencl' on host tensors instead: kernels still run there")
        cl = ctx.cl
        flags = cl.svm_mem_flags.READ_WRITE | cl.svm_mem_flags.SVM_FINE_GRAIN_BUFFER
        array = cl.svm_empty(ctx.context, flags, max(1, nbytes), np.uint8)
        address = array.ctypes.data
        with _lock:
            _SEGMENTS[address] = (address + nbytes, ctx)
        return array, array[:nbytes], address

    def free(self, handle) -> None:
        with _lock:
            _SEGMENTS.pop(handle.ctypes.data, None)
        del handle  # the SVM allocation goes with the last view of it


def svm_owner(array: np.ndarray):
    """The DeviceContext whose SVM holds `array`'s memory, or None."""
    address = array.__array_interface__["data"][0]
    with _lock:
        for start, (end, ctx) in _SEGMENTS.items():
            if start <= address < end or (start == address == end):
                return ctx
    return None


def _devices(kind: str) -> tuple:
    from kiln.codegen.opencl.runtime import all_devices, intel_gpus

    return intel_gpus() if kind == "xpu" else all_devices()


def _total(kind: str, index: int) -> int:
    from kiln.codegen.opencl.runtime import device_for

    return int(device_for(kind, index).global_mem_size)


def _synchronize(kind: str):
    def sync(index: int) -> None:
        from kiln.codegen.opencl.runtime import context

        context(kind, index).queue.finish()
    return sync


for _kind, _hardware in (("opencl", "an OpenCL device and its ICD loader (pyopencl; on Debian "
                                    "pocl-opencl-icd for the CPU)"),
                         ("xpu", "an Intel GPU with its OpenCL driver (intel-opencl-icd) and pyopencl")):
    register_device_kind(_kind, hardware=_hardware,
                         raw_memory=lambda index, k=_kind: SvmMemory(k, index),
                         total_memory=lambda index, k=_kind: _total(k, index),
                         available=lambda k=_kind: bool(_devices(k)),
                         count=lambda k=_kind: len(_devices(k)), synchronize=_synchronize(_kind),
                         backend=lambda index, k=_kind: f"{k}:{index}")
