"""The CPU's erf/erfc loops over libm (kiln/codegen/cpu/special_native.py): element for
element math.erf / math.erfc (which are libm's) on float32 and float64, specials included,
on one thread and cut over two; the ops' references take them for large arrays and give
the numpy path's values bit for bit (float32, float64, float16 rounded once); small
arrays and other dtypes keep the numpy path; `import kiln` does not load the module."""

import math
import subprocess
import sys

import numpy as np
import pytest

from kiln.codegen.cpu import special_native
from kiln.ir import registry
from kiln.ir.ops import erf_reference

SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1e-310, 5.0, -5.0, 27.0, -27.0]


def _values(dtype, n=special_native.MIN_ELEMS * 5 + 3):
    x = (np.random.default_rng(0).standard_normal(n) * 3).astype(dtype)
    x[:len(SPECIAL)] = np.array(SPECIAL, dtype=np.float64).astype(dtype)
    return x


@pytest.mark.parametrize("split", [False, True], ids=["one thread", "two threads"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_element_is_libm_s_value(request, dtype, split):
    if split:
        request.getfixturevalue("split_always")
    x = _values(dtype)
    for name, scalar in (("erf", math.erf), ("erfc", math.erfc)):
        got = special_native.compute(x, name)
        want = np.array([scalar(v) for v in x.astype(np.float64).tolist()])
        assert got.dtype == np.float64 and got.shape == x.shape
        np.testing.assert_array_equal(got, want)


def test_the_references_take_it_and_keep_their_values(monkeypatch):
    native = erf_reference.NATIVE
    assert native is not None  # installed by kiln.frontend
    for op in ("erf", "erfc"):
        reference = registry.get(op).reference
        for dtype in (np.float32, np.float64, np.float16):
            x = _values(dtype, 3 * special_native.MIN_ELEMS + 3).reshape(-1, 3)
            calls = []
            monkeypatch.setattr(erf_reference, "NATIVE", lambda a, n: calls.append(n) or native(a, n))
            got = reference(x)
            monkeypatch.setattr(erf_reference, "NATIVE", None)  # the numpy path
            want = reference(x)
            assert calls == [op] and got.dtype == want.dtype == x.dtype
            np.testing.assert_array_equal(got, want)


def test_small_arrays_and_other_dtypes_keep_the_numpy_path():
    assert special_native.compute(np.ones(special_native.MIN_ELEMS - 1, np.float32), "erf") is None
    assert special_native.compute(np.ones(special_native.MIN_ELEMS, np.int32), "erf") is None
    assert special_native.compute(np.ones(special_native.MIN_ELEMS, np.float32), "lgamma") is None
    assert special_native.compute(3.0, "erf") is None


def test_import_kiln_loads_nothing_native():
    code = "import sys, kiln; print('kiln.codegen.cpu.special_native' in sys.modules, 'llvmlite' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr
