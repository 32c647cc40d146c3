"""The batched symmetric eigensolver by LAPACK's route, as an LLVM kernel over lanes.

    eigh  Householder tridiagonalization (dsytd2, lower), the orthogonal factor formed
          by backward accumulation (dorgtr), then implicit QL with Wilkinson-type shifts
          on the tridiagonal matrix (tqli, as dsteqr's QL branch), each plane rotation
          applied to the accumulated vectors; eigenvalues ascending, eigenvectors as
          columns with the sign convention of linalg_kernels (largest-magnitude entry
          positive)

Two-sided Jacobi (linalg_kernels.eigh, the algorithm of the Metal kernels) needs ~6
sweeps of n^2 / 2 rotations, each turning 4n entries of A and the vectors: ~12 n^3 loads
and as many stores. Here the reduction costs ~n^3 and each QL iteration on eigenvalue l
rotates n - l pairs of vector columns, ~2 iterations per eigenvalue: ~4 n^3 in all, which
at n = 32 runs in well under half the time (benchmarks/results/linalg.md).

Lanes (W matrices per vector, linalg_lanes.Lanes) diverge only in QL: each lane has its
own split point m (the first negligible off-diagonal from l on), its own shift and its
own number of iterations. All lanes run the chain of rotations from the largest m down
to l; a lane whose m is below the current row has not started (its rotation is the
identity), a lane whose off-diagonal e[l] is already negligible takes no part, and the
iterations on l repeat until no lane has work left (at most MAX_ITERATIONS times).
"""

from __future__ import annotations

from kiln.codegen.cpu.linalg_kernels import _householder, _reflect, _sign_rows, _store
from kiln.codegen.cpu.linalg_lanes import Lanes

MAX_ITERATIONS = 40  # QL iterations on one eigenvalue (LAPACK allows 30 per eigenvalue)
# the smallest n taken by this kernel rather than Jacobi's (linalg_native.builder): the
# crossover measured with 4096 matrices on one thread (n = 10: Jacobi 2.3 ms vs 2.5 ms
# in float32, QL 5.7 vs 6.5 ms in float64; n = 12: QL ahead in both)
QL_FROM = 11


def _tridiagonalize(L: Lanes, A, n: int, ld: int, D, E, T, Vv, P) -> None:
    """A (full symmetric, rows ld apart) <- Q^T A Q = tridiagonal (D diagonal, E[j] the
    entry (j + 1, j), E[n - 1] = 0); reflector j's vector below A's subdiagonal in
    column j (its leading 1 implicit), its tau in T[j]."""
    at = lambda i, j: L.idx(i, ld, j)  # noqa: E731
    with L.loop(0, n - 1) as jl:
        j = jl.i
        j1 = L.add(j, 1)
        alpha = L.ld(A, at(j1, j))
        with L.loop(L.add(j, 2), n, [L.k(0)]) as il:
            x = L.ld(A, at(il.i, j))
            il.next = [L.fma(x, x, il.vals[0])]
        xn2 = il.vals[0]
        beta, tau, scale = _householder(L, alpha, xn2)
        L.st(D, j, L.ld(A, at(j, j)))
        L.st(E, j, beta)
        L.st(T, j, tau)
        L.st(Vv, j1, L.k(1))
        with L.loop(L.add(j, 2), n) as il:
            e = at(il.i, j)
            v = L.fmul(L.ld(A, e), scale)
            L.st(A, e, v)
            L.st(Vv, il.i, v)
        # trailing block B = A[j+1:, j+1:] <- H B H: p = tau B v, w = p - (tau/2)(p.v) v,
        # B -= v w^T + w v^T (rows of B are contiguous: dot products along them)
        with L.loop(j1, n, [L.k(0)]) as il:
            with L.loop(j1, n, [L.k(0)]) as kl:
                kl.next = [L.fma(L.ld(A, at(il.i, kl.i)), L.ld(Vv, kl.i), kl.vals[0])]
            pi = L.fmul(tau, kl.vals[0])
            L.st(P, il.i, pi)
            il.next = [L.fma(pi, L.ld(Vv, il.i), il.vals[0])]
        half = L.fmul(L.fmul(L.k(-0.5), tau), il.vals[0])
        with L.loop(j1, n) as il:
            L.st(P, il.i, L.fma(half, L.ld(Vv, il.i), L.ld(P, il.i)))
        with L.loop(j1, n) as il:
            vi, wi = L.ld(Vv, il.i), L.ld(P, il.i)
            with L.loop(j1, n) as kl:
                e = at(il.i, kl.i)
                upd = L.fma(vi, L.ld(P, kl.i), L.fmul(wi, L.ld(Vv, kl.i)))
                L.st(A, e, L.fsub(L.ld(A, e), upd))
    L.st(D, n - 1, L.ld(A, at(n - 1, n - 1)))
    L.st(E, n - 1, L.k(0))


