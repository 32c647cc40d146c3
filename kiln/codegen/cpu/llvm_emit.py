"""Kernel IR `Kernel` -> LLVM IR text, with the fixed CPU ABI:

    void NAME(i8** buffers, i64* sizes, i64 begin, i64 end)

`buffers` follow `kernel.buffers`, `sizes` follow `kernel.sizes`, and [begin, end) is a
range of the row-major flattened `kernel.outer` space, so the runtime can split work
over threads. The exported function only unpacks its arguments and calls `NAME.body`,
whose buffer parameters are `noalias`: that is what lets LLVM vectorize without runtime
alias checks (buffers passed to one call must therefore not overlap).

Loop shape: the last outer dim becomes a plain counted loop (an odometer steps the other
dims between rows), so a pointwise kernel's innermost loop is `for j in [lo, hi)` with
no divisions; every stage's own loops are counted loops too. Each loop carries
`llvm.loop.vectorize.enable`. Reductions accumulate with `reassoc` on the combining op
only, so they vectorize while the element math stays exact IEEE. float32 sums run in
blocks of 1024: float32 vector lanes within a block (each lane adds ~32 values), the
block sums in float64, so the error stays ~1e-7 relative for any n at float32 speed;
float32 products accumulate in float64.
"""

from __future__ import annotations

import numpy as np
import sympy

from kiln.codegen.kernel_ir import Acc, Const, IndexValue, Kernel, Load, Op, Reduce, ReduceRef, Store, walk
from kiln.codegen.legalize import reduce_identity
from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.ir.dtypes import DType

from kiln.codegen.cpu import dtype_map
from kiln.codegen.cpu.index_emit import emit_index
from kiln.codegen.cpu.mathlib import F32_FUNCS
from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, Module, V, const
from kiln.codegen.cpu.scalar_ops import convert, emit_op
from kiln.codegen.cpu.column_reduce import column_friendly, emit_columns, scratch_arrays
from kiln.codegen.cpu import minmax_keys


SUM_BLOCK = 1024  # float32 elements summed in float32 lanes before a float64 add
LONG_SUM = 4 * SUM_BLOCK  # a float32 sum this long (or of unknown length) gets wide vectors
LONG_MAP = 1024  # a float32 store of a transcendental over rows this long gets them too
MATH_HEAVY = frozenset(F32_FUNCS)
NUMPY_DATA_OFFSET = 16  # offsetof(PyArrayObject_fields, data) on 64-bit CPython


def array_data_ir(names: tuple) -> str:
    """Hand-written IR lines of a template function's entry: the data pointers of the
    array objects whose `id`s `%bufs` holds, in order, as `%name` (what `template_args`
    emits through an Fn)."""
    lines = []
    for k, name in enumerate(names):
        slot = "%bufs"
        if k:
            slot = f"%{name}.slot"
            lines.append(f"  {slot} = getelementptr ptr, ptr %bufs, i64 {k}")
        lines += [f"  %{name}.obj = load ptr, ptr {slot}",
                  f"  %{name}.at = getelementptr i8, ptr %{name}.obj, i64 {NUMPY_DATA_OFFSET}",
                  f"  %{name} = load ptr, ptr %{name}.at"]
    return "\n".join(lines) + "\n"


def template_args(fn, count: int, names: tuple) -> tuple[list, dict]:
    """The arguments of a template module's `fn(ptr %bufs, ptr %sizes, i64 %begin, i64
    %end)` (conv, gathers, scan, topk): the data pointers of the `count` array objects
    in %bufs (their `id`s, read at NUMPY_DATA_OFFSET), and %sizes' words by `names`."""
    from kiln.codegen.cpu.ir_builder import V, const

    data = []
    for k in range(count):
        obj = fn.load("ptr", fn.gep("ptr", V("%bufs", "ptr"), const("i64", k)), 8)
        data.append(fn.load("ptr", fn.gep("i8", obj, const("i64", NUMPY_DATA_OFFSET)), 8))
    sizes = {name: fn.load("i64", fn.gep("i64", V("%sizes", "ptr"), const("i64", k)), 8)
             for k, name in enumerate(names)}
    return data, sizes


