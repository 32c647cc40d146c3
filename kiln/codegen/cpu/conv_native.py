"""`convolution` on the CPU: im2col blocks in L2 and one BLAS GEMM per block, over kiln's
threads.

`convolution` stays an extern step in compiled programs (no loop nest expresses a
sliding window well), and its numpy reference (kiln/ir/ops/linalg.py, `conv_reference`)
contracts a `sliding_window_view` with `np.einsum`: a (32, 64, 56, 56) x (64, 64, 3, 3)
convolution took 190-204 ms there against torch's 21-42 ms, a (1, 3, 8, 8) one 80-119 us
against 6 (benchmarks/bench_conv.py). This module is the CPU backend's `conv` template kind
(`CpuBackend.templates()`), for 1-d and 2-d convolutions of float32 or float64 operands:

- the output of one batch item and group, [O/G, OH * OW] in row-major memory, is cut in
  blocks of output rows; a block's im2col matrix [C/G * KH * KW, rows * OW] is built
  in a scratch of its thread (sized to stay in L2: BLOCK_ELEMS), one contiguous run per
  kernel tap and output row (zeros where the window reads padding), then
  `y[block] = W_g @ cols` is one BLAS call on one thread (MKL's sequential layer, or
  numpy's OpenBLAS held at one thread) writing the output in place;
- a 1 x 1 kernel at stride 1 without padding reads the input itself as the matrix (no
  copy); a 1-d convolution is a 2-d one of height 1;
- a kernel wider than its output (a convolution's kernel gradient, whose "kernel" is the
  cotangent) builds the matrix transposed, runs along kernel rows, and where its items
  have few outputs puts a thread's items side by side as the columns of ONE GEMM (the
  weights packed once, not once per item);
- the blocks (batch items x groups x row blocks) are cut evenly over kiln's threads
  (`native_pool.parallel_for`, one range per thread, so a thread's scratch is the slot
  of its range's first block).

The sums run in the operands' dtype in BLAS's order (as torch's CPU convolutions, which
differ from the reference's einsum in the last bits); the gradients of a convolution are
convolutions too (linalg.py's vjp), so training runs here as well. Anything else (3-d,
low precision, integers, negative padding) runs the reference. The function is built
once per machine and BLAS (the glue cache keeps its object code).
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu import blas
from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V, const
from kiln.codegen.cpu.jit import CBLAS_NO_TRANS, CBLAS_ROW_MAJOR, CBLAS_TRANS
from kiln.codegen.cpu.llvm_emit import template_args

FLOATS = {np.dtype(np.float32): ("float", "s"), np.dtype(np.float64): ("double", "d")}
# sizes[]: per group channels, input rows and columns, per group outputs, kernel rows and
# columns, output rows and columns, strides, padding (top, left), dilation, groups, row
# blocks per item and group, rows per block, blocks per thread's range, scratch elements
# per thread, 1 where the input is the matrix itself (1 x 1 kernel, stride 1, no pad), and
# 1 where the im2col matrix is built transposed (runs along kernel rows), 1 where a range's
# whole items are one GEMM (transposed, one group, one block per item: MERGE_ELEMS)
SIZE_NAMES = ("C", "H", "W", "O", "KH", "KW", "OH", "OW", "SH", "SW", "PH", "PW", "DH", "DW",
              "G", "NB", "BH", "ALIGN", "SLOT", "DIRECT", "TRANS", "MERGE")
BLOCK_ELEMS = 1 << 18  # an im2col block of at most ~this many elements (1 MB of float32: L2)
MERGE_WIDTH = 64  # transposed items with fewer outputs than this are merged into one GEMM
MERGE_ELEMS = 1 << 23  # ... when a range's scratch stays under this many elements (32 MB float32)
SPLIT_MACS = 1 << 21  # a convolution of fewer multiply-adds runs on the caller's thread
_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_OBJECTS = ctypes.c_void_p * 4
_SCRATCH = threading.local()  # per calling thread: {dtype: array} reused across calls


def entry(ty: str) -> str:
    return f"kiln_conv2d_{ty}"


def module_text(ty: str, gemm: str) -> str:
    """fn(bufs = [x, w, y, scratch] (array objects), sizes, begin, end): blocks [begin,
    end) of x [N, G*C, H, W] (*) w [G*O, C, KH, KW] into y [N, G*O, OH, OW]."""
    module = Module()
    module.declare(gemm, f"declare void @{gemm}(i32, i32, i32, i64, i64, i64, {ty}, ptr, i64, ptr, "
                         f"i64, {ty}, ptr, i64)")
    module.declare("llvm.memset.p0.i64", "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)")
    module.declare("llvm.memcpy.p0.p0.i64", "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)")
    esize = 8 if ty == "double" else 4
    fn = Fn(module)
    i64 = lambda v: const("i64", v)  # noqa: E731
    (x, w, y, scratch), s = template_args(fn, 4, SIZE_NAMES)
    mul, add, sub = (lambda a, b: fn.bin("mul", a, b, "nsw")), (lambda a, b: fn.bin("add", a, b, "nsw")), \
        (lambda a, b: fn.bin("sub", a, b, "nsw"))
    sdiv = lambda a, b: fn.bin("sdiv", a, b)  # noqa: E731
    smin = lambda a, b: fn.select(fn.icmp("slt", a, b), a, b)  # noqa: E731
    smax = lambda a, b: fn.select(fn.icmp("sgt", a, b), a, b)  # noqa: E731
    memset = lambda dst, count: fn.call("llvm.memset.p0.i64", "void", [  # noqa: E731
        dst, const("i8", 0), mul(count, i64(esize)), const("i1", 0)])  # (+0.0 is all zero bits)
    memcpy = lambda dst, src, count: fn.call("llvm.memcpy.p0.p0.i64", "void", [  # noqa: E731
        dst, src, mul(count, i64(esize)), const("i1", 0)])
    ck = mul(s["C"], mul(s["KH"], s["KW"]))  # the GEMM's k
    plane = mul(s["H"], s["W"])
    outs = mul(s["OH"], s["OW"])
    begin, end = V("%begin", "i64"), V("%end", "i64")
    cols = fn.gep(ty, scratch, mul(sdiv(begin, s["ALIGN"]), s["SLOT"]))  # this range's scratch
    direct = fn.icmp("ne", s["DIRECT"], i64(0))
    trans = fn.icmp("ne", s["TRANS"], i64(0))
    gemm_call = lambda tb, m, n, a, b, ldb, c, ldc: fn.call(gemm, "void", [  # noqa: E731
        const("i32", CBLAS_ROW_MAJOR), const("i32", CBLAS_NO_TRANS), tb, m, n, ck, const(ty, 1.0), a, ck, b,
        ldb, const(ty, 0.0), c, ldc])

    def run(dst: V, row: V, inside: V, off: V, count: V, stride: V, done: str) -> None:
        """dst[t] = row[off + t * stride] for t in [0, count), 0.0 where that is outside
        [0, W) or the row is (`inside` false); then a branch to `done`."""
        copy, blank = fn.new_label("copy"), fn.new_label("blank")
        fn.cbr(inside, copy, blank)
        fn.start_block(blank)  # the whole run reads padding
        memset(dst, count)
        fn.br(done)
        fn.start_block(copy)
        # t in [lo, hi) reads inside the row: off + t * stride in [0, W)
        neg = fn.icmp("slt", off, i64(0))
        lo_raw = sdiv(add(sub(i64(0), off), sub(stride, i64(1))), stride)
        lo = smin(fn.select(neg, lo_raw, i64(0)), count)
        room = sub(s["W"], off)
        hi_raw = sdiv(add(room, sub(stride, i64(1))), stride)
        hi = smax(smin(fn.select(fn.icmp("sgt", room, i64(0)), hi_raw, i64(0)), count), lo)
        # (before the row where off < 0: a plain getelementptr, only [lo, hi) is read)
        src = fn.emit(f"getelementptr {ty}, ptr {row.ref}, i64 {off.ref}", "ptr")
        whole, edges = fn.new_label("whole"), fn.new_label("edges")
        full = fn.bin("and", fn.icmp("eq", lo, i64(0)), fn.icmp("eq", hi, count))
        fn.cbr(fn.bin("and", full, fn.icmp("eq", stride, i64(1))), whole, edges)
        fn.start_block(whole)  # the common case: the run is inside, contiguous
        memcpy(dst, src, count)
        fn.br(done)
        fn.start_block(edges)  # (a strided run inside the row has no edges: no memset calls)
        for at, n in ((dst, lo), (fn.gep(ty, dst, hi), sub(count, hi))):
            zero, after = fn.new_label("pad"), fn.new_label("padded")
            fn.cbr(fn.icmp("sgt", n, i64(0)), zero, after)
            fn.start_block(zero)
            memset(at, n)
            fn.br(after)
            fn.start_block(after)
        unit_stride, strided = fn.new_label("contiguous"), fn.new_label("strided")
        fn.cbr(fn.icmp("eq", stride, i64(1)), unit_stride, strided)
        fn.start_block(unit_stride)
        memcpy(fn.gep(ty, dst, lo), fn.gep(ty, src, lo), sub(hi, lo))
        fn.br(done)
        fn.start_block(strided)
        # stride 2 (a downsampling convolution) as a literal: LLVM then loads two vectors
        # and keeps every other lane; a runtime stride stays one element at a time
        # (with the edges' zero-length memsets skipped: 3x3 stride 2, 64 -> 128 ch, 56x56,
        # batch 32, one thread 31.2 -> 25.3 ms, its GEMMs ~18)
        two, other = fn.new_label("stride2"), fn.new_label("stride_n")
        fn.cbr(fn.icmp("eq", stride, i64(2)), two, other)
        for label, step in ((two, i64(2)), (other, stride)):
            fn.start_block(label)
            mid = CountedLoop(fn, lo, hi, vectorize=None)
            t, _ = mid.begin()
            fn.store(fn.load(ty, fn.gep(ty, src, mul(t, step)), esize), fn.gep(ty, dst, t), esize)
            mid.end()
            fn.br(done)

    def row_of(xbase: V, c: V, ih: V) -> tuple[V, V]:
        """(channel c's input row ih, as a plain pointer, and whether ih is inside)"""
        inside = fn.bin("and", fn.icmp("sge", ih, i64(0)), fn.icmp("slt", ih, s["H"]))
        at = add(mul(c, plane), mul(ih, s["W"]))
        return fn.emit(f"getelementptr {ty}, ptr {xbase.ref}, i64 {at.ref}", "ptr"), inside

    def fill_rows(xbase: V, cols: V, oh0: V, rows: V, width: V) -> None:
        """cols[(c, kh, kw), (i, ow)] = x[c, (oh0 + i)*SH - PH + kh*DH, ow*SW - PW + kw*DW]:
        runs along output rows"""
        chans = CountedLoop(fn, i64(0), s["C"], vectorize=False)
        c, _ = chans.begin()
        khs = CountedLoop(fn, i64(0), s["KH"], vectorize=False)
        kh, _ = khs.begin()
        kws = CountedLoop(fn, i64(0), s["KW"], vectorize=False)
        kw, _ = kws.begin()
        dst_r = fn.gep(ty, cols, mul(add(mul(add(mul(c, s["KH"]), kh), s["KW"]), kw), width))
        off_w = sub(mul(kw, s["DW"]), s["PW"])  # input column of output column 0
        out_rows = CountedLoop(fn, i64(0), rows, vectorize=False)
        i, _ = out_rows.begin()
        row, inside = row_of(xbase, c, add(sub(mul(add(oh0, i), s["SH"]), s["PH"]), mul(kh, s["DH"])))
        done = fn.new_label("row")
        run(fn.gep(ty, dst_r, mul(i, s["OW"])), row, inside, off_w, s["OW"], s["SW"], done)
        fn.start_block(done)
        out_rows.end()
        kws.end()
        khs.end()
        chans.end()

    def fill_transposed(xbase: V, cols: V, oh0: V, rows: V) -> None:
        """cols[(i, ow), (c, kh, kw)]: the same values transposed, runs along kernel rows
        (a kernel wider than the output: a convolution's kernel gradient)"""
        out_rows = CountedLoop(fn, i64(0), rows, vectorize=False)
        i, _ = out_rows.begin()
        ih0 = sub(mul(add(oh0, i), s["SH"]), s["PH"])
        out_cols = CountedLoop(fn, i64(0), s["OW"], vectorize=False)
        j, _ = out_cols.begin()
        dst_p = fn.gep(ty, cols, mul(add(mul(i, s["OW"]), j), ck))
        off_k = sub(mul(j, s["SW"]), s["PW"])  # input column of kernel column 0
        chans = CountedLoop(fn, i64(0), s["C"], vectorize=False)
        c, _ = chans.begin()
        khs = CountedLoop(fn, i64(0), s["KH"], vectorize=False)
        kh, _ = khs.begin()
        row, inside = row_of(xbase, c, add(ih0, mul(kh, s["DH"])))
        done = fn.new_label("tap")
        run(fn.gep(ty, dst_p, mul(add(mul(c, s["KH"]), kh), s["KW"])), row, inside, off_k, s["KW"], s["DW"], done)
        fn.start_block(done)
        khs.end()
        chans.end()
        out_cols.end()
        out_rows.end()

    merged, blockwise, finish = fn.new_label("merged"), fn.new_label("blockwise"), fn.new_label("finish")
    fn.cbr(fn.icmp("ne", s["MERGE"], i64(0)), merged, blockwise)

    # one block per unit: y[n, g's outputs, rows] = W_g [O, C*KH*KW] @ cols [C*KH*KW, width]
    fn.start_block(blockwise)
    blocks = CountedLoop(fn, begin, end, vectorize=False)
    u, _ = blocks.begin()
    ng = sdiv(u, s["NB"])
    g = fn.bin("srem", ng, s["G"])
    oh0 = mul(fn.bin("srem", u, s["NB"]), s["BH"])
    rows = smin(s["BH"], sub(s["OH"], oh0))
    width = mul(rows, s["OW"])  # the block's GEMM n
    xbase = fn.gep(ty, x, mul(mul(ng, s["C"]), plane))  # item n, group g's channels
    wbase = fn.gep(ty, w, mul(mul(g, s["O"]), ck))
    ybase = fn.gep(ty, y, add(mul(mul(ng, s["O"]), outs), mul(oh0, s["OW"])))
    fill, fill_n, fill_t, gemm_block = (fn.new_label(h) for h in ("fill", "fill_n", "fill_t", "gemm"))
    fn.cbr(direct, gemm_block, fill)
    fn.start_block(fill)
    fn.cbr(trans, fill_t, fill_n)
    fn.start_block(fill_n)
    fill_rows(xbase, cols, oh0, rows, width)
    fn.br(gemm_block)
    fn.start_block(fill_t)
    fill_transposed(xbase, cols, oh0, rows)
    fn.br(gemm_block)
    fn.start_block(gemm_block)
    b = fn.select(direct, fn.gep(ty, xbase, mul(oh0, s["OW"])), cols)
    ldb = fn.select(direct, plane, fn.select(trans, ck, width))
    tb = fn.select(trans, const("i32", CBLAS_TRANS), const("i32", CBLAS_NO_TRANS))
    gemm_call(tb, s["O"], width, wbase, b, ldb, ybase, outs)
    blocks.end()
    fn.br(finish)

    # merged (one group, whole items, transposed): the range's items side by side as the
    # columns of ONE GEMM, W read (packed) once instead of once per item, then each
    # item's [O, OH*OW] copied out of the product [O, items*OH*OW]
    fn.start_block(merged)
    items = sub(end, begin)
    per = mul(outs, ck)
    fills = CountedLoop(fn, begin, end, vectorize=False)
    u, _ = fills.begin()
    fill_transposed(fn.gep(ty, x, mul(mul(u, s["C"]), plane)), fn.gep(ty, cols, mul(sub(u, begin), per)),
                    i64(0), s["OH"])
    fills.end()
    wide = mul(items, outs)
    product = fn.gep(ty, cols, mul(items, per))
    gemm_call(const("i32", CBLAS_TRANS), s["O"], wide, w, cols, ck, product, wide)
    copies = CountedLoop(fn, begin, end, vectorize=False)
    u, _ = copies.begin()
    outs_o = CountedLoop(fn, i64(0), s["O"], vectorize=False)
    o, _ = outs_o.begin()
    memcpy(fn.gep(ty, y, mul(add(mul(u, s["O"]), o), outs)),
           fn.gep(ty, product, add(mul(o, wide), mul(sub(u, begin), outs))), outs)
    outs_o.end()
    copies.end()
    fn.br(finish)

    fn.start_block(finish)
    fn.stmt("ret void")
    module.functions.append(fn.define(f"define void @{entry(ty)}(ptr %bufs, ptr %sizes, i64 %begin, "
                                      "i64 %end) nounwind"))
    return module.text()


@lru_cache(maxsize=None)
def _entry(dtype: np.dtype, provider: str):
    """(the jitted module, the function's address) for `dtype`, calling BLAS `provider`."""
    from kiln.codegen.cpu.glue_cache import glue_module

    ty, letter = FLOATS[dtype]
    jitted = glue_module(module_text(ty, blas.load(provider).gemm(letter)), 2)
    return jitted, jitted.address(entry(ty))


def _scratch(dtype: np.dtype, elems: int) -> np.ndarray:
    """This thread's im2col scratch of at least `elems` elements (kept across calls)."""
    kept = getattr(_SCRATCH, "arrays", None)
    if kept is None:
        kept = _SCRATCH.arrays = {}
    have = kept.get(dtype)
    if have is None or have.size < elems:
        have = kept[dtype] = np.empty(max(elems, 1), dtype)
    return have


class _Conv:
    """A prepared convolution for one signature (shapes, dtype, attributes, BLAS,
    threads): the function's sizes and the cut, decided once; a call allocates the output
    and runs the blocks."""

    __slots__ = ("out_shape", "dtype", "sizes", "total", "align", "threads", "scratch", "fn",
                 "address", "one_blas", "x4", "w4")

    def __init__(self, out_shape, dtype, sizes, total, align, threads, scratch, address, one_blas, x4, w4):
        self.out_shape, self.dtype, self.sizes, self.total = out_shape, dtype, sizes, total
        self.align, self.threads, self.scratch, self.address = align, threads, scratch, address
        self.fn, self.one_blas, self.x4, self.w4 = _FN(address), one_blas, x4, w4

    def __call__(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        y = np.empty(self.out_shape, self.dtype)
        if self.total == 0:
            y.fill(0)
            return y
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        if not w.flags.c_contiguous:
            w = np.ascontiguousarray(w)
        if self.x4 is not None:  # 1-d: [N, C, W] as [N, C, 1, W]
            x, w = x.reshape(self.x4), w.reshape(self.w4)
        scratch = _scratch(self.dtype, self.scratch)
        bufs = _OBJECTS(id(x), id(w), id(y), id(scratch))  # all alive until the call returns
        region = None
        if self.threads > 1:
            from kiln.codegen.cpu.native_pool import parallel_for

            region = parallel_for()
        if self.one_blas:  # numpy's OpenBLAS at one thread inside (MKL runs sequential)
            from kiln.runtime.threads import blas_single_thread

            with blas_single_thread():
                self._run(region, bufs)
        else:
            self._run(region, bufs)
        return y

    def _run(self, region, bufs) -> None:
        if region is not None:
            region(self.address, bufs, self.sizes, self.total, self.align, self.threads)
        else:
            self.fn(bufs, self.sizes, 0, self.total)


_PREPARED: dict = {}  # signature -> _Conv, or False (the reference runs it)
MAX_PREPARED = 256


def _prepare(xs: tuple, dtype, ws: tuple, wdtype, strides, padding, dilation, groups: int,
             threads: int, provider: str):
    """The `_Conv` for x of shape `xs` and w of shape `ws`, or False where this module
    does not take them."""
    dtype, wdtype = np.dtype(dtype), np.dtype(wdtype)
    if dtype != wdtype or dtype not in FLOATS or len(xs) not in (3, 4) or len(ws) != len(xs) \
            or not blas.available(provider) or any(lo < 0 or hi < 0 for lo, hi in padding):
        return False
    x4 = w4 = None
    if len(xs) == 3:  # 1-d: height 1
        x4, w4 = xs[:2] + (1,) + xs[2:], ws[:2] + (1,) + ws[2:]
        strides, padding, dilation = (1,) + tuple(strides), ((0, 0),) + tuple(padding), (1,) + tuple(dilation)
        xs, ws = x4, w4
    N, _, H, W = xs
    O, C, KH, KW = ws
    G = groups
    (sh, sw), (dh, dw) = strides, dilation
    (ph, ph_hi), (pw, pw_hi) = padding
    OH = (H + ph + ph_hi - dh * (KH - 1) - 1) // sh + 1
    OW = (W + pw + pw_hi - dw * (KW - 1) - 1) // sw + 1
    out_shape = (N, O, OH, OW) if x4 is None else (N, O, OW)
    ck = C * KH * KW
    direct = KH == KW == 1 and sh == sw == 1 and ph == pw == ph_hi == pw_hi == 0
    bh = max(1, min(OH, BLOCK_ELEMS // max(1, ck * OW)))
    nb = -(-OH // bh) if OH > 0 else 0
    total = N * G * nb if ck and OW > 0 else 0
    if N * O * OH * OW * ck < SPLIT_MACS:
        threads = 1
    threads = max(1, min(threads, total))
    align = max(1, -(-total // threads))
    slot = 0 if direct else ck * bh * OW
    # im2col runs along the output row (OW values per copy), or transposed along the
    # kernel row where that is longer (a kernel gradient: a 28-wide "kernel", 3 outputs)
    trans = not direct and KW > OW
    # a transposed item of few outputs is a thin GEMM (n = OH*OW) that packs all of W
    # again: the items of a range go side by side into one GEMM instead
    merge = trans and G == 1 and nb == 1 and OH * OW < MERGE_WIDTH and align * OH * OW * (ck + O) <= MERGE_ELEMS
    if merge:
        slot = align * OH * OW * (ck + O)  # the range's im2col matrices, then their product
    sizes = (ctypes.c_int64 * len(SIZE_NAMES))(C, H, W, O // G, KH, KW, OH, OW, sh, sw, ph, pw, dh, dw, G, nb,
                                               bh, align, slot, int(direct), int(trans), int(merge))
    return _Conv(out_shape, dtype, sizes, total, align, threads, slot * -(-max(total, 1) // align),
                 _entry(dtype, provider)[1], provider != "mkl", x4, w4)


def conv2d(x: np.ndarray, w: np.ndarray, strides, padding, dilation, groups: int,
           threads: int | None = None, provider: str | None = None) -> np.ndarray | None:
    """The convolution of x [N, C, (H,) W] with w [O, C/groups, (KH,) KW] (attributes as
    `conv_attrs` gives them), or None where this module does not take it (the caller
    runs the reference)."""
    if threads is None:
        from kiln.runtime.threads import parallel_threads

        threads = parallel_threads()
    call = _prepare(x.shape, x.dtype, w.shape, w.dtype, strides, padding, dilation, groups, threads,
                    provider or blas.default_name())
    return None if call is False else call(x, w)


def run_convolution(arrays, attrs) -> list:
    """The CPU backend's extern `convolution` (templates()["conv"]): a prepared `_Conv`
    per signature, or the op's numpy reference where it does not apply."""
    x, w = arrays
    if x.__class__ is np.ndarray and w.__class__ is np.ndarray and x.ndim >= 3:
        from kiln.runtime.threads import parallel_threads

        threads = parallel_threads()
        try:
            key = (x.shape, x.dtype, w.shape, w.dtype, attrs["window_strides"], attrs["padding"],
                   attrs["rhs_dilation"], attrs["feature_group_count"], threads)
            call = _PREPARED.get(key)
        except TypeError:  # attributes given as lists: not kept
            key = call = None
        if call is None:
            from kiln.ir.ops.linalg import conv_attrs

            strides, padding, dilation, groups = conv_attrs(
                "convolution", x.ndim - 2, attrs["window_strides"], attrs["padding"], attrs["rhs_dilation"],
                attrs["feature_group_count"])
            call = _prepare(x.shape, x.dtype, w.shape, w.dtype, strides, padding, dilation, groups, threads,
                            blas.default_name())
            if key is not None:
                if len(_PREPARED) >= MAX_PREPARED:
                    _PREPARED.clear()
                _PREPARED[key] = call
        if call is not False:
            return [call(x, w)]
    from kiln.ir.emitter import EAGER

    return EAGER.apply("convolution", arrays, attrs)
