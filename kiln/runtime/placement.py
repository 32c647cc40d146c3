"""Putting arrays on devices and charging them there: what the frontend calls when an
eager tensor is made, moved (`x.to(device)`) or computed.

An eager op's result is a numpy array the op's reference made; it is *tracked* by the
caching allocator of the device the op ran on (counted while it lives). A copy to
another device is a block of that device's allocator, filled by the device kind's copy
function. Host-visible memory only (see kiln/runtime/device.py).
"""

from __future__ import annotations

import numpy as np

from kiln.runtime.device import CPU, Device, allocator_for, copy_to, kind_of
from kiln.runtime.transfers import record

_cpu_allocator = None


def _cpu():
    global _cpu_allocator
    if _cpu_allocator is None:
        _cpu_allocator = allocator_for(CPU)
    return _cpu_allocator


def charge(array, device: Device | None) -> None:
    """Count an eager result on its device while it lives (a view is its base's memory,
    counted with the base; an array counted already is not counted twice)."""
    if type(array) is np.ndarray and array.base is None:  # owns its data (no flags object)
        (_cpu() if device is None else allocator_for(device)).track(array)


ALIGNED_MIN_BYTES = 4096


def host_copy(data, from_cache: bool = True) -> np.ndarray:
    """A copy of `data` (what `np.array(data, copy=True)` gives), for a new tensor. With
    `from_cache`, a C-ordered numeric array of at least ALIGNED_MIN_BYTES is copied into a
    block of the CPU caching allocator instead: counted there like any block (returned to
    the cache when the tensor dies), and 512-byte aligned, as torch's tensors are 64-byte
    aligned; numpy's large arrays start 16 bytes past a page, so every vector load of a row
    splits two cache lines (kiln's GEMM micro-kernel then copies B aligned first: ~12% of
    a small batched product's time per thread)."""
    src = np.asarray(data)
    if not from_cache or src.nbytes < ALIGNED_MIN_BYTES or src.dtype.hasobject or not src.flags.c_contiguous:
        return np.array(src, copy=True)
    out = _cpu().array(src.shape, src.dtype, "tensor")
    np.copyto(out, src)
    return out


def place(array: np.ndarray, device: Device) -> np.ndarray:
    """A fresh host array handed to kiln, on `device`: counted on the CPU, or copied
    into `device`'s memory."""
    if device is CPU:
        charge(array, None)
        return array
    record("host_to_device", array.nbytes)
    return copy_to(np.ascontiguousarray(array), device)


def move(array: np.ndarray, source: Device, target: Device) -> np.ndarray:
    """`array` (on `source`) copied to `target`, with the copy function of the device
    kind that is not the host."""
    if target is CPU or target == "cpu":
        out = np.empty(array.shape, array.dtype)
        kind_of(source).copy(out, array)
        record("device_to_host", array.nbytes)
        charge(out, None)
        return out
    record("host_to_device" if source is CPU or source == "cpu" else "device_to_device", array.nbytes)
    return copy_to(np.ascontiguousarray(array), target)
