"""Which BLAS kiln's generated GEMMs call: Intel MKL where it is installed, else numpy's
bundled OpenBLAS.

Both are reached the same way: the library is loaded once and its CBLAS entry points
(64-bit integers) are known to LLVM, so generated code calls them directly (no Python in
the GEMM path); OpenBLAS, numpy's, is in the global namespace already, MKL stays a local
library whose entry points LLVM gets by address (see `_load`). They differ by name only:

    openblas   numpy.libs/libscipy_openblas64_*.so     scipy_cblas_sgemm64_, ...
    mkl        <prefix>/lib/libmkl_rt.so.N (PyPI mkl)  cblas_sgemm_64, ... (ILP64)

kiln owns the threads (runtime/threads.py): every BLAS call runs on one thread, on a
tile kiln's pool hands out. For MKL that is its sequential layer, chosen before its
first call (`MKL_Set_Threading_Layer`), so MKL never starts threads of its own; for
OpenBLAS it is OpenBLAS's own setter around kiln's parallel regions.

The choice: `KILN_BLAS=auto|mkl|openblas` for the process (default auto), or
`CpuOptions(blas=...)` per compile; the resolved name is part of the options, so it is in
every cache key (object code calls one library's symbols). `auto` takes MKL on an Intel
CPU where `pip install 'kiln[mkl]'` (or the `mkl` wheel) put `libmkl_rt` in the
environment: there its one-thread sgemm took 7-18% less time than OpenBLAS's on every
product measured, and kiln's GEMM-bound programs ran 1.11-1.15x faster on it
(benchmarks/results/cpu.md, section `blas_choice`). On other vendors
MKL is not measured here, so auto keeps OpenBLAS; `KILN_BLAS=mkl` still forces it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys
from dataclasses import dataclass
from functools import lru_cache

from kiln.errors import KilnArgumentError, KilnDeviceError

PROVIDERS = ("mkl", "openblas")
ENV = "KILN_BLAS"
MKL_THREADING_SEQUENTIAL = 1  # mkl_service.h: MKL_THREADING_INTEL 0, SEQUENTIAL 1, ...


@dataclass(frozen=True)
class Blas:
    """A loaded BLAS: its name, the library's path and its CBLAS GEMM symbols (64-bit
    integers, row-major interface), by accumulator letter s/d/c/z."""

    name: str
    path: str
    symbols: dict

    def gemm(self, letter: str) -> str:
        return self.symbols[letter]


SYMBOLS = {
    "openblas": {t: f"scipy_cblas_{t}gemm64_" for t in "sdcz"},
    "mkl": {t: f"cblas_{t}gemm_64" for t in "sdcz"},
}


def find_openblas() -> str | None:
    """Path of numpy's bundled OpenBLAS, or None (e.g. a numpy built against MKL)."""
    import numpy as np

    root = os.path.dirname(os.path.abspath(np.__file__))
    patterns = [os.path.join(root, "..", "numpy.libs", "libscipy_openblas*.so*"),
                os.path.join(root, ".libs", "libscipy_openblas*.so*"),
                os.path.join(root, ".dylibs", "libscipy_openblas*.dylib")]
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return os.path.realpath(hits[0])
    return None


def find_mkl() -> str | None:
    """Path of MKL's single dynamic library (`libmkl_rt`) as the PyPI `mkl` wheel installs
    it (into the environment's `lib/`, or the user base's), or None."""
    prefixes = [sys.prefix, getattr(site, "USER_BASE", None) or "", sys.base_prefix]
    for prefix in dict.fromkeys(p for p in prefixes if p):
        hits = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if hits:
            return os.path.realpath(hits[-1])
    return None


@lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The CPU vendor string (`GenuineIntel`, `AuthenticAMD`, ...), or "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def check_name(name: str, where: str) -> str:
    """`name` if it is a provider or "auto"; else a numbered argument error naming `where`."""
    if name not in PROVIDERS + ("auto",):
        raise KilnArgumentError(f"{where}: unknown BLAS {name!r}; choose one of auto, "
                                f"{', '.join(PROVIDERS)}")
    return name


@lru_cache(maxsize=1)
def default_name() -> str:
    """The process's BLAS: `KILN_BLAS` (auto when unset), auto resolved as the module
    docstring says. Read once per process."""
    wanted = check_name(os.environ.get(ENV, "auto").strip().lower() or "auto", ENV)
    return resolve(wanted)


def resolve(name: str) -> str:
    """A provider's name for `name` ("auto" -> MKL on Intel CPUs where it is installed and
    loads with its sequential layer, else OpenBLAS)."""
    if name != "auto":
        return name
    if cpu_vendor() == "GenuineIntel" and find_mkl() is not None and isinstance(_load("mkl"), Blas):
        return "mkl"
    return "openblas"


@lru_cache(maxsize=None)
def _load(name: str) -> Blas | str:
    """The provider loaded into the process and LLVM's symbol space, or why it cannot be."""
    path = find_mkl() if name == "mkl" else find_openblas()
    if path is None:
        return ("MKL's libmkl_rt was not found in this environment (pip install 'kiln[mkl]')"
                if name == "mkl" else "numpy's bundled OpenBLAS (libscipy_openblas64_) was not found")
    try:
        # MKL stays out of the process's global symbol namespace: loaded globally before
        # torch, its symbols interposed the MKL torch links in, and torch's matmul ran on
        # MKL's sequential layer (2048^3 on two threads 42 -> 84 ms); LLVM gets the GEMM
        # entry points by address instead
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL if name == "mkl" else ctypes.RTLD_GLOBAL)
    except OSError as e:
        return f"{path} did not load: {e}"
    missing = [s for s in SYMBOLS[name].values() if not hasattr(lib, s)]
    if missing:
        return f"{path} lacks {', '.join(missing)}"
    if name == "mkl":
        layer = lib.MKL_Set_Threading_Layer(ctypes.c_int(MKL_THREADING_SEQUENTIAL))
        if layer != MKL_THREADING_SEQUENTIAL:  # another user of MKL chose a threaded layer
            return (f"MKL in this process already runs threading layer {layer}, not the "
                    "sequential one kiln's threads need")
    import llvmlite.binding as llvm

    if name == "mkl":
        for symbol in SYMBOLS[name].values():
            llvm.add_symbol(symbol, ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    else:
        llvm.load_library_permanently(path)
    _HANDLES[name] = lib  # never unloaded: generated code calls into it
    return Blas(name, path, dict(SYMBOLS[name]))


_HANDLES: dict = {}


def available(name: str | None = None) -> bool:
    """Whether BLAS `name` (default: the process's) loads here."""
    return isinstance(_load(resolve(name or default_name())), Blas)


def load(name: str | None = None) -> Blas:
    """BLAS `name` (default: the process's), loaded; a numbered device error saying why
    where it cannot be."""
    name = resolve(check_name(name or default_name(), "cpu backend"))
    got = _load(name)
    if isinstance(got, str):
        raise KilnDeviceError(f"cpu backend: GEMM needs BLAS {name!r}: {got}",
                              hint="choose another with KILN_BLAS=openblas|mkl or "
                                   "CpuOptions(blas=...) (auto takes the one that loads)")
    return got
