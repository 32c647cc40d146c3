"""Which implementation runs `kn.linalg.cholesky/qr/eigh/svd`: the rule, and the hook.

    >>> path("eigh", (4096, 8, 8), "float32")        # 'native'
    >>> path("eigh", (3, 8, 8), "float32")           # 'lapack': too few matrices
    >>> path("qr", (64, 8, 8), "float32", "metal:0") # 'metal'

The rule (docs/linalg.md; measured by benchmarks/bench_linalg.py on this project's
machines, same-run ratios against numpy.linalg):

    device metal:N / mps:N     the Metal kernels (kiln/codegen/metal/linalg.py; float32)
    complex, or n > 64         LAPACK
    fewer than MIN_BATCH       LAPACK (one call's overhead is small; compiling is not)
    otherwise                  the batched CPU kernels (linalg_native.py) where the table
                               NATIVE_WINS says they beat LAPACK, else LAPACK

`install()` registers the CPU kernels into the op definitions' hook
(kiln/ir/ops/lapack.py NATIVE), so eager calls and the extern steps of compiled
programs take the same path; kn.linalg installs it on first use.
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnArgumentError

MIN_BATCH = 32
# (op, dtype) -> largest max(m, n) at which the CPU kernels beat LAPACK per matrix
# by at least 1.2x in both of benchmarks/results/linalg.md's runs (wall clock, and CPU
# time on one thread; measured at 8, 16, 32 and 64): every op and dtype up to the
# kernels' limit since eigh and svd take LAPACK's own tridiagonal / bidiagonal routes
# from n = 11 / 14 (float64 at 64 x 64, the closest: eigh 2.2x, svd 1.7x CPU time)
NATIVE_WINS = {("cholesky", "float32"): 64, ("cholesky", "float64"): 64,
               ("qr", "float32"): 64, ("qr", "float64"): 64,
               ("eigh", "float32"): 64, ("eigh", "float64"): 64,
               ("svd", "float32"): 64, ("svd", "float64"): 64}
OPS = ("cholesky", "qr", "eigh", "svd")


def path(op: str, shape: tuple, dtype, device: str = "cpu") -> str:
    """'metal', 'native' (the batched CPU kernels) or 'lapack' for `op` on a [..., m, n]
    operand of `dtype` on `device`."""
    from kiln.codegen.cpu import linalg_native

    if op not in OPS:
        raise KilnArgumentError(f"kn.linalg.path: op must be one of {', '.join(OPS)}, got {op!r}",
                                hint='kn.linalg.path("eigh", a)')
    if str(device).split(":")[0] in ("metal", "mps"):
        return "metal"
    name = np.dtype(dtype).name
    if not linalg_native.supports(tuple(shape), name):
        return "lapack"
    batch = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
    if batch < MIN_BATCH or max(shape[-2:]) > NATIVE_WINS.get((op, name), 0):
        return "lapack"
    return "native"


def _cholesky(a: np.ndarray):
    from kiln.codegen.cpu import linalg_native

    L, info = linalg_native.cholesky(a)
    L[info > 0] = np.nan  # the op's contract: a failing matrix's slot is NaN (as JAX)
    return L


def _hooks() -> dict:
    from kiln.codegen.cpu import linalg_native

    impls = {"cholesky": _cholesky, "qr": linalg_native.qr, "eigh": linalg_native.eigh,
             "svd": linalg_native.svd}

    def hook(op):
        def run(a: np.ndarray):
            return impls[op](a) if path(op, a.shape, a.dtype) == "native" else None
        return run

    return {op: hook(op) for op in OPS}


def install() -> None:
    """Register the CPU kernels in the op definitions' NATIVE hook (idempotent)."""
    from kiln.ir.ops import lapack

    if not all(op in lapack.NATIVE for op in OPS):
        lapack.NATIVE.update(_hooks())


def cholesky_ex(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(L, info) as torch.linalg.cholesky_ex for a [..., n, n] array: info 0, or the
    order k of the first leading minor that is not positive definite."""
    from kiln.codegen.cpu import linalg_native

    if linalg_native.supports(a.shape, a.dtype):
        return linalg_native.cholesky(a)
    batch = a.reshape((-1,) + a.shape[-2:])
    L, info = np.zeros_like(batch), np.zeros(batch.shape[0], np.int32)
    for b in range(batch.shape[0]):
        try:
            L[b] = np.linalg.cholesky(batch[b])
        except np.linalg.LinAlgError:  # the first failing leading minor, by bisection
            lo, hi = 1, batch.shape[-1]
            while lo < hi:
                mid = (lo + hi) // 2
                try:
                    np.linalg.cholesky(batch[b, :mid, :mid])
                    lo = mid + 1
                except np.linalg.LinAlgError:
                    hi = mid
            info[b] = lo
    return L.reshape(a.shape), info.reshape(a.shape[:-2])
