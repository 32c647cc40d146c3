"""`fft` (complex64, forward or inverse) on the CPU through MKL's DFTI, where MKL is installed.

The op's reference (kiln/ir/ops/fft.py) is numpy's pocketfft in complex128, rounded to
complex64: 256 transforms of 1024 points took 2.5 ms there, against 0.11 ms for torch
(MKL) (benchmarks/bench_nn_ops.py). This module is the CPU backend's `fft` template kind
(`CpuBackend.templates()`): one committed single-precision DFTI descriptor per (length,
count), kept (MAX_DESCRIPTORS, freed when dropped), computes every transform of the call
in one `DftiComputeForward`/`Backward` (an axis other than the last: the columns of each
block [n, inner] at once, strided, one call a block); the norm's scale is one multiply
after. Single precision keeps
the result within ~1e-7 of the transform's largest value (the reference's rounding alone
is ~6e-8). MKL runs on one thread (its sequential layer, blas.py), so a large call along
the last axis is cut into one equal unit of transforms per kiln thread, each unit with a
descriptor of its own, and the units are computed on kiln's threads by a small native
loop (`kiln_fft_units`) that calls DFTI through its address: 256 x 1024 points 0.22 ->
~0.12 ms on two threads (torch, MKL's own threads: 0.12). Without MKL, or for other
shapes of the op, the reference runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu import blas
from kiln.codegen.cpu.llvm_emit import array_data_ir

# mkl_dfti.h
DFTI_SINGLE_COMPLEX = 32  # DFTI_COMPLEX (domain)
DFTI_NUMBER_OF_TRANSFORMS = 7
DFTI_PLACEMENT = 11
DFTI_INPUT_STRIDES = 12
DFTI_OUTPUT_STRIDES = 13
DFTI_INPUT_DISTANCE = 14
DFTI_OUTPUT_DISTANCE = 15
DFTI_NOT_INPLACE = 44
MAX_DESCRIPTORS = 32  # committed descriptors kept (the oldest freed beyond)
MAX_BLOCKS = 64  # an axis not last: at most this many calls (one per block of columns)
MIN_POINTS = 1 << 12  # a smaller call runs the reference (a descriptor's commit costs more)
SPLIT_POINTS = 1 << 16  # a call along the last axis of fewer points runs whole on one thread

_lock = threading.Lock()
_kept: dict = {}  # (n, count, stride, slot) -> (handle, lock)


@lru_cache(maxsize=None)
def _mkl():
    """MKL's library with the DFTI entry points typed, or None (MKL is not installed).
    It is used whichever BLAS the GEMMs call (on other vendors' CPUs `auto` keeps
    OpenBLAS for them); loading it through blas.py keeps it in its sequential layer."""
    if not blas.available("mkl"):
        return None
    lib = ctypes.CDLL(blas.load("mkl").path)
    for name in ("DftiCreateDescriptor_s_1d", "DftiSetValue", "DftiCommitDescriptor", "DftiComputeForward",
                 "DftiComputeBackward", "DftiFreeDescriptor"):
        getattr(lib, name).restype = ctypes.c_long
    return lib




def _descriptor(lib, n: int, count: int, stride: int = 1, slot: int = 0):
    """(handle, lock) of a committed descriptor for `count` transforms of `n` points, the
    points `stride` apart and the transforms one after another (stride 1: n apart, else
    1 apart: the columns of a [n, stride] block), or None when MKL refuses one. `slot`:
    which of a split call's units it serves (each unit's thread has its own)."""
    key = (n, count, stride, slot)
    with _lock:
        found = _kept.get(key)
        if found is not None:
            return found
    handle = ctypes.c_void_p()
    if lib.DftiCreateDescriptor_s_1d(ctypes.byref(handle), DFTI_SINGLE_COMPLEX, ctypes.c_long(n)) != 0:
        return None
    distance = n if stride == 1 else 1
    strides = (ctypes.c_long * 2)(0, stride)
    ok = all(lib.DftiSetValue(handle, name, ctypes.c_long(value)) == 0 for name, value in (
        (DFTI_NUMBER_OF_TRANSFORMS, count), (DFTI_INPUT_DISTANCE, distance), (DFTI_OUTPUT_DISTANCE, distance),
        (DFTI_PLACEMENT, DFTI_NOT_INPLACE))) and all(
        lib.DftiSetValue(handle, name, strides) == 0 for name in (DFTI_INPUT_STRIDES, DFTI_OUTPUT_STRIDES))
    if not ok or lib.DftiCommitDescriptor(handle) != 0:
        lib.DftiFreeDescriptor(ctypes.byref(handle))
        return None
    found = (handle, threading.Lock())
    with _lock:
        if len(_kept) >= MAX_DESCRIPTORS:
            for old_key in list(_kept)[:len(_kept) - MAX_DESCRIPTORS + 1]:
                old, old_lock = _kept.pop(old_key)
                with old_lock:  # (a call still computing with it finishes first)
                    lib.DftiFreeDescriptor(ctypes.byref(old))
                    old.value = None  # a call that found it before: sees it gone, not freed memory
        _kept[key] = found
    return found


def fft(x: np.ndarray, axis: int, inverse: bool, norm: str) -> np.ndarray | None:
    """numpy.fft.fft / ifft of complex64 `x` along `axis` with `norm`, in complex64, or
    None (the caller runs the reference)."""
    if x.dtype != np.complex64 or x.ndim == 0 or x.size < MIN_POINTS:
        return None
    lib = _mkl()
    if lib is None:
        return None
    a = axis % x.ndim
    x = np.ascontiguousarray(x)
    n, inner = x.shape[a], math.prod(x.shape[a + 1:])
    outer = x.size // (n * inner)
    if inner > 1 and outer > MAX_BLOCKS:  # many small blocks: the axis moved last and back
        moved = fft(np.moveaxis(x, a, -1), -1, inverse, norm)
        return None if moved is None else np.ascontiguousarray(np.moveaxis(moved, -1, a))
    compute = lib.DftiComputeBackward if inverse else lib.DftiComputeForward
    out = np.empty_like(x)
    units = _units(outer, n) if inner == 1 else 1
    if units > 1:
        if not _split_rows(lib, compute, x, out, n, outer, units):
            return None
    else:
        # x as [outer, n, inner]: each block's `inner` columns in one call (rows: inner == 1)
        found = _descriptor(lib, n, inner if inner > 1 else outer, inner)
        if found is None:
            return None
        handle, lock = found
        block = n * inner * x.itemsize
        with lock:
            if handle.value is None:  # freed for a newer one since it was found: the reference
                return None
            for k in range(outer if inner > 1 else 1):
                if compute(handle, ctypes.c_void_p(x.ctypes.data + k * block),
                           ctypes.c_void_p(out.ctypes.data + k * block)) != 0:
                    return None
    scale = {"backward": 1.0 / n if inverse else 1.0, "forward": 1.0 if inverse else 1.0 / n,
             "ortho": 1.0 / math.sqrt(n)}[norm]
    if scale != 1.0:
        out *= np.float32(scale)
    return out


def _units(count: int, n: int) -> int:
    """Units (equal runs of whole transforms) a call of `count` transforms along the last
    axis is cut into: one per kiln thread where it divides the count, 1 below SPLIT_POINTS."""
    from kiln.runtime.threads import get_num_threads

    if count * n < SPLIT_POINTS:
        return 1
    for units in range(min(get_num_threads(), count), 1, -1):
        if count % units == 0:
            return units
    return 1


# sizes[]: the DFTI compute function's address, a unit's bytes, the handles' array, status
_UNITS_TEXT = f"""
define void @kiln_fft_units(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) nounwind {{
entry:
{array_data_ir(("x", "o"))}  %fn = load ptr, ptr %sizes
  %pb = getelementptr i64, ptr %sizes, i64 1
  %bytes = load i64, ptr %pb
  %ph = getelementptr i64, ptr %sizes, i64 2
  %handles = load ptr, ptr %ph
  %ps = getelementptr i64, ptr %sizes, i64 3
  br label %head
head:
  %u = phi i64 [ %begin, %entry ], [ %next, %done ]
  %more = icmp slt i64 %u, %end
  br i1 %more, label %body, label %exit
body:
  %hp = getelementptr ptr, ptr %handles, i64 %u
  %h = load ptr, ptr %hp
  %off = mul i64 %u, %bytes
  %xi = getelementptr i8, ptr %x, i64 %off
  %oi = getelementptr i8, ptr %o, i64 %off
  %status = call i64 (ptr, ptr, ...) %fn(ptr %h, ptr %xi, ptr %oi)
  %bad = icmp ne i64 %status, 0
  br i1 %bad, label %fail, label %done
fail:                                   ; only a failure is stored: no thread undoes another's
  store i64 %status, ptr %ps
  br label %done
done:
  %next = add i64 %u, 1
  br label %head
exit:
  ret void
}}
"""
_UNITS_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


@lru_cache(maxsize=None)
def _units_entry():
    """(the jitted module, kiln_fft_units' address, its ctypes callable), built on first
    use (the glue cache keeps the object code across processes)."""
    from kiln.codegen.cpu.glue_cache import glue_module

    jitted = glue_module(_UNITS_TEXT, 1)
    address = jitted.address("kiln_fft_units")
    return jitted, address, _UNITS_FN(address)


def _split_rows(lib, compute, x: np.ndarray, out: np.ndarray, n: int, count: int, units: int) -> bool:
    """`count` transforms of `n` points along x's rows into `out`, as `units` equal runs
    on kiln's threads, each run's descriptor its own; False where MKL refused one or one
    was freed (for a newer one) between finding it and locking it."""
    from kiln.codegen.cpu.native_pool import run_range

    found = [_descriptor(lib, n, count // units, 1, slot) for slot in range(units)]
    if any(f is None for f in found):
        return False
    _, address, call = _units_entry()
    bufs = (ctypes.c_void_p * 2)(id(x), id(out))  # x, out, handles alive until it returns
    with contextlib.ExitStack() as held:  # in slot order: no descriptor freed while in use
        for _, lock in found:
            held.enter_context(lock)
        if any(handle.value is None for handle, _ in found):  # one freed since: the reference
            return False
        handles = (ctypes.c_void_p * units)(*(handle.value for handle, _ in found))
        sizes = (ctypes.c_int64 * 4)(ctypes.cast(compute, ctypes.c_void_p).value, count // units * n * x.itemsize,
                                     ctypes.addressof(handles), 0)
        run_range(address, call, bufs, sizes, units, True)
    return sizes[3] == 0


def run_fft(arrays, attrs) -> list:
    """The CPU backend's extern `fft` (templates()["fft"])."""
    (x,) = arrays
    out = fft(x, attrs["axis"], attrs["inverse"], attrs["norm"]) if isinstance(x, np.ndarray) else None
    if out is None:
        from kiln.ir.emitter import EAGER

        return EAGER.apply("fft", arrays, attrs)
    return [out]
