"""Running the batched small-matrix kernels (linalg_kernels.py) on numpy batches.

    >>> L, info = linalg_native.cholesky(a)        # a: [..., n, n] float32/float64
    >>> w, v = linalg_native.eigh(a)               # ascending, sign-normalized columns

eigh takes two-sided Jacobi below n = 11 and Householder tridiagonalization + implicit QL
from there (linalg_tridiag.py), svd one-sided Jacobi below min(m, n) = 14 and Householder
bidiagonalization + implicit-shift QR from there (linalg_bidiag.py): LAPACK's routes do
~3x fewer loads and stores once n^3 dominates; qr from max(m, n) = 32 applies its
reflectors a panel of 8 at a time (linalg_qr.py) (builder()). Each call compiles (once per op, shape, dtype and width; cached in the process and, as
object code, in kiln's on-disk artifact cache) two kernels: one of W lanes, W = the
host's SIMD width over the dtype (AVX-512: 16 float32 / 8 float64; AVX2: 8 / 4), and one
of a single lane for the batch's tail. The full groups
are split over kiln's intra-op pool (kiln/codegen/cpu/compiled.py) when the work pays
for the hand-off. The kernels read and write the row-major batch directly.

The kernels also sort (eigh ascending, svd descending), apply the sign convention (each
eigenvector and right singular vector has its largest-magnitude entry positive, the
first such on ties, as the Metal kernels) and report each matrix's largest magnitude.
Left to numpy here, touching only the few matrices concerned: redoing a matrix whose
squares would overflow or underflow, scaled by a power of two; NaN results for a matrix
with a NaN or infinite entry; completing U for exactly zero singular values (a QR of
the matrices that have one); the transposes of a wide (m < n) SVD and its signs.
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu import linalg_bidiag as bidiag
from kiln.codegen.cpu import linalg_kernels as kernels
from kiln.codegen.cpu import linalg_qr as blocked
from kiln.codegen.cpu import linalg_tridiag as tridiag

_ABI = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_int64)
_SCALAR = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
# below this many flops a launch stays on the calling thread (the pool's hand-off costs
# 20-50 us on a loaded machine)
SPLIT_FLOPS = 1 << 22
_lock = threading.Lock()


@lru_cache(maxsize=None)
def simd_bits() -> int:
    """The widest vector the host runs natively: 512 (AVX-512F), 256 (AVX2), else 128."""
    import llvmlite.binding as llvm

    from kiln.codegen.cpu.jit import _init

    _init()
    feats = llvm.get_host_cpu_features()
    if feats.get("avx512f", False):
        return 512
    if feats.get("avx2", False) or feats.get("avx", False):
        return 256
    return 128


def lanes(dtype) -> int:
    """W: matrices per SIMD vector for `dtype` on this host."""
    return simd_bits() // (8 * np.dtype(dtype).itemsize)


class _Kernel:
    """One compiled kernel: its object code comes from kiln's on-disk artifact cache when
    a run before built the same IR for this CPU (keyed by kiln's version, the IR text and
    the host CPU), else from LLVM (and is stored there)."""

    def __init__(self, builder, *shape):
        import llvmlite.binding as llvm

        from kiln._version import __version__
        from kiln.codegen import artifact_cache
        from kiln.codegen.cpu import jit

        name, text = builder(*shape)
        jit._init()
        key = artifact_cache.content_key("linalg-native", __version__, text, llvm.get_host_cpu_name(),
                                         llvm.get_host_cpu_features().flatten())
        blob = artifact_cache.load(key)
        if blob is None:
            mod = jit.parse(text)
            jit.optimize(mod)
            blob = jit.object_code(mod)
            artifact_cache.store(key, blob)
        self.jitted = jit.Jitted(objects=(blob,))
        self.fn = _ABI(self.jitted.address(name))


def builder(op: str, dims: tuple):
    """The kernel builder for `op` on matrices of `dims`: eigh from n = tridiag.QL_FROM
    on is tridiagonalization + QL (linalg_tridiag.py), svd from min(m, n) =
    bidiag.GKR_FROM on bidiagonalization + QR sweeps (linalg_bidiag.py); below them
    Jacobi (linalg_kernels.py), which wins where the reductions' fixed costs dominate.
    qr from max(m, n) = blocked.BLOCKED_FROM on is blocked Householder (linalg_qr.py)."""
    if op == "eigh" and dims[0] >= tridiag.QL_FROM:
        return tridiag.eigh
    if op == "svd" and min(dims) >= bidiag.GKR_FROM:
        return bidiag.svd
    if op == "qr" and max(dims) >= blocked.BLOCKED_FROM:
        return blocked.qr
    return getattr(kernels, op)


@lru_cache(maxsize=None)
def _compiled(op: str, dims: tuple, scalar: str, width: int) -> _Kernel:
    with _lock:
        return _Kernel(builder(op, dims), *dims, scalar, width)


def _ptr(x) -> int | None:
    return None if x is None else x.ctypes.data


def _launch(op: str, dims: tuple, a: np.ndarray, outs: list, flops_each: float) -> np.ndarray:
    """Run `op` over the batch a [B, ...] into the preallocated `outs` (each [B, ...]);
    returns each matrix's largest magnitude (NaN: a NaN or infinite entry)."""
    from kiln.codegen.cpu.compiled import pool, split
    from kiln.runtime.threads import get_num_threads

    batch = a.shape[0]
    scalar = _SCALAR[a.dtype]
    width = lanes(a.dtype)
    mag = np.empty(batch, a.dtype)
    ptrs = [_ptr(a)] + [_ptr(o) for o in outs] + [None] * (3 - len(outs)) + [_ptr(mag)]
    groups = batch // width
    if groups:
        fn = _compiled(op, dims, scalar, width).fn
        threads = get_num_threads()
        parts = min(threads, groups) if flops_each * batch >= SPLIT_FLOPS else 1
        if parts > 1:
            pool(threads).run(lambda bufs, sizes, lo, hi: fn(*bufs, lo, hi), ptrs, None, split(groups, parts))
        else:
            fn(*ptrs, 0, groups)
    if groups * width < batch:
        _compiled(op, dims, scalar, 1).fn(*ptrs, groups * width, batch)
    return mag


