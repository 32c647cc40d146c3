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
from kiln.runtime.device import CPU, Device, kind_of

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
    if dl_device is not None and tuple(dl_device) != (kind, index):
        raise KilnDLPackError(f"__dlpack__: the tensor is on {device} ({_name(kind)}:{index}); "
                              f"a copy to {_name(dl_device[0])}:{dl_device[1]} was asked",
                              hint="move it first with x.to(device)")
    if copy:
        array = array.copy()
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

def from_dlpack(obj):
    """A kiln tensor over a DLPack producer's memory (numpy, torch, jax, cupy, ...):
    zero-copy for host memory; device memory that is not host-visible is K382.

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
    if kind not in _HOST_TYPES:
        raise KilnDLPackError(
            f"from_dlpack: the {what} lives in {_name(kind)}:{index} memory, which the host "
            "cannot read; kiln's device tensors are host-visible (CPU, or managed memory)",
            hint="move it to the host first (torch: t.cpu(); cupy: cp.asnumpy(a)), or let the "
                 "other library read a kiln tensor instead")
    try:
        array = np.from_dlpack(obj)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        if "dtype" not in str(exc).lower():
            raise KilnDLPackError(f"from_dlpack: cannot import the {what}: {exc}") from None
        array = _import_special(obj, what)
    dt.from_numpy(array.dtype)  # a dtype kiln lacks (uint16, ...) is K102 naming the dtypes
    return Tensor._make(array)


def _import_special(obj, what: str) -> np.ndarray:
    """bfloat16 / float8 host tensors numpy's DLPack refuses: read the struct ourselves."""
    capsule = obj.__dlpack__()
    address = _capsule_pointer(capsule, _NAME)
    managed = DLManagedTensor.from_address(address)
    tensor = managed.dl_tensor
    name = _SPECIAL_BY_CODE.get(tensor.dtype.code)
    if name is None or tensor.dtype.lanes != 1:
        raise KilnDLPackError(f"from_dlpack: the {what}'s DLPack dtype (code {tensor.dtype.code}, "
                              f"{tensor.dtype.bits} bits, {tensor.dtype.lanes} lanes) has no kiln "
                              "dtype")
    dtype = np.dtype(dt.dtype(name).np_dtype)
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    if tensor.strides:
        strides = tuple(tensor.strides[i] * dtype.itemsize for i in range(tensor.ndim))
    else:  # NULL strides: compact row-major
        strides = _contiguous_strides(shape, dtype.itemsize)
    _capsule_set_name(capsule, _USED)  # we own it now: we call its deleter
    holder = _Imported(address, managed, {
        "data": (tensor.data + tensor.byte_offset, False), "shape": shape,
        "strides": strides, "typestr": "|V%d" % dtype.itemsize, "version": 3})
    return np.asarray(holder).view(dtype)


def _contiguous_strides(shape: tuple, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


class _Imported:
    """numpy's base for an imported tensor: calls the producer's deleter when it dies."""

    def __init__(self, address: int, managed: DLManagedTensor, interface: dict):
        self.address, self.managed, self.__array_interface__ = address, managed, interface

    def __del__(self):
        deleter = self.managed.deleter
        if deleter:
            deleter(ctypes.cast(self.address, ctypes.POINTER(DLManagedTensor)))
