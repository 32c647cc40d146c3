"""The vectorized erf/erfc references (issue 22 item 5) against math.erf/math.erfc: float32,
float16 and bfloat16 results identical to math's rounded to the dtype, float64 identical."""

import math

import ml_dtypes
import numpy as np
import pytest

import kiln as kn
from kiln.ir import registry
from kiln.ir.ops import erf_reference as er

_MATH = {"erf": math.erf, "erfc": math.erfc}


def _oracle(name, x, dtype):
    """math.erf (erfc) of every element, in float64, rounded once to `dtype`."""
    scalar = np.frompyfunc(_MATH[name], 1, 1)
    with np.errstate(invalid="ignore"):  # NaN inputs: NaN out, as expected
        return np.asarray(scalar(x.astype(np.float64)), dtype=np.float64).astype(dtype)


def _reference(name):
    return registry.get(name).reference


def _same_bits(got, want):
    """Equal including NaN positions and the sign of zero."""
    assert got.dtype == want.dtype
    g, w = got.view(np.uint16 if got.itemsize == 2 else np.uint32), \
        want.view(np.uint16 if want.itemsize == 2 else np.uint32)
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    bad = np.flatnonzero((g != w) & ~nan)
    assert bad.size == 0, f"{bad.size} differ, e.g. x-index {bad[:5]}: {got[bad[:5]]} vs {want[bad[:5]]}"


def _float32_sweep() -> np.ndarray:
    """Every 1031st float32 up to 11.0 (erfc underflows float32 there), both signs, plus
    specials: ~1.1 million values, denormals and the region where erf rounds to 1."""
    bits = np.arange(0, 0x41300000, 1031, dtype=np.uint32)
    x = bits.view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754944e-38,
                        np.finfo(np.float32).max, -np.finfo(np.float32).max, 2.0, -2.0,
                        np.nextafter(np.float32(2), np.float32(0)), 3.9, 3.92, 10.05, 26.5, 27.5,
                        0.5, 1e-30, 6e-8], np.float32)
    return np.concatenate([x, -x, special])


@pytest.mark.parametrize("name", ["erf", "erfc"])
def test_float32_identical_to_math_rounded(name):
    x = _float32_sweep()
    _same_bits(_reference(name)(x), _oracle(name, x, np.float32))


@pytest.mark.parametrize("name", ["erf", "erfc"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_every_value(name, dtype):
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)  # every bit pattern
    _same_bits(_reference(name)(x), _oracle(name, x, dtype))


@pytest.mark.parametrize("name", ["erf", "erfc"])
def test_float64_is_math(name):
    x = np.concatenate([np.random.default_rng(0).standard_normal(5000) * 4,
                        [0.0, -0.0, np.inf, -np.inf, 27.0, -6.0, 1e-310]])
    got = _reference(name)(x)
    want = np.array([_MATH[name](v) for v in x])
    np.testing.assert_array_equal(got, want)
    assert np.isnan(_reference(name)(np.array([np.nan])))[0]
    assert math.copysign(1, _reference("erf")(np.array([-0.0]))[0]) == -1


def test_vectorized_error_is_within_the_bound_the_exactness_check_assumes():
    x = np.concatenate([np.linspace(-8, 8, 400_001), np.linspace(-0.01, 0.01, 10_001)])
    erf, erfc = er._erf_pair(x)
    want_erf = np.array([math.erf(v) for v in x])
    want_erfc = np.array([math.erfc(v) for v in x])
    nz = want_erf != 0
    assert np.max(np.abs(erf[nz] - want_erf[nz]) / np.abs(want_erf[nz])) < er._ERF_REL_ERROR / 4
    ok = want_erfc > 1e-300
    assert np.max(np.abs(erfc[ok] - want_erfc[ok]) / want_erfc[ok]) < er._ERF_REL_ERROR / 4


def test_only_a_few_elements_take_the_scalar_path():
    x = np.random.default_rng(1).standard_normal(100_000).astype(np.float64) * 3
    calls = []

    def scalar(v):
        calls.append(v)
        return math.erf(v)

    er._round_as_scalar(er._erf_pair(x)[0], x, scalar)
    assert len(calls) < 100  # ~1/10000 expected; frompyfunc was 100_000


def test_eager_erf_and_exact_gelu_use_it():
    x = _float32_sweep()[::50]
    x = x[np.isfinite(x)]
    _same_bits(kn.erf(kn.tensor(x)).numpy(), _oracle("erf", x, np.float32))
    y = np.linspace(-5, 5, 1001, dtype=np.float32)
    want = 0.5 * y.astype(np.float64) * (1 + np.array([math.erf(v / math.sqrt(2)) for v in y.astype(np.float64)]))
    np.testing.assert_allclose(kn.gelu(kn.tensor(y)).numpy(), want, rtol=2e-6, atol=1e-7)


def test_results_near_a_rounding_midpoint_are_recomputed():
    """The safety net the sweep rarely meets: values within the approximation's error of
    a float32, float16 or bfloat16 midpoint go to the scalar function, others do not."""
    one_m = 1 - 2.0 ** -25            # float32 midpoint between 1 - 2^-24 and 1
    f16_mid = 1 + 2.0 ** -11           # float16 midpoint between 1 and 1 + 2^-10
    bf16_mid = 1 + 2.0 ** -8           # bfloat16 midpoint between 1 and 1 + 2^-7
    sub_mid = 2.0 ** -25 * 3           # float16 subnormal midpoint (3 * 2^-25)
    doubtful = [one_m * (1 + 1e-14), f16_mid * (1 - 1e-14), bf16_mid * (1 + 3e-14), sub_mid * (1 + 1e-14)]
    clear = [1 - 1e-16, 1.0, 0.0, 0.75, 1 + 2.0 ** -10, one_m * (1 + 1e-9)]
    y = np.array(doubtful + clear)
    x = np.arange(y.size, dtype=np.float64)
    out = er._round_as_scalar(y.copy(), x, lambda v: -v - 1)  # marks which were recomputed
    recomputed = out == -x - 1
    assert recomputed.tolist() == [True] * len(doubtful) + [False] * len(clear)