class ExprEmitter:
    """Emits Kernel IR scalar expressions into the current block of `fn`, memoized
    within one block scope (LLVM's GVN/LICM take care of the rest)."""

    def __init__(self, fn: Fn, buffers: dict, symbols: dict, refs: dict, acc: V | None = None):
        self.fn, self.buffers, self.symbols, self.refs, self.acc = fn, buffers, symbols, refs, acc
        self.memo: dict = {}
        self.index_memo: dict = {}

    def index(self, expr) -> V:
        return emit_index(self.fn, expr, self.symbols, self.index_memo)

    def address(self, name: str, index_expr) -> tuple[V, DType]:
        ptr, param = self.buffers[name]
        return self.fn.gep(dtype_map.storage_type(param.dtype), ptr, self.index(index_expr)), param.dtype

    def __call__(self, e) -> V:
        if e in self.memo:
            return self.memo[e]
        fn = self.fn
        if isinstance(e, Const):
            value = const(dtype_map.reg_type(e.dtype), _const_value(e))
        elif isinstance(e, Load):
            addr, d = self.address(e.buffer, e.index)
            st = dtype_map.storage_type(d)
            value = dtype_map.load_convert(fn, fn.load(st, addr, max(1, d.itemsize)), d)
            if d != e.dtype:
                value = convert(fn, value, d, e.dtype)
        elif isinstance(e, IndexValue):
            value = convert(fn, self.index(e.expr), dt.int64, e.dtype)
        elif isinstance(e, ReduceRef):
            value, d = self.refs[e.name]
            if d != e.dtype:
                value = convert(fn, value, d, e.dtype)
        elif isinstance(e, Acc):
            if self.acc is None:
                raise KilnArgumentError("cpu backend: Acc is only valid in a GEMM epilogue")
            value = self.acc
        elif isinstance(e, Op):
            args = [self(a) for a in e.args]
            value = emit_op(fn, e.op, args, [a.dtype for a in e.args], e.dtype)
        else:
            raise KilnArgumentError(f"cpu backend: not a Kernel IR expression: {e!r}")
        self.memo[e] = value
        return value


def _const_value(c: Const):
    if c.dtype.is_floating:  # round to the dtype once, at compile time
        return float(np.asarray(c.value, dtype=np.float64).astype(c.dtype.np_dtype).astype(np.float64))
    if c.dtype.is_bool:
        return bool(c.value)
    return int(np.asarray(c.value).astype(c.dtype.np_dtype))


# -- reductions -----------------------------------------------------------------------

def _acc_type(r: Reduce) -> str:
    if r.dtype == dt.float32 and r.op in ("sum", "prod"):
        return "double"
    return dtype_map.reg_type(r.dtype)


def _reduce_init(r: Reduce, ty: str) -> V:
    """The reduction's identity (legalize.reduce_identity, the one definition)."""
    value = reduce_identity(r.op, r.dtype)
    if dtype_map.is_unsigned(r.dtype) and value == (1 << r.dtype.bits) - 1:
        value = -1  # LLVM prints unsigned patterns as signed integers
    return const(ty, value)


def _combine(fn: Fn, r: Reduce, acc: V, x: V) -> V:
    d = r.dtype
    if d.is_floating:
        if r.op == "sum":
            return fn.fadd(acc, x, "reassoc")
        if r.op == "prod":
            return fn.fmul(acc, x, "reassoc")
        if r.op in ("max", "min"):
            return fn.binary_intrinsic("maximum" if r.op == "max" else "minimum", acc, x)
    else:
        if r.op in ("sum", "prod"):
            return fn.bin("add" if r.op == "sum" else "mul", acc, x)
        if r.op in ("and", "or"):
            return fn.bin(r.op, acc, x)
        if r.op in ("max", "min"):
            sign = "u" if dtype_map.is_unsigned(d) else "s"
            return fn.select(fn.icmp(sign + ("gt" if r.op == "max" else "lt"), acc, x), acc, x)
    raise KilnArgumentError(f"cpu backend: reduce '{r.op}' over {d.name} is not supported")


