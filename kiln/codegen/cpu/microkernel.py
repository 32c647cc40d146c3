"""kiln's own GEMM micro-kernel: packed panels and a register-blocked MR x NR tile.

For the small and batched products where a BLAS call's fixed cost (argument checks,
buffer setup, thread wake-up: microseconds) is the bigger part of the time, e.g. the
attention GEMMs of a small transformer ((B*heads) x [32, 16] @ [16, 32]), the cost
model (autotune.py) picks this instead of BLAS. It is the BLIS/GotoBLAS structure in
miniature, written as LLVM IR with explicit vector types:

- B is read in place, NR columns of a row as NR/W vector loads, when its columns are
  contiguous and of the accumulator dtype; otherwise (and for the partial last panel)
  it is packed once per batch item a call sees into column panels of NR (k rows of NR
  contiguous values, zero-padded past n), converted to the accumulator dtype: a row
  at a time by masked vector loads (contiguous columns), W x W blocks transposed in
  registers (unit k stride: B^T, attention's q @ k^T), masked gathers (other strides),
  or element by element (low-precision B);
- a B item read in place whose rows are not 64-byte aligned (numpy's larger arrays start
  16 bytes past a page; vector loads that split cache lines cost 15-20%) is copied,
  aligned, in a batch by the first row block of the item a call runs (its tiles store the
  B vectors they load into the pack buffer, and the item's later row blocks read that
  copy), and packed whole first for a single product where a call runs REPACK_BLOCKS of
  its row blocks;
- a last panel of at most W columns (n = 65: one) gets one vector of accumulators per
  row instead of NR/W when B is read in place; the k loop prefetches B's rows
  PREFETCH_ROWS ahead;
- each outer point is a block of MR rows; for every panel the MR x NR tile accumulates
  in registers, MR * NR / W vector accumulators updated by one fused multiply-add per
  A value (read in place through its strides, broadcast) and B vector per k (12 ymm
  accumulators on AVX2, 16 zmm on AVX-512);
- the tile goes to a small stack buffer, and the epilogue (bias, activation, residual,
  cast: the GEMM template's `Acc` expression) runs on the valid rows and columns of it
  straight to the output, like the BLAS path's per-panel epilogue.

The vector width W comes from the host CPU's features: 512 bits with AVX-512F, 256 with
AVX2, else 128; NR = 2W, MR = 8 with AVX-512 (16 accumulators of its 32 registers), else
6 (12 of 16). Operand strides are any (the packing reads them), so transposed operands
need no copy. float32 and float64
accumulators; low-precision operands are converted while packing.
"""

from __future__ import annotations

from functools import lru_cache

from kiln.codegen.kernel_ir import GemmKernel

from kiln.codegen.cpu.gemm import GemmEmitter, acc_dtype
from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V, const
from kiln.ir import dtypes as dt

MR = 6  # rows per register tile (16 vector registers: AVX2)
MR_AVX512 = 8  # with 32 vector registers
PREFETCH_ROWS = 8  # the tile's k loop prefetches B this many rows ahead
# a single product's B whose rows are not 64-byte aligned is packed (aligned) where a call
# runs at least this many of its row blocks (`MicroEmitter._repacks`)
REPACK_BLOCKS = 16
# a batch item's is copied by its first row block where a call runs at least this many of
# its blocks (`MicroEmitter._copies`): one thread, B 16 bytes off, 16 x 32x64x256 (4 blocks
# an item) 101.4 us copied vs 106.0 read in place, 64 x 16x32x32 (2 blocks) 16.1 vs 15.4
COPY_BLOCKS = 3


@lru_cache(maxsize=None)
def vector_bits() -> int:
    """The widest vector registers of the host: 512 (AVX-512F), 256 (AVX2) or 128."""
    from kiln.codegen.cpu.jit import _init
    import llvmlite.binding as llvm

    _init()
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        return 512
    if features.get("avx2"):
        return 256
    return 128


