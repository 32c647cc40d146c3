"""Blocked Householder QR over lanes (LAPACK's geqrf + orgqr with larft/larfb).

At 64 x 64 and 16 float32 lanes the matrix (266 KB) and Q (266 KB) live in L2, and the
unblocked kernel (linalg_kernels.qr) streams the trailing matrix through L1 twice per
reflector. Here PANEL reflectors are factored on their own columns, gathered into a
compact WY form H_p ... H_{p+b-1} = I - V T V^T (T upper triangular, larft), and applied
to the trailing columns at once (larfb): Y = V^T X along X's columns with PANEL sums
held in registers, W = T^T Y, X -= V W: two passes per panel instead of two per column.
Q is formed backward panel by panel the same way (X -= V (T (V^T X))). A panel that runs
past min(m, n) gets tau = 0 and zero vectors for its missing reflectors, so every panel
has the same shape.
"""

from __future__ import annotations

from kiln.codegen.cpu.linalg_kernels import _column_reflector, _reflect, _store, _sum
from kiln.codegen.cpu.linalg_lanes import Lanes

PANEL = 8
# the smallest max(m, n) taken by this kernel rather than the unblocked one
# (linalg_native.builder), measured with 4096 matrices on one thread: 16 x 16 float32
# 4.0 vs 3.9 ms unblocked, 32 x 32 14.6 vs 15.9, 64 x 64 65 vs 111 (float64 142 vs 237)
BLOCKED_FROM = 32


def _panel_vectors(L: Lanes, A, na: int, m: int, k: int, p0, Vp, Tau, Tm) -> None:
    """Vp (rows p0.., PANEL columns, rows PANEL apart) <- the panel's reflector vectors
    with their zeros and leading ones; Tm (PANEL x PANEL) <- their T (larft, forward)."""
    b = PANEL
    with L.loop(p0, m) as rl:
        r = rl.i
        for i in range(b):
            j = L.add(p0, i)
            below = L.f.bin("and", L.icmp("slt", j, k), L.icmp("sgt", r, j))
            head = L.f.bin("and", L.icmp("slt", j, k), L.icmp("eq", r, j))
            value = L.select(below, L.ld(A, L.idx(r, na, L.select(L.icmp("slt", j, k), j, L.i(0)))), L.k(0))
            L.st(Vp, L.idx(r, b, i), L.select(head, L.k(1), value))
    for i in range(b):
        j = L.add(p0, i)
        tau = L.select(L.icmp("slt", j, k), L.ld(Tau, L.select(L.icmp("slt", j, k), j, L.i(0))), L.k(0))
        # T[0:i, i] = -tau T[0:i, 0:i] z, z_l = V[:, l] . v_i
        z = [_sum(L, p0, m, L.k(0), lambda r, l=l: L.fmul(L.ld(Vp, L.idx(r, b, l)), L.ld(Vp, L.idx(r, b, i))))
             for l in range(i)]
        for l in range(i):
            acc = L.k(0)
            for q in range(l, i):
                acc = L.fma(L.ld(Tm, l * b + q), z[q], acc)
            L.st(Tm, l * b + i, L.fmul(L.f.fneg(tau), acc))
        L.st(Tm, i * b + i, tau)
        for l in range(i + 1, b):
            L.st(Tm, l * b + i, L.k(0))


def _apply_block(L: Lanes, X, ldx: int, rows: int, p0, c_lo, c_hi, Vp, Tm, transpose: bool) -> None:
    """X[p0:, c_lo:c_hi] <- (I - V T' V^T) X[p0:, c_lo:c_hi] with T' = T^T if
    `transpose` (Q^T A, the factorization) else T (forming Q): larfb."""
    b = PANEL
    with L.loop(c_lo, c_hi) as cl:
        c = cl.i
        with L.loop(p0, rows, [L.k(0)] * b) as rl:  # y = V^T x, PANEL sums in registers
            x = L.ld(X, L.idx(rl.i, ldx, c))
            rl.next = [L.fma(L.ld(Vp, L.idx(rl.i, b, i)), x, rl.vals[i]) for i in range(b)]
        y = rl.vals
        if transpose:  # w_i = sum_{l <= i} T[l, i] y_l
            w = [None] * b
            for i in range(b):
                acc = L.k(0)
                for l in range(i + 1):
                    acc = L.fma(L.ld(Tm, l * b + i), y[l], acc)
                w[i] = acc
        else:  # w_i = sum_{l >= i} T[i, l] y_l
            w = [None] * b
            for i in range(b):
                acc = L.k(0)
                for l in range(i, b):
                    acc = L.fma(L.ld(Tm, i * b + l), y[l], acc)
                w[i] = acc
        with L.loop(p0, rows) as rl:  # x -= V w
            e = L.idx(rl.i, ldx, c)
            acc = L.ld(X, e)
            for i in range(b):
                acc = L.fsub(acc, L.fmul(L.ld(Vp, L.idx(rl.i, b, i)), w[i]))
            L.st(X, e, acc)


def qr(m: int, n: int, scalar: str, width: int) -> tuple[str, str]:
    """o0 <- Q (m x k), o1 <- R (k x n), k = min(m, n); as linalg_kernels.qr, blocked."""
    k = min(m, n)
    b = PANEL
    panels = -(-k // b)
    L = Lanes(f"kiln_la_qrb_{scalar}_{m}x{n}_w{width}", scalar, width)
    na, nq = n + 1, k + 1  # padded row strides (see Lanes.load_matrix)
    A, Tau, Q, Wk = L.array(m * na), L.array(k), L.array(m * nq), L.array(max(n, k))
    Vp, Tm = L.array(m * b), L.array(b * b)
    with L.loop(L.lo, L.hi) as gl:
        g = gl.i
        L.load_matrix(A, g, m, n, stride=na)
        L.magnitude(A, m, n, g, stride=na)
        with L.loop(0, panels) as pl:
            p0 = L.mul(pl.i, b)
            top = L.add(p0, b)
            end = L.select(L.icmp("slt", top, k), top, L.i(k))
            inner = L.select(L.icmp("slt", top, n), top, L.i(n))
            with L.loop(p0, end) as jl:  # the panel, unblocked (larfg + larf in its columns)
                j = jl.i
                tau = _column_reflector(L, A, na, j, m, Tau)
                _reflect(L, A, na, j, L.add(j, 1), inner, m, A, na, tau, Wk)
            with L.when(L.icmp("slt", top, n)):  # the trailing columns, at once
                _panel_vectors(L, A, na, m, k, p0, Vp, Tau, Tm)
                _apply_block(L, A, na, m, p0, top, n, Vp, Tm, transpose=True)
        with L.loop(0, m * nq) as el:  # Q = I, then the panels from the last one back
            L.st(Q, el.i, L.k(0))
        for d in range(k):
            L.st(Q, d * nq + d, L.k(1))
        with L.loop(0, panels) as pl:
            p0 = L.mul(L.f.bin("sub", L.i(panels - 1), pl.i, "nsw"), b)
            _panel_vectors(L, A, na, m, k, p0, Vp, Tau, Tm)
            _apply_block(L, Q, nq, m, p0, p0, k, Vp, Tm, transpose=False)
        _store(L, "o0", g, m, k, lambda r, c, e: L.ld(Q, L.idx(r, nq, c)))
        _store(L, "o1", g, k, n, lambda r, c, e: L.select(L.icmp("uge", c, r), L.ld(A, L.idx(r, na, c)), L.k(0)))
    return L.name, L.text()
