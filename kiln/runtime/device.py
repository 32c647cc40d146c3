"""Devices: the `kn.device` value, and the registry backends add their device kinds to.

A device kind is registered with one call (`register_device_kind`): its name, the
hardware it needs (named in the error when it is missing), how to tell whether it is
there and how many there are, where its memory comes from (a `RawMemory` for the
caching allocator) and how to copy between it and the host. The CPU registers itself
here; CUDA and ROCm register in `kiln/runtime/gpu_devices.py` (their libraries are
imported only when asked whether they are available); a test registers a fake device.

Tensors of every kind registered here hold numpy arrays over host-visible memory (CPU
memory, CUDA/HIP managed memory, a test's fake device memory): eager ops compute on
them with numpy and their results are charged to the device's caching allocator.
A kind may name the compile target of programs on its tensors (`backend`); the address
ranges of its allocator's segments are recorded (`in_memory_of`, `memory_owner`), so
kiln can tell device memory a kernel takes as it is from host memory it must copy
(kiln/runtime/device_programs.py).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kiln.errors import KilnDeviceError, KilnError
from kiln.memory_limits import physical_memory
from kiln.runtime.caching_allocator import CachingAllocator, RawMemory

# every device kind kiln names, registered or not (a backend may register a new one)
KNOWN_KINDS = ("cpu", "cuda", "rocm", "metal", "opencl", "xpu", "mps")
# who provides a kind nobody has registered in this process, for the error message
_HARDWARE = {"cuda": "an NVIDIA GPU and its driver (cuda-bindings)",
             "rocm": "an AMD GPU and the HIP runtime (libamdhip64)",
             "metal": "an Apple GPU (Metal)", "mps": "an Apple GPU (Metal)",
             "opencl": "an OpenCL device and its ICD loader",
             "xpu": "an Intel GPU (OpenCL/Level Zero)"}


class KilnDeviceMismatchError(KilnDeviceError):
    code = "K380"
    title = "an op's tensors are on different devices"


class KilnDeviceUnavailableError(KilnDeviceError):
    code = "K381"
    title = "the device's hardware or runtime is not here"


class KilnDeviceRegistryError(KilnError, ValueError):
    code = "K383"
    title = "a device kind registered twice or incompletely"


class Device(str):
    """A device, as `torch.device`: `kn.device("cuda:1")`, `kn.device("cuda", 1)`.

    A frozen value equal to its string form, with `.type` and `.index`:

    >>> d = kn.device("cpu")
    >>> d == "cpu", d.type, d.index
    (True, 'cpu', None)
    """

    __slots__ = ()

    def __new__(cls, spec="cpu", index: int | None = None):
        if isinstance(spec, Device) and index is None:
            return spec
        if not isinstance(spec, str) and hasattr(spec, "type"):  # torch.device, jax Device
            index = getattr(spec, "index", None) if index is None else index
            spec = str(spec.type)
        if not isinstance(spec, str):
            raise KilnDeviceError(f"device: expected a string such as 'cpu' or 'cuda:0', got "
                                  f"{type(spec).__name__}")
        kind, sep, number = spec.strip().partition(":")
        if sep and not number.isdigit() or (sep and index is not None):
            raise KilnDeviceError(f"device: malformed device {spec!r}; write 'kind' or 'kind:N'")
        if kind not in KNOWN_KINDS and kind not in _KINDS:
            raise KilnDeviceError(f"device: unknown device {kind!r}; device kinds are "
                                  f"{', '.join(sorted(set(KNOWN_KINDS) | set(_KINDS)))}")
        if number:
            index = int(number)
        if index is not None and (not isinstance(index, int) or index < 0):
            raise KilnDeviceError(f"device: index must be a non-negative int, got {index!r}")
        return str.__new__(cls, kind if index is None else f"{kind}:{index}")

    @property
    def type(self) -> str:
        return str.partition(str.__getnewargs__(self)[0], ":")[0]

    @property
    def index(self) -> int | None:
        number = str.partition(self, ":")[2]
        return int(number) if number else None

    def __str__(self) -> str:
        return str.__getnewargs__(self)[0]  # the plain string, not a Device

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __repr__(self) -> str:
        index = self.index
        return f"device(type={self.type!r}" + (f", index={index})" if index is not None else ")")

    def __reduce__(self):
        return Device, (str(self),)


CPU = Device("cpu")


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy between two host-visible arrays of the same shape and dtype."""
    np.copyto(dst, src)


@dataclass(frozen=True)
class DeviceKind:
    """What a backend registers for its device kind (see `register_device_kind`)."""
    name: str
    hardware: str
    raw_memory: Callable[[int], RawMemory]
    total_memory: Callable[[int], int]
    available: Callable[[], bool]
    count: Callable[[], int]
    copy: Callable[[np.ndarray, np.ndarray], None] = host_copy
    dlpack_type: int = 1  # DLDeviceType (kDLCPU = 1, kDLCUDA = 2, kDLROCM = 10, ...)
    synchronize: Callable[[int], None] | None = None
    extra: dict = field(default_factory=dict)
    # the compile target whose kernels run on this kind's memory ("cuda", "opencl:N" via
    # a function of the index); None: the compiled function's own backend runs its
    # kernels on the host-visible memory (the CPU; a test's fake device)
    backend: str | Callable[[int], str] | None = None


