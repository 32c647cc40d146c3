"""GEMM-bound programs against the bare BLAS product in the same run (issue 22 item 2):
GEMM + epilogue, the MLP, the backward GEMMs of a Linear (transposed operands), small
and batched products (BLAS vs kiln's micro-kernel), the BLAS libraries this machine
can load, and the compile times of the small GPT training step (bench_train.py).

    .venv/bin/python benchmarks/bench_gemm.py [--quick] [--out benchmarks/results/cpu.md]

Every row is timed in this one process, kiln first, then numpy (its OpenBLAS: "bare
BLAS" is the matrix products alone, no bias or activation), then torch (eager, and
torch.compile where given) and jax.jit; medians and minimums over the same repeats.
Peers are optional. The compile rows run in fresh processes with empty caches (cold)
and with the cold run's disk cache (warm).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import kiln as kn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_section  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu.md")
HERE = os.path.dirname(os.path.abspath(__file__))


def rows(quick: bool):
    """(label, kiln fn, bare-BLAS numpy fn, torch fn, args, flops)."""
    rng = np.random.default_rng(0)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    m = 1024 if quick else 2048
    yield (f"matmul+bias+relu {m}^3", lambda x, w, b: kn.relu(x @ w + b),
           lambda x, w, b: x @ w, lambda t, x, w, b: t.relu(x @ w + b),
           (r(m, m), r(m, m, scale=m ** -0.5), r(m)), 2 * m ** 3)
    yield ("MLP 512x1024 -> 4096 -> 1024 (gelu)",
           lambda x, w1, b1, w2, b2: kn.gelu(x @ w1 + b1) @ w2 + b2,
           lambda x, w1, b1, w2, b2: (x @ w1) @ w2,
           lambda t, x, w1, b1, w2, b2: t.nn.functional.gelu(x @ w1 + b1) @ w2 + b2,
           (r(512, 1024), r(1024, 4096, scale=0.03), r(4096), r(4096, 1024, scale=0.015), r(1024)),
           2 * 2 * 512 * 1024 * 4096)
    yield ("Linear backward 512x1024 -> 1024: dY @ W, dY^T @ X",
           lambda dy, w, x: (dy @ w, dy.T @ x), lambda dy, w, x: (dy @ w, dy.T @ x),
           lambda t, dy, w, x: (dy @ w, dy.T @ x),
           (r(512, 1024), r(1024, 1024, scale=0.03), r(512, 1024)), 2 * 2 * 512 * 1024 * 1024)
    yield ("batched GEMM (16,32,256) x (16,256,64)", lambda a, b: a @ b, lambda a, b: a @ b,
           lambda t, a, b: a @ b, (r(16, 32, 256), r(16, 256, 64)), 2 * 16 * 32 * 256 * 64)
    yield ("attention scores (64,32,16) x (64,32,16)^T", lambda q, k: q @ k.transpose(1, 2),
           lambda q, k: q @ k.transpose(0, 2, 1), lambda t, q, k: q @ k.transpose(1, 2),
           (r(64, 32, 16), r(64, 32, 16)), 2 * 64 * 32 * 32 * 16)


def round_robin(fns: dict, repeat: int, warmup: int = 2) -> dict:
    """{name: (median, minimum) seconds}: each repetition calls every fn once, one after
    the other, so a shared machine's load falls on all of them alike; in a new (seeded)
    order each round, since a library's threads spinning after its call slow down
    whichever call comes next."""
    import random

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in fns}
    order = list(fns)
    shuffle = random.Random(0).shuffle
    for _ in range(repeat):
        shuffle(order)
        for name in order:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (float(np.median(t)), float(np.min(t))) for name, t in times.items()}


def with_threads(fn, kiln_threads: int | None = None, blas_threads: int | None = None, torch_threads=None):
    """fn run with kiln's, numpy's OpenBLAS's or torch's thread count set for the call."""
    from kiln.runtime.threads import blas_num_threads, set_blas_num_threads

    def run():
        saved_kiln, saved_blas = kn.get_num_threads(), blas_num_threads()
        if kiln_threads is not None:
            kn.set_num_threads(kiln_threads)
        if blas_threads is not None:
            set_blas_num_threads(blas_threads)
        if torch_threads is not None:
            torch_threads[0].set_num_threads(torch_threads[1])
        try:
            return fn()
        finally:
            if kiln_threads is not None:
                kn.set_num_threads(saved_kiln)
            if blas_threads is not None and saved_blas is not None:
                set_blas_num_threads(saved_blas)
    return run


def measure_rows(quick: bool, peers: bool) -> list[dict]:
    """Every implementation of a row round-robin in one process: kiln with its default
    threads and with one, numpy's OpenBLAS with its default threads and with one, torch
    with 1 and all threads, torch.compile, jax.jit."""
    repeat = 5 if quick else 15
    cores = os.cpu_count() or 1
    out = []
    for label, kfn, npfn, tfn, args, flops in rows(quick):
        small = flops < 1e8
        f = kn.compile(kfn)
        targs = [kn.tensor(a) for a in args]
        fns = {"kiln": lambda: f(*targs), "kiln 1t": with_threads(lambda: f(*targs), kiln_threads=1),
               "bare BLAS": lambda: npfn(*args), "bare BLAS 1t": with_threads(lambda: npfn(*args), blas_threads=1)}
        if peers:
            try:
                import torch

                tt = [torch.tensor(a) for a in args]

                def tcall(fn=tfn, xs=tt):
                    with torch.no_grad():
                        return fn(torch, *xs)
                for threads in sorted({1, cores}):
                    fns[f"torch {threads}t"] = with_threads(tcall, torch_threads=(torch, threads))
                if not small:
                    tc = torch.compile(lambda *xs: tfn(torch, *xs))
                    fns["torch.compile"] = with_threads(lambda: tcall(lambda _t, *xs: tc(*xs)),
                                                        torch_threads=(torch, cores))
            except ImportError:
                pass
            try:
                import jax
                import jax.numpy as jnp

                jf = jax.jit(lambda *xs: kfn_jax(label, jnp, *xs))
                ja = [jnp.asarray(a) for a in args]
                fns["jax.jit"] = lambda: jax.block_until_ready(jf(*ja))
            except ImportError:
                pass
        load = os.getloadavg()[0]
        row = {"workload": label, "flops": flops, "load": load}
        row.update(round_robin(fns, repeat * (20 if small else 1)))
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def kfn_jax(label, jnp, *xs):
    import jax

    if label.startswith("matmul"):
        x, w, b = xs
        return jnp.maximum(x @ w + b, 0)
    if label.startswith("MLP"):
        x, w1, b1, w2, b2 = xs
        return jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2 + b2
    if label.startswith("Linear"):
        dy, w, x = xs
        return dy @ w, dy.T @ x
    if label.startswith("batched"):
        return xs[0] @ xs[1]
    q, k = xs
    return q @ jnp.swapaxes(k, 1, 2)


def micro_rows() -> list[tuple]:
    """Single-thread kiln BLAS path vs kiln micro-kernel vs np.matmul, small shapes."""
    from kiln.codegen.cpu import CpuBackend, CpuOptions
    from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, GemmKernel
    from kiln.ir import dtypes as dt
    from kiln.runtime.threads import blas_single_thread

    be = CpuBackend(CpuOptions(threads=1))
    out = []
    rng = np.random.default_rng(1)
    for b, m, n, k in [(64, 32, 32, 16), (16, 32, 64, 256), (1, 64, 64, 64), (1, 128, 128, 128),
                       (1, 512, 192, 64)]:
        g = GemmKernel("g", (BufferParam("a", dt.float32, (b, m, k), IN), BufferParam("b", dt.float32, (b, k, n), IN),
                             BufferParam("o", dt.float32, (b, m, n), OUT)), (), "a", "b", "o", b, m, n, k,
                       (m * k, k, 1), (k * n, n, 1), Acc(dt.float32))
        arrays = [rng.standard_normal((b, m, k)).astype(np.float32),
                  rng.standard_normal((b, k, n)).astype(np.float32), np.zeros((b, m, n), np.float32)]
        fns = {kind: (lambda ck=be._compile_plans([be._plan(g, set(), kind)])[0]: ck(arrays, {}))
               for kind in ("blas", "micro")}
        fns["np.matmul"] = lambda: np.matmul(arrays[0], arrays[1])
        with blas_single_thread():
            res = round_robin(fns, 200, warmup=5)
        out.append(((b, m, n, k), 2 * b * m * n * k, res))
    return out


LIB_SHAPES = [(2048, 2048, 2048, False), (512, 1024, 1024, False), (1024, 1024, 512, True),
              (128, 128, 128, False), (32, 64, 256, False)]


def _openblas_sgemm(path: str):
    """(sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), version,
    set_num_threads) of a scipy-openblas build (64-bit ints, `scipy_` symbol prefix)."""
    import ctypes

    lib = ctypes.CDLL(path)
    cfg = lib.scipy_openblas_get_config64_
    cfg.restype = ctypes.c_char_p
    f = lib.scipy_cblas_sgemm64_
    f.argtypes = [ctypes.c_int] * 3 + [ctypes.c_int64] * 3 + [
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
        ctypes.c_void_p, ctypes.c_int64]
    return f, cfg().decode().split()[1], lib.scipy_openblas_set_num_threads64_


def _mkl_sgemm(path: str):
    """The same for Intel MKL's single dynamic library, sequential threading layer."""
    import ctypes

    lib = ctypes.CDLL(path)
    lib.MKL_Set_Threading_Layer(1)  # MKL_THREADING_SEQUENTIAL
    lib.MKL_Set_Interface_Layer(0)  # LP64
    f = lib.cblas_sgemm
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    buf = ctypes.create_string_buffer(256)
    lib.mkl_get_version_string(buf, 256)
    version = buf.value.decode().split("Version ")[-1].split("-")[0].strip()
    return f, version, None


