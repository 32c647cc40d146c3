"""Float max/min reductions of the CPU backend (kiln/codegen/cpu/minmax_keys.py for row
reductions, column_reduce.py down a strided axis) against an IEEE 754-2019
maximum/minimum oracle built from numpy, the Kernel IR evaluator, and torch: row
lengths with vector tails, float32/float64/float16/bfloat16 and integers, NaN at every
position, infinities, signed zeros, masked (select) rows, empty rows; and that the
masked float row max (attention's softmax) compiles to a vector reduction."""

import numpy as np
import pytest

from kiln.codegen.kernel_eval import run_kernel
from kiln.codegen.kernel_ir import (
    IN, OUT, BufferParam, Const, IndexValue, Kernel, Load, Loop, Op, Reduce, ReduceRef, Store,
    loop_var,
)
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

from tests.codegen.cpu_helpers import BACKEND, random_array, single_threaded

M, K = symbol("M"), symbol("K")
o0, r0 = loop_var("o0"), loop_var("r0")
FLOATS = [dt.float32, dt.float64, dt.float16, dt.bfloat16]
LENGTHS = [1, 3, 8, 9, 17, 64, 100, 1029]


def row_kernel(d, op, masked=False):
    """out[o0] = op over r0 of x[o0, r0]; masked: elements with r0 > o0 % K are -inf/+inf
    (a causal mask written as a select, as attention's softmax has it)."""
    x = Load("x", K * o0 + r0, d)
    if masked:
        keep = Op("le", (IndexValue(r0, dt.int64), IndexValue(o0 % K, dt.int64)), dt.bool_)
        fill = float("-inf") if op == "max" else float("inf")
        x = Op("select", (keep, x, Const(fill, d)), d)
    return Kernel(f"row_{op}", (BufferParam("x", d, (M, K), IN), BufferParam("o", d, (M,), OUT)),
                  ("M", "K"), (Loop("o0", M),),
                  (Reduce("m", op, (Loop("r0", K),), x, d), Store("o", o0, ReduceRef("m", d))))


def col_kernel(d, op, rows):
    """out[o0] = op over r0 of x[r0, o0] (the column path)."""
    x = Load("x", M * r0 + o0, d)
    return Kernel(f"col_{op}", (BufferParam("x", d, (rows, M), IN), BufferParam("o", d, (M,), OUT)),
                  ("M",), (Loop("o0", M),),
                  (Reduce("m", op, (Loop("r0", rows),), x, d), Store("o", o0, ReduceRef("m", d))))


def ieee(x, op, axis):
    """IEEE 754-2019 maximum/minimum over `axis`: NaN if any NaN, and -0.0 < +0.0."""
    w = x.astype(np.float64)
    red = np.max if op == "max" else np.min
    out = red(w, axis=axis) if w.shape[axis] else np.full(
        np.delete(w.shape, axis), -np.inf if op == "max" else np.inf)
    zero = out == 0
    neg_zero = (w == 0) & np.signbit(w)
    pos_zero = (w == 0) & ~np.signbit(w)
    if op == "max":
        out = np.where(zero, np.where(pos_zero.any(axis=axis), 0.0, -0.0), out)
    else:
        out = np.where(zero, np.where(neg_zero.any(axis=axis), -0.0, 0.0), out)
    return np.where(np.isnan(w).any(axis=axis), np.nan, out)


def assert_bits(got, want):
    """Equal bit for bit, except that any NaN matches any NaN."""
    got = got.astype(np.float64)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


def run(kernel, x, sizes, backend=BACKEND):
    out = np.zeros(sizes["M"], x.dtype)
    backend.compile(kernel)([x, out], sizes)
    return out


