"""The batched small-matrix decompositions as LLVM kernels over lanes of W matrices.

The same algorithms as the Metal kernels (kiln/codegen/metal/linalg.py), written for one
CPU thread that holds W matrices in the lanes of its vectors (linalg_lanes.py). Larger
matrices take LAPACK's routes instead (linalg_native.builder): blocked QR
(linalg_qr.py), tridiagonal QL eigh (linalg_tridiag.py), bidiagonal QR svd
(linalg_bidiag.py).

    cholesky  unblocked Cholesky-Crout of the lower triangle (n <= 64 stays in L1/L2, so
              blocking buys nothing on a CPU); a lane whose pivot is not positive (or
              NaN) records torch's `info` (the 1-based order of the first failing minor)
              and continues on a unit pivot, so no NaN spreads into other lanes' work
    qr        Householder QR as LAPACK's geqrf + orgqr (beta = -sign(alpha) |x|; a column
              already zero below the diagonal gets tau = 0), reduced Q (m x k), R (k x n)
    eigh      two-sided Jacobi on the lower triangle (kept as such); sweeps end when
              every lane's off-diagonal mass is below (eps |A|_F)^2 or after MAX_SWEEPS;
              ascending eigenvalues, eigenvector columns with the sign convention
    svd       one-sided Jacobi (Hestenes) on the columns of an m x n (m >= n) matrix,
              held transposed so a column is contiguous; a pair rotates while its cosine
              exceeds sqrt(m) eps (squared column norms computed at each sweep's start and
              updated by each rotation); U's columns normalized; descending order. U's
              and V's columns share a row (one rotation turns both) and the pairs go in
              block-cyclic order so that two blocks of rows stay in L1

Both Jacobi kernels visit the pairs in rounds of disjoint pairs, so a round's rotations
are independent and are all computed before its updates (their division/sqrt chains
overlap); eigh replays the vectors' rotations a column block at a time after each sweep
(_RotationLog). A pair
that no lane needs to rotate is skipped with a real branch, so the last sweeps
(quadratic convergence: most pairs already converged) cost little.

Sorting and the sign convention happen in the kernels too (the order by O(n^2) lane
compares, outputs by one gather per vector, signs from each vector's largest-magnitude
entry): done in numpy afterwards they cost more than the decomposition at n = 8.

Every kernel: void f(ptr a, ptr o0, ptr o1, ptr o2, ptr o3, i64 lo, i64 hi) over groups
[lo, hi); o3 gets each matrix's largest magnitude (linalg_lanes.Lanes.magnitude).
"""

from __future__ import annotations

from kiln.codegen.cpu.ir_builder import V
from kiln.codegen.cpu.linalg_lanes import Lanes

MAX_SWEEPS = 30


def _sum(L: Lanes, start, stop, init, term):
    """init + sum over k in [start, stop) of term(k) (term returns a lane value)."""
    with L.loop(start, stop, [init]) as lp:
        lp.next = [L.fadd(lp.vals[0], term(lp.i))]
    return lp.vals[0]


def _dot_sub(L: Lanes, start, stop, init, x_at, y_at):
    """init - sum x(k) * y(k): the fused multiply-subtract of the factorizations."""
    with L.loop(start, stop, [init]) as lp:
        lp.next = [L.fsub(lp.vals[0], L.fmul(L.ld(*x_at(lp.i)), L.ld(*y_at(lp.i))))]
    return lp.vals[0]


def _store(L: Lanes, out, group, rows: int, cols: int, value_at) -> None:
    def get(e):
        r, c = L.rc(e, cols)
        return value_at(r, c, e)

    L.write_elements(L.args[out], group, rows * cols, get)


