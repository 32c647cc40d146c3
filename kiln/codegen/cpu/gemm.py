"""`GemmKernel` -> LLVM: BLAS (MKL or OpenBLAS, blas.py) on tiles with the epilogue
fused per tile.

The flattened outer space (the ABI's [begin, end)) is batch x row panels of `panel_rows`
rows x column panels of `panel_cols` columns (one, the full width, where panel_cols is
0). For each tile the generated code calls `cblas_?gemm` (64-bit ints) for that block of
the output only, then immediately runs the epilogue over it while it is still in cache
(`Acc` = the value BLAS just wrote), so bias/activation/residual/cast epilogues cost one
pass over L2-resident data instead of a trip through DRAM. A single product (batch 1)
cut into tiles for kiln's threads (autotune.panel_tiles_for: row panels, column panels
or a grid, by shape) gives BLAS the whole rows of tiles in one call's range as one call
of up to MERGED_ROWS rows (B packed once per call), and a lone tile as a call of its
own; an epilogue that is the bare product costs no pass at all. Tiles cut only m and n,
so every output sums k in BLAS's own order: a split product is bit-identical to one
call.

Operand layouts come from the element strides: a unit k-stride is row-major (NoTrans),
a unit row-stride is transposed (Trans, no copy); anything else, and every
low-precision operand, is packed into a float32/float64 scratch buffer (B once per
batch, A per panel). Integer GEMMs and tiny sizes use `gemm_as_kernel`: the same
contraction written as an ordinary Kernel IR reduction (see autotune.py).
"""

from __future__ import annotations

import sympy

from kiln.codegen.kernel_ir import (
    GEMM_VARS, Acc, GemmKernel, Kernel, Load, Loop, Op, Reduce, ReduceRef, Store, loop_var, walk,
)
from kiln.errors import KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.dtypes import DType

from kiln.codegen.cpu import blas as providers, dtype_map
from kiln.codegen.cpu.jit import CBLAS_NO_TRANS, CBLAS_ROW_MAJOR, CBLAS_TRANS
from kiln.codegen.cpu.index_emit import emit_index
from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V, const
from kiln.codegen.cpu.llvm_emit import ExprEmitter, abi_wrapper
from kiln.codegen.cpu.scalar_ops import convert

MERGED_ROWS = 1024  # at most this many output rows per BLAS call (the epilogue's panel)


def acc_dtype(g: GemmKernel) -> DType:
    """The accumulator dtype: float64 for float64 operands, else float32 (or the int)."""
    if g.acc_dtype is not None:
        return g.acc_dtype
    a = next(b.dtype for b in g.buffers if b.name == g.a)
    if a.is_floating:
        return dt.float64 if a == dt.float64 else dt.float32
    return a


def blas_capable(g: GemmKernel) -> bool:
    return acc_dtype(g) in (dt.float32, dt.float64)


def check_strides(g: GemmKernel) -> None:
    """Reject operand strides that reach past their buffer (static sizes only): BLAS and
    the loop nest would read out of bounds."""
    params = {b.name: b for b in g.buffers}
    for name, strides, dims in ((g.a, g.a_strides, (g.batch, g.m, g.k)), (g.b, g.b_strides, (g.batch, g.k, g.n))):
        last = sympy.sympify(sum((sympy.sympify(d) - 1) * s for d, s in zip(dims, strides)))
        numel = sympy.sympify(sympy.prod([sympy.sympify(d) for d in params[name].shape]))
        if last.is_Integer and numel.is_Integer and int(numel) > 0 and int(last) >= int(numel) \
                and all(sympy.sympify(d).is_Integer and int(d) > 0 for d in dims):
            raise KilnShapeError(f"{g.name}: strides {tuple(strides)} of operand {name} reach element "
                                 f"{int(last)}, past its {int(numel)} elements (shape {params[name].shape})",
                                 hint="strides are (batch, row, k) for a and (batch, k, col) for b, in elements")


def panel_count(g: GemmKernel, panel_rows: int, panel_cols: int = 0):
    """Tiles of the BLAS GEMM's outer space: batch x row panels x column panels (one
    column panel, the full width, where panel_cols is 0)."""
    rows = sympy.floor((sympy.sympify(g.m) + panel_rows - 1) / panel_rows)
    if not panel_cols:
        return g.batch * rows
    cols = sympy.Max(1, sympy.floor((sympy.sympify(g.n) + panel_cols - 1) / panel_cols))
    return g.batch * rows * cols


