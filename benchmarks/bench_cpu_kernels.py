"""CPU backend benchmarks: hand-built Kernel IR vs numpy (medians of repeated runs).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_cpu_kernels.py \
        [--only chain,small,softmax] [--f32-math native,double]

Prints a markdown table (the format of benchmarks/results/cpu-kernels.md).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time

import numpy as np

from kiln.codegen.cpu import CpuBackend
from kiln.codegen.cpu.mathlib import float32_math
from kiln.codegen.kernel_ir import (
    IN, OUT, Acc, BufferParam, Const, GemmKernel, Kernel, Load, Loop, Op, Reduce, ReduceRef, Store, loop_var,
)
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

f32 = dt.float32
N, B = symbol("N"), symbol("B")
i, r = loop_var("i"), loop_var("r")


def op(name, *args):
    return Op(name, tuple(args), args[0].dtype)


def c(v):
    return Const(v, f32)


def run_times(fn, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn, repeats=7):
    return statistics.median(run_times(fn, repeats))


def _chain_kernel(form):
    """gelu(x*a+b) * sigmoid(x); gelu in torch's tanh form or the exact erf form."""
    x = Load("x", i, f32)
    v = op("add", op("mul", x, Load("a", 0, f32)), Load("b", 0, f32))
    if form == "tanh":
        inner = op("mul", c(math.sqrt(2 / math.pi)),
                   op("add", v, op("mul", c(0.044715), op("mul", v, op("mul", v, v)))))
        gelu = op("mul", op("mul", c(0.5), v), op("add", c(1.0), op("tanh", inner)))
    else:
        gelu = op("mul", op("mul", c(0.5), v), op("add", c(1.0), op("erf", op("mul", v, c(math.sqrt(0.5))))))
    sig = op("div", c(1.0), op("add", c(1.0), op("exp", op("neg", x))))
    return Kernel(f"gelu_{form}_chain", (BufferParam("x", f32, (N,), IN), BufferParam("a", f32, (1,), IN),
                                         BufferParam("b", f32, (1,), IN), BufferParam("y", f32, (N,), OUT)),
                  ("N",), (Loop("i", N),), (Store("y", i, op("mul", gelu, sig)),))


def _numpy_chain(xs, a, b, form):
    v = xs * a + b
    if form == "tanh":
        g = 0.5 * v * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (v + np.float32(0.044715) * v * v * v)))
    else:
        erf = np.vectorize(math.erf, otypes=[np.float64])
        g = (0.5 * v * (1 + erf(v.astype(np.float64) * math.sqrt(0.5)))).astype(np.float32)
    return g * (1 / (1 + np.exp(-xs)))


def bench_gelu_chain(backend, n=1 << 24):
    rows = []
    xs = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    a, b, y = np.array([1.1], np.float32), np.array([0.1], np.float32), np.empty(n, np.float32)
    for form in ("tanh", "erf"):
        ck = backend.compile(_chain_kernel(form))
        t_k = median_time(lambda: ck([xs, a, b, y], {"N": n}))
        if form == "tanh":
            t_np = median_time(lambda: _numpy_chain(xs, a, b, form), 3)
            err = float(np.abs(_numpy_chain(xs, a, b, form) - y).max())
            np_col, speed = f"{t_np * 1e3:.1f} ms", f"{t_np / t_k:.1f}x"
        else:  # numpy has no vectorized erf: compare against 2^20 elements only
            sub = slice(0, 1 << 20)
            err = float(np.abs(_numpy_chain(xs[sub], a, b, form) - y[sub]).max())
            np_col, speed = "", ""
        rows.append((f"gelu-{form}(x*a+b)*sigmoid(x), 2^24 f32", f"{t_k * 1e3:.1f} ms", np_col, speed,
                     f"{2 * n * 4 / t_k / 1e9:.1f} GB/s, max abs diff {err:.1e}"))
    return rows


def bench_small_chain(backend, n=4096, reps=64):
    """The chain on 4096 elements on one thread: the whole call (validation + ctypes
    included), and the kernel alone, taken as a 64 x 4096-element call (1 MiB in and
    out, cache-resident) divided by 64, so the per-call overhead drops out."""
    from kiln.codegen.cpu import CpuOptions
    one = CpuBackend(CpuOptions(threads=1))
    xs = np.random.default_rng(0).standard_normal(n * reps).astype(np.float32)
    a, b, y = np.array([1.1], np.float32), np.array([0.1], np.float32), np.empty(n * reps, np.float32)
    rows = []
    for form in ("tanh", "erf"):
        ck = one.compile(_chain_kernel(form))
        x1, y1 = xs[:n], y[:n]
        t = median_time(lambda: [ck([x1, a, b, y1], {"N": n}) for _ in range(1000)]) / 1000
        times = run_times(lambda: [ck([xs, a, b, y], {"N": n * reps}) for _ in range(20)], 9)
        t_big = statistics.median(times) / 20 / reps
        t_min = min(times) / 20 / reps  # the least disturbed run on a shared host
        rows.append((f"gelu-{form} chain, 4096 f32, 1 thread", f"{t * 1e6:.1f} us", "", "",
                     f"kernel alone {t_big * 1e6:.2f} us ({t_big / n * 1e9:.2f} ns/element; "
                     f"min {t_min * 1e6:.2f} us)"))
    return rows