def cholesky(n: int, scalar: str, width: int) -> tuple[str, str]:
    """o0 <- L (n x n, zero above the diagonal), o1 <- info (int32 per matrix)."""
    L = Lanes(f"kiln_la_cholesky_{scalar}_{n}_w{width}", scalar, width)
    A = L.array(n * n)
    with L.loop(L.lo, L.hi) as gl:
        g = gl.i
        L.load_matrix(A, g, n, n)
        L.magnitude(A, n, n, g, lower=True)
        with L.loop(0, n, [L.k(0), L.k(1)]) as jl:
            j, (info, order) = jl.i, jl.vals
            rj = L.mul(j, n)
            jj = L.add(rj, j)
            d = _dot_sub(L, 0, j, L.ld(A, jj), lambda k: (A, L.add(rj, k)), lambda k: (A, L.add(rj, k)))
            bad = L.fcmp("ule", d, L.k(0))  # unordered: a NaN pivot fails too
            fresh = L.f.bin("and", bad, L.fcmp("oeq", info, L.k(0)))
            pivot = L.sqrt(L.select(bad, L.k(1), d))
            L.st(A, jj, pivot)
            inv = L.fdiv(L.k(1), pivot)
            with L.loop(L.add(j, 1), n) as il:
                ri = L.mul(il.i, n)
                s = _dot_sub(L, 0, j, L.ld(A, L.add(ri, j)), lambda k: (A, L.add(ri, k)),
                             lambda k: (A, L.add(rj, k)))
                L.st(A, L.add(ri, j), L.fmul(s, inv))
            jl.next = [L.select(fresh, order, info), L.fadd(order, L.k(1))]
        info = jl.vals[0]
        _store(L, "o0", g, n, n, lambda r, c, e: L.select(L.icmp("ule", c, r), L.ld(A, e), L.k(0)))
        L.scatter(L.args["o1"], g, 1, 0, info, as_int=True)
    return L.name, L.text()


def _householder(L: Lanes, alpha, xn2):
    """LAPACK's larfg for x = [alpha, tail], |tail|^2 = xn2: (beta, tau, scale) with
    H x = beta e_1 for H = I - tau v v^T, v = [1, tail * scale], beta = -sign(alpha) |x|;
    a zero tail gives tau = 0 and beta = alpha (H = I)."""
    beta = L.f.fneg(L.copysign(L.sqrt(L.fma(alpha, alpha, xn2)), alpha))
    zero = L.fcmp("oeq", xn2, L.k(0))
    tau = L.select(zero, L.k(0), L.fdiv(L.fsub(beta, alpha), beta))
    scale = L.select(zero, L.k(0), L.fdiv(L.k(1), L.fsub(alpha, beta)))
    return L.select(zero, alpha, beta), tau, scale


def _column_reflector(L: Lanes, A, na: int, j, m: int, Tau):
    """larfg on column j of A (rows j..m-1, rows na apart): beta on the diagonal, the
    vector's tail scaled in place below it, tau in Tau[j] (and returned)."""
    jj = L.idx(j, na, j)
    xn2 = _sum(L, L.add(j, 1), m, L.k(0), lambda i: L.fmul(x := L.ld(A, L.idx(i, na, j)), x))
    beta, tau, scale = _householder(L, L.ld(A, jj), xn2)
    L.st(A, jj, beta)
    L.st(Tau, j, tau)
    with L.loop(L.add(j, 1), m) as il:
        e = L.idx(il.i, na, j)
        L.st(A, e, L.fmul(L.ld(A, e), scale))
    return tau


def _reflect(L: Lanes, X, cols: int, j, c_lo, c_hi, rows: int, A, n: int, tau, Wk, col=None) -> None:
    """Apply H_j = I - tau v v^T (v = [1, A[j+1:, col]], col = j unless given: rows j..
    of X; the tridiagonal reduction's vectors sit one column left) to columns [c_lo, c_hi) of X
    (rows x cols), as LAPACK's larf: w = v^T X (Wk, a row of lanes), then X -= tau v w.
    Both passes run along X's rows (contiguous, one independent sum per column), not
    down its columns (a dependent chain of FMAs per column)."""
    with L.loop(c_lo, c_hi) as cl:
        L.st(Wk, cl.i, L.ld(X, L.idx(j, cols, cl.i)))
    col = j if col is None else col
    with L.loop(L.add(j, 1), rows) as il:
        vi = L.ld(A, L.idx(il.i, n, col))
        with L.loop(c_lo, c_hi) as cl:
            L.st(Wk, cl.i, L.fma(vi, L.ld(X, L.idx(il.i, cols, cl.i)), L.ld(Wk, cl.i)))
    with L.loop(c_lo, c_hi) as cl:
        w = L.fmul(L.ld(Wk, cl.i), tau)
        L.st(Wk, cl.i, w)
        xj = L.idx(j, cols, cl.i)
        L.st(X, xj, L.fsub(L.ld(X, xj), w))
    with L.loop(L.add(j, 1), rows) as il:
        vi = L.ld(A, L.idx(il.i, n, col))
        with L.loop(c_lo, c_hi) as cl:
            xi = L.idx(il.i, cols, cl.i)
            L.st(X, xi, L.fsub(L.ld(X, xi), L.fmul(vi, L.ld(Wk, cl.i))))


