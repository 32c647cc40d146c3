"""The batched SVD by the Golub-Kahan-Reinsch route, as an LLVM kernel over lanes.

    svd  Householder bidiagonalization A = U_b B V_b^T (dgebd2, m >= n, B upper
         bidiagonal), U_b and V_b formed by backward accumulation (dorgbr), then
         implicit-shift QR sweeps on B (Golub and Reinsch, as Numerical Recipes' svdcmp
         and LAPACK's dbdsqr), each plane rotation applied to U's and V's columns;
         singular values made non-negative, sorted descending, each right singular vector
         with its largest-magnitude entry positive (linalg_kernels' convention)

One-sided Jacobi (linalg_kernels.svd, the Metal kernels' algorithm) needs ~7 sweeps of
n^2 / 2 rotations of (m + n)-long rows; here the reduction costs ~4 m n^2 and each QR
sweep on singular value k rotates k pairs of columns of U and of V, ~2 sweeps per value.

Lanes (W matrices per vector, linalg_lanes.Lanes) diverge in the QR phase: each lane has
its own split point l (the last negligible superdiagonal, or the last negligible
diagonal, which first chases that row's superdiagonal out with rotations against U's
column l - 1, gathered into a scratch column since l differs per lane), its own shift and
iteration count. All lanes run the rotations from the smallest l up to k; a lane whose l
is above the current index has not started (its rotations are the identity), a lane
whose B is already split at k takes no part, and the sweeps on k repeat until no lane
has work left (at most MAX_ITERATIONS times).
"""

from __future__ import annotations

from kiln.codegen.cpu.linalg_kernels import _column_reflector, _householder, _reflect, _sign_rows, _store
from kiln.codegen.cpu.linalg_lanes import Lanes

MAX_ITERATIONS = 40  # QR sweeps on one singular value (LAPACK: 6 per value on average)
# the smallest min(m, n) taken by this kernel rather than one-sided Jacobi's
# (linalg_native.builder): the crossover measured with 4096 matrices on one thread
# (n = 12: Jacobi 6.0 vs 6.4 ms in float32, 13.9 vs 14.1 in float64; n = 16: this
# kernel 11.4 vs 12.4 and 24.6 vs 28.5 ms)
GKR_FROM = 14


def _hypot(L: Lanes, a, b):
    return L.sqrt(L.fma(a, a, L.fmul(b, b)))


def _and(L: Lanes, *masks):
    out = masks[0]
    for m in masks[1:]:
        out = L.f.bin("and", out, m)
    return out


def _rotate_columns(L: Lanes, X, rows: int, ld: int, a, b, c, s) -> None:
    """(X[:, a], X[:, b]) <- (c x_a + s x_b, c x_b - s x_a) over `rows` rows."""
    with L.loop(0, rows) as rl:
        ia, ib = L.idx(rl.i, ld, a), L.idx(rl.i, ld, b)
        xa, xb = L.ld(X, ia), L.ld(X, ib)
        L.st(X, ia, L.fma(c, xa, L.fmul(s, xb)))
        L.st(X, ib, L.fsub(L.fmul(c, xb), L.fmul(s, xa)))


def _bidiagonalize(L: Lanes, A, m: int, n: int, na: int, Wd, Ws, TL, TR, Wk) -> None:
    """A <- the reflectors of A = U_b B V_b^T: left reflector i's vector below A's
    diagonal in column i (tau TL[i]), right reflector i's right of the superdiagonal in
    row i (tau TR[i]); Wd <- B's diagonal, Ws[i + 1] <- B[i, i + 1] (Ws[0] = 0)."""
    L.st(Ws, 0, L.k(0))
    with L.loop(0, n) as jl:
        j = jl.i
        j1 = L.add(j, 1)
        tau = _column_reflector(L, A, na, j, m, TL)
        L.st(Wd, j, L.ld(A, L.idx(j, na, j)))
        _reflect(L, A, na, j, j1, n, m, A, na, tau, Wk)
        with L.when(L.icmp("slt", j1, n)):  # the right reflector of row j, columns j+1..
            j2 = L.add(j, 2)
            with L.loop(j2, n, [L.k(0)]) as cl:
                x = L.ld(A, L.idx(j, na, cl.i))
                cl.next = [L.fma(x, x, cl.vals[0])]
            head = L.idx(j, na, j1)
            beta, tau, scale = _householder(L, L.ld(A, head), cl.vals[0])
            L.st(A, head, beta)
            L.st(Ws, j1, beta)
            L.st(TR, j, tau)
            with L.loop(j2, n) as cl:
                e = L.idx(j, na, cl.i)
                L.st(A, e, L.fmul(L.ld(A, e), scale))
            with L.loop(j1, m) as rl:  # rows below: A[r, j+1:] -= tau (A[r, j+1:] . v) v
                r = rl.i
                with L.loop(j2, n, [L.ld(A, L.idx(r, na, j1))]) as cl:
                    cl.next = [L.fma(L.ld(A, L.idx(r, na, cl.i)), L.ld(A, L.idx(j, na, cl.i)), cl.vals[0])]
                t = L.fmul(tau, cl.vals[0])
                e = L.idx(r, na, j1)
                L.st(A, e, L.fsub(L.ld(A, e), t))
                with L.loop(j2, n) as cl:
                    e = L.idx(r, na, cl.i)
                    L.st(A, e, L.fsub(L.ld(A, e), L.fmul(t, L.ld(A, L.idx(j, na, cl.i)))))