def _form_q(L: Lanes, A, n: int, ld: int, T, Z, Wk) -> None:
    """Z <- H_0 H_1 ... H_{n-2} (rows ld apart), from the last reflector back: H_j acts
    on rows and columns j+1.. only, where the product so far is the identity outside."""
    with L.loop(0, n * ld) as el:
        L.st(Z, el.i, L.k(0))
    for d in range(n):
        L.st(Z, d * ld + d, L.k(1))
    with L.loop(0, n - 1) as bl:
        j = L.f.bin("sub", L.i(n - 2), bl.i, "nsw")
        j1 = L.add(j, 1)
        tau = L.ld(T, j)
        # Z[j+1:, j+1:] <- H_j Z[j+1:, j+1:], v = [1, A[j+2:, j]]
        _reflect(L, Z, ld, j1, j1, n, n, A, ld, tau, Wk, col=j)


def _ql(L: Lanes, n: int, ld: int, D, E, Z) -> None:
    """Implicit QL on the tridiagonal (D, E) with the rotations applied to Z's columns:
    D <- the eigenvalues (unsorted), Z <- Z times the eigenvectors of the tridiagonal."""
    f = L.f
    eps = L.k(L.eps)
    with L.loop(0, n - 1) as ll:
        l = ll.i
        fl = L.findex(l)
        _count, end = L.sweep_loop(MAX_ITERATIONS + 1)
        # per lane m: the first k >= l with |e_k| <= eps (|d_k| + |d_k+1|), else n - 1
        with L.loop(l, n - 1, [L.findex(n - 1), L.k(0)]) as kl:
            k = kl.i
            mval, found = kl.vals
            dd = L.fadd(L.fabs(L.ld(D, k)), L.fabs(L.ld(D, L.add(k, 1))))
            small = L.fcmp("ole", L.fabs(L.ld(E, k)), L.fmul(eps, dd))
            first = f.bin("and", small, L.fcmp("oeq", found, L.k(0)))
            kl.next = [L.select(first, L.findex(k), mval), L.select(small, L.k(1), found)]
        mval = kl.vals[0]
        active = L.fcmp("ogt", mval, fl)
        with L.when(L.any(active)):
            el = L.select(active, L.ld(E, l), L.k(1))
            dl = L.ld(D, l)
            g0 = L.fdiv(L.fsub(L.ld(D, L.add(l, 1)), dl), L.fmul(L.k(2), el))
            r0 = L.sqrt(L.fma(g0, g0, L.k(1)))
            g = L.fadd(L.fsub(L.pick(D, mval), dl), L.fdiv(el, L.fadd(g0, L.copysign(r0, g0))))
            g = L.select(active, g, L.k(0))
            top = f.cast("fptosi", L.hmax(mval), "i64")  # the largest m of any lane
            with L.loop(0, f.bin("sub", top, l, "nsw"), [L.k(1), L.k(1), L.k(0), g, L.k(0)]) as il:
                i = f.bin("sub", L.add(top, -1), il.i, "nsw")
                i1 = L.add(i, 1)
                s, c, p, g, broken = il.vals
                started = f.bin("and", f.bin("and", L.fcmp("olt", L.findex(i), mval), active),
                                L.fcmp("oeq", broken, L.k(0)))
                ei = L.ld(E, i)
                ff, b = L.fmul(s, ei), L.fmul(c, ei)
                r = L.sqrt(L.fma(ff, ff, L.fmul(g, g)))
                vanish = L.fcmp("oeq", r, L.k(0))
                brk = f.bin("and", started, vanish)  # r underflowed: the lane stops here
                go = f.bin("and", started, L.mask_not(vanish))
                rr = L.select(go, r, L.k(1))
                sn, cs = L.select(go, L.fdiv(ff, rr), L.k(0)), L.select(go, L.fdiv(g, rr), L.k(1))
                L.st(E, i1, L.select(go, r, L.ld(E, i1)))
                di1 = L.ld(D, i1)
                g2 = L.fsub(di1, p)
                r2 = L.fma(L.fsub(L.ld(D, i), g2), sn, L.fmul(L.fmul(L.k(2), cs), b))
                p2 = L.fmul(sn, r2)
                L.st(D, i1, L.select(go, L.fadd(g2, p2), L.select(brk, L.fsub(di1, p), di1)))
                g3 = L.fsub(L.fmul(cs, r2), b)
                with L.loop(0, n) as zl:  # columns i, i+1 of Z (adjacent in each row)
                    zi, zi1 = L.idx(zl.i, ld, i), L.idx(zl.i, ld, i1)
                    a, bb = L.ld(Z, zi), L.ld(Z, zi1)
                    L.st(Z, zi1, L.fma(sn, a, L.fmul(cs, bb)))
                    L.st(Z, zi, L.fsub(L.fmul(cs, a), L.fmul(sn, bb)))
                il.next = [L.select(go, sn, s), L.select(go, cs, c), L.select(go, p2, p), L.select(go, g3, g),
                           L.select(brk, L.k(1), broken)]
            _s, _c, p, g, broken = il.vals
            ok = f.bin("and", active, L.fcmp("oeq", broken, L.k(0)))
            L.st(D, l, L.select(ok, L.fsub(L.ld(D, l), p), L.ld(D, l)))
            L.st(E, l, L.select(ok, g, L.ld(E, l)))
            with L.loop(L.add(l, 1), n) as kl:  # e_m <- 0
                hit = f.bin("and", active, L.fcmp("oeq", mval, L.findex(kl.i)))
                L.st(E, kl.i, L.select(hit, L.k(0), L.ld(E, kl.i)))
        end(f.emit(f"xor i1 {L.any(active).ref}, true", "i1"))


