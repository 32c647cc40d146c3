"""Which BLAS the CPU backend's GEMMs call (cpu/blas.py): MKL where installed on an Intel
CPU, else numpy's OpenBLAS; `KILN_BLAS` and `CpuOptions(blas=...)` choose; the choice is
in the options (so in every cache key) and in the generated code; MKL runs its
sequential layer (kiln owns the threads); bad names and a missing library are numbered
errors."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kiln.codegen.cpu import blas
from kiln.codegen.cpu.backend import CpuBackend, CpuOptions
from kiln.codegen.kernel_ir import IN, OUT, Acc, BufferParam, Const, GemmKernel, Load, Op, loop_var
from kiln.errors import KilnArgumentError, KilnDeviceError
from kiln.ir import dtypes as dt

needs_mkl = pytest.mark.skipif(not blas.available("mkl"), reason="Intel MKL not installed (pip install 'kiln[mkl]')")
needs_openblas = pytest.mark.skipif(not blas.available("openblas"), reason="numpy's bundled OpenBLAS not found")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **env})


def _gemm(m, n, k, t):
    """relu(a @ b + bias) as a GemmKernel of dtype `t` (row-major operands)."""
    gj = loop_var("gj")
    epi = Op("max", (Op("add", (Acc(t), Load("bias", gj, t)), t), Const(0.0, t)), t)
    bufs = (BufferParam("a", t, (m, k), IN), BufferParam("b", t, (k, n), IN),
            BufferParam("bias", t, (n,), IN), BufferParam("o", t, (m, n), OUT))
    return GemmKernel("g", bufs, (), "a", "b", "o", 1, m, n, k, (0, k, 1), (0, n, 1), epi)


@pytest.mark.parametrize("provider", [pytest.param("mkl", marks=needs_mkl),
                                      pytest.param("openblas", marks=needs_openblas)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_blas_computes_the_product_with_its_epilogue(provider, dtype):
    """A 300x200x150 GEMM with a bias+relu epilogue compiled for each BLAS, split over two
    threads: against numpy in float64; the module calls that BLAS's symbol only."""
    rng = np.random.default_rng(0)
    t = dt.float32 if dtype == np.float32 else dt.float64
    g = _gemm(300, 200, 150, t)
    backend = CpuBackend(CpuOptions(threads=2, blas=provider))
    plan = backend._plan(g, set(), "blas")
    a, b = rng.standard_normal((300, 150)).astype(dtype), rng.standard_normal((150, 200)).astype(dtype)
    bias = rng.standard_normal(200).astype(dtype)
    out = np.full((300, 200), np.nan, dtype)
    backend._compile_plans([plan])[0]([a, b, bias, out], {})
    want = np.maximum(a.astype(np.float64) @ b + bias, 0)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * 10)
    letter = "s" if dtype == np.float32 else "d"
    module = backend._module_text([plan])
    other = "openblas" if provider == "mkl" else "mkl"
    assert f"@{blas.SYMBOLS[provider][letter]}(" in module and blas.SYMBOLS[other][letter] not in module


def test_the_choice_is_part_of_the_options_and_so_of_cache_keys():
    a, b = CpuOptions(blas="openblas"), CpuOptions(blas="mkl")
    assert a.blas == "openblas" and b.blas == "mkl"
    assert a.cache_text() != b.cache_text() and "blas='openblas'" in a.cache_text()
    assert CpuOptions().blas == blas.default_name() in blas.PROVIDERS
    assert CpuOptions(blas="auto").blas == blas.resolve("auto")


def test_auto_prefers_mkl_on_intel_where_installed(monkeypatch):
    monkeypatch.setattr(blas, "find_mkl", lambda: "/somewhere/libmkl_rt.so.2")
    monkeypatch.setattr(blas, "_load", lambda name: blas.Blas(name, "/somewhere", blas.SYMBOLS[name]))
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "GenuineIntel")
    assert blas.resolve("auto") == "mkl"
    monkeypatch.setattr(blas, "_load", lambda name: "it did not load")  # e.g. a threaded MKL already
    assert blas.resolve("auto") == "openblas"
    monkeypatch.setattr(blas, "_load", lambda name: blas.Blas(name, "/somewhere", blas.SYMBOLS[name]))
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "AuthenticAMD")  # not measured there: OpenBLAS
    assert blas.resolve("auto") == "openblas"
    assert blas.resolve("mkl") == "mkl"  # asked for by name: taken on any vendor
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(blas, "find_mkl", lambda: None)
    assert blas.resolve("auto") == "openblas"