def _form_u(L: Lanes, A, m: int, n: int, na: int, TL, U, nu: int, Wk) -> None:
    """U (m x n) <- H_0 ... H_{n-1} times the first n columns of the identity."""
    with L.loop(0, m * nu) as el:
        L.st(U, el.i, L.k(0))
    for d in range(n):
        L.st(U, d * nu + d, L.k(1))
    with L.loop(0, n) as bl:
        j = L.f.bin("sub", L.i(n - 1), bl.i, "nsw")
        _reflect(L, U, nu, j, j, n, m, A, na, L.ld(TL, j), Wk)


def _form_v(L: Lanes, A, n: int, na: int, TR, V, nv: int, Wk) -> None:
    """V (n x n) <- G_0 ... G_{n-3}; G_i acts on rows and columns i+1.. with the vector
    [1, A[i, i+2:]], and the product so far is the identity outside them."""
    with L.loop(0, n * nv) as el:
        L.st(V, el.i, L.k(0))
    for d in range(n):
        L.st(V, d * nv + d, L.k(1))
    if n < 3:
        return
    with L.loop(0, n - 2) as bl:
        i = L.f.bin("sub", L.i(n - 3), bl.i, "nsw")
        i1, i2 = L.add(i, 1), L.add(i, 2)
        tau = L.ld(TR, i)
        with L.loop(i1, n) as cl:  # w = v^T V[i+1:, i+1:]
            L.st(Wk, cl.i, L.ld(V, L.idx(i1, nv, cl.i)))
        with L.loop(i2, n) as rl:
            vr = L.ld(A, L.idx(i, na, rl.i))
            with L.loop(i1, n) as cl:
                L.st(Wk, cl.i, L.fma(vr, L.ld(V, L.idx(rl.i, nv, cl.i)), L.ld(Wk, cl.i)))
        with L.loop(i1, n) as cl:
            w = L.fmul(tau, L.ld(Wk, cl.i))
            L.st(Wk, cl.i, w)
            e = L.idx(i1, nv, cl.i)
            L.st(V, e, L.fsub(L.ld(V, e), w))
        with L.loop(i2, n) as rl:
            vr = L.ld(A, L.idx(i, na, rl.i))
            with L.loop(i1, n) as cl:
                e = L.idx(rl.i, nv, cl.i)
                L.st(V, e, L.fsub(L.ld(V, e), L.fmul(vr, L.ld(Wk, cl.i))))


def _put_at(L: Lanes, arr, lo, hi, where, value) -> None:
    """Per lane, arr[where] <- value for the float index lanes `where` in [lo, hi) (lanes
    whose `where` is outside keep theirs): a select at each candidate."""
    with L.loop(lo, hi) as kl:
        hit = L.fcmp("oeq", where, L.findex(kl.i))
        L.st(arr, kl.i, L.select(hit, value, L.ld(arr, kl.i)))