def qr(m: int, n: int, scalar: str, width: int) -> tuple[str, str]:
    """o0 <- Q (m x k), o1 <- R (k x n), k = min(m, n)."""
    k = min(m, n)
    L = Lanes(f"kiln_la_qr_{scalar}_{m}x{n}_w{width}", scalar, width)
    na, nq = n + 1, k + 1  # padded row strides (see Lanes.load_matrix)
    A, T, Q, Wk = L.array(m * na), L.array(k), L.array(m * nq), L.array(max(n, k))
    with L.loop(L.lo, L.hi) as gl:
        g = gl.i
        L.load_matrix(A, g, m, n, stride=na)
        L.magnitude(A, m, n, g, stride=na)
        with L.loop(0, k) as jl:
            j = jl.i
            tau = _column_reflector(L, A, na, j, m, T)
            _reflect(L, A, na, j, L.add(j, 1), n, m, A, na, tau, Wk)
        with L.loop(0, m * nq) as el:  # Q = I, then the reflectors from the last one back
            L.st(Q, el.i, L.k(0))
        for d in range(k):
            L.st(Q, d * nq + d, L.k(1))
        with L.loop(0, k) as bl:
            j = L.f.bin("sub", L.i(k - 1), bl.i, "nsw")
            tau = L.ld(T, j)
            _reflect(L, Q, nq, j, j, k, m, A, na, tau, Wk)
        _store(L, "o0", g, m, k, lambda r, c, e: L.ld(Q, L.idx(r, nq, c)))
        _store(L, "o1", g, k, n, lambda r, c, e: L.select(L.icmp("uge", c, r), L.ld(A, L.idx(r, na, c)), L.k(0)))
    return L.name, L.text()


def _rotation(L: Lanes, d, off, rotate):
    """(t, c, s) of the Jacobi rotation that zeroes the pair whose difference of diagonal
    terms (or squared norms) is d and whose coupling is off: t = sign(zeta) / (|zeta| +
    sqrt(1 + zeta^2)) for zeta = d / (2 off); t = 0 (c = 1, s = 0) where `rotate` is false.

    With r = sqrt(d^2 + 4 off^2) and h = |d| + r: t = 2 off sign(d) / h and
    c = 1 / sqrt(1 + t^2) = sqrt(h / (2 r)); one reciprocal 1 / (h r) serves both, so a
    rotation costs two roots and one division (the divider bounds small n)."""
    two_off = L.fmul(L.k(2), off)
    root = L.sqrt(L.fma(d, d, L.fmul(two_off, two_off)))
    h = L.fadd(L.fabs(d), root)
    inv = L.fdiv(L.k(1), L.fmul(h, root))
    t = L.select(rotate, L.fmul(L.fmul(L.copysign(two_off, L.fmul(two_off, d)), root), inv), L.k(0))
    c = L.select(rotate, L.sqrt(L.fmul(L.fmul(L.fmul(h, h), inv), L.k(0.5))), L.k(1))
    return t, c, L.fmul(t, c)


def _rotate_rows(L: Lanes, X, stride: int, p, q, length: int, c, s) -> None:
    """(X[p, :], X[q, :]) <- (c x_p - s x_q, s x_p + c x_q) over `length` entries."""
    with L.loop(0, length) as rl:
        ip, iq = L.idx(p, stride, rl.i), L.idx(q, stride, rl.i)
        xp, xq = L.ld(X, ip), L.ld(X, iq)
        L.st(X, ip, L.fsub(L.fmul(c, xp), L.fmul(s, xq)))
        L.st(X, iq, L.fma(s, xp, L.fmul(c, xq)))


