"""The cuda and rocm device kinds: memory through the vendor runtimes, never torch.

CUDA goes through NVIDIA's `cuda-bindings` (`cuda.bindings.driver`, which
nvidia-cutlass-dsl brings); ROCm through the HIP runtime library Triton's AMD driver
loads (`libamdhip64.so`, with ctypes). Both are imported only when a device of the
kind is first asked for, and a machine without the hardware says so (K381).

Segments are *managed* memory (`cuMemAllocManaged` / `hipMallocManaged`): a kernel
reads it on the device, and the host reads it through the same address, so kiln's
eager tensors there stay numpy arrays (eager ops then run on the host, the pages
migrating on demand) and compiled kernels take the pointers without copies. Host
access waits for the device first (`synchronize`). Not exercised on this CPU-only
machine: scripts/gpu_check.py runs it on an H200.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from kiln.runtime.caching_allocator import RawMemory
from kiln.runtime.device import register_device_kind

_CU_MEM_ATTACH_GLOBAL = 1


def _host_view(address: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of `nbytes` at `address` (managed memory)."""
    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    return np.frombuffer(buffer, np.uint8, nbytes)


# -- CUDA -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cuda():
    from cuda.bindings import driver

    _check(driver, driver.cuInit(0), "cuInit")
    return driver


def _check(driver, result, what: str):
    """cuda-bindings returns (CUresult, *values): raise on an error, give the values."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {status}")
    return values[0] if len(values) == 1 else values


def _cuda_count() -> int:
    driver = _cuda()
    return int(_check(driver, driver.cuDeviceGetCount(), "cuDeviceGetCount"))


@functools.lru_cache(maxsize=None)
def _cuda_context(index: int):
    driver = _cuda()
    device = _check(driver, driver.cuDeviceGet(index), "cuDeviceGet")
    context = _check(driver, driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    return device, context


def _cuda_current(index: int):
    driver = _cuda()
    device, context = _cuda_context(index)
    _check(driver, driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return driver, device


class CudaManagedMemory(RawMemory):
    """Segments of CUDA managed memory on one GPU."""

    def __init__(self, index: int):
        self.index = index

    def alloc(self, nbytes: int):
        driver, _ = _cuda_current(self.index)
        status, pointer = driver.cuMemAllocManaged(nbytes, _CU_MEM_ATTACH_GLOBAL)
        if status != driver.CUresult.CUDA_SUCCESS:
            raise MemoryError(f"cuMemAllocManaged({nbytes}) on cuda:{self.index}: {status}")
        address = int(pointer)
        return pointer, _host_view(address, nbytes), address

    def free(self, handle) -> None:
        driver, _ = _cuda_current(self.index)
        _check(driver, driver.cuMemFree(handle), "cuMemFree")


def _cuda_total(index: int) -> int:
    driver, device = _cuda_current(index)
    return int(_check(driver, driver.cuDeviceTotalMem(device), "cuDeviceTotalMem"))


def _cuda_synchronize(index: int) -> None:
    driver, _ = _cuda_current(index)
    _check(driver, driver.cuCtxSynchronize(), "cuCtxSynchronize")


def _cuda_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy between managed (or host) arrays: cuMemcpy knows where each side lives."""
    driver = _cuda()
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        np.copyto(dst, src)
        return
    _check(driver, driver.cuMemcpy(dst.ctypes.data, src.ctypes.data, src.nbytes), "cuMemcpy")
    _check(driver, driver.cuCtxSynchronize(), "cuCtxSynchronize")


def _cuda_available() -> bool:
    return _cuda_count() > 0


# -- ROCm (HIP) ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _hip():
    """libamdhip64, found as Triton's AMD driver finds it (ROCm's lib folder, then the
    loader's search path)."""
    import os

    names = [os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), "lib", "libamdhip64.so"),
             "libamdhip64.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise OSError("libamdhip64.so not found (ROCm's HIP runtime)")
    lib.hipGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.hipSetDevice.argtypes = [ctypes.c_int]
    lib.hipMallocManaged.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                     ctypes.c_uint]
    lib.hipFree.argtypes = [ctypes.c_void_p]
    lib.hipMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    lib.hipMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def _hip_call(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: hipError {status}")


def _hip_count() -> int:
    count = ctypes.c_int(0)
    _hip_call(_hip().hipGetDeviceCount(ctypes.byref(count)), "hipGetDeviceCount")
    return count.value


class HipManagedMemory(RawMemory):
    """Segments of HIP managed memory on one AMD GPU."""

    def __init__(self, index: int):
        self.index = index

    def alloc(self, nbytes: int):
        lib = _hip()
        _hip_call(lib.hipSetDevice(self.index), "hipSetDevice")
        pointer = ctypes.c_void_p()
        if lib.hipMallocManaged(ctypes.byref(pointer), nbytes, 1) != 0:  # hipMemAttachGlobal
            raise MemoryError(f"hipMallocManaged({nbytes}) on rocm:{self.index}")
        return pointer.value, _host_view(pointer.value, nbytes), pointer.value

    def free(self, handle) -> None:
        _hip_call(_hip().hipFree(handle), "hipFree")


def _hip_total(index: int) -> int:
    lib = _hip()
    _hip_call(lib.hipSetDevice(index), "hipSetDevice")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _hip_call(lib.hipMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "hipMemGetInfo")
    return total.value


def _hip_copy(dst: np.ndarray, src: np.ndarray) -> None:
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        np.copyto(dst, src)
        return
    _hip_call(_hip().hipMemcpy(dst.ctypes.data, src.ctypes.data, src.nbytes, 4),  # Default
              "hipMemcpy")


def _hip_synchronize(index: int) -> None:
    lib = _hip()
    _hip_call(lib.hipSetDevice(index), "hipSetDevice")
    _hip_call(lib.hipDeviceSynchronize(), "hipDeviceSynchronize")


register_device_kind("cuda", hardware="an NVIDIA GPU and its driver",
                     raw_memory=CudaManagedMemory, total_memory=_cuda_total,
                     available=_cuda_available, count=_cuda_count, copy=_cuda_copy,
                     # kDLCUDA, not kDLCUDAManaged (13), which torch refuses: managed memory
                     # is CUDA device memory too (kiln/runtime/dlpack_cuda.py)
                     dlpack_type=2, synchronize=_cuda_synchronize,
                     backend="cuda")
register_device_kind("rocm", hardware="an AMD GPU and the HIP runtime",
                     raw_memory=HipManagedMemory, total_memory=_hip_total,
                     available=lambda: _hip_count() > 0, count=_hip_count, copy=_hip_copy,
                     dlpack_type=10, synchronize=_hip_synchronize,  # kDLROCM
                     backend="rocm")
