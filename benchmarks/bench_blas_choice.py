"""Which BLAS kiln's GEMMs should call: the same programs compiled against Intel MKL and
against numpy's OpenBLAS, beside torch eager and numpy, round-robin in one process.

    .venv/bin/python benchmarks/bench_blas_choice.py [--rounds 7] [--out FILE]

Part 1 times bench_cpu.py's GEMM-bound workloads (matmul+bias+relu 2048^3, the MLP, the
complex64 product) and the large MLP's forward and backward products, each compiled
twice in this process (`KILN_BLAS` set before each compile: a program keeps the BLAS it
was compiled for; kiln's complex product is called for each BLAS directly, as the
compiled program's extern step calls it). Part 2 is the one-thread `sgemm` of each
library through ctypes on the same products (kiln's threads run one-thread BLAS tiles),
process CPU time per call. Needs the `mkl` wheel (`pip install 'kiln[mkl]'`).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kiln as kn  # noqa: E402
from bench_cpu import fresh_caches, interleaved, settle  # noqa: E402
from kiln.codegen.backend import get_backend  # noqa: E402
from kiln.codegen.cpu import blas  # noqa: E402
from kiln.codegen.cpu.gemm_complex import blas_matmul  # noqa: E402

PROVIDERS = ("mkl", "openblas")


def compiled_for(provider: str, fn):
    """`fn` compiled now with BLAS `provider` (the options are resolved when the backend
    is made, so the process default is switched around this compile only)."""
    os.environ[blas.ENV] = provider
    blas.default_name.cache_clear()
    get_backend.cache_clear()
    return kn.compile(fn)


def workloads():
    rng = np.random.default_rng(0)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def c(*shape):
        return (r(*shape) + 1j * r(*shape)).astype(np.complex64)

    import torch
    import torch.nn.functional as F

    yield ("matmul+bias+relu 2048^3", lambda x, w, b: kn.relu(x @ w + b),
           lambda x, w, b: torch.relu(x @ w + b), (r(2048, 2048), r(2048, 2048, scale=2048 ** -0.5), r(2048)))
    yield ("MLP 512x1024 -> 4096 -> 1024 (gelu)", lambda x, w1, b1, w2, b2: kn.gelu(x @ w1 + b1) @ w2 + b2,
           lambda x, w1, b1, w2, b2: F.gelu(x @ w1 + b1) @ w2 + b2,
           (r(512, 1024), r(1024, 4096, scale=0.03), r(4096), r(4096, 1024, scale=0.015), r(1024)))
    yield ("x @ W^T: 512x1024x1024 (Linear forward)", lambda x, w: x @ w.T, lambda x, w: x @ w.T,
           (r(512, 1024), r(1024, 1024)))
    yield ("dY^T @ X: 1024x1024x512 (weight gradient)", lambda dy, x: dy.T @ x, lambda dy, x: dy.T @ x,
           (r(512, 1024), r(512, 1024)))
    yield ("complex64 matmul 512^3", None, lambda a, b: a @ b, (c(512, 512), c(512, 512)))


def part1(rounds: int) -> list[str]:
    import torch

    torch.set_num_threads(2)
    lines = ["| workload | kiln + MKL | kiln + OpenBLAS | torch eager | numpy | OpenBLAS / MKL (kiln) "
             "| torch / kiln + MKL |", "|---|---|---|---|---|---|---|"]
    for label, kfn, tfn, inputs in workloads():
        fns = {}
        if kfn is None:  # the complex product: the extern step, for each BLAS
            for p in PROVIDERS:
                fns[f"kiln {p}"] = (lambda p=p: blas_matmul(inputs[0], inputs[1], provider=p))
            expect = inputs[0] @ inputs[1]
        else:
            kin = [kn.tensor(i) for i in inputs]
            for p in PROVIDERS:
                f = compiled_for(p, kfn)
                f(*kin)
                fns[f"kiln {p}"] = (lambda f=f: f(*kin))
            tin = [torch.from_numpy(i) for i in inputs]
            expect = tfn(*tin).numpy()
        tin = [torch.from_numpy(i) for i in inputs]
        fns["torch eager"] = lambda: tfn(*tin)
        if kfn is None:
            fns["numpy"] = lambda: inputs[0] @ inputs[1]
        for p in PROVIDERS:
            got = fns[f"kiln {p}"]()
            got = got.numpy() if hasattr(got, "numpy") else got
            err = float(np.max(np.abs(got - expect)) / max(1.0, float(np.max(np.abs(expect)))))
            assert err < 1e-3, (label, p, err)
        for fn in fns.values():
            settle(fn, 5, 0.25)
        t = interleaved(fns, rounds)

        def cell(name):
            return f"{t[name][0] * 1e3:.2f} ({t[name][1] * 1e3:.2f})" if name in t else "-"

        mk, ob, th = t["kiln mkl"], t["kiln openblas"], t["torch eager"]
        lines.append(f"| {label} | {cell('kiln mkl')} | {cell('kiln openblas')} | {cell('torch eager')} | "
                     f"{cell('numpy')} | {ob[0] / mk[0]:.2f}x ({ob[1] / mk[1]:.2f}x) | "
                     f"{th[0] / mk[0]:.2f}x ({th[1] / mk[1]:.2f}x) |")
        print(lines[-1], flush=True)
    return lines


def _sgemm(provider: str):
    lib = ctypes.CDLL(blas.load(provider).path)
    f = getattr(lib, blas.SYMBOLS[provider]["s"])
    i64 = ctypes.c_int64
    f.restype = None
    f.argtypes = [ctypes.c_int] * 3 + [i64] * 3 + [ctypes.c_float, ctypes.c_void_p, i64, ctypes.c_void_p,
                                                   i64, ctypes.c_float, ctypes.c_void_p, i64]
    return f


def part2(rounds: int) -> list[str]:
    """One-thread sgemm per library, process CPU ms per call, round-robin."""
    from kiln.runtime.threads import blas_single_thread

    fns = {p: _sgemm(p) for p in PROVIDERS}
    lines = ["| product (m x n x k, NN) | MKL | OpenBLAS | OpenBLAS / MKL |", "|---|---|---|---|"]
    rng = np.random.default_rng(1)
    for m, n, k in ((2048, 2048, 2048), (512, 4096, 1024), (512, 1024, 4096), (512, 1024, 1024), (256, 256, 256)):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        out = {p: np.empty((m, n), np.float32) for p in PROVIDERS}
        reps = max(1, int(0.05 / (2 * m * n * k / 100e9)))
        times: dict = {p: [] for p in PROVIDERS}
        with blas_single_thread():
            for _ in range(rounds):
                for p, f in fns.items():
                    c = out[p]
                    f(101, 111, 111, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, c.ctypes.data, n)
                    t0 = time.process_time()
                    for _ in range(reps):
                        f(101, 111, 111, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, c.ctypes.data, n)
                    times[p].append((time.process_time() - t0) / reps)
        assert np.allclose(out["mkl"], out["openblas"], rtol=1e-3, atol=1e-2 * k ** 0.5)
        mk, ob = (float(np.median(times[p])) for p in PROVIDERS)
        lines.append(f"| {m}x{n}x{k} | {mk * 1e3:.2f} | {ob * 1e3:.2f} | {ob / mk:.2f}x |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="write the markdown here")
    args = parser.parse_args()
    if not (blas.available("mkl") and blas.available("openblas")):
        print("needs both MKL (pip install 'kiln[mkl]') and numpy's OpenBLAS", file=sys.stderr)
        return 2
    fresh_caches()
    model = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                           text=True).stdout.strip() or platform.processor()
    head = [f"- command: `.venv/bin/python benchmarks/bench_blas_choice.py --rounds {args.rounds}`",
            f"- machine: {os.cpu_count()} CPUs, {model}; load average at the start "
            f"{os.getloadavg()[0]:.1f}", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "", "Part 1: ms per call, median (min), every implementation round-robin in one process; "
            "ratios of medians (of minimums).", ""]
    lines = head + part1(args.rounds)
    lines += ["", "Part 2: one-thread sgemm through ctypes (what each kiln thread runs per tile), "
              "process CPU ms per call, median.", ""] + part2(args.rounds)
    lines.append(f"\n- load average at the end {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