def eigh(n: int, scalar: str, width: int) -> tuple[str, str]:
    """o0 <- eigenvalues (n, ascending), o1 <- eigenvectors (n x n, as columns); only
    the lower triangle of the input is read."""
    L = Lanes(f"kiln_la_eighql_{scalar}_{n}_w{width}", scalar, width)
    ld = n + 1  # padded row stride (see Lanes.load_matrix)
    A, Z, Vt = L.array(n * ld), L.array(n * ld), L.array(n * ld)
    D, E, T, Vv, P = (L.array(n) for _ in range(5))
    with L.loop(L.lo, L.hi) as gl:
        g = gl.i
        L.load_matrix(A, g, n, n, stride=ld)
        L.magnitude(A, n, n, g, lower=True, stride=ld)
        with L.loop(0, n) as il:  # the upper triangle from the lower
            with L.loop(L.add(il.i, 1), n) as jl:
                L.st(A, L.idx(il.i, ld, jl.i), L.ld(A, L.idx(jl.i, ld, il.i)))
        _tridiagonalize(L, A, n, ld, D, E, T, Vv, P)
        _form_q(L, A, n, ld, T, Z, P)
        _ql(L, n, ld, D, E, Z)
        with L.loop(0, n) as il:  # Vt's row i = eigenvector i = Z's column i
            with L.loop(0, n) as jl:
                L.st(Vt, L.idx(il.i, ld, jl.i), L.ld(Z, L.idx(jl.i, ld, il.i)))
        _sign_rows(L, Vt, n, n, ld)
        order = L.order(D, n)
        L.write_elements(L.args["o0"], g, n, lambda e: L.pick(D, L.ld(order, e)))
        _store(L, "o1", g, n, n, lambda r, c, e: L.pick(Vt, L.fma(L.ld(order, c), L.k(ld), L.findex(r))))
    return L.name, L.text()