class KernelEmitter:
    """Emits one `Kernel` as `NAME.body` plus the exported ABI wrapper `NAME`."""

    def __init__(self, module: Module, kernel: Kernel, symbol: str, wrappers: bool = True):
        self.module, self.k, self.symbol, self.wrappers = module, kernel, symbol, wrappers
        self.wide = False  # a long float32 sum asks for 512-bit vectors (`wide_attrs`)

    def emit(self) -> None:
        k, module = self.k, self.module
        fn = Fn(module)
        params = []
        buffers = {}
        for i, b in enumerate(k.buffers):
            attrs = "noalias nocapture" + (" readonly" if b.role == "in" else "")
            params.append(f"ptr {attrs} %b{i}")
            buffers[b.name] = (V(f"%b{i}", "ptr"), b)
        params += [f"i64 %s{i}" for i in range(len(k.sizes))] + ["i64 %begin", "i64 %end"]
        symbols = {name: V(f"%s{i}", "i64") for i, name in enumerate(k.sizes)}
        self.buffers = buffers
        self._outer(fn, symbols)
        fn.stmt("ret void")
        attrs = " " + wide_attrs() if self.wide else ""
        module.functions.append(fn.define(
            f"define internal void @{self.symbol}.body({', '.join(params)}) noinline nounwind{attrs}"))
        if self.wrappers:
            module.functions.append(abi_wrapper(self.symbol, len(k.buffers), len(k.sizes)))

    def _outer(self, fn: Fn, symbols: dict) -> None:
        begin, end = V("%begin", "i64"), V("%end", "i64")
        outer = self.k.outer
        # reductions down a strided axis run interchanged, vectorized across columns
        scratch = scratch_arrays(fn, self.k, _acc_type) if column_friendly(self.k) else None
        if scratch is not None and len(outer) == 1:
            emit_columns(self, fn, dict(symbols), begin, end, scratch)
            return
        if len(outer) <= 1:
            loop = CountedLoop(fn, begin, end, vectorize=bool(outer), unroll_nested=False)
            i, _ = loop.begin()
            env = dict(symbols)
            if outer:
                env[outer[0].var] = i
            self._point(fn, env)
            loop.end()
            return
        # odometer: decompose `begin` once, then run row segments of the last dim
        extents = [emit_index(fn, l.extent, symbols) for l in outer]
        nonempty = fn.icmp("slt", begin, end)
        go, done = fn.new_label("go"), fn.new_label("done")
        fn.cbr(nonempty, go, done)
        fn.start_block(go)
        rest, start = begin, []
        for ext in reversed(extents):
            start.append(fn.bin("urem", rest, ext))
            rest = fn.bin("udiv", rest, ext)
        start.reverse()
        rows = CountedLoop(fn, const("i64", 0), const("i64", 1 << 62), carried=[begin] + start,
                           vectorize=False, unroll_nested=False)
        _, carried = rows.begin()
        pos, idx = carried[0], carried[1:]
        left = fn.bin("sub", end, pos)
        room = fn.bin("sub", extents[-1], idx[-1])
        count = fn.select(fn.icmp("slt", left, room), left, room)
        stop = fn.bin("add", idx[-1], count)
        env = dict(symbols)
        env.update({l.var: v for l, v in zip(outer[:-1], idx[:-1])})
        if scratch is not None:
            emit_columns(self, fn, env, idx[-1], stop, scratch)
        else:
            inner = CountedLoop(fn, idx[-1], stop)
            j, _ = inner.begin()
            env[outer[-1].var] = j
            self._point(fn, env)
            inner.end()
        new_pos = fn.bin("add", pos, count)
        carry, nxt = const("i1", 1), []
        for v, ext in zip(reversed(idx[:-1]), reversed(extents[:-1])):
            bumped = fn.bin("add", v, fn.cast("zext", carry, "i64"))
            wrap = fn.icmp("eq", bumped, ext)
            nxt.append(fn.select(wrap, const("i64", 0), bumped))
            carry = fn.bin("and", carry, wrap)
        nxt.reverse()
        more = fn.icmp("slt", new_pos, end)
        body_end, exit_label = fn.new_label("more"), fn.new_label("rows_done")
        fn.cbr(more, body_end, exit_label)
        fn.start_block(body_end)
        rows.end([new_pos] + nxt + [const("i64", 0)])
        fn.br(done)
        fn.start_block(exit_label)
        fn.br(done)
        fn.start_block(done)

    def _point(self, fn: Fn, env: dict) -> None:
        refs: dict = {}
        for stage in self.k.stages:
            if isinstance(stage, Reduce):
                refs[stage.name] = (self._reduce(fn, stage, env, refs), stage.dtype)
            elif isinstance(stage, Store):
                self._store(fn, stage, env, refs)
            else:
                raise KilnArgumentError(f"cpu backend: unknown stage {stage!r}")

    def _nest(self, fn: Fn, loops, env: dict, carried: list[V], body, vectorize: bool | None = True):
        """Nested counted loops over `loops`; `body(env, carried) -> new carried`."""
        if not loops:
            return body(env, carried)
        ext = emit_index(fn, loops[0].extent, env)
        loop = CountedLoop(fn, const("i64", 0), ext, carried=carried, vectorize=vectorize,
                           unroll_nested=False)
        i, phis = loop.begin()
        inner_env = dict(env)
        inner_env[loops[0].var] = i
        out = self._nest(fn, loops[1:], inner_env, phis, body, vectorize)
        return loop.end(out)

    def _reduce(self, fn: Fn, r: Reduce, env: dict, refs: dict) -> V:
        ty = _acc_type(r)

        def body(inner_env, carried):
            ex = ExprEmitter(fn, self.buffers, inner_env, refs)
            x = convert(fn, ex(r.value), r.value.dtype, r.dtype)
            if ty == "double" and x.ty == "float":
                x = fn.cast("fpext", x, "double")
            return [_combine(fn, r, carried[0], x)]

        if ty == "double" and r.dtype == dt.float32 and r.op == "sum" and r.loops:
            # float32 sums: 8-wide float32 lanes within blocks of SUM_BLOCK (fast, each
            # lane adds only SUM_BLOCK/8/interleave values), blocks combined in float64
            def blocked(outer_env, carried):
                return self._blocked_sum(fn, r, outer_env, carried, refs)
            (acc,) = self._nest(fn, r.loops[:-1], env, [_reduce_init(r, ty)], blocked)
        elif minmax_keys.applies(r):
            # float max/min: ordered integer keys, a reduction LLVM vectorizes
            def keyed(inner_env, carried):
                x = convert(fn, ExprEmitter(fn, self.buffers, inner_env, refs)(r.value),
                            r.value.dtype, r.dtype)
                return [minmax_keys.combine(fn, r, carried[0], minmax_keys.to_key(fn, r, x))]
            (key,) = self._nest(fn, r.loops, env, [minmax_keys.key_init(r)], keyed)
            acc = minmax_keys.from_key(fn, r, key)
        else:
            # NaN-propagating float max/min reductions over a select (a masked softmax)
            # are not always recognized as reductions: let LLVM decide quietly there
            hint = None if r.op in ("max", "min") and r.dtype.is_floating else True
            (acc,) = self._nest(fn, r.loops, env, [_reduce_init(r, ty)], body, hint)
        if ty == "double" and r.dtype == dt.float32:
            acc = fn.cast("fptrunc", acc, "float")
        return dtype_map.round_to(fn, acc, r.dtype) if r.dtype.is_floating else acc

    def _blocked_sum(self, fn: Fn, r: Reduce, env: dict, carried: list[V], refs: dict) -> list[V]:
        last = r.loops[-1]
        ext = emit_index(fn, last.extent, env)
        nblocks = fn.bin("sdiv", fn.bin("add", ext, const("i64", SUM_BLOCK - 1)), const("i64", SUM_BLOCK))
        blocks = CountedLoop(fn, const("i64", 0), nblocks, carried=carried, vectorize=False,
                             unroll_nested=False)
        b, (acc,) = blocks.begin()
        lo = fn.bin("mul", b, const("i64", SUM_BLOCK))
        if _long_rows(r):
            self.wide = True
        hi = fn.bin("add", lo, const("i64", SUM_BLOCK))
        hi = fn.select(fn.icmp("slt", hi, ext), hi, ext)
        inner = CountedLoop(fn, lo, hi, carried=[const("float", 0.0)])
        i, (part,) = inner.begin()
        inner_env = dict(env)
        inner_env[last.var] = i
        x = convert(fn, ExprEmitter(fn, self.buffers, inner_env, refs)(r.value), r.value.dtype, r.dtype)
        (total,) = inner.end([fn.fadd(part, x, "reassoc")])
        (out,) = blocks.end([fn.fadd(acc, fn.cast("fpext", total, "double"))])
        return [out]

    def _store(self, fn: Fn, s: Store, env: dict, refs: dict) -> None:
        if _math_heavy(s, tuple(self.k.outer) + tuple(s.loops)):
            self.wide = True

        def body(inner_env, carried):
            ex = ExprEmitter(fn, self.buffers, inner_env, refs)
            value = ex(s.value)
            addr, d = ex.address(s.buffer, s.index)
            value = convert(fn, value, s.value.dtype, d)
            fn.store(dtype_map.store_convert(fn, value, d), addr, max(1, d.itemsize))
            return []

        self._nest(fn, s.loops, env, [], body)