def blas_libraries() -> list[tuple]:
    """One-thread sgemm of each CBLAS this machine can load, round-robin per shape:
    numpy's bundled OpenBLAS, scipy-openblas64 and Intel MKL (the `mkl` wheel's
    libmkl_rt, found in this environment or named by KILN_BENCH_MKL) where installed,
    and torch (1 thread, its bundled MKL/oneDNN) for reference. kiln calls BLAS with one
    thread per pool thread, so this is the figure that decides."""
    from kiln.codegen.cpu.jit import find_openblas

    libs = {"numpy's bundled OpenBLAS": _openblas_sgemm(find_openblas())}
    try:
        import scipy_openblas64

        libs["scipy-openblas64 (PyPI)"] = _openblas_sgemm(glob.glob(os.path.join(
            scipy_openblas64.get_lib_dir(), "libscipy_openblas64_*.so"))[0])
    except (ImportError, IndexError):
        pass
    mkl = os.environ.get("KILN_BENCH_MKL") or next(iter(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*"))),
                                                    None)
    if mkl:
        libs["Intel MKL (PyPI `mkl`)"] = _mkl_sgemm(mkl)
    for _, _, set_threads in libs.values():
        if set_threads is not None:
            set_threads(1)
    rng = np.random.default_rng(2)
    res: dict = {name: {} for name in libs}
    versions = {name: v for name, (_, v, _) in libs.items()}
    try:
        import torch

        torch.set_num_threads(1)
        res["torch 1t (reference)"] = {}
        versions["torch 1t (reference)"] = torch.__version__
    except ImportError:
        torch = None
    for m, n, k, trans_a in LIB_SHAPES:
        a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        c = np.zeros((m, n), np.float32)
        ta, lda = (112, m) if trans_a else (111, k)
        fns = {name: (lambda f=f: f(101, ta, 111, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, n, 0.0,
                                    c.ctypes.data, n)) for name, (f, _, _) in libs.items()}
        if torch is not None:
            tta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c.copy())
            fns["torch 1t (reference)"] = lambda: torch.mm(tta.T if trans_a else tta, tb, out=tc)
        got = round_robin(fns, 5 if m * n * k > 1e9 else (15 if m * n * k > 1e7 else 300), warmup=1)
        for name, t in got.items():
            res[name][(m, n, k, trans_a)] = t
    return [(name, versions[name], res[name]) for name in res]