def special_rows(d, k, rng):
    """Rows of length k: random, NaN at each of several positions, +-inf, all -0.0,
    all +0.0, both zeros in either order among negatives, all NaN."""
    rows = [random_array(d, (k,), rng) for _ in range(3)]
    for pos in sorted({0, k // 2, k - 1, max(0, k - 9)}):
        r = random_array(d, (k,), rng)
        r[pos] = np.nan
        rows.append(r)
    r = random_array(d, (k,), rng)
    r[k // 3] = np.inf
    r[k - 1] = -np.inf
    rows.append(r)
    for first, second in ((-0.0, 0.0), (0.0, -0.0)):
        r = -np.abs(random_array(d, (k,), rng)) - 1
        r[0] = first
        r[k - 1] = second
        rows.append(r)
        r = np.abs(random_array(d, (k,), rng)) + 1
        r[0], r[k - 1] = first, second
        rows.append(r)
    rows += [np.full(k, -0.0), np.full(k, 0.0), np.full(k, np.nan)]
    return np.stack([np.asarray(r, dtype=np.float64) for r in rows]).astype(d.np_dtype)


@pytest.mark.parametrize("d", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("op", ["max", "min"])
def test_row_reduction_bits(d, op):
    rng = np.random.default_rng(1)
    for k in LENGTHS:
        x = special_rows(d, k, rng)
        got = run(row_kernel(d, op), x, {"M": x.shape[0], "K": k})
        assert_bits(got, ieee(x, op, 1).astype(d.np_dtype).astype(np.float64))


@pytest.mark.parametrize("d", [dt.float32, dt.float16])
@pytest.mark.parametrize("op", ["max", "min"])
def test_masked_rows_match_the_evaluator(d, op):
    """The select-masked row reduction against kernel_eval and the oracle, NaN included
    (a NaN inside the mask propagates; one masked out does not)."""
    rng = np.random.default_rng(2)
    k = 37
    x = random_array(d, (3 * k, k), rng)
    x[5, 3] = np.nan     # row 5 keeps r0 <= 5: propagates
    x[6, 30] = np.nan    # row 6 keeps r0 <= 6: masked out
    sizes = {"M": 3 * k, "K": k}
    kernel = row_kernel(d, op, masked=True)
    got = run(kernel, x, sizes)
    ref = [x.copy(), np.zeros(3 * k, x.dtype)]
    run_kernel(kernel, ref, sizes)
    keep = np.arange(k)[None, :] <= (np.arange(3 * k) % k)[:, None]
    masked = np.where(keep, x.astype(np.float64), -np.inf if op == "max" else np.inf)
    assert_bits(got, ieee(masked, op, 1).astype(d.np_dtype).astype(np.float64))
    assert_bits(got, ref[1].astype(np.float64))
    assert np.isnan(got[5]) and not np.isnan(got[6])


def test_masked_float_row_max_is_vectorized():
    text = BACKEND.stage_text(row_kernel(dt.float32, "max", masked=True), "optimized")
    assert "llvm.vector.reduce.smax.v8i32" in text or "llvm.vector.reduce.smax.v16i32" in text


def test_empty_rows_give_the_identity():
    x = np.zeros((4, 0), np.float32)
    for op, want in (("max", -np.inf), ("min", np.inf)):
        got = run(row_kernel(dt.float32, op), x, {"M": 4, "K": 0})
        np.testing.assert_array_equal(got, np.full(4, want, np.float32))


def test_threads_and_single_thread_agree():
    rng = np.random.default_rng(3)
    x = special_rows(dt.float32, 300, rng)
    x = np.concatenate([x] * 40)
    sizes = {"M": x.shape[0], "K": 300}
    want = ieee(x, "max", 1)
    assert_bits(run(row_kernel(dt.float32, "max"), x, sizes), want)
    assert_bits(run(row_kernel(dt.float32, "max"), x, sizes, single_threaded()), want)


@pytest.mark.parametrize("d", [dt.int32, dt.int64, dt.uint8, dt.int8])
@pytest.mark.parametrize("op", ["max", "min"])
def test_integer_rows(d, op):
    rng = np.random.default_rng(4)
    info = np.iinfo(d.np_dtype)
    for k in (1, 9, 33, 130):
        x = rng.integers(info.min, int(info.max) + 1, size=(7, k), dtype=d.np_dtype)
        x[0, k - 1], x[1, 0] = info.max, info.min
        got = run(row_kernel(d, op), x, {"M": 7, "K": k})
        np.testing.assert_array_equal(got, x.max(1) if op == "max" else x.min(1))


@pytest.mark.parametrize("d", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("op", ["max", "min"])
def test_column_reduction_bits(d, op):
    rng = np.random.default_rng(5)
    for k in (1, 9, 40):
        x = np.ascontiguousarray(special_rows(d, k, rng).T)  # reduce down axis 0
        got = run(col_kernel(d, op, k), x, {"M": x.shape[1]})
        assert_bits(got, ieee(x, op, 0).astype(d.np_dtype).astype(np.float64))


def test_against_torch():
    """torch.amax/amin over rows with NaNs and infinities (no zero ties: there torch
    keeps whichever zero it meets first, kiln orders -0.0 < +0.0)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((50, 77)).astype(np.float32)
    x[3, 76] = np.nan
    x[4, 0] = np.inf
    x[5, 10] = -np.inf
    x[6, :] = np.nan
    for op in ("max", "min"):
        got = run(row_kernel(dt.float32, op), x, {"M": 50, "K": 77})
        t = torch.from_numpy(x)
        want = (t.amax(1) if op == "max" else t.amin(1)).numpy()
        assert_bits(got, want.astype(np.float64))
