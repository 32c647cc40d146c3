"""Running the batched small-matrix kernels (linalg_kernels.py) on numpy batches.

    >>> L, info = linalg_native.cholesky(a)        # a: [..., n, n] float32/float64
    >>> w, v = linalg_native.eigh(a)               # ascending, sign-normalized columns

Each call compiles (once per op, shape, dtype and width; cached in the process) two
kernels: one of W lanes, W = the host's SIMD width over the dtype (AVX-512: 16 float32 /
8 float64; AVX2: 8 / 4), and one of a single lane for the batch's tail. The full groups
are split over kiln's intra-op pool (kiln/codegen/cpu/compiled.py) when the work pays
for the hand-off. The kernels read and write the row-major batch directly.

What the kernels leave to numpy here, all O(batch * n^2): eigh's ascending order and
svd's descending one (argsort + take_along_axis), the sign convention (each eigenvector
and right singular vector has its largest-magnitude entry positive, the first such on
ties, as the Metal kernels), scaling each matrix by a power of two when the batch holds
values whose squares would overflow or underflow, and completing U for exactly zero
singular values (a QR of the few matrices that have one).
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu import linalg_kernels as kernels

_ABI = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_int64, ctypes.c_int64)
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
    def __init__(self, builder, *shape):
        from kiln.codegen.cpu import jit

        name, text = builder(*shape)
        mod = jit.parse(text)
        jit.optimize(mod)
        self.jitted = jit.Jitted(mod)
        self.fn = _ABI(self.jitted.address(name))


@lru_cache(maxsize=None)
def _compiled(op: str, dims: tuple, scalar: str, width: int) -> _Kernel:
    with _lock:
        return _Kernel(getattr(kernels, op), *dims, scalar, width)


def _ptr(x) -> int | None:
    return None if x is None else x.ctypes.data


def _launch(op: str, dims: tuple, a: np.ndarray, outs: list, flops_each: float) -> None:
    """Run `op` over the batch a [B, ...] into the preallocated `outs` (each [B, ...])."""
    from kiln.codegen.cpu.compiled import pool, split
    from kiln.runtime.threads import get_num_threads

    batch = a.shape[0]
    scalar = _SCALAR[a.dtype]
    width = lanes(a.dtype)
    ptrs = [_ptr(a)] + [_ptr(o) for o in outs] + [None] * (3 - len(outs))
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


def supports(a_shape: tuple, dtype) -> bool:
    """Whether the kernels take this operand at all (float32/float64, 1..64 x 1..64)."""
    return (np.dtype(dtype) in _SCALAR and len(a_shape) >= 2
            and all(isinstance(d, int) and 1 <= d <= 64 for d in a_shape[-2:]))


def _batch(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape((-1,) + a.shape[-2:])


_SAFE_EXP = {np.dtype(np.float32): 40, np.dtype(np.float64): 400}


def _scales(a: np.ndarray, even: bool = False) -> np.ndarray | None:
    """Power-of-two factors bringing each matrix's largest entry near 1, or None when
    every entry's square is representable as it is (the usual case: one max and min)."""
    mag = np.abs(a).max(axis=(-2, -1))
    limit = _SAFE_EXP[a.dtype]
    finite = mag[np.isfinite(mag) & (mag > 0)]
    if finite.size == 0 or (np.frexp(finite.max())[1] < limit and np.frexp(finite.min())[1] > -limit):
        return None
    _, e = np.frexp(np.where(np.isfinite(mag) & (mag > 0), mag, 1))
    if even:
        e = e + (e % 2)
    return np.ldexp(np.ones_like(mag), -e).astype(a.dtype)


def cholesky(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(L, info) of the lower triangles of a [..., n, n], as torch.linalg.cholesky_ex:
    info[...] is 0, or k when the leading minor of order k is not positive definite (L
    is then not a factor)."""
    x = _batch(a)
    n = x.shape[-1]
    scale = _scales(x, even=True)
    if scale is not None:
        x = x * scale[:, None, None]
    out, info = np.empty_like(x), np.empty(x.shape[0], np.int32)
    _launch("cholesky", (n,), x, [out, info], n ** 3 / 3)
    if scale is not None:
        out /= np.sqrt(scale)[:, None, None]
    return out.reshape(a.shape), info.reshape(a.shape[:-2])


def qr(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reduced (Q, R) of a [..., m, n] (LAPACK's Householder convention)."""
    x = _batch(a)
    m, n = x.shape[-2:]
    k = min(m, n)
    scale = _scales(x)
    if scale is not None:
        x = x * scale[:, None, None]
    q, r = np.empty((x.shape[0], m, k), x.dtype), np.empty((x.shape[0], k, n), x.dtype)
    _launch("qr", (m, n), x, [q, r], 2 * m * n * k)
    if scale is not None:
        r /= scale[:, None, None]
    lead = a.shape[:-2]
    return q.reshape(lead + (m, k)), r.reshape(lead + (k, n))


def _sign_columns(v: np.ndarray) -> np.ndarray:
    """+1/-1 per column of v [B, r, c]: the sign of its largest-|.| entry (first on ties)."""
    pick = np.abs(v).argmax(axis=-2)[:, None, :]
    s = np.sign(np.take_along_axis(v, pick, axis=-2))[:, 0, :]
    return np.where(s == 0, 1, s).astype(v.dtype)


def eigh(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w ascending [..., n], v [..., n, n] eigenvectors as columns) of the symmetric
    matrices whose lower triangles a holds."""
    x = _batch(a)
    b, n = x.shape[0], x.shape[-1]
    scale = _scales(x)
    if scale is not None:
        x = x * scale[:, None, None]
    w, vt = np.empty((b, n), x.dtype), np.empty((b, n, n), x.dtype)
    _launch("eigh", (n,), x, [w, vt], 8 * n ** 3)
    if scale is not None:
        w /= scale[:, None]
    order = np.argsort(w, axis=-1, kind="stable")
    w = np.take_along_axis(w, order, axis=-1)
    v = np.take_along_axis(vt, order[:, :, None], axis=1).transpose(0, 2, 1)
    v = v * _sign_columns(v)[:, None, :]
    return w.reshape(a.shape[:-1]), np.ascontiguousarray(v).reshape(a.shape)


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
    scale = _scales(x)
    if scale is not None:
        x = x * scale[:, None, None]
    u, s, vh = np.empty((b, m, n), x.dtype), np.empty((b, n), x.dtype), np.empty((b, n, n), x.dtype)
    _launch("svd", (m, n), x, [u, s, vh], 10 * m * n * n)
    if scale is not None:
        s /= scale[:, None]
    order = np.argsort(-s, axis=-1, kind="stable")
    s = np.take_along_axis(s, order, axis=-1)
    u = np.take_along_axis(u, order[:, None, :], axis=2)
    v = np.take_along_axis(vh, order[:, :, None], axis=1).transpose(0, 2, 1)  # columns
    u = _complete(u, s)
    if wide:
        u, v = v, u
    sign = _sign_columns(v)
    u, vh = u * sign[:, None, :], (v * sign[:, None, :]).transpose(0, 2, 1)
    lead, k = a.shape[:-2], min(a.shape[-2:])
    return (np.ascontiguousarray(u).reshape(lead + (a.shape[-2], k)), s.reshape(lead + (k,)),
            np.ascontiguousarray(vh).reshape(lead + (k, a.shape[-1])))


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
