"""DLPack in and out, without copying: `kn.from_dlpack(x)` and `Tensor.__dlpack__`.

What is shared: a kiln tensor made by `from_dlpack` reads the producer's memory, and
`torch.from_dlpack(t)` (or `np.from_dlpack(t)`) reads the kiln tensor's. kiln's own
ops never write into an existing tensor (every op makes a new one; in-place methods
such as `x.add_(1)` rebind `x` to a new array), so a write through the other library's
view is seen by the kiln tensor, while a kiln op never changes what the other library
sees. Imported memory is the producer's: it is not counted by kiln's allocators.

numpy does the work for the dtypes it knows; bfloat16 and the float8 types (which
numpy's DLPack refuses) go through the C structs here, read and written with ctypes —
DLPack is a C ABI, so no unpickling and no evaluation is involved.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.runtime.device import CPU, Device, copy_to, kind_of

K_DLCPU, K_DLCUDA, K_DLCUDA_HOST, K_DLROCM, K_DLCUDA_MANAGED = 1, 2, 3, 10, 13
_HOST_TYPES = (K_DLCPU, K_DLCUDA_HOST, K_DLCUDA_MANAGED)
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                 9: "vpi", 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}


class KilnDLPackError(KilnDTypeError, BufferError):
    code = "K382"
    title = "a DLPack exchange kiln cannot make"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _DELETER)]

# DLPack type codes of the dtypes numpy's DLPack does not carry (DLPack 1.1 enum values)
_SPECIAL = {"bfloat16": (4, 16), "float8_e4m3fn": (10, 8), "float8_e5m2": (12, 8)}
_SPECIAL_BY_CODE = {code: name for name, (code, _) in _SPECIAL.items()}



def _capi(name: str, restype, *argtypes):
    """A private prototype of a C-API function (the GIL held: PyDLL), so that no other
    library's argtypes on ctypes.pythonapi are changed or relied on."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_new = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                     ctypes.c_void_p)
_capsule_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object,
                         ctypes.c_char_p)
_capsule_raw_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_char_p)
_capsule_set_name = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_capsule_is_valid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)

_NAME = b"dltensor"
_USED = b"used_dltensor"
_exported: dict[int, tuple] = {}  # DLManagedTensor address -> what must outlive the consumer


def dlpack_device(device: Device) -> tuple[int, int]:
    """(DLDeviceType, index) of a kiln device."""
    if device is CPU or device == "cpu":
        return K_DLCPU, 0
    return kind_of(device).dlpack_type, device.index or 0


# -- out --------------------------------------------------------------------------------

def export_capsule(array: np.ndarray, device: Device, *args, stream=None, max_version=None,
                   dl_device=None, copy=None):
    """The capsule behind `Tensor.__dlpack__` (the array API's signature)."""
    kind, index = dlpack_device(device)
    host = device is CPU or device == "cpu"
    if not host and stream != -1:  # the consumer may use it on its stream at once
        sync = kind_of(device).synchronize
        if sync is not None:
            sync(device.index or 0)
    if dl_device is not None and tuple(dl_device) != (kind, index):
        if tuple(dl_device) != (K_DLCPU, 0) or host:
            raise KilnDLPackError(f"__dlpack__: the tensor is on {device} ({_name(kind)}:{index}); "
                                  f"a copy to {_name(dl_device[0])}:{dl_device[1]} was asked",
                                  hint="move it first with x.to(device)")
        kind, index, stream = K_DLCPU, 0, None  # kiln's device memory is host-visible
    if copy:
        array = array.copy() if kind == K_DLCPU else copy_to(np.ascontiguousarray(array), device)
    if kind == K_DLCPU and array.dtype.name not in _SPECIAL:
        return array.__dlpack__(stream=stream)
    return _capsule(array, kind, index)