def _cancel(L: Lanes, m: int, nu: int, U, Wd, Ws, Col, k, lval, canc, tol) -> None:
    """For the lanes `canc` (their B[l-1, l-1] negligible): chase B[l-1, l] out along
    row l - 1 by rotations of columns (l - 1, i), i = l..k, of B and of U (NR's
    cancellation); U's column l - 1 differs per lane: gathered into Col, scattered back."""
    nm = L.fsub(lval, L.k(1))
    where = L.select(canc, nm, L.k(0))
    with L.loop(0, m) as rl:  # Col <- U[:, l - 1] (column 0 for the other lanes)
        L.st(Col, rl.i, L.pick(U, L.fadd(where, L.findex(L.mul(rl.i, nu)))))
    with L.loop(1, L.add(k, 1), [L.k(0), L.k(1), L.k(0)]) as il:
        i = il.i
        c, s, stop = il.vals
        started = _and(L, canc, L.fcmp("oge", L.findex(i), lval), L.fcmp("oeq", stop, L.k(0)))
        si = L.ld(Ws, i)
        ff = L.fmul(s, si)
        L.st(Ws, i, L.select(started, L.fmul(c, si), si))
        small = L.fcmp("ole", L.fabs(ff), tol)
        go = _and(L, started, L.mask_not(small))
        g = L.ld(Wd, i)
        h = _hypot(L, ff, g)
        L.st(Wd, i, L.select(go, h, g))
        hinv = L.fdiv(L.k(1), L.select(go, h, L.k(1)))
        c2, s2 = L.select(go, L.fmul(g, hinv), L.k(1)), L.select(go, L.f.fneg(L.fmul(ff, hinv)), L.k(0))
        with L.loop(0, m) as rl:  # (Col, U[:, i]) <- (y c + z s, z c - y s)
            ui = L.idx(rl.i, nu, i)
            y, z = L.ld(Col, rl.i), L.ld(U, ui)
            L.st(Col, rl.i, L.fma(y, c2, L.fmul(z, s2)))
            L.st(U, ui, L.fsub(L.fmul(z, c2), L.fmul(y, s2)))
        il.next = [L.select(go, c2, c), L.select(go, s2, s),
                   L.select(_and(L, started, small), L.k(1), stop)]
    with L.loop(0, m) as rl:  # U[:, l - 1] <- Col
        base = L.mul(rl.i, nu)
        _put_at(L, U, base, L.add(base, k), L.fadd(where, L.findex(base)), L.ld(Col, rl.i))


def _qr_sweep(L: Lanes, m: int, n: int, nu: int, nv: int, U, V, Wd, Ws, k, lval, active) -> None:
    """One implicit-shift QR sweep on B[l..k, l..k] for the lanes `active` (NR's svdcmp
    inner loop), the rotations applied to U's and V's columns."""
    one = L.k(1)
    x = L.select(active, L.pick(Wd, lval), one)
    km1 = L.add(k, -1)
    y = L.select(active, L.ld(Wd, km1), one)
    z = L.ld(Wd, k)
    g = L.ld(Ws, km1)
    h = L.select(active, L.ld(Ws, k), one)
    ff = L.fdiv(L.fadd(L.fmul(L.fsub(y, z), L.fadd(y, z)), L.fmul(L.fsub(g, h), L.fadd(g, h))),
                L.fmul(L.fmul(L.k(2), h), y))
    g = _hypot(L, ff, one)
    ff = L.fdiv(L.fadd(L.fmul(L.fsub(x, z), L.fadd(x, z)),
                       L.fmul(h, L.fsub(L.fdiv(y, L.fadd(ff, L.copysign(g, ff))), h))), x)
    with L.loop(0, k, [one, one, ff, x]) as jl:
        j = jl.i
        i = L.add(j, 1)
        c, s, ff, x = jl.vals
        started = _and(L, active, L.fcmp("oge", L.findex(j), lval))
        g, y = L.ld(Ws, i), L.ld(Wd, i)
        h, g = L.fmul(s, g), L.fmul(c, g)
        z = _hypot(L, ff, h)
        L.st(Ws, j, L.select(started, z, L.ld(Ws, j)))
        nz = L.fcmp("one", z, L.k(0))
        zinv = L.fdiv(one, L.select(nz, z, one))
        c1 = L.select(nz, L.fmul(ff, zinv), one)
        s1 = L.select(nz, L.fmul(h, zinv), L.k(0))
        ff2 = L.fma(x, c1, L.fmul(g, s1))
        g2 = L.fsub(L.fmul(g, c1), L.fmul(x, s1))
        h2, y2 = L.fmul(y, s1), L.fmul(y, c1)
        _rotate_columns(L, V, n, nv, j, i, L.select(started, c1, one), L.select(started, s1, L.k(0)))
        z2 = _hypot(L, ff2, h2)
        L.st(Wd, j, L.select(started, z2, L.ld(Wd, j)))
        nz2 = L.fcmp("one", z2, L.k(0))
        z2inv = L.fdiv(one, L.select(nz2, z2, one))
        c2 = L.select(nz2, L.fmul(ff2, z2inv), c1)
        s2 = L.select(nz2, L.fmul(h2, z2inv), s1)
        ff3 = L.fma(c2, g2, L.fmul(s2, y2))
        x3 = L.fsub(L.fmul(c2, y2), L.fmul(s2, g2))
        _rotate_columns(L, U, m, nu, j, i, L.select(started, c2, one), L.select(started, s2, L.k(0)))
        jl.next = [L.select(started, c2, c), L.select(started, s2, s), L.select(started, ff3, ff),
                   L.select(started, x3, x)]
    _c, _s, ff, x = jl.vals
    _put_at(L, Ws, 0, k, L.select(active, lval, L.k(-1)), L.k(0))  # B[l-1, l] <- 0
    L.st(Ws, k, L.select(active, ff, L.ld(Ws, k)))
    L.st(Wd, k, L.select(active, x, L.ld(Wd, k)))


