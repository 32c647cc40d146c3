"""Offline fitting of the float32 minimax polynomials embedded in mathlib_f32.py.

    .venv/bin/python scripts/fit_float32_math.py

prints, for each polynomial, its float32 coefficients as exact hex literals and the
weighted max error of the float32-rounded polynomial (evaluated in float64, so this is
the approximation error alone; rounding in the float32 evaluation comes on top and is
measured by tests/codegen/test_cpu_mathlib.py). Not imported by the compiler.

Method: Lawson's iteratively reweighted least squares converges to the weighted
minimax fit; then the coefficients are rounded to float32 one at a time, lowest degree
first, refitting the remaining ones after each rounding so later coefficients absorb
the rounding error of earlier ones (plain rounding of all of them costs ~2x in error).
Reference values come from mpmath at 100 bits, so cancellation in targets such as
(e^r - 1 - r) / r^2 does not pollute the fit.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np

mpmath.mp.prec = 100


def _lawson(basis: np.ndarray, target: np.ndarray, weight: np.ndarray, iters: int = 400) -> np.ndarray:
    """Coefficients c minimizing max |weight * (target - basis @ c)|."""
    a, b = basis * weight[:, None], target * weight
    u = np.full(len(b), 1.0 / len(b))
    for _ in range(iters):
        s = np.sqrt(u)
        c = np.linalg.lstsq(a * s[:, None], b * s, rcond=None)[0]
        err = np.abs(b - a @ c)
        u = u * err
        u /= u.sum()
    return c


def fit_f32(x: np.ndarray, target: np.ndarray, weight: np.ndarray, powers: list[int]) -> tuple[list[float], float]:
    """Float32 coefficients of sum c_j x^powers[j] ~ target, and the weighted max error."""
    basis = np.stack([x ** p for p in powers], axis=1)
    fixed: list[float] = []
    rest = target.copy()
    for j in range(len(powers)):
        c = _lawson(basis[:, j:], rest, weight)
        cj = float(np.float32(c[0]))
        fixed.append(cj)
        rest = rest - cj * basis[:, j]
    err = float(np.max(np.abs(weight * rest)))
    return fixed, err


def _nodes(lo: float, hi: float, n: int = 3000) -> np.ndarray:
    """Chebyshev-like nodes (dense at the ends, where minimax error peaks)."""
    t = np.cos(np.linspace(0.0, math.pi, n))[::-1]
    return lo + (hi - lo) * (t + 1) / 2


def _mp(f, xs) -> np.ndarray:
    return np.array([float(f(mpmath.mpf(float(v)))) for v in xs])


def fit_exp():
    """e^r = 1 + r + r^2 P(r) on |r| <= ln2/2 (+ margin for the rounded reduction);
    weighted for relative error of expm1(r), the stricter of exp and expm1."""
    r = _nodes(-0.3467, 0.3467)
    r = r[np.abs(r) > 1e-9]
    target = _mp(lambda v: (mpmath.expm1(v) - v) / v ** 2, r)
    weight = r ** 2 / np.abs(_mp(mpmath.expm1, r))
    return fit_f32(r, target, weight, [0, 1, 2, 3, 4])


def fit_log():
    """log(1+f) = f - f^2/2 + f^3 Q(f), f in [sqrt(1/2)-1, sqrt(2)-1] (+ margin for
    log1p's rounding correction); relative error."""
    f = _nodes(math.sqrt(0.5) - 1 - 1e-5, math.sqrt(2) - 1 + 1e-5)
    f = f[np.abs(f) > 1e-6]
    target = _mp(lambda v: (mpmath.log1p(v) - v + v * v / 2) / v ** 3, f)
    weight = np.abs(f ** 3 / _mp(mpmath.log1p, f))
    return fit_f32(f, target, weight, list(range(8)))


def fit_erf_small(t: float):
    """erf(a) = a + a C(a^2) for |a| < t: C(z) = erf(sqrt z)/sqrt z - 1 (its constant
    term 2/sqrt(pi) - 1 is fitted too); error relative to erf(a)/a."""
    a = _nodes(1e-4, t)
    target = _mp(lambda v: mpmath.erf(v) / v - 1, a)
    weight = a / _mp(mpmath.erf, a)
    return fit_f32(a * a, target, weight, list(range(6)))


def fit_erfc_big(t: float, hi: float = 3.9193):
    """erfc(a) = exp(-a^2) Q(a) for t <= a <= hi (erf rounds to 1 above); the error that matters is
    absolute (erf = 1 - erfc is >= 0.79 there), so the weight is exp(-a^2)."""
    a = _nodes(t, hi)
    target = _mp(lambda v: mpmath.erfc(v) * mpmath.exp(v * v), a)
    weight = np.exp(-a * a)
    return fit_f32(a, target, weight, list(range(9)))


def fit_tanh_small(t: float):
    """tanh(a) = a + a^3 P(a^2) for |a| < t; relative error."""
    a = _nodes(1e-4, t)
    target = _mp(lambda v: (mpmath.tanh(v) - v) / v ** 3, a)
    weight = a ** 3 / _mp(mpmath.tanh, a)
    return fit_f32(a * a, target, weight, list(range(5)))


def main():
    for name, (coeffs, err) in [("exp", fit_exp()), ("log", fit_log()), ("erf_small", fit_erf_small(0.921875)),
                                ("erfc_big", fit_erfc_big(0.921875)), ("tanh_small", fit_tanh_small(0.625))]:
        print(f"{name}: max weighted error {err:.3e} ({err / 2 ** -24:.4f} x 2^-24)")
        print("    (" + ", ".join(f'"{c.hex()}"' for c in coeffs) + ")")


if __name__ == "__main__":
    main()
