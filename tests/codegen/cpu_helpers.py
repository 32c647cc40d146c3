"""Shared helpers for the CPU backend tests: random inputs per dtype and a check that
runs a kernel compiled by the CPU backend against kernel_eval.run_kernel."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.cpu import CpuBackend, CpuOptions
from kiln.codegen.cpu.jit import ensure_blas_loaded
from kiln.codegen.kernel_eval import run_kernel
from kiln.ir.shapes import evaluate

BACKEND = CpuBackend()


def random_array(dtype, shape, rng, low=-3.0, high=3.0):
    npd = dtype.np_dtype
    if dtype.is_bool:
        return rng.random(shape) < 0.5
    if dtype.is_integer:
        info = np.iinfo(npd)
        lo, hi = max(info.min, -100), min(info.max, 100)
        return rng.integers(lo, hi + 1, size=shape).astype(npd)
    return rng.uniform(low, high, size=shape).astype(npd)


def make_arrays(kernel, sizes, rng, **ranges):
    arrays = []
    for b in kernel.buffers:
        shape = tuple(evaluate(d, sizes) for d in b.shape)
        if b.role == "in":
            arrays.append(random_array(b.dtype, shape, rng, **ranges))
        else:
            arrays.append(np.zeros(shape, b.dtype.np_dtype))
    return arrays


def check(kernel, sizes, *, seed=0, arrays=None, rtol=1e-6, atol=1e-6, backend=None, **ranges):
    """Compile `kernel`, run it and the numpy evaluator on the same inputs, compare."""
    rng = np.random.default_rng(seed)
    arrays = arrays if arrays is not None else make_arrays(kernel, sizes, rng, **ranges)
    ours = [a.copy() for a in arrays]
    ref = [a.copy() for a in arrays]
    compiled = (backend or BACKEND).compile(kernel)
    compiled(ours, sizes)
    with np.errstate(all="ignore"):
        run_kernel(kernel, ref, sizes)
    for b, got, want in zip(kernel.buffers, ours, ref):
        if b.role != "out":
            continue
        if b.dtype.is_floating:
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                                       atol=atol, equal_nan=True, err_msg=f"buffer {b.name}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"buffer {b.name}")
    return ours


def single_threaded():
    return CpuBackend(CpuOptions(threads=1))


skip_if_no_blas = pytest.mark.skipif(not ensure_blas_loaded(), reason="numpy's bundled OpenBLAS not found")
