"""LLVM IR for batched small-matrix kernels, vectorized ACROSS the batch.

A kernel works on W matrices at once: every "scalar" of the algorithm is a `<W x T>`
vector whose lane w belongs to matrix g*W + w of group g. The algorithms then need no
horizontal operations and no divergence (a lane that takes the other branch gets a
`select`), and an 8x8 Cholesky runs at the machine's full SIMD width, which no
per-matrix library call can do. W comes from the host's features (AVX-512: 512 bits,
AVX2: 256, else 128); a width-1 build of the same kernel takes the batch's tail.

Matrices are read from and written to the plain row-major batch (lane w's element e of
group g is at (g*W + w) * size + e): W scalar loads gather one vector, so no transposed
copy of the batch is ever made; the working copies live in stack arrays of vectors
(L1/L2-resident for n <= 64).

Kernel ABI (every kernel): void f(ptr a, ptr o0, ptr o1, ptr o2, ptr o3, i64 lo, i64 hi)
runs the groups [lo, hi); unused outputs are null; o3 receives each matrix's largest
magnitude (the part the op reads), so the caller learns from B numbers, not B n^2,
whether some matrix needs rescaling. `Lanes` is the small builder the kernels
in linalg_kernels.py are written with (on top of ir_builder's text builder).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V, const, float_literal

ABI_ARGS = ("a", "o0", "o1", "o2", "o3")


class LoopState:
    """The induction variable and carried values of one `Lanes.loop`."""

    def __init__(self, i: V, vals: list):
        self.i, self.vals, self.next = i, vals, list(vals)


class Lanes:
    """Builder of one kernel over `<W x scalar>` lanes (scalar "float" or "double")."""

    def __init__(self, name: str, scalar: str, width: int):
        self.name, self.t, self.W = name, scalar, width
        self.vt = f"<{width} x {scalar}>"
        self.mt = f"<{width} x i1>"
        self.bytes = 4 if scalar == "float" else 8
        self.module = Module()
        self.f = Fn(self.module)
        self.allocas: list[str] = []
        self.args = {n: V(f"%{n}", "ptr") for n in ABI_ARGS}
        self.lo, self.hi = V("%lo", "i64"), V("%hi", "i64")
        self.eps = float(np.finfo(np.float32 if scalar == "float" else np.float64).eps)

    # -- constants and names ------------------------------------------------------------
    def k(self, value: float) -> V:
        """A splat float constant."""
        lit = float_literal(float(value), self.t)
        return V("<" + ", ".join([f"{self.t} {lit}"] * self.W) + ">", self.vt)

    @staticmethod
    def i(value: int) -> V:
        return const("i64", value)

    def _sfx(self, ty: str | None = None) -> str:
        base = {"float": "f32", "double": "f64"}[self.t]
        return f"v{self.W}{base}" if ty is None else f"v{self.W}{ty}"

    def intrinsic(self, base: str, nargs: int) -> str:
        name = f"llvm.{base}.{self._sfx()}"
        self.module.declare(name, f"declare {self.vt} @{name}({', '.join([self.vt] * nargs)})")
        return name

    # -- stack arrays of lanes ---------------------------------------------------------------
    def array(self, count: int) -> V:
        name = f"%arr{len(self.allocas)}"
        self.allocas.append(f"  {name} = alloca {self.vt}, i64 {count}, align 64")
        return V(name, "ptr")

    def scalars(self, ty: str, count: int) -> V:
        """A stack array of `count` plain scalars of type `ty` (indices, a counter)."""
        name = f"%arr{len(self.allocas)}"
        self.allocas.append(f"  {name} = alloca {ty}, i64 {count}, align 8")
        return V(name, "ptr")

    def at(self, arr: V, index) -> V:
        index = index if isinstance(index, V) else self.i(index)
        return self.f.gep(self.vt, arr, index)

    def ld(self, arr: V, index) -> V:
        return self.f.load(self.vt, self.at(arr, index), self.W * self.bytes)

    def st(self, arr: V, index, value: V) -> None:
        # the vector's own alignment: a 1-lane array's entries are only 4 or 8 apart
        self.f.store(value, self.at(arr, index), self.W * self.bytes)

    # -- integer index arithmetic ------------------------------------------------------------
    def iv(self, x) -> V:
        return x if isinstance(x, V) else self.i(x)

    def add(self, a, b) -> V:
        return self.f.bin("add", self.iv(a), self.iv(b), "nsw")

    def mul(self, a, b) -> V:
        return self.f.bin("mul", self.iv(a), self.iv(b), "nsw")

    def idx(self, row, stride: int, col) -> V:
        """row * stride + col."""
        return self.add(self.mul(row, stride), col)

    def icmp(self, pred: str, a, b) -> V:
        return self.f.icmp(pred, self.iv(a), self.iv(b))

    # -- lane arithmetic ---------------------------------------------------------------------
    def fadd(self, a, b):
        return self.f.fadd(a, b, "contract")

    def fsub(self, a, b):
        return self.f.fsub(a, b, "contract")

    def fmul(self, a, b):
        return self.f.fmul(a, b, "contract")

    def fdiv(self, a, b):
        return self.f.fdiv(a, b)

    def fma(self, a, b, c):
        """a * b + c."""
        return self.f.fadd(self.f.fmul(a, b, "contract"), c, "contract")

    def sqrt(self, a):
        return self.f.call(self.intrinsic("sqrt", 1), self.vt, [a])

    def fabs(self, a):
        return self.f.call(self.intrinsic("fabs", 1), self.vt, [a])

    def copysign(self, mag, sign):
        return self.f.call(self.intrinsic("copysign", 2), self.vt, [mag, sign])

    def fmax(self, a, b):
        return self.f.call(self.intrinsic("maxnum", 2), self.vt, [a, b])

    def fcmp(self, pred: str, a, b) -> V:
        return self.f.emit(f"fcmp {pred} {self.vt} {a.ref}, {b.ref}", self.mt)

    def select(self, cond: V, a: V, b: V) -> V:
        """Per lane (vector cond) or for all lanes (i1 cond)."""
        return self.f.emit(f"select {cond.ty} {cond.ref}, {a.ty} {a.ref}, {b.ty} {b.ref}", a.ty)

    def hmax(self, a: V) -> V:
        """The largest lane, as a scalar."""
        name = f"llvm.vector.reduce.fmax.{self._sfx()}"
        self.module.declare(name, f"declare {self.t} @{name}({self.vt})")
        return self.f.call(name, self.t, [a])

    def mask_not(self, mask: V) -> V:
        """The lane-wise negation of a <W x i1> mask."""
        ones = "<" + ", ".join(["i1 true"] * self.W) + ">"
        return self.f.emit(f"xor {self.mt} {mask.ref}, {ones}", self.mt)

    def any(self, mask: V) -> V:
        """i1: some lane of the <W x i1> mask is set."""
        name = f"llvm.vector.reduce.or.v{self.W}i1"
        self.module.declare(name, f"declare i1 @{name}({self.mt})")
        return self.f.call(name, "i1", [mask])

    @contextmanager
    def when(self, cond: V):
        """Emit the block only for the i1 `cond` (a real branch: lanes that all agree
        skip work, e.g. the rotations of pairs every lane has converged)."""
        f = self.f
        then, done = f.new_label("then"), f.new_label("done")
        f.cbr(cond, then, done)
        f.start_block(then)
        yield
        f.br(done)
        f.start_block(done)

    # -- loops ----------------------------------------------------------------------------------
    @contextmanager
    def loop(self, start, stop, carried: list | None = None):
        """for i in [start, stop) as `with L.loop(a, b, [init]) as lp:`; the body reads
        lp.i and lp.vals and sets lp.next; after the block lp.vals hold the final values."""
        counted = CountedLoop(self.f, self.iv(start), self.iv(stop), list(carried or []), vectorize=False)
        i, phis = counted.begin()
        lp = LoopState(i, list(phis))
        yield lp
        counted.end(lp.next)

    def sweep_loop(self, limit: int):
        """A bounded do-while: returns (begin, end) callables; end(done: i1) exits when
        done or after `limit` iterations."""
        f = self.f
        pre, head, out = f.block, f.new_label("sweep"), f.new_label("swept")
        count = V(f.fresh("sw"), "i64")
        f.br(head)
        f.start_block(head)
        at = len(f.lines)
        f.lines.append("")

        def end(done: V) -> V:
            latch = f.block
            nxt = f.bin("add", count, self.i(1), "nuw nsw")
            more = f.icmp("slt", nxt, self.i(limit))
            go = f.emit(f"select i1 {done.ref}, i1 false, i1 {more.ref}", "i1")
            f.cbr(go, head, out)
            f.lines[at] = f"  {count.ref} = phi i64 [ 0, %{pre} ], [ {nxt.ref}, %{latch} ]"
            f.start_block(out)
            return nxt

        return count, end

    def round_robin(self, n: int):
        """A constant table of the round-robin ordering of the pairs of n indices: n-1
        rounds (n even; n odd adds a dummy index) of disjoint pairs (p < q), so that
        consecutive rotations are independent and their latency chains overlap. Returns
        (table, rounds, per_round); a dummy pair holds p = q = -1."""
        big = n + n % 2
        rounds, half = big - 1, big // 2
        pos = lambda k, r: 0 if k == 0 else 1 + (k - 1 + r) % (big - 1)  # noqa: E731
        flat = []
        for r in range(rounds):
            for k in range(half):
                p, q = sorted((pos(k, r), pos(big - 1 - k, r)))
                flat += [p, q] if q < n else [-1, -1]
        return self.table(f"kiln_rr_{n}", flat), rounds, half

    def table(self, name: str, values: list[int]) -> V:
        """A module constant [len x i32] named @name (emitted once)."""
        ref = f"@{name}"
        if ref not in self.module.helpers:
            self.module.helpers.add(ref)
            body = ", ".join(f"i32 {v}" for v in values)
            self.module.functions.insert(0, f"{ref} = internal unnamed_addr constant [{len(values)} x i32] [{body}]\n")
        return V(ref, "ptr")

    def pair(self, table: V, r, k, half: int) -> tuple[V, V]:
        """(p, q) of pair k of round r, as i64."""
        base = self.mul(self.idx(r, half, k), 2)
        out = []
        for j in (0, 1):
            x = self.f.load("i32", self.f.gep("i32", table, self.add(base, j)), 4)
            out.append(self.f.cast("sext", x, "i64"))
        return out[0], out[1]

    # -- the batch in memory ------------------------------------------------------------------
    def gather(self, ptr: V, group: V, size: int, element) -> V:
        """Element `element` of the W matrices (each `size` scalars) of `group`."""
        f, base = self.f, self.mul(group, self.W * size)
        vec = V("poison", self.vt) if self.W > 1 else None
        for w in range(self.W):
            p = f.gep(self.t, ptr, self.add(base, self.add(w * size, element)))
            x = f.load(self.t, p, self.bytes)
            if self.W == 1:
                return f.emit(f"insertelement {self.vt} poison, {self.t} {x.ref}, i32 0", self.vt)
            vec = f.emit(f"insertelement {self.vt} {vec.ref}, {self.t} {x.ref}, i32 {w}", self.vt)
        return vec

    def scatter(self, ptr: V, group: V, size: int, element, value: V, as_int: bool = False) -> None:
        """Write lane w of `value` to element `element` of matrix group*W + w (as int32
        when as_int: Cholesky's info)."""
        f, base = self.f, self.mul(group, self.W * size)
        for w in range(self.W):
            x = f.emit(f"extractelement {self.vt} {value.ref}, i32 {w}", self.t)
            ty, nbytes = (self.t, self.bytes)
            if as_int:
                x, ty, nbytes = f.cast("fptosi", x, "i32"), "i32", 4
            p = f.gep(ty, ptr, self.add(base, self.add(w * size, element)))
            f.store(x, p, nbytes)

    def _transpose(self, rows: list[V]) -> list[V]:
        """The W x W transpose of W vectors by log2(W) stages of two-input shuffles
        (swap the off-diagonal h x h blocks, h = W/2, ..., 1); it is its own inverse."""
        f, W = self.f, self.W
        h = W // 2
        while h >= 1:
            out = list(rows)
            for r in range(W):
                if (r // h) % 2:
                    continue
                a, b = rows[r], rows[r + h]
                for dst, shift in ((r, 0), (r + h, h)):
                    mask = []
                    for c0 in range(0, W, 2 * h):
                        mask += [c0 + shift + i for i in range(h)] + [W + c0 + shift + i for i in range(h)]
                    m = ", ".join(f"i32 {i}" for i in mask)
                    out[dst] = f.emit(f"shufflevector {self.vt} {a.ref}, {self.vt} {b.ref}, <{W} x i32> <{m}>",
                                      self.vt)
            rows, h = out, h // 2
        return rows

    def read_elements(self, ptr: V, group: V, size: int, put) -> None:
        """For every element e of the group's W matrices (each `size` scalars):
        put(e, lanes). Whole blocks of W elements are W contiguous vector loads and a
        transpose; the rest (size % W of them) scalar gathers."""
        W, blocks = self.W, (size // self.W if self.W > 1 else 0)
        if blocks:
            base = self.mul(group, W * size)
            with self.loop(0, blocks) as bl:
                e0 = self.mul(bl.i, W)
                rows = []
                for w in range(W):
                    p = self.f.gep(self.t, ptr, self.add(base, self.add(e0, w * size)))
                    rows.append(self.f.load(self.vt, p, self.bytes))
                for j, vec in enumerate(self._transpose(rows)):
                    put(self.add(e0, j), vec)
        if blocks * W < size:
            with self.loop(blocks * W, size) as el:
                put(el.i, self.gather(ptr, group, size, el.i))

    def write_elements(self, ptr: V, group: V, size: int, get) -> None:
        """Element e of the group's W matrices <- get(e) (lanes), as read_elements."""
        W, blocks = self.W, (size // self.W if self.W > 1 else 0)
        if blocks:
            base = self.mul(group, W * size)
            with self.loop(0, blocks) as bl:
                e0 = self.mul(bl.i, W)
                rows = self._transpose([get(self.add(e0, j)) for j in range(W)])
                for w, vec in enumerate(rows):
                    p = self.f.gep(self.t, ptr, self.add(base, self.add(e0, w * size)))
                    self.f.store(vec, p, self.bytes)
        if blocks * W < size:
            with self.loop(blocks * W, size) as el:
                self.scatter(ptr, group, size, el.i, get(el.i))

    def magnitude(self, arr: V, rows: int, cols: int, group: V, lower: bool = False,
                  stride: int | None = None) -> None:
        """o3 <- per matrix the largest |entry| of arr (rows x cols; its lower triangle
        only if `lower`), NaN when an entry is NaN or infinite (x * 0 carries that)."""
        with self.loop(0, rows, [self.k(0), self.k(0)]) as rl:
            with self.loop(0, self.add(rl.i, 1) if lower else cols, rl.vals) as cl:
                x = self.ld(arr, self.idx(rl.i, stride or cols, cl.i))
                big, bad = cl.vals
                cl.next = [self.fmax(big, self.fabs(x)), self.f.fadd(bad, self.f.fmul(x, self.k(0)))]
            rl.next = cl.vals
        biggest = self.f.fadd(rl.vals[0], rl.vals[1])
        self.write_elements(self.args["o3"], group, 1, lambda e: biggest)

    def findex(self, i) -> V:
        """The i64 i as a splat float lane value (lane-varying indices are kept as floats,
        exact up to 2^24)."""
        x = self.f.cast("sitofp", self.iv(i), self.t)
        x = self.f.emit(f"insertelement {self.vt} poison, {self.t} {x.ref}, i32 0", self.vt)
        return self.f.emit(f"shufflevector {self.vt} {x.ref}, {self.vt} poison, <{self.W} x i32> zeroinitializer",
                           self.vt)

    def order(self, values: V, n: int, descending: bool = False) -> V:
        """A new array of n lanes: order[c] = the index i of the value at position c of the
        stable ascending (or descending) order of values[0..n), per lane, as a float.
        Ranks by O(n^2) lane compares, then their inverse by O(n^2) selects."""
        rank = self.array(n)
        strict, loose = ("ogt", "oge") if descending else ("olt", "ole")
        with self.loop(0, n) as il:
            vi = self.ld(values, il.i)
            with self.loop(0, n, [self.k(0)]) as jl:
                vj = self.ld(values, jl.i)
                before = self.select(self.icmp("slt", jl.i, il.i), self.fcmp(loose, vj, vi), self.fcmp(strict, vj, vi))
                jl.next = [self.f.fadd(jl.vals[0], self.select(before, self.k(1), self.k(0)))]
            self.st(rank, il.i, jl.vals[0])
        out = self.array(n)
        with self.loop(0, n) as cl:
            want = self.findex(cl.i)
            with self.loop(0, n, [self.k(0)]) as il:
                hit = self.fcmp("oeq", self.ld(rank, il.i), want)
                il.next = [self.select(hit, self.findex(il.i), il.vals[0])]
            self.st(out, cl.i, il.vals[0])
        return out

    def pick(self, arr: V, index: V) -> V:
        """Per lane w, lane w of arr[index_w] for the float lanes `index`: one gather
        (a lane-varying address), where selecting among n candidates costs O(n)."""
        f = self.f
        if self.W == 1:
            i = f.cast("fptosi", f.emit(f"extractelement {self.vt} {index.ref}, i32 0", self.t), "i64")
            return self.ld(arr, i)
        iv = f"<{self.W} x i64>"
        lanes = "<" + ", ".join(f"i64 {w}" for w in range(self.W)) + ">"
        width = "<" + ", ".join([f"i64 {self.W}"] * self.W) + ">"
        e = f.emit(f"fptosi {self.vt} {index.ref} to {iv}", iv)
        e = f.emit(f"mul nsw {iv} {e.ref}, {width}", iv)
        e = f.emit(f"add nsw {iv} {e.ref}, {lanes}", iv)
        pt = f"<{self.W} x ptr>"
        ptrs = f.emit(f"getelementptr inbounds {self.t}, ptr {arr.ref}, {iv} {e.ref}", pt)
        name = f"llvm.masked.gather.{self._sfx()}.v{self.W}p0"
        self.module.declare(name, f"declare {self.vt} @{name}({pt}, i32 immarg, {self.mt}, {self.vt})")
        ones = "<" + ", ".join(["i1 true"] * self.W) + ">"
        return f.emit(f"call {self.vt} @{name}({pt} {ptrs.ref}, i32 {self.bytes}, {self.mt} {ones}, "
                      f"{self.vt} poison)", self.vt)

    def rc(self, e: V, cols: int) -> tuple[V, V]:
        """(row, col) of flat index e in a row-major matrix of `cols` columns."""
        return self.f.bin("udiv", e, self.i(cols)), self.f.bin("urem", e, self.i(cols))

    def load_matrix(self, arr: V, group: V, rows: int, cols: int, transpose: bool = False,
                    stride: int | None = None) -> None:
        """arr <- the group's rows x cols input matrices (arr[c*rows + r] if transpose;
        the stored rows `stride` apart if given: padding a power-of-two row length keeps
        column walks from thrashing one L1 set)."""
        def put(e, vec):
            if transpose or stride:
                r, c = self.rc(e, cols)
                e = self.idx(c, stride or rows, r) if transpose else self.idx(r, stride, c)
            self.st(arr, e, vec)

        self.read_elements(self.args["a"], group, rows * cols, put)

    # -- the module ------------------------------------------------------------------------------
    def text(self) -> str:
        """The finished module: the kernel's group loop must already be closed."""
        f = self.f
        f.stmt("ret void")
        f.lines[1:1] = self.allocas
        header = (f"define void @{self.name}(ptr noalias %a, ptr noalias %o0, ptr noalias %o1, "
                  f"ptr noalias %o2, ptr noalias %o3, i64 %lo, i64 %hi) #0")
        self.module.functions.append(f.define(header))
        bits = self.W * self.bytes * 8
        width = max(128, bits)
        self.module.metadata.append(
            f'attributes #0 = {{ nounwind "min-legal-vector-width"="{width}" '
            f'"prefer-vector-width"="{width}" }}')
        return self.module.text()
