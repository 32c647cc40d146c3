"""ULP accuracy of the CPU backend's transcendentals against float64 numpy / math.

float32 references are float64 results (numpy / math, < 1 ulp of float64), so "error in
float32 ulps" is measured against the correctly rounded value up to ~2^-29 ulp."""

import math
import re

import numpy as np
import pytest

from kiln.codegen.cpu import CpuBackend
from kiln.codegen.cpu.mathlib import float32_math
from kiln.codegen.cpu.mathlib_f32 import NATIVE_F32
from kiln.codegen.kernel_ir import IN, OUT, BufferParam, Kernel, Load, Loop, Op, Store, loop_var
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

from tests.codegen.cpu_helpers import BACKEND

N = symbol("N")
i = loop_var("i")

_ERF = np.vectorize(math.erf, otypes=[np.float64])
try:  # scipy's erf is < 1 ulp of float64 and vectorized; math.erf is the fallback
    from scipy.special import erf as _ERF_FAST
except ImportError:
    _ERF_FAST = _ERF
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


def _run_f32(name, x, backend=BACKEND):
    y = np.empty_like(x)
    backend.compile(_kernel(name, dt.float32, 1))([x, y], {"N": x.size})
    return y


def _sweep_inputs():
    """Every 1031st float32 bit pattern (both signs, all exponents) plus dense ranges
    around the places where the native functions switch method or saturate."""
    bits = np.arange(0, 2 ** 32, 1031, dtype=np.uint64).astype(np.uint32).view(np.float32)
    dense = [np.linspace(lo, hi, 20001, dtype=np.float32) for lo, hi in
             [(-1.2, 1.2), (0.55, 0.7), (0.85, 1.0), (3.8, 4.1), (8.9, 9.3), (86.0, 89.5), (-105.0, -85.0),
              (-0.36, 0.36), (-1.0, -0.99), (0.7, 1.45), (1e-30, 1e-28)]]
    tiny = np.logspace(-45, 0, 20001).astype(np.float32)
    return np.concatenate([bits] + dense + [tiny, -tiny])


@pytest.mark.parametrize("name", NATIVE_F32)
def test_native_f32_sweep(name):
    """The float32-native functions stay within 4 ulp (measured worst cases: ~1.5)."""
    x = _sweep_inputs()
    y = _run_f32(name, x)
    with np.errstate(all="ignore"):
        ref = _ERF_FAST(x.astype(np.float64)) if name == "erf" else UNARY[name](x.astype(np.float64))
    err = ulp_error(y, ref, np.float32)
    worst = int(np.argmax(err))
    assert err.max() <= 4.0, f"{name}: {err.max():.2f} ulp at x={x[worst]!r}: got {y[worst]!r}, want {ref[worst]!r}"
    assert np.mean(err > 1.0) < 0.01, f"{name}: {np.mean(err > 1.0):.2%} of results are off by more than 1 ulp"


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, 1e-45, -1e-45, 2.0 ** -126,
                     -2.0 ** -126, 3.4028235e38, -3.4028235e38, 88.72283, 88.72284, 89.0, -87.33655, -103.97,
                     -103.98, -104.0, -200.0, 1e-8, -1e-8, 9.1, -9.1, 3.92, 4.0, -4.0, 5.0, 7.0e15, -17.4,
                     -0.99999994, -1.0000001], np.float32)


@pytest.mark.parametrize("name", NATIVE_F32)
def test_native_f32_specials_match_numpy(name):
    """Special results (NaN, ±inf, ±0, saturation at ±1 / -1) exactly as numpy's float32
    functions (math.erf for erf), the sign of zero included."""
    y = _run_f32(name, SPECIALS)
    with np.errstate(all="ignore"):
        want = (np.array([math.erf(float(v)) for v in SPECIALS], np.float32) if name == "erf"
                else UNARY[name](SPECIALS))
    special = ~np.isfinite(want) | (want == 0) | (np.abs(want) == 1)
    for x, got, ref in zip(SPECIALS[special], y[special], want[special]):
        same = (np.isnan(got) and np.isnan(ref)) or (got == ref and np.signbit(got) == np.signbit(ref))
        assert same, f"{name}({x!r}) = {got!r}, numpy gives {ref!r}"
    with np.errstate(all="ignore"):
        ref = UNARY[name](SPECIALS.astype(np.float64))
    assert ulp_error(y, ref, np.float32).max() <= 4.0


@pytest.mark.parametrize("name", NATIVE_F32)
def test_float64_internal_versions_stay_available(name):
    """float32_math("double") emits the float64-internal bodies (correctly rounded on
    these inputs), under distinct helper names."""
    x = _inputs(dt.float32, 20000, seed=5)
    with float32_math("double"):
        backend = CpuBackend()
        assert f"kiln.{name}.f32d" in backend.stage_text(_kernel(name, dt.float32, 1), "llvm")
        y = _run_f32(name, x, backend)
    with np.errstate(all="ignore"):
        ref = UNARY[name](x.astype(np.float64))
    assert ulp_error(y, ref, np.float32).max() <= 1.0
    assert f"kiln.{name}.f32n" in BACKEND.stage_text(_kernel(name, dt.float32, 1), "llvm")


def _host_has_avx2_fma() -> bool:
    import llvmlite.binding as llvm
    feats = llvm.get_host_cpu_features()
    return feats.get("avx2", False) and feats.get("fma", False)


@pytest.mark.skipif(not _host_has_avx2_fma(), reason="checks x86 AVX2/FMA code generation")
@pytest.mark.parametrize("name", ["exp", "erf", "tanh", "log1p"])
def test_float32_transcendentals_vectorize_full_width(name):
    """Native float32 math vectorizes as float32 lanes (8 or more) with no calls left."""
    k = _kernel(name, dt.float32, 1)
    text = BACKEND.stage_text(k, "optimized")
    widths = {int(w) for w in re.findall(r"<(\d+) x float>", text)}
    assert widths and max(widths) >= 8, widths
    assert "x double>" not in text
    asm = BACKEND.stage_text(k, "asm")
    # the kernel's body, not its exported entries (optnone: they call the body)
    body = asm[asm.index(".body:"):]
    body = body[:body.index(".Lfunc_end")]
    assert not re.search(r"\bcall", body), "the vectorized loop must not call anything"
    assert re.search(r"vfn?m?(add|sub)\d+ps\s.*[yz]mm", asm), "expected packed float32 FMAs"
