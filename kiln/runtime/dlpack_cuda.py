"""DLPack with CUDA producers and consumers: `kn.from_dlpack(torch_cuda_tensor)` and
`torch.from_dlpack(kiln_cuda_tensor)`.

In: a producer whose `__dlpack_device__()` is kDLCUDA or kDLCUDAManaged is asked for its
capsule with `stream=1` (DLPack's legacy default stream: the producer makes the work
that writes the tensor, on its own stream, ordered before anything later on that
stream; kiln then waits for that stream, `cuStreamSynchronize`, before the host or its
device copy reads the memory). kiln reads
the DLManagedTensor with ctypes, renames the capsule "used_dltensor" and calls the
producer's deleter exactly once, when nothing of kiln refers to the memory any more.

kiln's cuda tensors are *managed* memory that the host reads too (eager ops compute on
the host, kiln/runtime/gpu_devices.py). So the producer's memory is shared, with no
copy, when the host can read it: kDLCUDAManaged, or kDLCUDA memory the driver reports
as managed (`cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_IS_MANAGED)`: cupy's managed
pool, a torch tensor from a managed allocator). The kiln tensor is then a `cuda:N`
tensor over it, and its address range is recorded as device memory, so compiled
programs take it as it is. Plain device memory (torch's caching allocator,
`cudaMalloc`) cannot back a host-visible tensor: `copy=None` (the array API's default,
"copy only if needed") copies it once on the device (`cuMemcpyDtoDAsync` into a block
of kiln's cuda allocator, counted as device_to_device), and `copy=False` refuses with
K382. `copy=True` always copies.

Out: a kiln cuda tensor reports `(kDLCUDA, N)` (torch refuses kDLCUDAManaged; managed
memory is valid CUDA device memory) and, for any consumer stream but -1, waits for
kiln's own device work first (`synchronize`: every stream of the context), so the
consumer may use it on its stream at once.

The driver is `cuda.bindings.driver` (`cuda_driver`); the tests put a fake in its place.
"""

from __future__ import annotations

import weakref

import numpy as np

from kiln.runtime import device as devices
from kiln.runtime.transfers import record

K_DLCUDA, K_DLCUDA_MANAGED = 2, 13
CUDA_TYPES = (K_DLCUDA, K_DLCUDA_MANAGED)
LEGACY_DEFAULT_STREAM = 1  # DLPack's stream number for CUDA's legacy default stream


def cuda_driver():
    """`cuda.bindings.driver`, initialized (kiln/runtime/gpu_devices.py)."""
    from kiln.runtime.gpu_devices import _cuda

    return _cuda()


def _check(driver, result, what: str):
    from kiln.runtime.dlpack import KilnDLPackError

    status, *values = result if isinstance(result, tuple) else (result,)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise KilnDLPackError(f"from_dlpack: {what} failed: {status}")
    return values[0] if len(values) == 1 else (values or None)