COMPILE_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
import kiln as kn
imported = time.perf_counter() - t0
sys.path.insert(0, {here!r})
import bench_train as bt
import numpy as np
from kiln import optim
kn.manual_seed(0)
module = bt.gpt_module("kiln")
model = module.GPT(module.GPTConfig(**bt.GPT))
rng = np.random.default_rng(0)
x, y = (kn.tensor(rng.integers(0, bt.GPT["vocab_size"], (bt.GPT_BATCH, bt.GPT["block_size"]))) for _ in range(2))
opt = optim.AdamW(lr=1e-3, weight_decay=0.1)
step = bt.kiln_step_fn(model, opt)
params = dict(model.named_parameters())
state = opt.init(params)
key = kn.nn.random.key(0)
c = kn.compile(step)
t0 = time.perf_counter()
c(params, state, x, y, key)
first = time.perf_counter() - t0
cg = c.compiled_graphs()[0]
print(json.dumps({{"import": imported, "first": first, "passes": cg.stage_seconds}}))
"""


def compile_times() -> dict:
    cache = tempfile.mkdtemp(prefix="bench-gemm-cache-")
    env = dict(os.environ, KILN_CACHE_DIR=cache)
    out = {}
    for which in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", COMPILE_SNIPPET.format(here=HERE)], env=env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            out[which] = {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:100]}
            continue
        out[which] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def fmt(t) -> str:
    return f"{t[0] * 1e3:.3f} ({t[1] * 1e3:.3f})"


def render(args, table, micro, libs, compile_t, load0) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown")
    peers = ["torch 1t", f"torch {os.cpu_count()}t", "torch.compile", "jax.jit"]
    lines = ["## GEMM-bound programs and the training step's compile (bench_gemm.py, issue 22 items 2-3)", "",
             f"- command: `.venv/bin/python benchmarks/bench_gemm.py{' --quick' if args.quick else ''}`",
             f"- machine: {os.cpu_count()} cores, {cpu} (lscpu model name); load average "
             f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (a shared machine)",
             f"- date: {datetime.date.today().isoformat()}; numpy {np.__version__}", "",
             "Milliseconds, median (minimum) over the same repeats, one process, every "
             "implementation called once per round in a shuffled order (round-robin), so the "
             "machine's load and other libraries' spinning threads fall on all alike. `kiln` and `bare BLAS` "
             f"run with their default threads (kiln: its pool of {kn.get_num_threads()}, large products split "
             "in one tile per thread (rows or columns by shape), one BLAS thread each; numpy: "
             "OpenBLAS's own threads), `1t` with one. `bare BLAS` is numpy's OpenBLAS doing the "
             "products alone (no bias, no activation). Ratios: minimum (median); above 1 kiln is "
             "faster. `best peer` is the fastest torch/jax variant against kiln's faster variant.", "",
             "| workload | load | kiln | kiln 1t | bare BLAS | bare BLAS 1t | " + " | ".join(peers)
             + " | BLAS / kiln | BLAS 1t / kiln 1t | best peer / kiln |",
             "|---" * (len(peers) + 9) + "|"]

    def ratio(num, den, i):
        return num[i] / den[i]

    for r in table:
        kbest = min((r["kiln"], r["kiln 1t"]), key=lambda t: t[1])
        have = [r[p] for p in peers if p in r]
        best = (min(t[0] for t in have), min(t[1] for t in have)) if have else None
        cells = [f"{ratio(r['bare BLAS'], r['kiln'], 1):.2f}x ({ratio(r['bare BLAS'], r['kiln'], 0):.2f}x)",
                 f"{ratio(r['bare BLAS 1t'], r['kiln 1t'], 1):.2f}x ({ratio(r['bare BLAS 1t'], r['kiln 1t'], 0):.2f}x)",
                 f"{ratio(best, kbest, 1):.2f}x ({ratio(best, kbest, 0):.2f}x)" if best else "—"]
        lines.append(f"| {r['workload']} | {r['load']:.1f} | " + " | ".join(
            fmt(r[c]) for c in ("kiln", "kiln 1t", "bare BLAS", "bare BLAS 1t"))
            + " | " + " | ".join(fmt(r[p]) if p in r else "—" for p in peers) + " | " + " | ".join(cells) + " |")
    lines += ["", "Small and batched products, one thread: kiln's BLAS path, kiln's micro-kernel "
              "(forced) and np.matmul; microseconds, median (minimum), GFLOP/s at the minimum.", "",
              "| batch x m x n x k | kiln BLAS path | kiln micro-kernel | np.matmul | micro / BLAS path |",
              "|---|---|---|---|---|"]
    for shape, flops, res in micro:
        cells = [f"{res[k][0] * 1e6:.1f} ({res[k][1] * 1e6:.1f}), {flops / res[k][1] / 1e9:.0f}"
                 for k in ("blas", "micro", "np.matmul")]
        lines.append(f"| {' x '.join(map(str, shape))} | " + " | ".join(cells)
                     + f" | {res['blas'][1] / res['micro'][1]:.2f}x |")
    lines += ["", "BLAS libraries, one thread (cblas_sgemm through ctypes, row-major; `T` = A "
              "transposed), round-robin per shape; milliseconds, median (minimum):", "",
              "| library | version | " + " | ".join(
                  f"{m}x{n}x{k}{' T' if t else ''}" for m, n, k, t in LIB_SHAPES) + " |",
              "|---" * (2 + len(LIB_SHAPES)) + "|"]
    for name, version, res in libs:
        lines.append(f"| {name} | {version} | " + " | ".join(fmt(v) for v in res.values()) + " |")
    if not compile_t:
        return "\n".join(lines) + "\n"
    lines += ["", "Small GPT training step (bench_train.py's GPT row): first call (trace + passes "
              "+ LLVM + first step) in a fresh process, seconds; cold = empty caches, warm = the "
              "cold run's disk cache.", "",
              "| | import kiln | first call | of which fuse | of which the other graph passes |",
              "|---|---|---|---|---|"]
    for which, v in compile_t.items():
        if "error" in v:
            lines.append(f"| {which} | {v['error']} | | | |")
            continue
        fuse = v["passes"].get("fuse", 0.0)
        other = sum(s for n, s in v["passes"].items() if n != "fuse")
        lines.append(f"| {which} | {v['import']:.2f} | {v['first']:.2f} | {fuse:.2f} | {other:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results file ('' to only print)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="skip the GPT compile-time rows")
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    table = measure_rows(args.quick, not args.no_peers)
    micro = micro_rows()
    libs = blas_libraries()
    compile_t = {} if args.no_compile else compile_times()
    text = render(args, table, micro, libs, compile_t, load0)
    print(text)
    if args.out:
        write_section(args.out, "bench_gemm", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