def _long_rows(r: Reduce) -> bool:
    """Whether a float32 sum's innermost extent may reach LONG_SUM elements (unknown
    sizes may): a streaming loop worth 512-bit vectors (`wide_attrs`)."""
    ext = sympy.sympify(r.loops[-1].extent)
    return not (ext.is_Integer and int(ext) < LONG_SUM)


def _math_heavy(s: Store, loops: tuple) -> bool:
    """Whether a store computes a float32 transcendental (exp, tanh, erf, ...: mathlib's
    polynomials) over rows (`loops`: the kernel's outer loops, then the store's) that may
    reach LONG_MAP elements: arithmetic-bound, so 512-bit vectors do twice the work per
    instruction (`wide_attrs`). Same process, fresh caches, 2^20 float32, two threads
    (2026-12-02): exp(-v*v) 0.32 -> 0.20 ms, tanh 0.37 -> 0.25, the exact-gelu chain over
    2^24 18.8 -> 9.8; copies and sqrt, bound by memory, unchanged (0.18 ms either way),
    so they keep LLVM's 256-bit choice."""
    if not loops:
        return False
    ext = sympy.sympify(loops[-1].extent)
    if ext.is_Integer and int(ext) < LONG_MAP:
        return False
    return any(isinstance(e, Op) and e.op in MATH_HEAVY and e.dtype == dt.float32 for e in walk(s.value))


