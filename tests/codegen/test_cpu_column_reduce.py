"""Column reductions (reduce down a strided axis, vectorized across outputs) against the
numpy Kernel IR evaluator and numpy: chunk edges, dtypes, ops, chained reductions,
3-D middle-axis reductions, several threads; and which kernels take the path."""

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu.column_reduce import COLUMN_CHUNK, column_friendly
from kiln.codegen.kernel_ir import (
    IN, OUT, BufferParam, Kernel, Load, Loop, Reduce, ReduceRef, Store, loop_var,
)
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

from tests.codegen.cpu_helpers import check, single_threaded
from tests.codegen.ir_builders import op

N = symbol("N")
o0, o1, r0 = loop_var("o0"), loop_var("o1"), loop_var("r0")


def column_kernel(d, ops, rows=37):
    """out_op[o0] = reduce_op over r0 of x[r0, o0] (x: [rows, N]), several ops fused."""
    stages, outs = [], []
    for name in ops:
        stages.append(Reduce(name, name, (Loop("r0", rows),), Load("x", N * r0 + o0, d), d))
        stages.append(Store(f"o_{name}", o0, ReduceRef(name, d)))
        outs.append(BufferParam(f"o_{name}", d, (N,), OUT))
    return Kernel("cols", (BufferParam("x", d, (rows, N), IN), *outs), ("N",), (Loop("o0", N),),
                  tuple(stages))


@pytest.mark.parametrize("n", [1, 7, COLUMN_CHUNK - 1, COLUMN_CHUNK, COLUMN_CHUNK + 1, 333])
def test_chunk_edges(n):
    k = column_kernel(dt.float32, ("sum", "max"))
    assert column_friendly(k)
    check(k, {"N": n}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,ops", [
    (dt.float32, ("sum", "max", "min", "prod")), (dt.float64, ("sum", "max", "min", "prod")),
    (dt.int32, ("sum", "max", "min", "and", "or")), (dt.uint8, ("max", "min")),
    (dt.bool_, ("and", "or")),
])
def test_dtypes_and_ops(d, ops):
    check(column_kernel(d, ops, rows=11), {"N": 150}, rtol=1e-5, low=0.5, high=1.5)


def test_chained_reductions_and_threads():
    """mean then variance down the columns (the second reduction reads the first), with
    an epilogue store; compiled for one thread and for the default pool."""
    rows, f32 = 300, dt.float32
    x = Load("x", N * r0 + o0, f32)
    mean = op("div", ReduceRef("s", f32), Load("n", 0, f32))
    dev = op("sub", x, mean)
    k = Kernel("meanvar", (BufferParam("x", f32, (rows, N), IN), BufferParam("n", f32, (1,), IN),
                           BufferParam("v", f32, (N,), OUT)), ("N",), (Loop("o0", N),),
               (Reduce("s", "sum", (Loop("r0", rows),), x, f32),
                Reduce("q", "sum", (Loop("r0", rows),), op("mul", dev, dev), f32),
                Store("v", o0, op("div", ReduceRef("q", f32), Load("n", 0, f32)))))
    assert column_friendly(k)
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((rows, 2000)).astype(np.float32) + 5
    arrays = [xs, np.array([rows], np.float32), np.zeros(2000, np.float32)]
    for backend in (single_threaded(), None):
        out = check(k, {"N": 2000}, arrays=[a.copy() for a in arrays], backend=backend, rtol=1e-4,
                    atol=1e-5)
        np.testing.assert_allclose(out[2], xs.astype(np.float64).var(0), rtol=1e-4)


def test_middle_axis_of_3d():
    """x[a, r, c] summed over r: outer (a, c), the last outer dim unit stride."""
    A, R, C = 3, 9, 130
    x = Load("x", R * C * o0 + C * r0 + o1, dt.float64)
    k = Kernel("mid", (BufferParam("x", dt.float64, (A, R, C), IN), BufferParam("y", dt.float64, (A, C), OUT)),
               (), (Loop("o0", A), Loop("o1", C)),
               (Reduce("s", "sum", (Loop("r0", R),), x, dt.float64), Store("y", C * o0 + o1, ReduceRef("s", dt.float64))))
    assert column_friendly(k)
    out = check(k, {}, rtol=1e-12, atol=1e-12)
    assert out[1].shape == (A, C)


def test_row_reductions_keep_the_row_path():
    x = Load("x", 23 * o0 + r0, dt.float32)
    k = Kernel("rows", (BufferParam("x", dt.float32, (N, 23), IN), BufferParam("y", dt.float32, (N,), OUT)),
               ("N",), (Loop("o0", N),), (Reduce("s", "sum", (Loop("r0", 23),), x, dt.float32),
                                          Store("y", o0, ReduceRef("s", dt.float32))))
    assert not column_friendly(k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_bias_gradients(dtype):
    """What a training step runs: column sums of several [M, N] gradients, fused."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((257, 131)).astype(dtype) for _ in range(3)]
    f = kn.compile(lambda a, b, c: (a.sum(0), kn.amax(b, 0), (c * c).sum(0)))
    got = f(*(kn.tensor(x) for x in xs))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got[0].numpy(), xs[0].sum(0), rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[1].numpy(), xs[1].max(0))
    np.testing.assert_allclose(got[2].numpy(), (xs[2] ** 2).sum(0), rtol=tol, atol=tol)