def bench_sum_squares(backend, n=1 << 25):
    x = Load("x", r, f32)
    k = Kernel("sumsq", (BufferParam("x", f32, (N,), IN), BufferParam("o", f32, (1,), OUT)), ("N",), (),
               (Reduce("s", "sum", (Loop("r", N),), op("mul", x, x), f32), Store("o", 0, ReduceRef("s", f32))))
    ck = backend.compile(k)
    xs = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    o = np.zeros(1, np.float32)
    t_k = median_time(lambda: ck([xs, o], {"N": n}))
    t_np = median_time(lambda: np.dot(xs, xs))
    exact = float(np.dot(xs.astype(np.float64), xs.astype(np.float64)))
    return [("sum of squares, 2^25 f32", f"{t_k * 1e3:.1f} ms", f"{t_np * 1e3:.1f} ms (np.dot)",
             f"{t_np / t_k:.1f}x", f"{n * 4 / t_k / 1e9:.1f} GB/s, rel err {abs(o[0] - exact) / exact:.1e}")]


def bench_softmax(backend, rows=4096, width=4096):
    x = Load("x", width * i + r, f32)
    e = op("exp", op("sub", x, ReduceRef("m", f32)))
    k = Kernel("softmax", (BufferParam("x", f32, (B, width), IN), BufferParam("y", f32, (B, width), OUT)), ("B",),
               (Loop("i", B),),
               (Reduce("m", "max", (Loop("r", width),), x, f32), Reduce("s", "sum", (Loop("r", width),), e, f32),
                Store("y", width * i + r, op("mul", e, op("div", c(1.0), ReduceRef("s", f32))),
                      (Loop("r", width),))))
    ck = backend.compile(k)
    xs = np.random.default_rng(2).standard_normal((rows, width)).astype(np.float32)
    y = np.empty_like(xs)
    t_k = median_time(lambda: ck([xs, y], {"B": rows}))

    def numpy_softmax():
        z = np.exp(xs - xs.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)

    t_np = median_time(numpy_softmax, 3)
    nbytes = 2 * xs.nbytes
    return [("row softmax 4096x4096 f32", f"{t_k * 1e3:.1f} ms", f"{t_np * 1e3:.1f} ms", f"{t_np / t_k:.1f}x",
             f"{nbytes / t_k / 1e9:.1f} GB/s (1 read + 1 write)")]


def bench_gemm(backend, n=2048):
    gj = loop_var("gj")
    epi = Op("max", (Op("add", (Acc(f32), Load("bias", gj, f32)), f32), Const(0.0, f32)), f32)
    g = GemmKernel("gemm_bias_relu", (BufferParam("a", f32, (n, n), IN), BufferParam("b", f32, (n, n), IN),
                                      BufferParam("bias", f32, (n,), IN), BufferParam("o", f32, (n, n), OUT)),
                   (), "a", "b", "o", 1, n, n, n, (n * n, n, 1), (n * n, n, 1), epi)
    ck = backend.compile(g)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    bias, o = rng.standard_normal(n).astype(np.float32), np.empty((n, n), np.float32)
    t_k = median_time(lambda: ck([a, b, bias, o], {}), 5)
    t_mm = median_time(lambda: a @ b, 5)
    t_np = median_time(lambda: np.maximum(a @ b + bias, 0), 5)
    flops = 2 * n ** 3
    return [("GEMM+bias+relu 2048^3 f32", f"{t_k * 1e3:.1f} ms ({flops / t_k / 1e9:.0f} GFLOP/s)",
             f"{t_mm * 1e3:.1f} ms bare matmul ({flops / t_mm / 1e9:.0f} GFLOP/s)", f"{t_mm / t_k:.2f}x",
             f"numpy matmul+bias+relu: {t_np * 1e3:.1f} ms")]


def bench_compile(backend):
    import kiln.codegen.cpu.backend as be_mod
    fresh = be_mod.CpuBackend()
    x = Load("x", i, f32)
    kernels = [Kernel(f"k{j}", (BufferParam("x", f32, (N,), IN), BufferParam("y", f32, (N,), OUT)), ("N",),
                      (Loop("i", N),), (Store("y", i, op("add", op("mul", op("exp", x), c(j)), x)),))
               for j in range(10)]
    t0 = time.perf_counter()
    fresh.compile_many(kernels)
    t_many = time.perf_counter() - t0
    ck = fresh.compile(kernels[0])
    xs, ys = np.zeros(16, np.float32), np.zeros(16, np.float32)
    t_call = median_time(lambda: [ck([xs, ys], {"N": 16}) for _ in range(1000)]) / 1000
    return [("compile_many, 10 pointwise kernels", f"{t_many * 1e3:.0f} ms", "", "", "one module, one JIT"),
            ("small call overhead (16 elements)", f"{t_call * 1e6:.1f} us", "", "", "validation + ctypes")]


BENCHES = {"chain": bench_gelu_chain, "small": bench_small_chain, "sumsq": bench_sum_squares,
           "softmax": bench_softmax, "gemm": bench_gemm, "compile": bench_compile}


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ", ".join(BENCHES))
    ap.add_argument("--f32-math", default="native",
                    help="float32 transcendentals: native, double (float64-internal) or native,double "
                         "(both, rows labelled)")
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"machine: {os.cpu_count()} cores, {cpu}; numpy {np.__version__}")
    print("| benchmark | kiln cpu | numpy | speed-up | notes |")
    print("|---|---|---|---|---|")
    modes = args.f32_math.split(",")
    for name in args.only.split(","):
        for mode in modes:
            with float32_math(mode):  # a fresh backend: compiled kernels are cached per backend
                rows = BENCHES[name](CpuBackend())
            for row in rows:
                label = f" [{mode}]" if len(modes) > 1 else ""
                print("| " + " | ".join((row[0] + label,) + tuple(row[1:])) + " |", flush=True)


if __name__ == "__main__":
    main()