def test_bad_names_are_numbered_errors():
    with pytest.raises(KilnArgumentError, match=r"K103.*CpuOptions: blas: unknown BLAS 'atlas'.*auto, mkl, openblas"):
        CpuOptions(blas="atlas")
    r = _run("import kiln.codegen.cpu.blas as b; b.default_name()", KILN_BLAS="goto")
    assert r.returncode != 0 and "K103" in r.stderr and "KILN_BLAS: unknown BLAS 'goto'" in r.stderr
    assert "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("kiln.errors.KilnArgumentError")


def test_a_missing_library_says_what_to_install(monkeypatch):
    monkeypatch.setattr(blas, "find_mkl", lambda: None)
    blas._load.cache_clear()
    try:
        assert not blas.available("mkl")
        with pytest.raises(KilnDeviceError, match=r"GEMM needs BLAS 'mkl'.*libmkl_rt was not found.*kiln\[mkl\]"):
            blas.load("mkl")
    finally:
        blas._load.cache_clear()


@needs_mkl
def test_mkl_runs_its_sequential_layer_and_starts_no_threads():
    """In a fresh process: after a compiled 512^3 GEMM on MKL, MKL reports one thread
    and the process has no more threads than kiln's own team (MKL starts none)."""
    code = (
        "import ctypes, os, numpy as np, kiln as kn\n"
        "from kiln.codegen.cpu import blas\n"
        "f = kn.compile(lambda x, w: kn.relu(x @ w))\n"
        "x = np.random.rand(512, 512).astype(np.float32)\n"
        "for _ in range(3): r = f(x, x).numpy()\n"
        "assert np.allclose(r, np.maximum(x @ x, 0), rtol=1e-4, atol=1e-3)\n"
        "lib = ctypes.CDLL(blas.load().path)\n"
        "print(blas.default_name(), lib.MKL_Get_Max_Threads(), len(os.listdir('/proc/self/task')))\n")
    r = _run(code, KILN_BLAS="mkl", KILN_THREADS="2", OMP_NUM_THREADS="8")
    assert r.returncode == 0, r.stderr
    name, mkl_threads, tasks = r.stdout.split()
    assert name == "mkl" and int(mkl_threads) == 1
    assert int(tasks) <= 4, r.stdout  # the main thread, kiln's one worker, at most a build thread or two


@needs_mkl
def test_an_mkl_already_threaded_in_the_process_is_refused(monkeypatch):
    """Another library that set MKL's threading layer first: kiln does not run tiles on a
    threaded MKL (each tile would start MKL's threads); it says so."""
    code = (
        "import ctypes\n"
        "from kiln.codegen.cpu import blas\n"
        "lib = ctypes.CDLL(blas.find_mkl(), mode=ctypes.RTLD_GLOBAL)\n"
        "lib.MKL_Set_Threading_Layer(ctypes.c_int(3))\n"  # MKL_THREADING_GNU
        "print(blas.available('mkl'), blas.resolve('auto'))\n"
        "try:\n"
        "    blas.load('mkl')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()[:2]
    assert first == "False openblas"  # auto falls back to OpenBLAS
    assert second.startswith("KilnDeviceError") and "threading layer 3" in second and "sequential" in second


@needs_mkl
def test_mkl_stays_out_of_the_global_symbol_namespace():
    """Loaded globally before torch, MKL's symbols interposed the MKL torch links in, and
    torch's matmul ran on MKL's sequential layer (half speed on two threads): kiln keeps
    it local, and a GEMM compiled after still calls it."""
    code = (
        "import ctypes, numpy as np, kiln as kn\n"
        "from kiln.codegen.cpu import blas\n"
        "blas.load('mkl')\n"
        "glob = ctypes.CDLL(None)\n"
        "print([hasattr(glob, s) for s in ('MKL_Set_Threading_Layer', 'cblas_sgemm_64', 'mkl_serv_malloc')])\n"
        "f = kn.compile(lambda x, w: x @ w)\n"
        "x = np.random.rand(700, 600).astype(np.float32)\n"
        "print(np.allclose(f(x, x.T).numpy(), x @ x.T, rtol=1e-4, atol=1e-3))\n")
    r = _run(code, KILN_BLAS="mkl")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[False, False, False]", "True"], r.stdout