def supports(a_shape: tuple, dtype) -> bool:
    """Whether the kernels take this operand at all (float32/float64, 1..64 x 1..64)."""
    return (np.dtype(dtype) in _SCALAR and len(a_shape) >= 2
            and all(isinstance(d, int) and 1 <= d <= 64 for d in a_shape[-2:]))


def _batch(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape((-1,) + a.shape[-2:])


_SAFE_EXP = {np.dtype(np.float32): 40, np.dtype(np.float64): 400}


def _run(op: str, dims: tuple, x: np.ndarray, outs: list, flops_each: float, unscale, even: bool = False):
    """Launch, then redo the matrices whose squares would overflow or underflow scaled
    by a power of two (4^k when `even`), `unscale(sub_outs, factors)` undoing it on the
    results; matrices with a NaN or infinite entry get NaN results (as LAPACK's)."""
    mag = _launch(op, dims, x, outs, flops_each)
    _, e = np.frexp(mag)
    limit = _SAFE_EXP[x.dtype]
    redo = np.nonzero(np.isfinite(mag) & (mag > 0) & ((e > limit) | (e < -limit)))[0]
    if redo.size:
        e = e[redo] + (e[redo] % 2 if even else 0)
        factor = np.ldexp(np.ones(redo.size, x.dtype), -e)
        sub = [np.empty((redo.size,) + o.shape[1:], o.dtype) for o in outs]
        _launch(op, dims, np.ascontiguousarray(x[redo] * factor[:, None, None]), sub, flops_each)
        unscale(sub, factor)
        for o, v in zip(outs, sub):
            o[redo] = v
    bad = ~np.isfinite(mag)
    if bad.any():
        for o in outs:
            if o.dtype.kind == "f":
                o[bad] = np.nan
    return outs


def cholesky(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(L, info) of the lower triangles of a [..., n, n], as torch.linalg.cholesky_ex:
    info[...] is 0, or k when the leading minor of order k is not positive definite (L
    is then not a factor)."""
    x = _batch(a)
    n = x.shape[-1]

    def unscale(sub, factor):
        sub[0] /= np.sqrt(factor)[:, None, None]

    out, info = _run("cholesky", (n,), x, [np.empty_like(x), np.empty(x.shape[0], np.int32)], n ** 3 / 3,
                     unscale, even=True)
    return out.reshape(a.shape), info.reshape(a.shape[:-2])


def qr(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reduced (Q, R) of a [..., m, n] (LAPACK's Householder convention)."""
    x = _batch(a)
    b, (m, n) = x.shape[0], x.shape[-2:]
    k = min(m, n)

    def unscale(sub, factor):
        sub[1] /= factor[:, None, None]

    q, r = _run("qr", (m, n), x, [np.empty((b, m, k), x.dtype), np.empty((b, k, n), x.dtype)], 2 * m * n * k,
                unscale)
    lead = a.shape[:-2]
    return q.reshape(lead + (m, k)), r.reshape(lead + (k, n))


def eigh(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w ascending [..., n], v [..., n, n] eigenvectors as columns) of the symmetric
    matrices whose lower triangles a holds."""
    x = _batch(a)
    b, n = x.shape[0], x.shape[-1]

    def unscale(sub, factor):
        sub[0] /= factor[:, None]

    w, v = _run("eigh", (n,), x, [np.empty((b, n), x.dtype), np.empty((b, n, n), x.dtype)], 8 * n ** 3, unscale)
    return w.reshape(a.shape[:-1]), v.reshape(a.shape)


def svd(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reduced (u [..., m, k], s [..., k] descending, vh [..., k, n]); each right singular
    vector (row of vh) has its largest-magnitude entry positive."""
    x = _batch(a)
    m, n = x.shape[-2:]
    wide = m < n
    if wide:  # a^T = V S U^T
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
        m, n = n, m
    b = x.shape[0]

    def unscale(sub, factor):
        sub[1] /= factor[:, None]

    u, s, vh = _run("svd", (m, n), x, [np.empty((b, m, n), x.dtype), np.empty((b, n), x.dtype),
                                       np.empty((b, n, n), x.dtype)], 10 * m * n * n, unscale)
    u = _complete(u, s)
    if wide:  # u, vh of a^T: a's are vh^T, u^T; its sign convention is on the rows of vh
        v, u = u, vh.transpose(0, 2, 1)
        sign = _sign_columns(v)
        u, vh = u * sign[:, None, :], (v * sign[:, None, :]).transpose(0, 2, 1)
    lead, k = a.shape[:-2], min(a.shape[-2:])
    return (np.ascontiguousarray(u).reshape(lead + (a.shape[-2], k)), s.reshape(lead + (k,)),
            np.ascontiguousarray(vh).reshape(lead + (k, a.shape[-1])))


def _sign_columns(v: np.ndarray) -> np.ndarray:
    """+1/-1 per column of v [B, r, c]: the sign of its largest-|.| entry (first on ties)."""
    pick = np.abs(v).argmax(axis=-2)[:, None, :]
    s = np.sign(np.take_along_axis(v, pick, axis=-2))[:, 0, :]
    return np.where(s == 0, 1, s).astype(v.dtype)


def _complete(u: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Give U's columns of exactly zero singular values (zero columns: nothing to
    normalize) an orthonormal completion; they are last after the descending sort, so
    Householder QR of [U's other columns | identity columns] keeps the others (up to
    sign, undone) and makes the rest orthonormal to them."""
    zero = ~(s > 0)
    hit = np.nonzero(zero.any(axis=-1))[0]
    if hit.size == 0:
        return u
    sub, z = u[hit], zero[hit][:, None, :]
    seed = np.broadcast_to(np.eye(*sub.shape[-2:], dtype=u.dtype), sub.shape)
    q, r = np.linalg.qr(np.where(z, seed, sub))
    d = np.sign(np.diagonal(r, axis1=-2, axis2=-1))
    q = q * np.where(d == 0, 1, d)[:, None, :]
    u = u.copy()
    u[hit] = np.where(z, q, sub)
    return u
