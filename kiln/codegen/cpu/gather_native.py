"""`take` and `take_along` (embedding lookups, torch.gather) on the CPU as native loops.

Both stay extern steps in compiled programs: which element a position reads is data.
Their numpy references (kiln/ir/ops/shape.py) check the indices, make negative ones
non-negative in a new array, then gather (`np.take`, or fancy indexing over `np.ogrid`
grids for `take_along`): an embedding lookup of 32 x 128 tokens from a 50000 x 256 table
took 0.47 ms there against torch's 0.22, a (1024, 1024) gather of 64 columns a row 0.51
ms against 0.044 (benchmarks/bench_nn_ops.py).

This module is the CPU backend's `take` and `take_along` template kinds
(`CpuBackend.templates()`). With x viewed as [P, X, Q] around the indexed axis:

- take: indices flat [I], out [P, I, Q]: out[p, i, :] = x[p, idx[i], :], one `memcpy` of
  Q elements per (p, i) (any dtype: bytes are copied), or, for rows under SHORT_ROW
  bytes (an upsampling's last dim), a loop of element copies;
- take_along: indices [P, I, Q] (x's dims but the axis; smaller ones run the
  reference), out[p, i, q] = x[p, idx[p, i, q], q], copied as integers of the dtype's size.

take's indices are checked first by one LLVM function (a block of CHECK_BLOCK at a time,
vectorized), which returns the first out of range in C order; take_along checks each p's
indices (vectorized) on the thread that then gathers them, while they are in its cache,
and flags a bad one. Either way the reference is then run to raise its K104; negative
indices count from the end. Large gathers are cut over kiln's threads. The functions are
built once per machine (the glue cache keeps their object code).
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache

import numpy as np

from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V, const
from kiln.codegen.cpu.llvm_emit import template_args
from kiln.codegen.cpu.native_pool import run_range

# sizes[]: P, X, Q, I (the index count: take's all, take_along's along the axis), element
# bytes; take_along's has one more word, set to 1 where a p's indices had one out of range
SIZE_NAMES = ("P", "X", "Q", "I", "E")
SPLIT_BYTES = 1 << 20  # a gather writing fewer bytes runs on the caller's thread
SHORT_ROW = 64  # take's rows of fewer bytes are copied element by element, not by memcpy
# a take of a smaller result runs the reference: np.take is as fast there (a small GPT's
# embedding lookup, 128 KB: 9.9 us against 7.2), and a program that has none larger does
# not build this module on its first step (a cold compile's first call)
SMALL_TAKE = 256 << 10
_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_CHECK = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_OBJECTS = ctypes.c_void_p * 3
INT_TYPES = {1: "i8", 2: "i16", 4: "i32", 8: "i64"}
# indices checked a block at a time, vectorized (an OR of out-of-range flags), the first
# bad one looked for only in a block that has one: 64 K indices 25 -> ~5 us
CHECK_BLOCK = 1024


def module_text(keep: tuple = ()) -> str:
    """(only the functions named in `keep`, when given: each entry is built on its
    first use, a module of its own, so a program pays LLVM only for what it runs)
    kiln_gather_check(idx, n, X) -> the first index out of [-X, X) or -1;
    kiln_take(bufs = [x, idx, out], sizes, begin, end): rows [begin, end) of P * I;
    kiln_take_along_E(...): the [I, Q] blocks of p in [begin, end), E bytes an element."""
    module = Module()
    module.declare("llvm.memcpy.p0.p0.i64", "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)")
    i64 = lambda v: const("i64", v)  # noqa: E731

    fn = Fn(module)  # the check: blocks scanned vectorized, the first bad one element-wise
    X, n, idx = V("%X", "i64"), V("%n", "i64"), V("%idx", "ptr")
    blocks = CountedLoop(fn, i64(0), fn.bin("sdiv", fn.bin("add", n, i64(CHECK_BLOCK - 1)), i64(CHECK_BLOCK)),
                         vectorize=False)
    b, _ = blocks.begin()
    lo = fn.bin("mul", b, i64(CHECK_BLOCK))
    hi = fn.bin("add", lo, i64(CHECK_BLOCK))
    hi = fn.select(fn.icmp("slt", hi, n), hi, n)
    found, clean = fn.new_label("found"), fn.new_label("clean")
    fn.cbr(_any_out_of_range(fn, idx, lo, hi, X), found, clean)
    fn.start_block(found)  # the block holds a bad index: which one comes first
    first = CountedLoop(fn, lo, hi, vectorize=False)
    j, _ = first.begin()
    hit, more = fn.new_label("hit"), fn.new_label("more")
    fn.cbr(_out_of_range(fn, idx, j, X), hit, more)
    fn.start_block(hit)
    fn.stmt(f"ret i64 {j.ref}")
    fn.start_block(more)
    first.end()
    fn.br(clean)
    fn.start_block(clean)
    blocks.end()
    fn.stmt("ret i64 -1")
    module.functions.append(fn.define("define i64 @kiln_gather_check(ptr %idx, i64 %n, i64 %X) nounwind"))

    def header(fn):
        (x, idx, out), s = template_args(fn, 3, SIZE_NAMES)
        return x, idx, out, s

    def wrapped(fn, s, v):  # a negative index counts from the end
        return fn.select(fn.icmp("slt", v, i64(0)), fn.bin("add", v, s["X"]), v)

    fn = Fn(module)  # take: one memcpy of Q elements per (p, i)
    x, idx, out, s = header(fn)
    row = fn.bin("mul", s["Q"], s["E"])
    loop = CountedLoop(fn, V("%begin", "i64"), V("%end", "i64"), vectorize=False)
    r, _ = loop.begin()
    p = fn.bin("sdiv", r, s["I"])
    k = wrapped(fn, s, fn.load("i64", fn.gep("i64", idx, fn.bin("srem", r, s["I"])), 8))
    src = fn.gep("i8", x, fn.bin("mul", fn.bin("add", fn.bin("mul", p, s["X"]), k), row))
    fn.call("llvm.memcpy.p0.p0.i64", "void", [fn.gep("i8", out, fn.bin("mul", r, row)), src, row,
                                              const("i1", 0)])
    loop.end()
    fn.stmt("ret void")
    module.functions.append(fn.define("define void @kiln_take(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) "
                                      "nounwind"))

    for size, ty in INT_TYPES.items():  # take of short rows: elements of E bytes, no memcpy call
        fn = Fn(module)
        x, idx, out, s = header(fn)
        loop = CountedLoop(fn, V("%begin", "i64"), V("%end", "i64"), vectorize=False)
        p, _ = loop.begin()  # the rows of one p: out[p, i, :] = x[p, idx[i], :]
        xrow = fn.bin("mul", p, s["X"])
        single, several, next_p = fn.new_label("single"), fn.new_label("several"), fn.new_label("next_p")
        fn.cbr(fn.icmp("eq", s["Q"], i64(1)), single, several)
        fn.start_block(single)  # along the last dim (an upsampling's columns): one loop LLVM vectorizes
        elems = CountedLoop(fn, i64(0), s["I"], vectorize=None)
        i, _ = elems.begin()
        k = wrapped(fn, s, fn.load("i64", fn.gep("i64", idx, i), 8))
        fn.store(fn.load(ty, fn.gep(ty, x, fn.bin("add", xrow, k)), size),
                 fn.gep(ty, out, fn.bin("add", fn.bin("mul", p, s["I"]), i)), size)
        elems.end()
        fn.br(next_p)
        fn.start_block(several)
        rows = CountedLoop(fn, i64(0), s["I"], vectorize=False)
        i, _ = rows.begin()
        k = wrapped(fn, s, fn.load("i64", fn.gep("i64", idx, i), 8))
        src = fn.bin("mul", fn.bin("add", xrow, k), s["Q"])
        dst = fn.bin("mul", fn.bin("add", fn.bin("mul", p, s["I"]), i), s["Q"])
        cols = CountedLoop(fn, i64(0), s["Q"], vectorize=False)
        q, _ = cols.begin()
        fn.store(fn.load(ty, fn.gep(ty, x, fn.bin("add", src, q)), size), fn.gep(ty, out, fn.bin("add", dst, q)),
                 size)
        cols.end()
        rows.end()
        fn.br(next_p)
        fn.start_block(next_p)
        loop.end()
        fn.stmt("ret void")
        module.functions.append(fn.define(f"define void @kiln_take_small_{size}(ptr %bufs, ptr %sizes, "
                                          "i64 %begin, i64 %end) nounwind"))

    for size, ty in INT_TYPES.items():  # take_along: element by element, E bytes each
        fn = Fn(module)
        x, idx, out, s = header(fn)
        outer = CountedLoop(fn, V("%begin", "i64"), V("%end", "i64"), vectorize=False)
        p, _ = outer.begin()
        xrow = fn.bin("mul", p, s["X"])
        last, blocks, next_p = fn.new_label("last"), fn.new_label("blocks"), fn.new_label("next_p")
        flag, gather = fn.new_label("flag"), fn.new_label("gather")
        per_p = fn.bin("mul", s["I"], s["Q"])  # p's indices, checked where this thread reads them
        lo = fn.bin("mul", p, per_p)
        fn.cbr(_any_out_of_range(fn, idx, lo, fn.bin("add", lo, per_p), s["X"]), flag, gather)
        fn.start_block(flag)  # nothing read for p: the caller runs the reference (its K104)
        fn.store(i64(1), fn.gep("i64", V("%sizes", "ptr"), i64(len(SIZE_NAMES))), 8)
        fn.br(next_p)
        fn.start_block(gather)
        fn.cbr(fn.icmp("eq", s["Q"], i64(1)), last, blocks)
        fn.start_block(last)  # along the last dim (torch.gather(x, -1, i)): one loop
        rows = CountedLoop(fn, i64(0), s["I"], vectorize=False)
        i, _ = rows.begin()
        e = fn.bin("add", fn.bin("mul", p, s["I"]), i)
        k = wrapped(fn, s, fn.load("i64", fn.gep("i64", idx, e), 8))
        fn.store(fn.load(ty, fn.gep(ty, x, fn.bin("add", xrow, k)), size), fn.gep(ty, out, e), size)
        rows.end()
        fn.br(next_p)
        fn.start_block(blocks)
        rows = CountedLoop(fn, i64(0), s["I"], vectorize=False)
        i, _ = rows.begin()
        base = fn.bin("mul", fn.bin("add", fn.bin("mul", p, s["I"]), i), s["Q"])  # (p, i, 0) of out
        cols = CountedLoop(fn, i64(0), s["Q"], vectorize=False)
        q, _ = cols.begin()
        e = fn.bin("add", base, q)
        k = wrapped(fn, s, fn.load("i64", fn.gep("i64", idx, e), 8))
        at = fn.bin("add", fn.bin("mul", fn.bin("add", xrow, k), s["Q"]), q)
        fn.store(fn.load(ty, fn.gep(ty, x, at), size), fn.gep(ty, out, e), size)
        cols.end()
        rows.end()
        fn.br(next_p)
        fn.start_block(next_p)
        outer.end()
        fn.stmt("ret void")
        module.functions.append(fn.define(f"define void @kiln_take_along_{size}(ptr %bufs, ptr %sizes, "
                                          "i64 %begin, i64 %end) nounwind"))
    if keep:
        module.functions = [f for f in module.functions if f.split("(", 1)[0].rsplit("@", 1)[1] in keep]
    return module.text()


def _out_of_range(fn, idx: V, j: V, X: V) -> V:
    """Is idx[j] outside [-X, X)? (v + X) mod 2^64 >= 2X: one unsigned compare."""
    v = fn.load("i64", fn.gep("i64", idx, j), 8)
    return fn.icmp("uge", fn.bin("add", v, X), fn.bin("add", X, X))


def _any_out_of_range(fn, idx: V, lo: V, hi: V, X: V) -> V:
    """An i1: is any of idx[lo:hi] outside [-X, X)? A vectorized OR of the flags."""
    scan = CountedLoop(fn, lo, hi, carried=[const("i8", 0)])
    j, (seen,) = scan.begin()
    (seen,) = scan.end([fn.bin("or", seen, fn.cast("zext", _out_of_range(fn, idx, j, X), "i8"))])
    return fn.icmp("ne", seen, const("i8", 0))


@lru_cache(maxsize=None)
def _entry(name: str):
    """(the jitted module, the function's address, a ctypes callable of it), its module
    built once per process (the object code from the glue cache when a process before
    built it on this machine)."""
    from kiln.codegen.cpu.glue_cache import glue_module

    jitted = glue_module(module_text((name,)), 2)
    address = jitted.address(name)
    return jitted, address, (_CHECK if name == "kiln_gather_check" else _FN)(address)


def _indices(indices: np.ndarray, size: int) -> np.ndarray | None:
    """The indices as contiguous int64, or None when one is out of [-size, size) (the
    caller runs the reference, which raises its K104)."""
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    check = _entry("kiln_gather_check")[2]
    return None if check(idx.ctypes.data, idx.size, size) >= 0 else idx


def _run(name: str, x: np.ndarray, idx: np.ndarray, out: np.ndarray, sizes, total: int,
         reads: int | None = None) -> None:
    """`name` over [0, total), split over kiln's threads when the bytes it moves (the
    output, and `reads`: what it reads, by default as much) reach SPLIT_BYTES."""
    _, address, call = _entry(name)
    bufs = _OBJECTS(id(x), id(idx), id(out))  # alive until the call returns
    run_range(address, call, bufs, sizes, total, out.nbytes + (out.nbytes if reads is None else reads) >= SPLIT_BYTES)


def take(x: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray | None:
    """np.take(x, indices, axis) natively, or None (the caller runs the reference)."""
    if x.ndim == 0 or indices.dtype.kind not in "iu" or x.dtype.hasobject or \
            x.itemsize * indices.size * x.size // max(x.shape[axis % x.ndim], 1) < SMALL_TAKE:
        return None
    a = axis % x.ndim
    idx = _indices(indices, x.shape[a])
    if idx is None:
        return None
    x = np.ascontiguousarray(x)
    P, X, Q = math.prod(x.shape[:a]), x.shape[a], math.prod(x.shape[a + 1:])
    out = np.empty(x.shape[:a] + indices.shape + x.shape[a + 1:], x.dtype)
    total = P * idx.size
    if total and Q:
        sizes = (ctypes.c_int64 * len(SIZE_NAMES))(P, X, Q, idx.size, x.itemsize)
        if Q * x.itemsize < SHORT_ROW and x.itemsize in INT_TYPES:  # a call per row costs more
            _run(f"kiln_take_small_{x.itemsize}", x, idx, out, sizes, P)
        else:
            _run("kiln_take", x, idx, out, sizes, total)
    return out


def take_along(x: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray | None:
    """x's entries at `indices` along `axis` (torch.gather) natively, or None (the caller
    runs the reference): indices of x's shape but along the axis."""
    if x.ndim == 0 or indices.ndim != x.ndim or indices.dtype.kind not in "iu" or x.itemsize not in INT_TYPES \
            or x.dtype.hasobject:
        return None
    a = axis % x.ndim
    if any(n != d for i, (n, d) in enumerate(zip(indices.shape, x.shape)) if i != a):
        return None
    idx = np.ascontiguousarray(indices, dtype=np.int64)  # checked by the gather itself
    x = np.ascontiguousarray(x)
    P, X, Q = math.prod(x.shape[:a]), x.shape[a], math.prod(x.shape[a + 1:])
    out = np.empty(indices.shape, x.dtype)
    if out.size:
        sizes = (ctypes.c_int64 * (len(SIZE_NAMES) + 1))(P, X, Q, indices.shape[a], x.itemsize, 0)
        # each element may read a cache line of its own (a gather of 64 of a 1024-wide
        # row reads every line of it): 0.21 ms on one thread, 0.10 on two
        _run(f"kiln_take_along_{x.itemsize}", x, idx, out, sizes, P, reads=min(x.nbytes, out.size * 64))
        if sizes[len(SIZE_NAMES)]:  # an index out of range: the reference raises its K104
            return None
    return out


def run_take(arrays, attrs) -> list:
    """The CPU backend's extern `take` (templates()["take"])."""
    x, indices = arrays
    out = take(x, indices, attrs["axis"]) if isinstance(x, np.ndarray) and isinstance(indices, np.ndarray) else None
    if out is None:
        from kiln.ir.emitter import EAGER

        return EAGER.apply("take", arrays, attrs)
    return [out]


def run_take_along(arrays, attrs) -> list:
    """The CPU backend's extern `take_along` (templates()["take_along"])."""
    x, indices = arrays
    out = take_along(x, indices, attrs["axis"]) if isinstance(x, np.ndarray) and isinstance(indices, np.ndarray) \
        else None
    if out is None:
        from kiln.ir.emitter import EAGER

        return EAGER.apply("take_along", arrays, attrs)
    return [out]
