"""ULP accuracy of the CPU backend's transcendentals against float64 numpy / math."""

import math

import numpy as np
import pytest

from kiln.codegen.kernel_ir import IN, OUT, BufferParam, Kernel, Load, Loop, Op, Store, loop_var
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

from tests.codegen.cpu_helpers import BACKEND

N = symbol("N")
i = loop_var("i")

_ERF = np.vectorize(math.erf, otypes=[np.float64])
UNARY = {"exp": np.exp, "expm1": np.expm1, "log": np.log, "log1p": np.log1p, "sin": np.sin, "cos": np.cos,
         "tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh,
         "cosh": np.cosh, "tanh": np.tanh, "erf": _ERF, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x)}
BINARY = {"atan2": np.arctan2, "pow": np.power}
EDGES = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-38, 2.0 ** -126, 88.72, 89.0, -87.3, -104.0,
         1.0, -1.0, 0.5, 3.0e38, -3.0e38, 1.4142135, 0.70710677, 7.0e15, 1.0e30, 710.0, -745.0]


def _kernel(name, dtype, nargs):
    params = tuple(BufferParam(f"x{j}", dtype, (N,), IN) for j in range(nargs))
    args = tuple(Load(f"x{j}", i, dtype) for j in range(nargs))
    return Kernel(f"m_{name}", params + (BufferParam("y", dtype, (N,), OUT),), ("N",), (Loop("i", N),),
                  (Store("y", i, Op(name, args, dtype)),))


def ulp_error(got, ref, np_dtype):
    """|got - ref| in units of the last place of ref rounded to the output type; NaN
    vs NaN and equal infinities count as exact."""
    with np.errstate(all="ignore"):
        rounded = ref.astype(np_dtype)
        tiny = np.finfo(np_dtype).smallest_subnormal
        spacing = np.maximum(np.spacing(np.abs(rounded)).astype(np.float64), float(tiny))
        err = np.abs(got.astype(np.float64) - ref) / spacing
        if np_dtype == np.float64:  # ref is float64 itself: compare in float64 ulps
            err = np.abs(got - ref) / spacing
    exact = (np.isnan(got) & np.isnan(ref)) | (got == rounded)
    err = np.where(exact, 0.0, err)
    return np.where(np.isnan(err), np.inf, err)


def _inputs(dtype, count, seed):
    rng = np.random.default_rng(seed)
    npd = dtype.np_dtype
    if dtype == dt.float32:
        bits = rng.integers(0, 2 ** 32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    else:
        bits = rng.integers(0, 2 ** 63, count, dtype=np.int64).view(np.float64)
        bits = np.where(rng.random(count) < 0.5, -bits, bits)
    dense = np.linspace(-12, 12, count // 2).astype(npd)
    return np.concatenate([bits.astype(npd), dense, np.array(EDGES, np.float64).astype(npd)])


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("d", [dt.float32, dt.float64], ids=lambda d: d.short)
def test_unary_ulp(name, d):
    x = _inputs(d, 60000 if d == dt.float32 else 20000, seed=hash(name) % 1000)
    y = np.zeros_like(x)
    BACKEND.compile(_kernel(name, d, 1))([x, y], {"N": x.size})
    with np.errstate(all="ignore"):
        ref = UNARY[name](x.astype(np.float64))
    err = ulp_error(y, ref, d.np_dtype)
    worst = int(np.argmax(err))
    assert err.max() <= 4.0, f"{name}: {err.max():.2f} ulp at x={x[worst]!r}: got {y[worst]!r}, want {ref[worst]!r}"


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("d", [dt.float32, dt.float64], ids=lambda d: d.short)
def test_binary_ulp(name, d):
    rng = np.random.default_rng(7)
    npd = d.np_dtype
    if name == "pow":
        a = (np.abs(rng.standard_normal(40000)) * 3).astype(npd)
        b = (rng.standard_normal(40000) * 12).astype(npd)
        b[::7] = np.round(b[::7])
        a[1::5] = -a[1::5]
    else:
        a, b = _inputs(d, 20000, 1)[:20000], _inputs(d, 20000, 2)[:20000]
    grid = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0], npd)
    ga, gb = np.meshgrid(grid, grid)
    a, b = np.concatenate([a, ga.ravel()]), np.concatenate([b, gb.ravel()])
    y = np.zeros_like(a)
    BACKEND.compile(_kernel(name, d, 2))([a, b, y], {"N": a.size})
    with np.errstate(all="ignore"):
        ref = BINARY[name](a.astype(np.float64), b.astype(np.float64))
    err = ulp_error(y, ref, npd)
    worst = int(np.argmax(err))
    assert err.max() <= 4.0, f"{name}({a[worst]!r}, {b[worst]!r}) = {y[worst]!r}, want {ref[worst]!r}"


def test_float32_transcendentals_vectorize():
    text = BACKEND.stage_text(_kernel("erf", dt.float32, 1), "optimized")
    assert "x double>" in text or "x float>" in text
    assert "call float @erf" not in text and "@erff" not in text