class _RotationLog:
    """The rotations of one Jacobi sweep, recorded and applied to the eigenvector (or
    right singular vector) rows only after the sweep, a block of columns at a time.

    Rotating those rows inline puts them in the working set of every rotation: at n = 32,
    16 float32 lanes, A's triangle (34 KB) and the vectors (64 KB) do not fit a 48 KB L1
    together, and each rotation streamed its four rows from L2. Replayed per block of
    BLOCK_BYTES, a block stays in L1 while the whole sweep's rotations pass over it
    (kn.linalg takes tridiagonal QL from n = 11 on, so that size runs here only when
    this kernel is called directly, as the tests do)."""

    BLOCK_BYTES = 32768
    MAX_COLS = 16

    def __init__(self, L: Lanes, pairs: int):
        self.L = L
        self.cs, self.pq, self.count = L.array(2 * pairs), L.scalars("i32", 2 * pairs), L.scalars("i64", 1)

    def reset(self) -> None:
        self.L.f.store(self.L.i(0), self.count, 8)

    def record(self, p, q, c, s) -> None:
        L, f = self.L, self.L.f
        j = f.load("i64", self.count, 8)
        L.st(self.cs, L.mul(j, 2), c)
        L.st(self.cs, L.add(L.mul(j, 2), 1), s)
        for k, x in enumerate((p, q)):
            f.store(f.cast("trunc", x, "i32"), f.gep("i32", self.pq, L.add(L.mul(j, 2), k)), 4)
        f.store(L.add(j, 1), self.count, 8)

    def size(self) -> V:
        """How many rotations are logged so far (i64)."""
        return self.L.f.load("i64", self.count, 8)

    def entry(self, j) -> tuple:
        """(p, q, c, s) of logged rotation j."""
        L, f = self.L, self.L.f
        two = L.mul(j, 2)
        p, q = (f.cast("sext", f.load("i32", f.gep("i32", self.pq, L.add(two, k)), 4), "i64") for k in (0, 1))
        return p, q, L.ld(self.cs, two), L.ld(self.cs, L.add(two, 1))

    def apply(self, X, rows: int, length: int, stride: int) -> None:
        """(X[p, :], X[q, :]) <- (c x_p - s x_q, s x_p + c x_q) for every logged rotation
        in order (X: rows x length, rows `stride` apart); a block's columns unrolled."""
        L = self.L
        block = max(1, min(self.MAX_COLS, length, self.BLOCK_BYTES // (rows * L.W * L.bytes)))
        count = self.size()
        for c0 in range(0, length, block):
            with L.loop(0, count) as jl:
                p, q, c, s = self.entry(jl.i)
                bp, bq = L.mul(p, stride), L.mul(q, stride)
                for col in range(c0, min(length, c0 + block)):
                    ip, iq = L.add(bp, col), L.add(bq, col)
                    xp, xq = L.ld(X, ip), L.ld(X, iq)
                    L.st(X, ip, L.fsub(L.fmul(c, xp), L.fmul(s, xq)))
                    L.st(X, iq, L.fma(s, xp, L.fmul(c, xq)))


def _dot(L: Lanes, X, stride: int, p, q, length: int):
    """Rows p and q of X (`stride` apart, `length` long) dotted with K independent partial sums (K = 4,
    2 or 1 as `length` allows): one sum's chain of FMA latencies would bound the pair."""
    k = 4 if length % 4 == 0 else 2 if length % 2 == 0 else 1
    with L.loop(0, length // k, [L.k(0)] * k) as rl:
        base = L.mul(rl.i, k)
        rl.next = [L.fma(L.ld(X, L.add(L.idx(p, stride, base), j)), L.ld(X, L.add(L.idx(q, stride, base), j)),
                         rl.vals[j]) for j in range(k)]
    total = rl.vals[0]
    for extra in rl.vals[1:]:
        total = L.fadd(total, extra)
    return total


def _sign_rows(L: Lanes, X, rows: int, cols: int, stride: int, also=None, by_columns: bool = False) -> None:
    """Flip each row of X (rows `stride` apart; and the same row of `also` = (Y, its
    cols, its stride)) whose entry of largest magnitude (the first such on ties) is
    negative: the sign convention. With `by_columns`, the columns of X and Y instead
    (`rows` of them, each `cols` long, and Y's `also[1]` long)."""
    at = (lambda v, k, ld: L.idx(k, ld, v)) if by_columns else (lambda v, k, ld: L.idx(v, ld, k))  # noqa: E731
    with L.loop(0, rows) as rl:
        with L.loop(0, cols, [L.k(-1), L.k(1)]) as cl:
            x = L.ld(X, at(rl.i, cl.i, stride))
            best, value = cl.vals
            better = L.fcmp("ogt", L.fabs(x), best)
            cl.next = [L.select(better, L.fabs(x), best), L.select(better, x, value)]
        sign = L.copysign(L.k(1), cl.vals[1])
        for Y, ycols, ystride in [(X, cols, stride)] + ([also] if also else []):
            with L.loop(0, ycols) as yl:
                e = at(rl.i, yl.i, ystride)
                L.st(Y, e, L.f.fmul(L.ld(Y, e), sign))


def _identity(L: Lanes, X, n: int, stride: int) -> None:
    """X <- the n x n identity, rows `stride` apart (the entries between left alone)."""
    with L.loop(0, n) as rl:
        with L.loop(0, n) as cl:
            L.st(X, L.idx(rl.i, stride, cl.i), L.select(L.icmp("eq", rl.i, cl.i), L.k(1), L.k(0)))


def eigh(n: int, scalar: str, width: int) -> tuple[str, str]:
    """o0 <- eigenvalues (n, ascending), o1 <- eigenvectors (n x n, as columns).

    A lives in its lower triangle only (the symmetric entry (i, j) at row max(i, j)): a
    rotation reads and writes each entry it changes once, and the triangle touches half
    the cache lines of the full matrix."""
    L = Lanes(f"kiln_la_eigh_{scalar}_{n}_w{width}", scalar, width)
    ld = n + 1  # A's padded row stride
    A, Vt, D = L.array(n * ld), L.array(n * ld), L.array(n)  # Vt's rows padded alike
    tol2 = L.eps * L.eps
    at = lambda i, j: L.idx(i, ld, j)  # noqa: E731  (row i >= column j)
    with L.loop(L.lo, L.hi) as gl:
        g = gl.i
        L.load_matrix(A, g, n, n, stride=ld)
        L.magnitude(A, n, n, g, lower=True, stride=ld)
        strict = _lower_mass(L, A, n, ld)
        diag = _sum(L, 0, n, L.k(0), lambda i: L.fmul(x := L.ld(A, at(i, i)), x))
        limit = L.fmul(L.fma(L.k(2), strict, diag), L.k(tol2))  # (eps |A|_F)^2, the off mass bound
        pair_limit = L.fmul(limit, L.k(1.0 / (n * n)))
        table, rounds, half = L.round_robin(n)
        _identity(L, Vt, n, ld)
        log = _RotationLog(L, rounds * half)
        _count, end = L.sweep_loop(MAX_SWEEPS)
        log.reset()
        with L.loop(0, rounds) as rl_:
            # a round's pairs are disjoint, so each 2x2 block (p, q) changes only by its own
            # rotation: first every rotation of the round (independent division/root
            # chains, side by side), then the rest of rows and columns p and q
            first = log.size()
            with L.loop(0, half) as kl_:
                p, q = L.pair(table, rl_.i, kl_.i, half)
                valid = L.icmp("sge", p, 0)
                p, q = L.select(valid, p, L.i(0)), L.select(valid, q, L.i(1))  # p < q
                qp, pp, qq = at(q, p), at(p, p), at(q, q)
                apq, app, aqq = L.ld(A, qp), L.ld(A, pp), L.ld(A, qq)
                rotate = L.fcmp("ogt", L.fmul(apq, apq), pair_limit)
                with L.when(L.f.bin("and", valid, L.any(rotate))):
                    t, c, s = _rotation(L, L.fsub(aqq, app), apq, rotate)
                    tapq = L.fmul(t, apq)
                    L.st(A, pp, L.fsub(app, tapq))
                    L.st(A, qq, L.fadd(aqq, tapq))
                    L.st(A, qp, L.select(rotate, L.k(0), apq))
                    log.record(p, q, c, s)
            with L.loop(first, log.size()) as jl:
                p, q, c, s = log.entry(jl.i)
                # entries (k, p) and (k, q) outside the 2x2 block, where the triangle keeps
                # them: rows p and q for k < p, column p and row q between, columns p and
                # q below q
                for lo, hi, kp_at, kq_at in ((0, p, lambda k: at(p, k), lambda k: at(q, k)),
                                             (L.add(p, 1), q, lambda k: at(k, p), lambda k: at(q, k)),
                                             (L.add(q, 1), n, lambda k: at(k, p), lambda k: at(k, q))):
                    with L.loop(lo, hi) as kl:
                        kp, kq = kp_at(kl.i), kq_at(kl.i)
                        akp, akq = L.ld(A, kp), L.ld(A, kq)
                        L.st(A, kp, L.fsub(L.fmul(c, akp), L.fmul(s, akq)))
                        L.st(A, kq, L.fma(s, akp, L.fmul(c, akq)))
        log.apply(Vt, n, n, ld)
        excess = L.hmax(L.fsub(_lower_mass(L, A, n, ld), limit))
        end(L.f.emit(f"fcmp ole {L.t} {excess.ref}, 0.0", "i1"))
        with L.loop(0, n) as dl:
            L.st(D, dl.i, L.ld(A, at(dl.i, dl.i)))
        _sign_rows(L, Vt, n, n, ld)
        order = L.order(D, n)
        L.write_elements(L.args["o0"], g, n, lambda e: L.pick(D, L.ld(order, e)))
        _store(L, "o1", g, n, n, lambda r, c, e: L.pick(Vt, L.fma(L.ld(order, c), L.k(ld), L.findex(r))))
    return L.name, L.text()


def _lower_mass(L: Lanes, A, n: int, ld: int):
    """Per lane, the sum of squares of A's strict lower triangle (the off-diagonal mass)."""
    with L.loop(1, n, [L.k(0)]) as rl:
        rl.next = [_sum(L, 0, rl.i, rl.vals[0], lambda c: L.fmul(x := L.ld(A, L.idx(rl.i, ld, c)), x))]
    return rl.vals[0]


def _block_rounds(n: int, block: int) -> list[list[tuple[int, int]]]:
    """Every pair (p < q) of n indices once, in rounds of disjoint pairs, in a
    block-cyclic order: the indices cut into blocks of `block`, the blocks paired in
    round-robin order, each block's own pairs (round robin) at its first appearance, then
    all pairs across the two blocks in rounds (i, (i + r) mod size). Work on two blocks'
    rows stays in L1; with a single block this is the plain round robin."""
    def rr(idx):
        big = len(idx) + len(idx) % 2
        pos = lambda k, r: 0 if k == 0 else 1 + (k - 1 + r) % (big - 1)  # noqa: E731
        rounds = []
        for r in range(big - 1):
            pairs = [sorted((pos(k, r), pos(big - 1 - k, r))) for k in range(big // 2)]
            rounds.append([(idx[a], idx[b]) for a, b in pairs if b < len(idx)])
        return rounds

    blocks = [list(range(lo, min(n, lo + block))) for lo in range(0, n, block)]
    if len(blocks) == 1:
        return rr(blocks[0])
    out, seen = [], set()
    for b1, b2 in [pq for rnd in rr(list(range(len(blocks)))) for pq in rnd]:
        for b in (b1, b2):
            if b not in seen:
                seen.add(b)
                out += rr(blocks[b])
        small, big = sorted((blocks[b1], blocks[b2]), key=len)
        for r in range(len(big)):
            out.append([tuple(sorted((small[i], big[(i + r) % len(big)]))) for i in range(len(small))])
    return [rnd for rnd in out if rnd]


# the rows two blocks of one-sided Jacobi hold at once: most of a 48 KB L1
SVD_BLOCK_BYTES = 36864


def svd(m: int, n: int, scalar: str, width: int) -> tuple[str, str]:
    """m >= n. o0 <- U (m x n), o1 <- s (n, descending), o2 <- V^T (n x n).

    Row i of X holds column i of the working matrix (m entries, U's column at the end)
    followed by column i of V (n entries, from the identity): one rotation turns both.
    Pairs go in block-cyclic order (_block_rounds) with blocks of rows that fit in L1 by
    two: at 32 x 32, 16 float32 lanes, X is 130 KB, and a round-robin sweep streamed
    every pair's rows from L2 (kn.linalg takes bidiagonal QR from min(m, n) = 14 on)."""
    L = Lanes(f"kiln_la_svd_{scalar}_{m}x{n}_w{width}", scalar, width)
    lx = m + n + 1  # X's padded row stride (see Lanes.load_matrix)
    X, N, M = L.array(n * lx), L.array(n), L.array(1)
    Vt = L.at(X, m)  # the V part: row i at Vt + i * lx
    block = max(2, SVD_BLOCK_BYTES // (2 * lx * L.W * L.bytes))
    rounds = _block_rounds(n, block)
    starts = [0]
    for rnd in rounds:
        starts.append(starts[-1] + len(rnd))
    table = L.table(f"kiln_svd_pairs_{n}_{block}", [i for rnd in rounds for pq in rnd for i in pq] or [0])
    bounds = L.table(f"kiln_svd_rounds_{n}_{block}", starts)
    widest = max([len(rnd) for rnd in rounds] + [1])
    C, S, F = L.array(widest), L.array(widest), L.scalars("i8", widest)

    def entry(tab, i) -> V:
        return L.f.cast("sext", L.f.load("i32", L.f.gep("i32", tab, L.iv(i)), 4), "i64")

    tol = (m ** 0.5) * L.eps
    with L.loop(L.lo, L.hi) as gl:
        g = gl.i
        L.load_matrix(X, g, m, n, transpose=True, stride=lx)
        L.magnitude(X, n, m, g, stride=lx)
        _identity(L, Vt, n, lx)
        _count, end = L.sweep_loop(MAX_SWEEPS)
        with L.loop(0, n) as cl:  # exact squared column norms at each sweep's start
            L.st(N, cl.i, _sum(L, 0, m, L.k(0), lambda r: L.fmul(x := L.ld(X, L.idx(cl.i, lx, r)), x)))
        L.st(M, 0, L.k(0))
        with L.loop(0, len(rounds)) as rl:
            # a round's pairs are disjoint: first all their dot products and rotations
            # (independent latency chains, side by side), then the rows they turn
            lo, hi = entry(bounds, rl.i), entry(bounds, L.add(rl.i, 1))
            with L.loop(lo, hi) as pl:
                slot, (p, q) = L.f.bin("sub", pl.i, lo, "nsw"), (entry(table, L.add(L.mul(pl.i, 2), j))
                                                                 for j in (0, 1))
                gamma = _dot(L, X, lx, p, q, m)
                alpha, beta = L.ld(N, p), L.ld(N, q)
                # cosine > tol, without a division or a root: gamma^2 > tol^2 alpha beta
                rotate = L.fcmp("ogt", L.fmul(gamma, gamma), L.fmul(L.k(tol * tol), L.fmul(alpha, beta)))
                flag = L.f.gep("i8", F, slot)
                L.f.store(V("0", "i8"), flag, 1)
                with L.when(L.any(rotate)):
                    t, c, s = _rotation(L, L.fsub(beta, alpha), gamma, rotate)
                    L.st(C, slot, c)
                    L.st(S, slot, s)
                    L.f.store(V("1", "i8"), flag, 1)
                    tg = L.fmul(t, gamma)  # the rotated columns' squared norms
                    L.st(N, p, L.fsub(alpha, tg))
                    L.st(N, q, L.fadd(beta, tg))
                    L.st(M, 0, L.k(1))  # some lane rotated in this sweep
            with L.loop(lo, hi) as pl:
                slot, (p, q) = L.f.bin("sub", pl.i, lo, "nsw"), (entry(table, L.add(L.mul(pl.i, 2), j))
                                                                 for j in (0, 1))
                turn = L.f.load("i8", L.f.gep("i8", F, slot), 1)
                with L.when(L.f.icmp("ne", turn, V("0", "i8"))):
                    _rotate_rows(L, X, lx, p, q, m + n, L.ld(C, slot), L.ld(S, slot))
        end(L.f.emit(f"fcmp oeq {L.t} {L.hmax(L.ld(M, 0)).ref}, 0.0", "i1"))
        with L.loop(0, n) as cl:
            c = cl.i
            norm = L.sqrt(_sum(L, 0, m, L.k(0), lambda r: L.fmul(x := L.ld(X, L.idx(c, lx, r)), x)))
            inv = L.select(L.fcmp("ogt", norm, L.k(0)), L.fdiv(L.k(1), norm), L.k(0))
            with L.loop(0, m) as rl:
                e = L.idx(c, lx, rl.i)
                L.st(X, e, L.fmul(L.ld(X, e), inv))
            L.st(N, c, norm)
        _sign_rows(L, Vt, n, n, lx, also=(X, m, lx))
        order = L.order(N, n, descending=True)
        L.write_elements(L.args["o1"], g, n, lambda e: L.pick(N, L.ld(order, e)))
        _store(L, "o0", g, m, n, lambda r, c, e: L.pick(X, L.fma(L.ld(order, c), L.k(lx), L.findex(r))))
        _store(L, "o2", g, n, n, lambda r, c, e: L.pick(Vt, L.fma(L.ld(order, r), L.k(lx), L.findex(c))))
    return L.name, L.text()