def wide_attrs() -> str:
    """Function attributes asking for 512-bit vectors, on a host that has them. LLVM
    prefers 256-bit vectors on AVX-512 hosts (the wide units used to lower the clock);
    a long float32 sum is bound by memory, not arithmetic, and its 512-bit loads keep
    more bytes in flight. Same process, round-robin, two threads (2026-12-02, a shared
    machine): softmax 4096 x 4096 10.5 -> 9.4-9.7 ms median (10.1 -> 9.1-9.3 min);
    `(x * x).sum()` over 2^25 floats 37 -> 44 GB/s by minimum in one run, equal in two
    others. Software prefetch of the block two or four ahead was measured too and lost
    (44 -> 40 GB/s): the hardware prefetchers already follow these streams."""
    from kiln.codegen.cpu.microkernel import vector_bits  # microkernel imports this module

    return '"min-legal-vector-width"="512" "prefer-vector-width"="512"' if vector_bits() >= 512 else ""


# An exported entry (ABI wrapper, batch entry) only loads pointers and sizes and calls
# bodies, once per launch: `optnone` has LLVM skip its IR passes and select its
# instructions with FastISel, ~0.8 ms less per function (two per kernel: 57 kernels of
# the GPT training step, 1.42 -> 1.33 CPU s built one by one), while every body's
# machine code stays byte-identical (benchmarks/results/cpu.md, cold_compile).
WRAPPER_ATTRS = "noinline optnone nounwind"


def abi_wrapper(symbol: str, n_buffers: int, n_sizes: int) -> str:
    """The exported `void NAME(i8** buffers, i64* sizes, i64 begin, i64 end)`, plus
    `NAME.np`, the same taking numpy array *objects* (PyArrayObject*) instead of data
    pointers: it reads each array's `data` field itself, which saves the ~4 us per
    array that `ndarray.ctypes.data` costs in the Python call path. Both are built
    without optimization (`WRAPPER_ATTRS`)."""
    out = []
    for suffix, deref in (("", False), (".np", True)):
        lines = [f"define void @{symbol}{suffix}(ptr %bufs, ptr %sizes, i64 %begin, i64 %end) {WRAPPER_ATTRS} {{"]
        args = []
        for i in range(n_buffers):
            lines.append(f"  %pp{i} = getelementptr inbounds ptr, ptr %bufs, i64 {i}")
            lines.append(f"  %p{i} = load ptr, ptr %pp{i}, align 8")
            if deref:  # PyArrayObject: PyObject_HEAD (16 bytes), then char *data
                lines.append(f"  %d{i} = getelementptr inbounds i8, ptr %p{i}, i64 {NUMPY_DATA_OFFSET}")
                lines.append(f"  %q{i} = load ptr, ptr %d{i}, align 8")
            args.append(f"ptr %q{i}" if deref else f"ptr %p{i}")
        for i in range(n_sizes):
            lines.append(f"  %sp{i} = getelementptr inbounds i64, ptr %sizes, i64 {i}")
            lines.append(f"  %sz{i} = load i64, ptr %sp{i}, align 8")
            args.append(f"i64 %sz{i}")
        args += ["i64 %begin", "i64 %end"]
        lines.append(f"  call void @{symbol}.body({', '.join(args)})")
        lines.append("  ret void\n}\n")
        out.append("\n".join(lines))
    return "\n".join(out)


def emit_kernel(module: Module, kernel: Kernel, symbol: str, wrappers: bool = True) -> None:
    """Add `kernel` to `module` as the exported function `symbol` (see module doc); with
    `wrappers=False` only `symbol.body` (a batch member, called by the batch's entry)."""
    KernelEmitter(module, kernel, symbol, wrappers).emit()
