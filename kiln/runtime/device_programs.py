"""Compiled programs on device tensors: which device a call runs on, the backend and the
buffers its program gets there, and the call itself.

A compiled function called with tensors on device D (`x.to("opencl:0")`) runs the
program compiled for D's backend (the device kind's `backend`: "opencl:N", "cuda",
"rocm"; a kind without one — a test's fake device — runs the compiled function's own
backend's kernels on its host-visible memory). Every intermediate and result buffer
comes from D's caching allocator, so the kernels hand each other device memory and
nothing goes through the host between them; the results are tensors on D. Host copies
happen only where the program needs the host (an extern such as sort or LAPACK, the
index of a `cond`, the flag of a `while_loop`) and where the user asks (`.numpy()`,
`.to("cpu")`); kiln/runtime/transfers.py counts every one.

Rules, as PyTorch's: all tensor arguments on one device (K380 names both otherwise);
a 0-d CPU tensor or numpy scalar may join a device call (copied to the device: a
counted transfer of a few bytes); any other host array beside device tensors is K380.
"""

from __future__ import annotations

import threading

import numpy as np

from kiln.runtime.device import (CPU, Device, KilnDeviceMismatchError, allocator_for, in_memory_of,
                                 kind_of)
from kiln.runtime.transfers import record

_ALLOCATORS: dict = {}
_lock = threading.Lock()


def call_device(leaves, statics=(), op: str = "compiled function") -> Device | None:
    """The device of a call's tensor arguments (None: the host), or K380 when they are
    on two devices, or a host array that is not 0-d sits beside device tensors."""
    device, host = None, None
    for i, leaf in enumerate(leaves):
        if i in statics:
            continue
        dev = getattr(leaf, "_device", None)
        if dev is None:
            if host is None and (isinstance(leaf, np.ndarray) or hasattr(leaf, "_x")) \
                    and np.ndim(getattr(leaf, "_x", leaf)) > 0:
                host = i
            continue
        if device is None:
            device = dev
        elif dev != device:
            raise KilnDeviceMismatchError(
                f"{op}: tensor arguments are on different devices: {device} and {dev}",
                hint=f"move them to one device first, e.g. x.to({str(device)!r})")
    if device is not None and host is not None:
        raise KilnDeviceMismatchError(
            f"{op}: argument {host} is on the cpu and other tensor arguments are on {device}",
            hint=f"move it with x.to({str(device)!r}); only 0-d CPU tensors join a device call")
    return device


def backend_on(device: Device, backend: str) -> str:
    """The compile target for a program on `device`: the kind's own backend, else the
    compiled function's (`backend`), whose kernels run on host-visible memory."""
    from kiln.runtime.device import backend_for

    return backend_for(device) or backend


def runtime_allocator(device: Device):
    """The runtime Allocator whose buffers are blocks of `device`'s caching allocator
    (one per device, shared by every program there)."""
    segments = allocator_for(device)  # a re-registered kind has a new one: follow it
    allocator = _ALLOCATORS.get(device)
    if allocator is None or allocator.device_allocator is not segments:
        from kiln.runtime.allocator import Allocator

        with _lock:
            allocator = _ALLOCATORS.get(device)
            if allocator is None or allocator.device_allocator is not segments:
                allocator = _ALLOCATORS[device] = Allocator(device_allocator=segments)
    return allocator


class DeviceSide:
    """What an Executable on a device does at the host boundary: put host arrays into
    device memory (counted), read a value on the host after the device is done
    (counted), and wait for the device at the end of a call."""

    def __init__(self, device: Device, allocator):
        self.device = device
        self.allocator = allocator
        kind = kind_of(device)
        index = device.index or 0
        self._sync = (lambda: kind.synchronize(index)) if kind.synchronize else None
        self._copy = kind.copy

    def to_device(self, array):
        """`array` (host memory) copied into a block of the device (one h2d transfer);
        anything that is not array data (a collective's pending call) passes as it is."""
        if isinstance(array, np.generic):
            array = np.asarray(array)
        if not isinstance(array, np.ndarray):
            return array
        out = self.allocator.empty(array.shape, array.dtype)
        self._copy(out, np.ascontiguousarray(array))
        record("host_to_device", array.nbytes)
        return out

    def copy(self, array: np.ndarray) -> np.ndarray:
        """A copy of `array` (device memory) in a new block of the device."""
        out = self.allocator.empty(array.shape, array.dtype)
        self._copy(out, np.ascontiguousarray(array))
        record("device_to_device", array.nbytes)
        return out

    def host_read(self, arrays) -> None:
        """The host is about to read `arrays` (an extern's operands, a loop flag): wait
        for the device, and count what crosses."""
        if self._sync is not None:
            self._sync()
        for a in arrays:
            if isinstance(a, np.ndarray):
                record("device_to_host", a.nbytes)

    def finish(self) -> None:
        """The end of a call: the device has written every result."""
        if self._sync is not None:
            self._sync()

    def constant(self, data):
        """A program constant as device memory (copied once, when the program is built)."""
        return self.to_device(data)


def bind_arguments(arrays: list, device: Device, allocator) -> list:
    """The call's arrays, each in `device`'s memory: arrays there already (results of
    compiled programs, `x.to(device)`) pass as they are; others — an eager result on the
    device kind (eager ops compute on the host), a 0-d CPU tensor — are copied into a
    block of the device (a counted host-to-device transfer); a strided view of device
    memory is made dense there (a counted device-to-device copy)."""
    out = arrays
    for i, a in enumerate(arrays):
        there = in_memory_of(device, a)
        if not there or not a.flags.c_contiguous:  # kernels take dense device buffers
            if out is arrays:
                out = list(arrays)
            block = allocator.empty(a.shape, a.dtype)
            kind_of(device).copy(block, np.ascontiguousarray(a))
            record("device_to_device" if there else "host_to_device", a.nbytes)
            out[i] = block
    return out


def is_host(device) -> bool:
    return device is None or device is CPU or device == "cpu"