def rows_per_tile() -> int:
    """MR: 8 with AVX-512's 32 vector registers (16 accumulators, 2 B vectors and the
    broadcast A value fit; for m = 32, the attention shapes, 4 blocks with no padded rows
    instead of 6 blocks computing 36 rows), else 6 (12 of AVX2's 16 registers)."""
    return MR_AVX512 if vector_bits() == 512 else MR


def tile(esize: int) -> tuple[int, int, int]:
    """(MR, NR, W): rows and columns of the register tile and lanes per vector."""
    lanes = vector_bits() // (8 * esize)
    return rows_per_tile(), 2 * lanes, lanes


def micro_capable(g: GemmKernel) -> bool:
    """Float accumulators (float32/float64) only: integer GEMMs keep the loop nest."""
    return acc_dtype(g) in (dt.float32, dt.float64)


def row_blocks(g: GemmKernel):
    """The outer space: batch x blocks of MR rows."""
    import sympy

    mr = rows_per_tile()
    return g.batch * sympy.floor((sympy.sympify(g.m) + mr - 1) / mr)


class MicroEmitter(GemmEmitter):
    """GemmEmitter's frame (parameters, malloc/free, the ABI wrapper), operand loads and
    epilogue, with the register-tiled body instead of BLAS calls."""

    def __init__(self, module: Module, g: GemmKernel, symbol: str):
        super().__init__(module, g, symbol, 0)
        self.ty = self.acc_ty
        self.mr, self.nr, self.w = tile(self.esize)
        self.vty = f"<{self.w} x {self.ty}>"

    def _declare(self, module: Module) -> None:
        self.fma = f"llvm.fma.v{self.w}{'f64' if self.esize == 8 else 'f32'}"
        module.declare(self.fma, f"declare {self.vty} @{self.fma}({self.vty}, {self.vty}, {self.vty})")
        module.declare("llvm.prefetch.p0", "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)")

    def _direct_b(self) -> bool:
        """B rows can be read as vectors in place: unit column stride, accumulator dtype."""
        import sympy

        param = self.buffers[self.g.b][1]
        return sympy.sympify(self.g.b_strides[2]) == 1 and param.dtype == self.acc

    def _copies(self) -> bool:
        """May a B read in place be copied, aligned, while the first row block of an item
        reads it (`_body`)? B read in place, a batch (a single product packs instead:
        `_repacks`), at least COPY_BLOCKS row blocks per item (static m, or symbolic) and
        a full panel to copy (static n >= NR, or symbolic). The copying tile is a second
        copy of the k loop (~+11 ms of LLVM optimize and +4 ms codegen CPU for a kernel),
        so only where it can run and pay."""
        import sympy

        g = self.g
        m, n, batch = sympy.sympify(g.m), sympy.sympify(g.n), sympy.sympify(g.batch)
        return self._direct_b() and batch != 1 and (not m.is_Integer or int(m) > (COPY_BLOCKS - 1) * self.mr) and \
            (not n.is_Integer or int(n) >= self.nr)

    def _repacks(self) -> bool:
        """May a single product's B that could be read in place be packed whole instead
        (aligned), where its rows are not 64-byte aligned and the call runs at least
        REPACK_BLOCKS of its row blocks (static m >= REPACK_BLOCKS x MR, or symbolic)?
        One thread, round-robin, us, B 16 bytes off: 512x64x192 79.9 in place, 70.3
        packed; 128^3 28.9, 27.2. (A thread claiming one row block at a time reads it in
        place: a copy for one block costs more than it saves.)"""
        import sympy

        m = sympy.sympify(self.g.m)
        return self._direct_b() and not self._copies() and (not m.is_Integer or int(m) >= REPACK_BLOCKS * self.mr)

    def _body(self, fn: Fn) -> None:
        g, mr, nr = self.g, self.mr, self.nr
        m, n, k = (self._ix(fn, d) for d in (g.m, g.n, g.k))
        c = lambda v: const("i64", v)  # noqa: E731
        esz = c(self.esize)
        npanels = fn.bin("sdiv", fn.bin("add", n, c(nr - 1)), c(nr))
        nblocks = fn.bin("sdiv", fn.bin("add", m, c(mr - 1)), c(mr))
        direct, copies, repacks = self._direct_b(), self._copies(), self._repacks()
        # packed panels: all of them, or only the partial last one when B is read in place
        # (all of them again where an item's misaligned rows are copied or packed)
        in_place_panels = fn.bin("sdiv", n, c(nr)) if direct else c(0)
        packed = fn.bin("sub", npanels, in_place_panels) if direct and not (copies or repacks) else npanels
        kpad = self._k_rows(fn, k)
        panel_size = fn.bin("mul", kpad, c(nr))
        # (64 bytes when nothing is packed: B read in place, n a multiple of NR)
        size = fn.bin("add", fn.bin("mul", fn.bin("mul", packed, panel_size), esz), c(64))
        raw = fn.call("malloc", "ptr", [size])
        skew = fn.bin("and", fn.bin("sub", c(0), fn.cast("ptrtoint", raw, "i64")), c(63))
        pack_b = fn.gep("i8", raw, skew)  # 64-byte aligned panels
        tile_buf = fn.emit(f"alloca [{mr * nr} x {self.ty}], align 64", "ptr", "tile")
        sb0, sb1 = self._ix(fn, g.b_strides[0]), self._ix(fn, g.b_strides[1])
        end = V("%end", "i64")
        # carried: the item last seen, the first packed panel of its next row blocks, and
        # the panel at the pack buffer's start (0 where an item's panels are all copied)
        loop = CountedLoop(fn, V("%begin", "i64"), end, carried=[c(-1), in_place_panels, in_place_panels],
                           vectorize=False)
        p, (last_b, first_before, origin_before) = loop.begin()
        bi = fn.bin("sdiv", p, nblocks)
        i0 = fn.bin("mul", fn.bin("srem", p, nblocks), c(mr))
        left = fn.bin("sub", m, i0)
        rows = fn.select(fn.icmp("slt", left, c(mr)), left, c(mr))
        pack, after = fn.new_label("packb"), fn.new_label("packed")
        before = fn.block
        fn.cbr(fn.icmp("ne", bi, last_b), pack, after)
        fn.start_block(pack)
        no = const("i1", 0)
        copy_now, origin, pack_from = no, in_place_panels, in_place_panels
        if copies or repacks:
            # an item whose rows are not 64-byte aligned (numpy's larger arrays start 16
            # bytes past a page): vector loads of them split cache lines (16 x 32x64x256:
            # 108 us against 92 aligned, one thread). A batch item: where COPY_BLOCKS row
            # blocks of it or more follow in this call, this block's tiles store what they load
            # into the pack buffer (aligned) and the following blocks read that copy. A
            # single product: packed whole first, where the call runs REPACK_BLOCKS of it
            addr = fn.cast("ptrtoint", fn.gep(self.ty, self.buffers[g.b][0], fn.bin("mul", bi, sb0)), "i64")
            off = fn.bin("and", fn.bin("or", addr, fn.bin("mul", sb1, esz)), c(63))
            item_end = fn.bin("mul", fn.bin("add", bi, c(1)), nblocks)
            stop = fn.select(fn.icmp("slt", end, item_end), end, item_end)
            more = fn.icmp("sgt", fn.bin("sub", stop, p), c((COPY_BLOCKS if copies else REPACK_BLOCKS) - 1))
            now = fn.bin("and", fn.icmp("ne", off, c(0)), more)
            origin = fn.select(now, c(0), in_place_panels)
            if copies:
                copy_now = now
            else:
                pack_from = origin
        # the panels packed now (the partial last one; all where a single product's B is
        # repacked), at their place from `origin`
        dst = fn.gep(self.ty, pack_b, fn.bin("mul", fn.bin("sub", pack_from, origin), panel_size))
        self._pack_b(fn, dst, bi, k, n, pack_from, npanels)
        next_first = origin if copies or repacks else in_place_panels
        packed_at = fn.block
        fn.br(after)
        fn.start_block(after)

        def phi(ty, new, old):
            return fn.emit(f"phi {ty} [ {new.ref}, %{packed_at} ], [ {old.ref}, %{before} ]", ty)
        first = phi("i64", pack_from, first_before)  # this block reads in place below it
        copying = phi("i1", copy_now, no)
        origin = phi("i64", origin, origin_before)
        carry_first = phi("i64", next_first, first_before)
        panels = CountedLoop(fn, c(0), npanels, vectorize=False)
        jp, _ = panels.begin()
        j0 = fn.bin("mul", jp, c(nr))
        cleft = fn.bin("sub", n, j0)
        cols = fn.select(fn.icmp("slt", cleft, c(nr)), cleft, c(nr))
        packed_base = fn.gep(self.ty, pack_b, fn.bin("mul", fn.bin("sub", jp, origin), panel_size))
        tiled = fn.new_label("tiled")
        b_base, b_row = packed_base, c(nr)
        if direct:  # one tile for in-place and packed panels: their base and row stride
            in_place = fn.icmp("slt", jp, first)
            at = fn.gep(self.ty, self.buffers[g.b][0], fn.bin("add", fn.bin("mul", bi, sb0), j0))
            b_base = fn.emit(f"select i1 {in_place.ref}, ptr {at.ref}, ptr {packed_base.ref}", "ptr")
            b_row = fn.select(in_place, sb1, c(nr))
        if copies:  # the first of an item's misaligned blocks: read in place, copy aligned
            copy_tile, plain = fn.new_label("bcopy"), fn.new_label("bplain")
            fn.cbr(fn.bin("and", copying, in_place), copy_tile, plain)
            fn.start_block(copy_tile)
            self._tile(fn, at, sb1, tile_buf, bi, i0, m, k, copy_to=packed_base)
            fn.br(tiled)
            fn.start_block(plain)
        if direct and self._narrow_last():
            # a partial last panel of at most W columns: one vector per row covers it
            # (1 x 512x65x64: 39.0 -> 35.1 us)
            thin, full = fn.new_label("bthin"), fn.new_label("bfull")
            fn.cbr(fn.icmp("eq", jp, in_place_panels), thin, full)
            fn.start_block(full)
            self._tile(fn, b_base, b_row, tile_buf, bi, i0, m, k)
            fn.br(tiled)
            fn.start_block(thin)
            self._tile(fn, packed_base, c(nr), tile_buf, bi, i0, m, k, vectors=1)
        else:
            self._tile(fn, b_base, b_row, tile_buf, bi, i0, m, k)
        fn.br(tiled)
        fn.start_block(tiled)
        self._epilogue(fn, tile_buf, c(self.nr), bi, i0, rows, j0, cols, m, n)
        panels.end()
        loop.end([bi, carry_first, origin])
        fn.call("free", "void", [raw])

    def _narrow_last(self) -> bool:
        """Has the product a last panel of at most W valid columns (static n only), which
        one vector of accumulators per row covers (a vocabulary of 65: 1 column)?"""
        import sympy

        n = sympy.sympify(self.g.n)
        return n.is_Integer and self.nr > self.w and 0 < int(n) % self.nr <= self.w

    def _pack_b(self, fn, dst, bi, k, n, first, npanels) -> None:
        """dst[((jp - first) * K + kk) * NR + jj] = B[bi, kk, jp * NR + jj] for the panels
        first <= jp < npanels, 0 past n (K: `_k_rows`). Operands of the accumulator dtype
        move a vector at a time: a masked load per row for unit column strides, W x W
        blocks transposed in registers for a unit k stride (`_pack_b_transposed`), a
        masked gather otherwise; low-precision ones convert element by element."""
        import sympy

        if self.buffers[self.g.b][1].dtype != self.acc:
            return self._pack_b_scalar(fn, dst, bi, k, n, first, npanels)
        if self._transposes():
            return self._pack_b_transposed(fn, dst, bi, k, n, first, npanels)
        nr, w, vty = self.nr, self.w, self.vty
        c = lambda v: const("i64", v)  # noqa: E731
        s0, s1, s2 = (self._ix(fn, s) for s in self.g.b_strides)
        unit = sympy.sympify(self.g.b_strides[2]) == 1
        ivty, mty, pty = f"<{w} x i64>", f"<{w} x i1>", f"<{w} x ptr>"
        lanes = "<" + ", ".join(f"i64 {i}" for i in range(w)) + ">"
        sfx = f"v{w}{'f64' if self.esize == 8 else 'f32'}"
        if unit:
            intr = f"llvm.masked.load.{sfx}.p0"
            self.module.declare(intr, f"declare {vty} @{intr}(ptr, i32 immarg, {mty}, {vty})")
        else:
            intr = f"llvm.masked.gather.{sfx}.v{w}p0"
            self.module.declare(intr, f"declare {vty} @{intr}({pty}, i32 immarg, {mty}, {vty})")
        jl = CountedLoop(fn, first, npanels, vectorize=False)
        jp, _ = jl.begin()
        rolled(jl)
        j0 = fn.bin("mul", jp, c(nr))
        base = fn.bin("add", fn.bin("mul", bi, s0), fn.bin("mul", j0, s2))
        out = fn.bin("mul", fn.bin("mul", fn.bin("sub", jp, first), self._k_rows(fn, k)), c(nr))
        left = fn.bin("sub", n, j0)  # valid columns of this panel (>= NR: all)
        masks, offsets = [], []
        for v in range(nv := nr // w):
            ins = fn.emit(f"insertelement {ivty} poison, i64 {fn.bin('sub', left, c(v * w)).ref}, i64 0", ivty)
            splat = fn.emit(f"shufflevector {ivty} {ins.ref}, {ivty} poison, <{w} x i32> zeroinitializer", ivty)
            masks.append(fn.emit(f"icmp sgt {ivty} {splat.ref}, {lanes}", mty))
            if not unit:  # lane jj of vector v reads column j0 + v * W + jj
                sins = fn.emit(f"insertelement {ivty} poison, i64 {s2.ref}, i64 0", ivty)
                ssplat = fn.emit(f"shufflevector {ivty} {sins.ref}, {ivty} poison, <{w} x i32> zeroinitializer",
                                 ivty)
                cols = fn.emit(f"add {ivty} {lanes}, " + "<" + ", ".join([f"i64 {v * w}"] * w) + ">", ivty)
                offsets.append(fn.emit(f"mul {ivty} {cols.ref}, {ssplat.ref}", ivty))
        kl = CountedLoop(fn, c(0), k, vectorize=False)
        kk, _ = kl.begin()
        rolled(kl)
        row = fn.gep(self.ty, self.buffers[self.g.b][0], fn.bin("add", base, fn.bin("mul", kk, s1)))
        at = fn.bin("add", out, fn.bin("mul", kk, c(nr)))
        for v in range(nv):
            if unit:
                src = fn.gep(self.ty, row, c(v * w))
                value = fn.emit(f"call {vty} @{intr}(ptr {src.ref}, i32 {self.esize}, {mty} {masks[v].ref}, "
                                f"{vty} zeroinitializer)", vty)
            else:
                ptrs = fn.emit(f"getelementptr {self.ty}, ptr {row.ref}, {ivty} {offsets[v].ref}", pty)
                value = fn.emit(f"call {vty} @{intr}({pty} {ptrs.ref}, i32 {self.esize}, {mty} {masks[v].ref}, "
                                f"{vty} zeroinitializer)", vty)
            fn.store(value, fn.gep(self.ty, dst, fn.bin("add", at, c(v * w))), self.esize)
        kl.end()
        jl.end()

    def _transposes(self) -> bool:
        """Is B^T packed by in-register transposes: a unit k stride, the accumulator
        dtype, and a batch (its items pack B once each, so packing is a large part of a
        small product: attention's 64 x 32x32x16 q @ k^T 22.0 -> 19.8 us with them, 21.6
        with gathers). A single product packs B once per call and gathers (the same
        speed, and ~3 ms less LLVM time per kernel than the transposes' shuffles)."""
        import sympy

        g = self.g
        return (sympy.sympify(g.b_strides[2]) != 1 and sympy.sympify(g.b_strides[1]) == 1
                and self.buffers[g.b][1].dtype == self.acc and sympy.sympify(g.batch) != 1)

    def _k_rows(self, fn, k):
        """Rows per packed panel: k, rounded up to W where B^T is packed by W x W blocks."""
        if self._transposes():
            w = const("i64", self.w)
            return fn.bin("mul", fn.bin("sdiv", fn.bin("add", k, const("i64", self.w - 1)), w), w)
        return k

    def _pack_b_transposed(self, fn, dst, bi, k, n, first, npanels) -> None:
        """`_pack_b` for a batch's B^T (unit k stride: attention's q @ k^T, `_transposes`):
        W columns of W k values each are W masked vector loads, transposed in registers
        (log2 W rounds of two-source shuffles) into W rows of the panel. Panels hold k
        rounded up to W rows (the tile never reads past k)."""
        nr, w, vty = self.nr, self.w, self.vty
        c = lambda v: const("i64", v)  # noqa: E731
        s0, s2 = self._ix(fn, self.g.b_strides[0]), self._ix(fn, self.g.b_strides[2])
        ivty, mty = f"<{w} x i64>", f"<{w} x i1>"
        lanes = "<" + ", ".join(f"i64 {i}" for i in range(w)) + ">"
        intr = f"llvm.masked.load.v{w}{'f64' if self.esize == 8 else 'f32'}.p0"
        self.module.declare(intr, f"declare {vty} @{intr}(ptr, i32 immarg, {mty}, {vty})")
        kpad = self._k_rows(fn, k)
        jl = CountedLoop(fn, first, npanels, vectorize=False)
        jp, _ = jl.begin()
        rolled(jl)
        j0 = fn.bin("mul", jp, c(nr))
        cols = fn.bin("sub", n, j0)
        out = fn.bin("mul", fn.bin("mul", fn.bin("sub", jp, first), kpad), c(nr))
        kl = CountedLoop(fn, c(0), fn.bin("sdiv", kpad, c(w)), vectorize=False)
        kb, _ = kl.begin()
        k0 = fn.bin("mul", kb, c(w))
        ins = fn.emit(f"insertelement {ivty} poison, i64 {fn.bin('sub', k, k0).ref}, i64 0", ivty)
        kleft = fn.emit(f"shufflevector {ivty} {ins.ref}, {ivty} poison, <{w} x i32> zeroinitializer", ivty)
        kmask = fn.emit(f"icmp sgt {ivty} {kleft.ref}, {lanes}", mty)
        none = "zeroinitializer"
        vl = CountedLoop(fn, c(0), c(nr // w), vectorize=False)  # W-column blocks
        v, _ = vl.begin()
        rolled(vl)  # one transpose's code, not NR/W
        vw = fn.bin("mul", v, c(w))
        rows = []
        for jj in range(w):  # column j0 + v W + jj: k values k0 .. k0 + W
            col = fn.bin("add", vw, c(jj))
            j = fn.bin("add", j0, col)
            src = fn.gep(self.ty, self.buffers[self.g.b][0],
                         fn.bin("add", fn.bin("add", fn.bin("mul", bi, s0), fn.bin("mul", j, s2)), k0))
            inside = fn.icmp("slt", col, cols)
            mask = fn.emit(f"select i1 {inside.ref}, {mty} {kmask.ref}, {mty} {none}", mty)
            rows.append(fn.emit(f"call {vty} @{intr}(ptr {src.ref}, i32 {self.esize}, {mty} {mask.ref}, "
                                f"{vty} zeroinitializer)", vty))
        d = 1
        while d < w:  # swap bit d of (row, lane): after every bit, rows[kk][jj] = B(k0 + kk, jj)
            for i in range(w):
                if i & d:
                    continue
                lo = [x if not x & d else w + x - d for x in range(w)]
                hi = [x + d if not x & d else w + x for x in range(w)]
                a, b = rows[i], rows[i + d]
                rows[i] = fn.emit(f"shufflevector {vty} {a.ref}, {vty} {b.ref}, <{w} x i32> <"
                                  + ", ".join(f"i32 {x}" for x in lo) + ">", vty)
                rows[i + d] = fn.emit(f"shufflevector {vty} {a.ref}, {vty} {b.ref}, <{w} x i32> <"
                                      + ", ".join(f"i32 {x}" for x in hi) + ">", vty)
            d *= 2
        for kk in range(w):
            at = fn.bin("add", out, fn.bin("add", fn.bin("mul", fn.bin("add", k0, c(kk)), c(nr)), vw))
            fn.store(rows[kk], fn.gep(self.ty, dst, at), self.esize)
        vl.end()
        kl.end()
        jl.end()

    def _pack_b_scalar(self, fn, dst, bi, k, n, first, npanels) -> None:
        """`_pack_b` element by element, converting each to the accumulator dtype."""
        nr = self.nr
        s0, s1, s2 = (self._ix(fn, s) for s in self.g.b_strides)
        j_lo = fn.bin("mul", first, const("i64", nr))
        width = fn.bin("mul", fn.bin("sub", npanels, first), const("i64", nr))
        kl = CountedLoop(fn, const("i64", 0), k, vectorize=False)
        kk, _ = kl.begin()
        jl = CountedLoop(fn, const("i64", 0), width, vectorize=None)
        jrel, _ = jl.begin()
        j = fn.bin("add", j_lo, jrel)
        inside, outside, joined = fn.new_label("bin"), fn.new_label("bpad"), fn.new_label("bjoin")
        fn.cbr(fn.icmp("slt", j, n), inside, outside)
        fn.start_block(inside)
        src = fn.bin("add", fn.bin("mul", bi, s0), fn.bin("add", fn.bin("mul", kk, s1), fn.bin("mul", j, s2)))
        value = self._load_operand(fn, self.g.b, src)
        fn.br(joined)
        fn.start_block(outside)
        fn.br(joined)
        fn.start_block(joined)
        v = fn.emit(f"phi {self.ty} [ {value.ref}, %{inside} ], [ {const(self.ty, 0.0).ref}, %{outside} ]",
                    self.ty)
        jp = fn.bin("sdiv", jrel, const("i64", nr))
        jj = fn.bin("srem", jrel, const("i64", nr))
        at = fn.bin("add", fn.bin("mul", fn.bin("add", fn.bin("mul", jp, k), kk), const("i64", nr)), jj)
        fn.store(v, fn.gep(self.ty, dst, at), self.esize)
        jl.end()
        kl.end()

    def _tile(self, fn, b_base, b_row, tile_buf, bi, i0, m, k, vectors: int | None = None,
              copy_to: V | None = None) -> None:
        """tile[ii * NR + jj] = sum_kk A[bi, i0 + ii, kk] * B(kk, jj) with B's vector v of
        row kk at b_base + kk * b_row + v * W: MR x NR/W vector accumulators carried
        through the k loop (`vectors`: only the first that many of the NR/W, for a narrow
        last panel). A is read in place (rows past m repeat row m - 1; the epilogue never
        stores them). `copy_to`: B's vectors are also stored there as a packed panel
        (row kk at copy_to + kk * NR, 64-byte aligned), for the item's next row blocks."""
        mr, nr, w, vty = self.mr, self.nr, self.w, self.vty
        nv = vectors or nr // w
        sa0, sa1, sa2 = (self._ix(fn, s) for s in self.g.a_strides)
        last = fn.bin("sub", m, const("i64", 1))
        a_rows = []
        for ii in range(mr):
            row = fn.bin("add", i0, const("i64", ii))
            row = fn.select(fn.icmp("slt", row, m), row, last)
            a_rows.append(fn.bin("add", fn.bin("mul", bi, sa0), fn.bin("mul", row, sa1)))
        zero = V("zeroinitializer", vty)
        # B's row is a pointer carried through the loop, advanced by b_row: where b_row is
        # a select (in place or packed) an index kk * b_row cost a variable shift and an
        # add per row (16 x 32x64x256 aligned: 4% slower than a constant stride)
        kl = CountedLoop(fn, const("i64", 0), k, carried=[zero] * (mr * nv) + [b_base], vectorize=False)
        kk, carried = kl.begin()
        accs, b_ptr = carried[:-1], carried[-1]
        bvecs = [fn.load(vty, fn.gep(self.ty, b_ptr, const("i64", v * w)), self.esize) for v in range(nv)]
        if copy_to is not None:  # (the store ports are idle in this loop)
            row = fn.bin("mul", kk, const("i64", nr))
            for v in range(nv):
                fn.store(bvecs[v], fn.gep(self.ty, copy_to, fn.bin("add", row, const("i64", v * w))),
                         min(64, w * self.esize))
        koff = fn.bin("mul", kk, sa2)
        # B's row PREFETCH_ROWS ahead into L1 (a prefetch past B's end does not fault):
        # 16 x 32x64x256, B rows 256 bytes apart, 105.8 -> 100.2 us; others within 3%
        ahead = fn.bin("mul", const("i64", PREFETCH_ROWS), b_row)
        for v in range(nv):  # (no `inbounds`: the address may lie past B)
            at = fn.bin("add", ahead, const("i64", v * w))
            where = fn.emit(f"getelementptr {self.ty}, ptr {b_ptr.ref}, i64 {at.ref}", "ptr")
            fn.call("llvm.prefetch.p0", "void", [where, const("i32", 0), const("i32", 3), const("i32", 1)])
        new = []
        for ii in range(mr):
            a = self._load_operand(fn, self.g.a, fn.bin("add", a_rows[ii], koff))
            ins = fn.emit(f"insertelement {vty} poison, {self.ty} {a.ref}, i64 0", vty)
            splat = fn.emit(f"shufflevector {vty} {ins.ref}, {vty} poison, <{w} x i32> zeroinitializer", vty)
            for v in range(nv):
                acc = accs[ii * nv + v]
                new.append(fn.emit(f"call {vty} @{self.fma}({vty} {splat.ref}, {vty} {bvecs[v].ref}, "
                                   f"{vty} {acc.ref})", vty))
        new.append(fn.emit(f"getelementptr {self.ty}, ptr {b_ptr.ref}, i64 {b_row.ref}", "ptr"))
        outs = kl.end(new)[:-1]  # phis in (ii, v) order, as `new`
        for ii in range(mr):
            for v in range(nv):
                at = const("i64", ii * nr + v * w)
                fn.store(outs[ii * nv + v], fn.gep(self.ty, tile_buf, at), self.esize)


def rolled(loop: CountedLoop) -> None:
    """Keep a just-begun loop rolled (`llvm.loop.unroll.disable`): a packing loop unrolled
    copies its vector moves many times over for no speed (CountedLoop disables unrolling
    only for loops around loops; this marks the loop as one)."""
    loop.unroll_nested = False
    loop.marks = (loop.marks[0] - 1, loop.marks[1])


def emit_micro_gemm(module: Module, g: GemmKernel, symbol: str) -> None:
    """Add the micro-kernel GEMM `g` to `module` as exported function `symbol`."""
    MicroEmitter(module, g, symbol).emit()