def gemm_as_kernel(g: GemmKernel) -> Kernel:
    """The GEMM as a loop-nest Kernel: parallel (gb, gi, gj), reduce sum over k."""
    gb, gi, gj, kk = (loop_var(v) for v in GEMM_VARS + ("gk",))
    acc = acc_dtype(g)
    params = {b.name: b for b in g.buffers}
    sa, sb = g.a_strides, g.b_strides
    a = Load(g.a, gb * sa[0] + gi * sa[1] + kk * sa[2], params[g.a].dtype)
    b = Load(g.b, gb * sb[0] + kk * sb[1] + gj * sb[2], params[g.b].dtype)
    a, b = (x if x.dtype == acc else Op("convert", (x,), acc) for x in (a, b))
    reduce = Reduce("acc", "sum", (Loop("gk", g.k),), Op("mul", (a, b), acc), acc)
    epilogue = _replace_acc(g.epilogue, ReduceRef("acc", acc))
    out = Store(g.out, (gb * g.m + gi) * g.n + gj, epilogue)
    return Kernel(g.name, g.buffers, g.sizes, (Loop("gb", g.batch), Loop("gi", g.m), Loop("gj", g.n)),
                  (reduce, out))


def _replace_acc(e, by):
    if isinstance(e, Acc):
        return by
    if isinstance(e, Op):
        return Op(e.op, tuple(_replace_acc(a, by) for a in e.args), e.dtype)
    return e


def _layout(strides, row: int, col: int):
    """(transposed, leading-dim stride) for BLAS, or None when a copy is needed."""
    s_row, s_col = sympy.sympify(strides[row]), sympy.sympify(strides[col])
    if s_col == 1 and s_row != 0:
        return False, strides[row]
    if s_row == 1 and s_col != 0:
        return True, strides[col]
    return None


