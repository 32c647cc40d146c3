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
is ~6e-8); MKL runs on one thread (its sequential layer, blas.py). Without MKL, or for
other shapes of the op, the reference runs.
"""

from __future__ import annotations

import ctypes
import math
import threading
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu import blas

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

_lock = threading.Lock()
_kept: dict = {}  # (n, count) -> (handle, lock)


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




def _descriptor(lib, n: int, count: int, stride: int = 1):
    """(handle, lock) of a committed descriptor for `count` transforms of `n` points, the
    points `stride` apart and the transforms one after another (stride 1: n apart, else
    1 apart: the columns of a [n, stride] block), or None when MKL refuses one."""
    key = (n, count, stride)
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
    # x as [outer, n, inner]: each block's `inner` columns in one call (rows: inner == 1)
    found = _descriptor(lib, n, inner if inner > 1 else outer, inner)
    if found is None:
        return None
    handle, lock = found
    out = np.empty_like(x)
    compute = lib.DftiComputeBackward if inverse else lib.DftiComputeForward
    block = n * inner * x.itemsize
    with lock:
        for k in range(outer if inner > 1 else 1):
            if compute(handle, ctypes.c_void_p(x.ctypes.data + k * block),
                       ctypes.c_void_p(out.ctypes.data + k * block)) != 0:
                return None
    scale = {"backward": 1.0 / n if inverse else 1.0, "forward": 1.0 if inverse else 1.0 / n,
             "ortho": 1.0 / math.sqrt(n)}[norm]
    if scale != 1.0:
        out *= np.float32(scale)
    return out


def run_fft(arrays, attrs) -> list:
    """The CPU backend's extern `fft` (templates()["fft"])."""
    (x,) = arrays
    out = fft(x, attrs["axis"], attrs["inverse"], attrs["norm"]) if isinstance(x, np.ndarray) else None
    if out is None:
        from kiln.ir.emitter import EAGER

        return EAGER.apply("fft", arrays, attrs)
    return [out]