def import_cuda(obj, what: str, kind: int, index: int, copy: bool | None):
    """The kiln `cuda:index` tensor of a CUDA producer (see the module docstring)."""
    from kiln.errors import KilnError
    from kiln.frontend.tensor import Tensor
    from kiln.runtime import dlpack
    from kiln.runtime.dlpack import KilnDLPackError

    try:
        dev = devices.as_device(f"cuda:{index}", "from_dlpack")
    except KilnError as exc:
        raise KilnDLPackError(f"from_dlpack: the {what} lives in cuda:{index} memory, and kiln "
                              f"has no cuda:{index} device here ({exc.message})",
                              hint="run where kiln's cuda device kind is available") from None
    driver = cuda_driver()
    try:
        capsule = obj.__dlpack__(stream=LEGACY_DEFAULT_STREAM)
        synchronized = True
    except TypeError:  # a producer without the stream keyword: wait for the whole device
        capsule = obj.__dlpack__()
        synchronized = False
    managed_tensor, address = dlpack.take_capsule(capsule, what)
    holder = dlpack.Imported(address, managed_tensor)  # the deleter runs when it dies
    tensor = managed_tensor.dl_tensor
    if (tensor.device.device_type, tensor.device.device_id) != (kind, index):
        raise KilnDLPackError(f"from_dlpack: the {what} said it is on {dlpack._name(kind)}:{index} "
                              f"but its capsule is on {dlpack._name(tensor.device.device_type)}:"
                              f"{tensor.device.device_id}")
    dtype, shape, strides = dlpack.layout(tensor, what)
    pointer = tensor.data + tensor.byte_offset if tensor.data else 0
    if not synchronized:
        _check(driver, driver.cuCtxSynchronize(), "cuCtxSynchronize")
    host_visible = kind == K_DLCUDA_MANAGED or (pointer and int(_check(
        driver, driver.cuPointerGetAttribute(
            driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED, pointer),
        "cuPointerGetAttribute(IS_MANAGED)")) == 1)
    lo, hi = _extent(shape, strides, dtype.itemsize)
    if host_visible and not copy:
        # the producer's writes were ordered before the legacy default stream: kiln's eager
        # ops read on the host, so wait for that stream once, here
        _check(driver, driver.cuStreamSynchronize(0), "cuStreamSynchronize")
        array = holder.array(pointer, shape, strides, dtype)
        _record_range(dev, pointer + lo, hi - lo, array)
        return Tensor._make(array, None, dev)
    if copy is False:
        raise KilnDLPackError(
            f"from_dlpack(copy=False): the {what} is CUDA device memory that the host cannot "
            f"read, and kiln's cuda tensors are managed memory the host reads too (eager ops "
            f"run there), so it cannot be shared without a copy",
            hint="from_dlpack(x) (copy=None) copies it once on the device; or allocate it as "
                 "managed memory in the producer (cupy: a malloc_managed pool)")
    block = devices.allocator_for(dev).array((hi - lo,), np.uint8,
                                             f"from_dlpack: copying a {what}")
    if hi > lo:
        _check(driver, driver.cuMemcpyDtoDAsync(block.ctypes.data, pointer + lo, hi - lo, 0),
               "cuMemcpyDtoDAsync")
        _check(driver, driver.cuStreamSynchronize(0), "cuStreamSynchronize")
    record("device_to_device", hi - lo)
    del holder  # the producer's memory is no longer needed: its deleter runs now
    return Tensor._make(_view(block, lo, shape, strides, dtype), None, dev)


def _view(block: np.ndarray, lo: int, shape: tuple, strides: tuple, dtype: np.dtype):
    """`block` (the bytes [lo, hi) around the source's first element) seen with the
    source's layout; the view keeps the block alive."""
    interface = {"data": (block.ctypes.data - lo, False), "shape": shape, "strides": strides,
                 "typestr": "|V%d" % dtype.itemsize, "version": 3}
    return np.asarray(_Owner(block, interface)).view(dtype)


class _Owner:
    """numpy's base for a view into a kiln block."""

    def __init__(self, block: np.ndarray, interface: dict):
        self.block, self.__array_interface__ = block, interface


def _extent(shape: tuple, strides: tuple, itemsize: int) -> tuple[int, int]:
    """The byte range [lo, hi) the layout touches, relative to its first element."""
    if any(int(d) == 0 for d in shape):
        return 0, 0
    lo = sum((int(d) - 1) * s for d, s in zip(shape, strides) if s < 0)
    hi = sum((int(d) - 1) * s for d, s in zip(shape, strides) if s > 0) + itemsize
    return lo, hi


def _record_range(dev, start: int, nbytes: int, array: np.ndarray) -> None:
    """Mark [start, start+nbytes) as `dev`'s memory while `array` lives, so compiled
    programs on `dev` take it as it is (kiln/runtime/device.py's in_memory_of)."""
    import bisect

    if nbytes <= 0:
        return
    with devices._ranges_lock:
        starts = devices._RANGE_STARTS.setdefault(dev, [])
        if (dev, start) in devices._RANGE_ENDS:  # that range is known already
            return
        bisect.insort(starts, start)
        devices._RANGE_ENDS[(dev, start)] = start + nbytes

    def forget():
        with devices._ranges_lock:
            known = devices._RANGE_STARTS.get(dev, [])
            at = bisect.bisect_left(known, start)
            if at < len(known) and known[at] == start:
                del known[at]
            devices._RANGE_ENDS.pop((dev, start), None)

    weakref.finalize(array, forget)
