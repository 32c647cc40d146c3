"""Numerics of every OpenCL kernel kind against numpy, run on the OpenCL device (PoCL on
the CPU here): pointwise chains over dtypes, inner / outer / full reductions with their
local-memory trees, GEMM with epilogues (tails, batches, transposed operands, integer
and float64), symbolic sizes that one program serves, and a work-group shape from the
device's limits."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.backends import get_backend
from kiln.codegen.opencl.emit import Limits, group_shape
from tests.codegen.opencl.conftest import needs_device

pytestmark = needs_device
rng = np.random.default_rng(0)


def opencl(fn, **kw):
    return kn.compile(fn, backend="opencl", **kw)


def close(got, want, rtol=1e-5, atol=1e-6):
    got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
    assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("n", [1, 1025])
def test_pointwise_float32_chain_with_tails(n):
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    f = opencl(lambda a, b: kn.tanh(a) * b + kn.exp(-a * a) / (1 + kn.abs(b)))
    close(f(x, y), np.tanh(x) * y + np.exp(-x * x) / (1 + np.abs(y)), rtol=2e-6)


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint32])
def test_pointwise_integers_wrap_and_divide_as_numpy(dtype):
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, 777, dtype=dtype, endpoint=True)
    y = rng.integers(info.min, info.max, 777, dtype=dtype, endpoint=True)
    y[y == 0] = 3
    f = opencl(lambda a, b: (a + b) * a - b // b + a % b)
    with np.errstate(all="ignore"):
        want = (x + y) * x - y // y + x % y
    close(f(x, y), want)


def test_pointwise_float64_bool_and_select():
    x = rng.standard_normal((33, 17))
    f = opencl(lambda a: kn.where(a > 0, kn.sqrt(kn.abs(a)), kn.sin(a)) + kn.log1p(a * a))
    close(f(x), np.where(x > 0, np.sqrt(np.abs(x)), np.sin(x)) + np.log1p(x * x), rtol=1e-13)
    m = rng.standard_normal(100) > 0
    g = opencl(lambda a, b: a & ~b)
    close(g(m, m[::-1].copy()), m & ~m[::-1])


def test_nan_propagates_through_max_reductions_and_elementwise():
    x = rng.standard_normal((4, 50)).astype(np.float32)
    x[1, 7] = np.nan
    close(opencl(lambda a: kn.amax(a, -1))(x), x.max(-1))
    close(opencl(lambda a: kn.maximum(a, 0.0))(x), np.maximum(x, np.float32(0)))


@pytest.mark.parametrize("shape", [(1, 1), (7, 4097)])
def test_inner_reductions(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    close(opencl(lambda a: a.sum(-1))(x), x.sum(-1), rtol=1e-4, atol=1e-4)
    close(opencl(lambda a: kn.amin(a, -1))(x), x.min(-1))
    close(opencl(lambda a: kn.softmax(a, dim=-1))(x), _softmax(x), rtol=1e-5)


@pytest.mark.parametrize("shape", [(1000, 3), (37, 256)])
def test_outer_reductions(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    close(opencl(lambda a: a.sum(0))(x), x.sum(0), rtol=1e-4, atol=1e-4)
    xi = rng.integers(-100, 100, shape).astype(np.int32)
    close(opencl(lambda a: kn.amax(a, 0))(xi), xi.max(0))


@pytest.mark.parametrize("n", [1, 65537])
def test_full_reductions(n):
    x = rng.standard_normal(n)
    close(opencl(lambda a: a.sum())(x), x.sum(), rtol=1e-10, atol=1e-10)
    b = rng.standard_normal(n) > -2
    close(opencl(lambda a: a.all())(b), b.all())
    xi = rng.integers(-5, 5, n).astype(np.int64)
    close(opencl(lambda a: a.prod())(np.where(xi == 0, 1, xi) % 3 + 1), np.prod(np.where(xi == 0, 1, xi) % 3 + 1))


def test_layer_norm_mixes_reductions_and_stores_over_the_row():
    x = rng.standard_normal((19, 300)).astype(np.float32)
    g, b = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    f = opencl(lambda a, w, c: kn.layer_norm(a, (300,), w, c))
    mu = x.mean(-1, keepdims=True)
    want = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b
    close(f(x, g, b), want, rtol=1e-4, atol=1e-4)


def test_symbolic_sizes_one_program_serves_every_size():
    B = kn.ShapeVar("B", min=1, max=4096)
    f = opencl(lambda a: kn.softmax(a * 2, dim=-1), dynamic_shapes={"a": kn.TensorSpec([B, 37])})
    for n in (1, 5, 300, 17):
        x = rng.standard_normal((n, 37)).astype(np.float32)
        close(f(x), _softmax(x * 2), rtol=1e-5)
    assert f.stats()["compiles"] == 1


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (129, 200, 65)])
def test_gemm_with_epilogue_and_tails(m, k, n):
    a, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    f = opencl(lambda x, y, z: kn.relu(x @ y + z) * 2)
    close(f(a, w, b), np.maximum(a @ w + b, 0) * 2, rtol=1e-4, atol=1e-4)


def test_batched_transposed_and_integer_gemms():
    a, b = rng.standard_normal((3, 20, 31)), rng.standard_normal((3, 17, 31))
    close(opencl(lambda x, y: x @ y.transpose(1, 2))(a, b), a @ b.transpose(0, 2, 1), rtol=1e-12)
    ai, bi = rng.integers(-9, 9, (40, 23)).astype(np.int32), rng.integers(-9, 9, (23, 50)).astype(np.int32)
    close(opencl(lambda x, y: x @ y)(ai, bi), ai @ bi)
    B = kn.ShapeVar("B", min=1, max=512)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    f = opencl(lambda x, y: kn.gelu(x @ y), dynamic_shapes={"x": kn.TensorSpec([B, 16])})
    for rows in (3, 100):
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        close(f(x, w), np.asarray(kn.gelu(kn.tensor(x) @ kn.tensor(w)).numpy()), rtol=1e-4, atol=1e-5)


def test_work_group_shapes_follow_the_device_limits():
    backend = get_backend("opencl")
    limits = backend.limits()
    assert limits.max_work_group_size >= 1 and limits.local_mem_size > 0
    small = Limits(max_work_group_size=64, local_mem_size=1024)
    rl, xl = group_shape("reduction_inner", 1000, 4096, small, 4)
    assert (rl, xl) == (64, 1)
    rl, xl = group_shape("reduction_inner", 1000, 4096, Limits(64, 128), 4)
    assert (rl, xl) == (32, 1)  # 32 float accumulators fill 128 bytes of local memory
    rl, xl = group_shape("reduction_outer", 1000, 4096, Limits(256, 65536), 4)
    assert (rl, xl) == (8, 32)
    cpu = Limits(4096, 1 << 21, 2, cpu=True)  # PoCL: few lanes per row, many rows per group
    assert group_shape("reduction_inner", 1000, 4096, cpu, 4) == (4, 64)
    assert group_shape("reduction_outer", 1000, 4096, cpu, 4) == (1, 256)  # outer reductions put neighbouring work-items on neighbouring addresses
    from kiln.codegen.opencl.emit_gemm import gemm_shape

    assert gemm_shape(Limits(64, 65536), 4) == (8, 8) and gemm_shape(Limits(1024, 65536), 4) == (16, 16)
    assert gemm_shape(small, 4) == (2, 2)  # two 16-deep tiles of 8 x 4-byte values fill 1 KiB


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_erf_float32_polynomial_on_cpu_devices_and_native_float64():
    import math

    z = np.linspace(-5, 5, 20001)
    ref = np.array([math.erf(v) for v in z])
    f = opencl(lambda a: kn.erf(a))
    # float32 on a CPU device: legalize's polynomial (through bitcast_convert), ~1e-7 absolute
    np.testing.assert_allclose(f(z.astype(np.float32)).numpy(), ref, rtol=0, atol=3e-7)
    np.testing.assert_allclose(f(z).numpy(), ref, rtol=1e-14, atol=1e-15)  # the driver's erf
    backend = get_backend("opencl")
    assert backend.native("erf", [kn.float64], kn.float64)
    assert backend.native("erf", [kn.float32], kn.float32) == (not backend.limits().cpu)


@pytest.mark.parametrize("case", ["cat_slice_transpose", "uint8_max", "int16_sum", "var"])
def test_more_ops_and_dtypes_match_numpy(case):
    x = rng.standard_normal((6, 7, 5)).astype(np.float32)
    if case == "cat_slice_transpose":
        f, args = (lambda a: kn.cat([a[:, :3], a[:, 3:] * 2], dim=1).transpose(0, 2).sum(1)), (x,)
        want = np.swapaxes(np.concatenate([x[:, :3], x[:, 3:] * 2], 1), 0, 2).sum(1)  # torch transpose(0, 2)
    elif case == "uint8_max":
        u = rng.integers(0, 255, (300, 3)).astype(np.uint8)
        f, args, want = (lambda a: kn.amax(a, 0)), (u,), u.max(0)
    elif case == "int16_sum":
        s = rng.integers(-100, 100, (9, 40)).astype(np.int16)
        f, args, want = (lambda a: (a * 3 + 7).sum(-1)), (s,), (s * 3 + 7).sum(-1)
    else:
        f, args, want = (lambda a: a.var(-1)), (x,), x.var(-1, ddof=1)
    got = opencl(f)(*args).numpy()
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