_KINDS: dict[str, DeviceKind] = {}
_ALLOCATORS: dict[str, CachingAllocator] = {}
_lock = threading.Lock()


def register_device_kind(name: str, *, hardware: str, raw_memory: Callable[[int], RawMemory],
                         total_memory: Callable[[int], int], available: Callable[[], bool],
                         count: Callable[[], int] = lambda: 1, copy=host_copy,
                         dlpack_type: int = 1, synchronize=None,
                         backend: str | Callable[[int], str] | None = None) -> DeviceKind:
    """Register a device kind: after this, `kn.device(name)`, `x.to(name)` and
    `kn.memory.*(name)` work for it. `raw_memory(index)` gives the memory its caching
    allocator carves (host-visible: a numpy uint8 view per segment), `total_memory(index)`
    its size in bytes (what a memory fraction is of), `copy(dst, src)` copies between its
    arrays and host arrays. `backend` is the compile target of programs called with
    tensors of this kind (a string, or a function of the device index); without one, the
    compiled function's own backend runs its kernels on this kind's (host-visible) memory.

    >>> from kiln.runtime.caching_allocator import RawMemory
    >>> register_device_kind("fake", hardware="nothing", raw_memory=lambda i: RawMemory(),
    ...                      total_memory=lambda i: 1 << 30, available=lambda: True)
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise KilnDeviceRegistryError(f"register_device_kind: bad or reserved kind name {name!r}")
    for what, fn in (("raw_memory", raw_memory), ("total_memory", total_memory),
                     ("available", available), ("count", count), ("copy", copy)):
        if not callable(fn):
            raise KilnDeviceRegistryError(f"register_device_kind({name!r}): {what} must be "
                                          f"callable, got {type(fn).__name__}")
    with _lock:
        if name in _KINDS:
            raise KilnDeviceRegistryError(f"register_device_kind: {name!r} is already registered",
                                          hint="unregister_device_kind(name) first to replace it")
        kind = DeviceKind(name, hardware, raw_memory, total_memory, available, count, copy,
                          dlpack_type, synchronize, backend=backend)
        _KINDS[name] = kind
        _RESOLVED.clear()
    return kind


def unregister_device_kind(name: str) -> None:
    """Forget a kind and its allocators (tests; a backend being unloaded)."""
    if name == "cpu":
        raise KilnDeviceRegistryError("unregister_device_kind: the cpu kind is always there")
    with _lock:
        _KINDS.pop(name, None)
        _RESOLVED.clear()
        for key in [k for k in _ALLOCATORS if Device(k).type == name]:
            del _ALLOCATORS[key]
            _RANGE_STARTS.pop(key, None)


def device_kinds() -> dict[str, DeviceKind]:
    return dict(_KINDS)


def _kind_of(device: Device, op: str) -> DeviceKind:
    kind = _KINDS.get(device.type)
    if kind is None:
        if device.type in ("cuda", "rocm"):  # registered on first use (imports nothing heavy)
            from kiln.runtime import gpu_devices  # noqa: F401

            kind = _KINDS.get(device.type)
        elif device.type in ("opencl", "xpu"):  # registered on first use, as cuda/rocm
            from kiln.runtime import opencl_device  # noqa: F401

            kind = _KINDS.get(device.type)
        elif device.type in ("metal", "mps"):  # registered on first use (PyObjC imported lazily)
            from kiln.codegen.metal import device as _metal_device  # noqa: F401

            kind = _KINDS.get(device.type)
        if kind is None:
            hardware = _HARDWARE.get(device.type, "its backend")
            raise KilnDeviceUnavailableError(
                f"{op}: device {str(device)!r} is not available here: it needs {hardware}, and "
                f"no backend registered the {device.type!r} device kind in this process",
                hint="use 'cpu', or run where that hardware and its backend are installed")
    return kind


def as_device(device=None, op: str = "tensor") -> Device:
    """`device=` of a factory or `.to()` resolved to a present device: None is the CPU,
    a kind without an index is index 0; a kind whose hardware is missing is K381.

    >>> as_device("cpu:0")
    device(type='cpu')
    """
    if device is None:
        return CPU
    if type(device) is Device and device in _RESOLVED:
        return _RESOLVED[device]
    dev = device if isinstance(device, Device) else Device(device)
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise KilnDeviceError(f"{op}: there is one cpu device ('cpu' or 'cpu:0'), got "
                                  f"{str(dev)!r}")
        return CPU
    kind = _kind_of(dev, op)
    try:
        present, count = bool(kind.available()), int(kind.count())
    except Exception as exc:  # a driver library that fails to load: the hardware is missing
        present, count = False, 0
        detail = f" ({type(exc).__name__}: {exc})"
    else:
        detail = ""
    if not present or count == 0:
        raise KilnDeviceUnavailableError(
            f"{op}: device {str(dev)!r} is not available here: it needs {kind.hardware}, which "
            f"this machine does not have{detail}",
            hint="use 'cpu', or run where that hardware is installed")
    index = dev.index or 0
    if index >= count:
        raise KilnDeviceUnavailableError(
            f"{op}: device {str(dev)!r} does not exist: this machine has {count} {dev.type} "
            f"device(s), indices 0..{count - 1}")
    resolved = Device(dev.type, index)
    _RESOLVED[dev] = resolved
    return resolved


_RESOLVED: dict[Device, Device] = {}


def kind_of(device: Device) -> DeviceKind:
    return _kind_of(Device(device), "device")


def backend_for(device: Device) -> str | None:
    """The compile target for programs on `device` (None: the host's kernels serve)."""
    backend = kind_of(device).backend
    if callable(backend):
        return backend(device.index or 0)
    return backend


def allocator_for(device=None) -> CachingAllocator:
    """The caching allocator of a device (created on first use)."""
    dev = as_device(device, "memory")
    allocator = _ALLOCATORS.get(dev)
    if allocator is None:
        kind = kind_of(dev)
        index = dev.index or 0
        with _lock:
            allocator = _ALLOCATORS.get(dev)
            if allocator is None:
                raw = kind.raw_memory(index)
                if dev is not CPU:  # device memory: its address ranges are known (in_memory_of)
                    raw = _Ranges(raw, dev)
                allocator = CachingAllocator(str(dev), raw, kind.total_memory(index))
                _ALLOCATORS[dev] = allocator
        from kiln.runtime.memory_tracking import ensure_publisher

        ensure_publisher()
    return allocator


class _Ranges(RawMemory):
    """A device's RawMemory, recording the address range of every live segment."""

    def __init__(self, raw: RawMemory, device: Device):
        self.raw, self.device = raw, device
        self._address: dict[int, int] = {}  # id(handle) -> start (the handle lives as long)

    def alloc(self, nbytes: int):
        handle, view, address = self.raw.alloc(nbytes)
        with _ranges_lock:
            bisect.insort(_RANGE_STARTS.setdefault(self.device, []), address)
            _RANGE_ENDS[(self.device, address)] = address + nbytes
            self._address[id(handle)] = address
        return handle, view, address

    def free(self, handle) -> None:
        address = self._address.pop(id(handle), None)
        if address is not None:
            with _ranges_lock:
                starts = _RANGE_STARTS.get(self.device, [])
                at = bisect.bisect_left(starts, address)
                if at < len(starts) and starts[at] == address:
                    del starts[at]
                _RANGE_ENDS.pop((self.device, address), None)
        self.raw.free(handle)

    def __getattr__(self, name):  # what else the kind's memory offers (index, kind, ...)
        if name == "raw":
            raise AttributeError(name)
        return getattr(self.raw, name)


_RANGE_STARTS: dict[Device, list[int]] = {}
_RANGE_ENDS: dict[tuple, int] = {}
_ranges_lock = threading.Lock()


def in_memory_of(device: Device, array: np.ndarray) -> bool:
    """Whether `array`'s memory lies in a segment of `device`'s caching allocator (device
    memory a kernel there takes as it is), rather than in host memory."""
    if array.size == 0:
        return True
    address = array.__array_interface__["data"][0]
    with _ranges_lock:
        starts = _RANGE_STARTS.get(device)
        if not starts:
            return False
        at = bisect.bisect_right(starts, address) - 1
        return at >= 0 and address + array.nbytes <= _RANGE_ENDS[(device, starts[at])]


def memory_owner(array: np.ndarray, kinds: tuple[str, ...] = ()) -> Device | None:
    """The device (of one of `kinds`, or any) whose caching allocator holds `array`'s
    memory, or None for host memory."""
    for device in list(_RANGE_STARTS):
        if (not kinds or device.type in kinds) and in_memory_of(device, array):
            return device
    return None


def allocators() -> dict[str, CachingAllocator]:
    """The allocators made so far, by device (what `kiln mem` publishes)."""
    return dict(_ALLOCATORS)


def copy_to(array: np.ndarray, device: Device) -> np.ndarray:
    """A copy of `array` in a block of `device`'s caching allocator."""
    dst = allocator_for(device).array(array.shape, array.dtype,
                                      f"copying a {array.dtype.name}{list(array.shape)} tensor")
    kind = _KINDS[device.type]
    kind.copy(dst, array)
    return dst


register_device_kind("cpu", hardware="a CPU", raw_memory=lambda index: RawMemory(),
                     total_memory=lambda index: physical_memory(), available=lambda: True)