def _diagonalize(L: Lanes, m: int, n: int, nu: int, nv: int, U, V, Wd, Ws, Col) -> None:
    """QR sweeps on B (Wd, Ws) until it is diagonal, from its last value up."""
    f = L.f
    with L.loop(0, n, [L.k(0)]) as il:  # anorm: the largest |d_i| + |e_i|
        il.next = [L.fmax(il.vals[0], L.fadd(L.fabs(L.ld(Wd, il.i)), L.fabs(L.ld(Ws, il.i))))]
    tol = L.fmul(L.k(L.eps), il.vals[0])
    with L.loop(0, n) as kl:
        k = L.f.bin("sub", L.i(n - 1), kl.i, "nsw")
        kf = L.findex(k)
        _count, end = L.sweep_loop(MAX_ITERATIONS + 1)
        # per lane l: the largest l <= k with e_l negligible (flag 0) or d_{l-1}
        # negligible (flag 1, l >= 1); e_0 = 0, so l = 0 at the latest
        with L.loop(1, L.add(k, 1), [L.k(0), L.k(0)]) as ll:
            lf = L.findex(ll.i)
            hit_e = L.fcmp("ole", L.fabs(L.ld(Ws, ll.i)), tol)
            hit_d = L.fcmp("ole", L.fabs(L.ld(Wd, L.add(ll.i, -1))), tol)
            hit = L.f.bin("or", hit_e, hit_d)
            ll.next = [L.select(hit, lf, ll.vals[0]), L.select(hit, L.select(hit_e, L.k(0), L.k(1)), ll.vals[1])]
        lval, flag = ll.vals
        active = L.fcmp("olt", lval, kf)  # B not split at k: a QR sweep from l
        canc = L.fcmp("oeq", flag, L.k(1))  # d_{l-1} negligible: first chase e_l out
        work = L.f.bin("or", active, canc)
        with L.when(L.any(work)):
            with L.when(L.any(canc)):
                _cancel(L, m, nu, U, Wd, Ws, Col, k, lval, canc, tol)
            with L.when(L.any(active)):
                _qr_sweep(L, m, n, nu, nv, U, V, Wd, Ws, k, lval, active)
        end(f.emit(f"xor i1 {L.any(work).ref}, true", "i1"))
        z = L.ld(Wd, k)  # a negative singular value: flip it and V's column
        neg = L.fcmp("olt", z, L.k(0))
        with L.when(L.any(neg)):
            L.st(Wd, k, L.select(neg, L.f.fneg(z), z))
            with L.loop(0, n) as rl:
                e = L.idx(rl.i, nv, k)
                x = L.ld(V, e)
                L.st(V, e, L.select(neg, L.f.fneg(x), x))


def svd(m: int, n: int, scalar: str, width: int) -> tuple[str, str]:
    """m >= n. o0 <- U (m x n), o1 <- s (n, descending), o2 <- V^T (n x n)."""
    L = Lanes(f"kiln_la_svdqr_{scalar}_{m}x{n}_w{width}", scalar, width)
    na = nu = nv = n + 1  # padded row strides (see Lanes.load_matrix)
    A, U, V = L.array(m * na), L.array(m * nu), L.array(n * nv)
    Wd, Ws, TL, TR, Wk, Col = L.array(n), L.array(n), L.array(n), L.array(n), L.array(n), L.array(m)
    with L.loop(L.lo, L.hi) as gl:
        g = gl.i
        L.load_matrix(A, g, m, n, stride=na)
        L.magnitude(A, m, n, g, stride=na)
        _bidiagonalize(L, A, m, n, na, Wd, Ws, TL, TR, Wk)
        _form_u(L, A, m, n, na, TL, U, nu, Wk)
        _form_v(L, A, n, na, TR, V, nv, Wk)
        _diagonalize(L, m, n, nu, nv, U, V, Wd, Ws, Col)
        _sign_rows(L, V, n, n, nv, also=(U, m, nu), by_columns=True)
        order = L.order(Wd, n, descending=True)
        L.write_elements(L.args["o1"], g, n, lambda e: L.pick(Wd, L.ld(order, e)))
        _store(L, "o0", g, m, n, lambda r, c, e: L.pick(U, L.fadd(L.findex(L.mul(r, nu)), L.ld(order, c))))
        _store(L, "o2", g, n, n, lambda r, c, e: L.pick(V, L.fadd(L.findex(L.mul(c, nv)), L.ld(order, r))))
    return L.name, L.text()