class GemmEmitter:
    """The BLAS-panel GEMM; also the base of kiln's micro-kernel (microkernel.py), which
    shares the function frame, operand loads and the epilogue."""

    def __init__(self, module: Module, g: GemmKernel, symbol: str, panel_rows: int, panel_cols: int = 0,
                 blas: str | None = None):
        self.module, self.g, self.symbol, self.mp, self.np = module, g, symbol, panel_rows, panel_cols
        self.blas_name = blas  # blas.py's provider (None: the process's)
        self.acc = acc_dtype(g)
        if self.acc not in (dt.float32, dt.float64):
            raise KilnDTypeError(f"cpu backend: BLAS GEMM needs float operands, got {self.acc.name}; "
                                 "use gemm_as_kernel")
        self.acc_ty = dtype_map.reg_type(self.acc)
        self.esize = 8 if self.acc == dt.float64 else 4

    def _declare(self, module: Module) -> None:
        blas = providers.load(self.blas_name).gemm("d" if self.acc == dt.float64 else "s")
        module.declare(blas, f"declare void @{blas}(i32, i32, i32, i64, i64, i64, {self.acc_ty}, ptr, "
                             f"i64, ptr, i64, {self.acc_ty}, ptr, i64)")
        self.blas = blas

    def emit(self) -> None:
        g, module = self.g, self.module
        fn = Fn(module)
        params, self.buffers = [], {}
        for i, b in enumerate(g.buffers):
            params.append(f"ptr noalias %b{i}")
            self.buffers[b.name] = (V(f"%b{i}", "ptr"), b)
        params += [f"i64 %s{i}" for i in range(len(g.sizes))] + ["i64 %begin", "i64 %end"]
        self.sizes = {name: V(f"%s{i}", "i64") for i, name in enumerate(g.sizes)}
        module.declare("malloc", "declare noalias ptr @malloc(i64)")
        module.declare("free", "declare void @free(ptr)")
        self._declare(module)
        self._body(fn)
        fn.stmt("ret void")
        module.functions.append(fn.define(
            f"define internal void @{self.symbol}.body({', '.join(params)}) noinline nounwind"))
        module.functions.append(abi_wrapper(self.symbol, len(g.buffers), len(g.sizes)))

    def _ix(self, fn, expr, extra=None):
        env = dict(self.sizes)
        env.update(extra or {})
        return emit_index(fn, expr, env)

    def _body(self, fn: Fn) -> None:
        g = self.g
        m, n, k = (self._ix(fn, d) for d in (g.m, g.n, g.k))
        mp = const("i64", self.mp)
        npr = fn.bin("sdiv", fn.bin("add", m, const("i64", self.mp - 1)), mp)
        if self.np:  # column tiles of np columns (a single product split by shape)
            ncols = const("i64", self.np)
            npc = fn.bin("sdiv", fn.bin("add", n, const("i64", self.np - 1)), ncols)
            npc = fn.select(fn.icmp("slt", npc, const("i64", 1)), const("i64", 1), npc)
        else:
            ncols, npc = n, const("i64", 1)
        per_item = fn.bin("mul", npr, npc)
        # one product split into tiles for kiln's threads (autotune.panel_tiles_for):
        # consecutive whole rows of tiles in one call's range go to BLAS as one call of
        # up to MERGED_ROWS rows, so a thread that runs several (or all) of them packs B
        # once; a lone tile is one call of its own
        single = sympy.sympify(g.batch) == 1
        params = {b.name: b for b in g.buffers}
        a_dt, b_dt, out_dt = params[g.a].dtype, params[g.b].dtype, params[g.out].dtype
        a_lay = _layout(g.a_strides, 1, 2) if a_dt == self.acc else None
        b_lay = _layout(g.b_strides, 1, 2) if b_dt == self.acc else None
        reads_out = any(isinstance(x, Load) and x.buffer == g.out for x in walk(g.epilogue))
        direct_c = out_dt == self.acc and not reads_out
        group = max(1, MERGED_ROWS // self.mp) if single else 1
        if single and direct_c and a_lay is not None and isinstance(g.epilogue, Acc):
            # the bare product in place: no epilogue pass wants cache-sized panels and no
            # scratch is sized by them, so whole rows of tiles are one call however many
            # (B packed once: 2048^3 on one thread as 1 call, 3% less CPU than 2)
            group = 1 << 40
        cap = const("i64", self.mp * min(group, max(1, MERGED_ROWS // self.mp)))
        esz = const("i64", self.esize)
        tmp_a = fn.call("malloc", "ptr", [fn.bin("mul", fn.bin("mul", cap, fn.bin("add", k, const("i64", 1))), esz)]) \
            if a_lay is None else None
        tmp_b = fn.call("malloc", "ptr", [fn.bin("mul", fn.bin("add", fn.bin("mul", k, n), const("i64", 1)), esz)]) \
            if b_lay is None else None
        tmp_c = None if direct_c else fn.call(
            "malloc", "ptr", [fn.bin("mul", fn.bin("add", fn.bin("mul", cap, n), const("i64", 1)), esz)])
        begin, end = V("%begin", "i64"), V("%end", "i64")
        # tiles p of [begin, end), row-major per batch item; a call that merged rows of
        # tiles skips the tiles it covered (`skip`: the next tile still to run)
        loop = CountedLoop(fn, begin, end, carried=[const("i64", -1), begin], vectorize=False)
        p, (last_key, skip) = loop.begin()
        run_it, latch = fn.new_label("tile"), fn.new_label("next")
        todo = fn.icmp("sge", p, skip)
        skipped = fn.block
        fn.cbr(todo, run_it, latch)
        fn.start_block(run_it)
        bi = fn.bin("sdiv", p, per_item)
        q = fn.bin("srem", p, per_item)
        r, c = fn.bin("sdiv", q, npc), fn.bin("srem", q, npc)
        i0 = fn.bin("mul", r, mp)
        # whole rows of tiles from here on: one call over full rows, up to `group` of them
        full = fn.bin("and", fn.icmp("eq", c, const("i64", 0)),
                      fn.icmp("sle", fn.bin("add", p, npc), end))
        whole = fn.bin("sdiv", fn.bin("sub", end, p), npc)
        whole = fn.select(fn.icmp("slt", whole, const("i64", group)), whole, const("i64", group))
        nrows = fn.select(full, whole, const("i64", 1))
        stop = fn.bin("mul", fn.bin("add", r, nrows), mp)
        stop = fn.select(fn.icmp("slt", stop, m), stop, m)
        rows = fn.bin("sub", stop, i0)
        j0 = fn.select(full, const("i64", 0), fn.bin("mul", c, ncols))
        left = fn.bin("sub", n, j0)
        cols = fn.select(full, n, fn.select(fn.icmp("slt", left, ncols), left, ncols))
        next_skip = fn.select(full, fn.bin("add", p, fn.bin("mul", nrows, npc)), fn.bin("add", p, const("i64", 1)))
        # operand A: the tile's rows
        if a_lay is None:
            self._pack(fn, tmp_a, g.a, g.a_strides, bi, i0, rows, k)
            a_ptr, trans_a, lda = tmp_a, CBLAS_NO_TRANS, k
        else:
            off = fn.bin("add", fn.bin("mul", bi, self._ix(fn, g.a_strides[0])),
                         fn.bin("mul", i0, self._ix(fn, g.a_strides[1])))
            a_ptr = fn.gep(self.acc_ty, self.buffers[g.a][0], off)
            trans_a, lda = (CBLAS_TRANS if a_lay[0] else CBLAS_NO_TRANS), self._ix(fn, a_lay[1])
        # operand B: the tile's columns, packed once per batch index and column tile
        key = fn.bin("add", fn.bin("mul", bi, fn.bin("add", npc, const("i64", 1))), fn.select(full, npc, c))
        if b_lay is None:
            pack, after = fn.new_label("packb"), fn.new_label("packed")
            fn.cbr(fn.icmp("ne", key, last_key), pack, after)
            fn.start_block(pack)
            self._pack(fn, tmp_b, g.b, g.b_strides, bi, const("i64", 0), k, cols, j0)
            fn.br(after)
            fn.start_block(after)
            b_ptr, trans_b, ldb = tmp_b, CBLAS_NO_TRANS, cols
        else:
            trans_b, ldb = (CBLAS_TRANS if b_lay[0] else CBLAS_NO_TRANS), self._ix(fn, b_lay[1])
            b_off = fn.bin("add", fn.bin("mul", bi, self._ix(fn, g.b_strides[0])),
                           fn.bin("mul", j0, ldb) if b_lay[0] else j0)
            b_ptr = fn.gep(self.acc_ty, self.buffers[g.b][0], b_off)
        out_ptr = self.buffers[g.out][0]
        c_off = fn.bin("add", fn.bin("mul", fn.bin("add", fn.bin("mul", bi, m), i0), n), j0)
        c_ptr = fn.gep(self.acc_ty, out_ptr, c_off) if direct_c else fn.gep(self.acc_ty, tmp_c, j0)
        one = lambda v: fn.select(fn.icmp("slt", v, const("i64", 1)), const("i64", 1), v)  # noqa: E731

        def at_least(v, floor):
            return fn.select(fn.icmp("slt", v, floor), floor, v)

        # BLAS wants ld >= the stored row length even where only one row is read: a
        # leading stride below that only occurs along a size-1 dim, where any value works
        lda = at_least(lda, rows if trans_a == CBLAS_TRANS else k)
        ldb = at_least(ldb, k if trans_b == CBLAS_TRANS else cols)
        has_k = fn.icmp("sgt", k, const("i64", 0))
        call, zero, done = fn.new_label("gemm"), fn.new_label("zero"), fn.new_label("epi")
        fn.cbr(has_k, call, zero)
        fn.start_block(call)
        fn.call(self.blas, "void", [
            const("i32", CBLAS_ROW_MAJOR), const("i32", trans_a), const("i32", trans_b), rows, cols, k,
            const(self.acc_ty, 1.0), a_ptr, one(lda), b_ptr, one(ldb), const(self.acc_ty, 0.0), c_ptr, one(n)])
        fn.br(done)
        fn.start_block(zero)  # k == 0: the product is all zeros
        zr = CountedLoop(fn, const("i64", 0), rows, vectorize=False)
        zi, _ = zr.begin()
        zl = CountedLoop(fn, const("i64", 0), cols)
        z, _ = zl.begin()
        fn.store(const(self.acc_ty, 0.0), fn.gep(self.acc_ty, c_ptr, fn.bin("add", fn.bin("mul", zi, n), z)),
                 self.esize)
        zl.end()
        zr.end()
        fn.br(done)
        fn.start_block(done)
        if not (direct_c and isinstance(g.epilogue, Acc)):  # BLAS wrote the result in place
            self._epilogue(fn, c_ptr, n, bi, i0, rows, j0, cols, m, n)
        ran = fn.block
        fn.br(latch)
        fn.start_block(latch)
        key_out = fn.emit(f"phi i64 [ {key.ref}, %{ran} ], [ {last_key.ref}, %{skipped} ]", "i64")
        skip_out = fn.emit(f"phi i64 [ {next_skip.ref}, %{ran} ], [ {skip.ref}, %{skipped} ]", "i64")
        loop.end([key_out, skip_out])
        for t in (tmp_a, tmp_b, tmp_c):
            if t is not None:
                fn.call("free", "void", [t])

    def _pack(self, fn, dst, name, strides, bi, r0, rows, cols, c0=None):
        """dst[r * cols + c] = convert(src[b, r0 + r, c0 + c]) in the operand's logical
        layout (A: rows x k; B: k x n), as a dense row-major accumulator-dtype matrix."""
        s0, s1, s2 = (self._ix(fn, s) for s in strides)
        outer = CountedLoop(fn, const("i64", 0), rows, vectorize=False)
        r, _ = outer.begin()
        inner = CountedLoop(fn, const("i64", 0), cols)
        c, _ = inner.begin()
        col = c if c0 is None else fn.bin("add", c0, c)
        src = fn.bin("add", fn.bin("mul", bi, s0),
                     fn.bin("add", fn.bin("mul", fn.bin("add", r0, r), s1), fn.bin("mul", col, s2)))
        value = self._load_operand(fn, name, src)
        fn.store(value, fn.gep(self.acc_ty, dst, fn.bin("add", fn.bin("mul", r, cols), c)), self.esize)
        inner.end()
        outer.end()

    def _load_operand(self, fn, name, index):
        """Element `index` of operand `name`, converted to the accumulator dtype."""
        ptr, param = self.buffers[name]
        st = dtype_map.storage_type(param.dtype)
        raw = fn.load(st, fn.gep(st, ptr, index), max(1, param.dtype.itemsize))
        return convert(fn, dtype_map.load_convert(fn, raw, param.dtype), param.dtype, self.acc)

    def _epilogue(self, fn, c_ptr, ld, bi, i0, rows, j0, cols, m, n) -> None:
        """out[bi, i0 + r, j0 + j] = epilogue(Acc = c_ptr[r * ld + j]) for r < rows, j < cols."""
        g = self.g
        out_ptr, out_param = self.buffers[g.out]
        rl = CountedLoop(fn, const("i64", 0), rows, vectorize=False)
        r, _ = rl.begin()
        jl = CountedLoop(fn, const("i64", 0), cols)
        jc, _ = jl.begin()
        gi = fn.bin("add", i0, r)
        j = fn.bin("add", j0, jc)
        acc = fn.load(self.acc_ty, fn.gep(self.acc_ty, c_ptr, fn.bin("add", fn.bin("mul", r, ld), jc)), self.esize)
        symbols = dict(self.sizes)
        symbols.update({"gb": bi, "gi": gi, "gj": j})
        ex = ExprEmitter(fn, self.buffers, symbols, {}, acc=acc)
        value = convert(fn, ex(g.epilogue), g.epilogue.dtype, out_param.dtype)
        st = dtype_map.storage_type(out_param.dtype)
        index = fn.bin("add", fn.bin("mul", fn.bin("add", fn.bin("mul", bi, m), gi), n), j)
        fn.store(dtype_map.store_convert(fn, value, out_param.dtype), fn.gep(st, out_ptr, index),
                 max(1, out_param.dtype.itemsize))
        jl.end()
        rl.end()


def emit_gemm(module: Module, g: GemmKernel, symbol: str, panel_rows: int, panel_cols: int = 0,
              blas: str | None = None) -> None:
    """Add the BLAS GEMM `g` to `module` as exported function `symbol`: tiles of
    `panel_rows` rows by `panel_cols` columns (0: the full width), calling BLAS `blas`
    (blas.py; None: the process's)."""
    GemmEmitter(module, g, symbol, panel_rows, panel_cols, blas).emit()