def _capsule(array: np.ndarray, kind: int, index: int):
    """A "dltensor" capsule over `array`'s memory, built with ctypes."""
    return pointer_capsule(array.ctypes.data, array.shape,
                           tuple(s // array.itemsize for s in array.strides), array.dtype,
                           kind, index, array)


def pointer_capsule(address: int, shape: tuple, strides: tuple | None, dtype: np.dtype,
                    kind: int, index: int, owner, on_release=None):
    """A "dltensor" capsule over `address` (device memory included): `strides` in
    elements (None: row-major), `owner` kept alive until the consumer calls the deleter
    (or the capsule dies unconsumed), `on_release()` called then, exactly once."""
    dtype = np.dtype(dtype)
    name = dtype.name
    if name in _SPECIAL:
        code, bits = _SPECIAL[name]
    else:
        code = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}.get(dtype.kind)
        bits = dtype.itemsize * 8
        if code is None:
            raise KilnDLPackError(f"__dlpack__: dtype {name} has no DLPack type")
    ndim = len(shape)
    if strides is None:
        strides = tuple(s // dtype.itemsize for s in _contiguous_strides(shape, dtype.itemsize))
    c_shape = (ctypes.c_int64 * max(ndim, 1))(*shape)
    c_strides = (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(address, DLDevice(kind, index), ndim,
                                 DLDataType(code, bits, 1), c_shape, c_strides, 0)
    managed.deleter = _DELETE
    key = ctypes.addressof(managed)
    _exported[key] = (managed, c_shape, c_strides, owner, on_release)
    return _capsule_new(key, _NAME, ctypes.cast(_CAPSULE_DESTRUCTOR, ctypes.c_void_p))


def _release(key: int) -> None:
    held = _exported.pop(key, None)
    if held is not None and held[4] is not None:
        held[4]()


@_DELETER
def _DELETE(managed):  # noqa: N802  (a C callback)
    _release(ctypes.addressof(managed.contents))


@ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
def _CAPSULE_DESTRUCTOR(capsule):  # noqa: N802  (a C callback)
    # a capsule nobody consumed keeps its name: then nobody will call the deleter
    if _capsule_is_valid(capsule, _NAME):
        _release(_capsule_raw_pointer(capsule, _NAME))


def _name(kind) -> str:
    return _DEVICE_NAMES.get(int(kind), f"device type {kind}")


# -- in ---------------------------------------------------------------------------------

def from_dlpack(obj, *, device=None, copy: bool | None = None):
    """A kiln tensor over a DLPack producer's memory (numpy, torch, jax, cupy, ...):
    zero-copy for host memory and for CUDA memory the host can read (managed); plain
    CUDA device memory is copied once on the device unless `copy=False` (then K382;
    kiln/runtime/dlpack_cuda.py). `device`: None, or the producer's own device.

    >>> import numpy as np
    >>> a = np.arange(4.0)
    >>> t = kn.from_dlpack(a)
    >>> t.numpy().ctypes.data == a.ctypes.data
    True
    """
    from kiln.frontend.tensor import Tensor

    if isinstance(obj, Tensor):
        return obj
    what = type(obj).__name__
    if not hasattr(obj, "__dlpack__"):
        raise KilnDLPackError(f"from_dlpack: a {what} is not a DLPack producer (it has no "
                              "__dlpack__)", hint="pass a numpy/torch/jax/cupy array")
    kind, index = (int(v) for v in obj.__dlpack_device__()) \
        if hasattr(obj, "__dlpack_device__") else (K_DLCPU, 0)
    if device is not None:
        from kiln.runtime.device import Device

        want = Device(device)
        here = f"cuda:{index}" if kind in (K_DLCUDA, K_DLCUDA_MANAGED) else \
            "cpu" if kind in _HOST_TYPES else f"{_name(kind)}:{index}"
        if str(want) != here and not (want.index is None and here.startswith(want.type + ":")):
            raise KilnDLPackError(f"from_dlpack(device={str(want)!r}): the {what} is on {here}; "
                                  "from_dlpack shares memory where it is",
                                  hint="kn.from_dlpack(x).to(device) to move it")
    if kind in (K_DLCUDA, K_DLCUDA_MANAGED):
        from kiln.runtime.dlpack_cuda import import_cuda

        return import_cuda(obj, what, kind, index, copy)
    if kind == K_DLROCM:
        raise KilnDLPackError(
            f"from_dlpack: the {what} lives in rocm:{index} device memory; kiln imports CUDA "
            "device memory, and importing ROCm (HIP) memory is not built",
            hint="move it to the host first (t.cpu()); kiln's rocm tensors go out to other "
                 "libraries with __dlpack__")
    if kind not in _HOST_TYPES:
        raise KilnDLPackError(
            f"from_dlpack: the {what} lives in {_name(kind)}:{index} memory, and kiln has no "
            f"device for that kind of memory",
            hint="move it to the host first (e.g. t.cpu()), or let the other library read a "
                 "kiln tensor instead")
    try:
        array = np.from_dlpack(obj)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        if "dtype" not in str(exc).lower():
            raise KilnDLPackError(f"from_dlpack: cannot import the {what}: {exc}") from None
        array = _import_special(obj, what)
    dt.from_numpy(array.dtype)  # a dtype kiln lacks (uint16, ...) is K102 naming the dtypes
    if copy:
        array = array.copy()
    return Tensor._make(array)


def take_capsule(capsule, what: str) -> tuple[DLManagedTensor, int]:
    """The DLManagedTensor of an unconsumed "dltensor" capsule, which kiln now owns
    (renamed "used_dltensor": kiln calls the deleter, through `Imported`)."""
    try:
        address = _capsule_pointer(capsule, _NAME)
    except ValueError:
        raise KilnDLPackError(f"from_dlpack: the {what}'s __dlpack__ gave no unconsumed "
                              "\"dltensor\" capsule") from None
    _capsule_set_name(capsule, _USED)
    return DLManagedTensor.from_address(address), address


def layout(tensor: DLTensor, what: str) -> tuple[np.dtype, tuple, tuple]:
    """(numpy dtype, shape, byte strides) of a DLTensor."""
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    name = _SPECIAL_BY_CODE.get(code) if bits in (8, 16) else None
    if name is not None and _SPECIAL[name][1] == bits:
        dtype = np.dtype(dt.dtype(name).np_dtype)
    else:
        kinds = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}
        try:
            dtype = np.dtype("%s%d" % (kinds[code], bits // 8)) if code != 6 else np.dtype(bool)
        except (KeyError, TypeError):
            dtype = None
        if lanes != 1 or dtype is None or dtype.itemsize * 8 != bits:
            raise KilnDLPackError(f"from_dlpack: the {what}'s DLPack dtype (code {code}, {bits} "
                                  f"bits, {lanes} lanes) has no kiln dtype")
    dt.from_numpy(dtype)  # a dtype kiln lacks (uint16, ...) is K102 naming the dtypes
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    if tensor.strides:
        strides = tuple(int(tensor.strides[i]) * dtype.itemsize for i in range(tensor.ndim))
    else:  # NULL strides: compact row-major
        strides = _contiguous_strides(shape, dtype.itemsize)
    return dtype, shape, strides


def _import_special(obj, what: str) -> np.ndarray:
    """bfloat16 / float8 host tensors numpy's DLPack refuses: read the struct ourselves."""
    managed, address = take_capsule(obj.__dlpack__(), what)
    holder = Imported(address, managed)
    tensor = managed.dl_tensor
    dtype, shape, strides = layout(tensor, what)
    if dtype.name not in _SPECIAL:
        raise KilnDLPackError(f"from_dlpack: cannot import the {what} ({dtype})")
    return holder.array(tensor.data + tensor.byte_offset, shape, strides, dtype)


def _contiguous_strides(shape: tuple, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


class Imported:
    """numpy's base for an imported tensor: calls the producer's deleter, exactly once,
    when it dies (with the last numpy view of the memory, or at once if none was made)."""

    def __init__(self, address: int, managed: DLManagedTensor):
        self.address, self.managed = address, managed

    def array(self, pointer: int, shape: tuple, strides: tuple, dtype: np.dtype) -> np.ndarray:
        """A numpy view of the producer's memory (its base: this holder)."""
        self.__array_interface__ = {"data": (pointer or 0, False), "shape": shape,
                                    "strides": strides, "typestr": "|V%d" % dtype.itemsize,
                                    "version": 3}
        return np.asarray(self).view(dtype)

    def __del__(self):
        deleter, self.managed = (self.managed.deleter if self.managed is not None else None,
                                 None)
        if deleter:
            deleter(ctypes.cast(self.address, ctypes.POINTER(DLManagedTensor)))
