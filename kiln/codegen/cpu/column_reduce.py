"""Column reductions: reduce over rows while vectorizing across the output columns.

A kernel whose reductions run down a strided axis (`x.sum(0)` of a row-major [M, N]
matrix: each output `o` reads `x[r, o]` at stride N) cannot vectorize its reduce loop:
LLVM would gather one element per row. Every bias gradient of a training step is such a
reduction. Here the loop nest is interchanged instead, as XLA and Inductor do for
"column" reductions: the kernel's innermost outer loop (unit stride in every load) is
cut into chunks of `COLUMN_CHUNK` outputs; for each chunk the reduce loops run outside
and the chunk's columns inside, accumulating into a small stack array, so the inner
loop reads contiguous memory and vectorizes. The kernel's stores then run over the
chunk reading those accumulators. The accumulator dtype and the combine are the ones
the row emitter uses (float32 sums accumulate in float64), so results do not depend on
which path a kernel takes beyond summation order.

`column_friendly(kernel)` decides; `emit_columns` emits one run of outputs.
"""

from __future__ import annotations

import sympy

from kiln.codegen.kernel_ir import Kernel, Load, Reduce, ReduceRef, Store, loop_var, walk

from kiln.codegen.cpu import dtype_map
from kiln.codegen.cpu.ir_builder import CountedLoop, Fn, V, const
from kiln.codegen.cpu.scalar_ops import convert

COLUMN_CHUNK = 128  # outputs per chunk: 128 float64 accumulators = 1 KiB of stack each


def _coeff(index, var) -> sympy.Expr | None:
    """The coefficient of `var` in an index linear in it, else None."""
    e = sympy.expand(sympy.sympify(index))
    c = e.coeff(var)
    if c.has(var) or sympy.expand(e - c * var).has(var):
        return None
    return c


def column_friendly(k: Kernel) -> bool:
    """True when every reduction reads unit-stride along the kernel's innermost outer
    loop and at least one reads its own innermost reduce loop at another stride (so the
    interchange turns gathers into contiguous vector loads)."""
    if not k.outer:
        return False
    reduces = [s for s in k.stages if isinstance(s, Reduce)]
    if not reduces or any(isinstance(s, Store) and s.loops for s in k.stages):
        return False
    j = loop_var(k.outer[-1].var)
    strided = False
    for r in reduces:
        if not r.loops:
            return False
        last = loop_var(r.loops[-1].var)
        for e in walk(r.value):
            if not isinstance(e, Load):
                continue
            cj, cr = _coeff(e.index, j), _coeff(e.index, last)
            if cj is None or cr is None or cj not in (0, 1):
                return False
            if cj == 1 and cr != 1 and cr != 0:
                strided = True
            if cj == 0 and cr == 1:
                return False  # a row-contiguous operand: the row emitter suits it better
    return strided


def scratch_arrays(fn: Fn, k: Kernel, acc_type) -> dict:
    """One stack array of COLUMN_CHUNK accumulators per reduction (entry block)."""
    return {r.name: fn.emit(f"alloca [{COLUMN_CHUNK} x {acc_type(r)}], align 64", "ptr", "cols")
            for r in k.stages if isinstance(r, Reduce)}


def emit_columns(emitter, fn: Fn, env: dict, lo: V, hi: V, scratch: dict) -> None:
    """Outputs lo <= j < hi of the innermost outer loop (`env` binds the other loop
    variables and the sizes), chunk by chunk. `emitter` is the KernelEmitter: its
    buffers, `_nest`, and the reduction helpers of llvm_emit."""
    from kiln.codegen.cpu.llvm_emit import ExprEmitter, _acc_type, _combine, _reduce_init

    k = emitter.k
    var = k.outer[-1].var
    chunk = const("i64", COLUMN_CHUNK)
    n = fn.bin("sub", hi, lo)
    nchunks = fn.bin("sdiv", fn.bin("add", n, const("i64", COLUMN_CHUNK - 1)), chunk)
    chunks = CountedLoop(fn, const("i64", 0), nchunks, vectorize=False, unroll_nested=False)
    ci, _ = chunks.begin()
    c0 = fn.bin("add", lo, fn.bin("mul", ci, chunk))
    left = fn.bin("sub", hi, c0)
    count = fn.select(fn.icmp("slt", left, chunk), left, chunk)
    done: dict[str, Reduce] = {}

    def point_refs(t: V) -> dict:
        """The finished reductions' values at column `t`, each loaded where an expression
        first reads it (a stage reads a few of the kernel's reductions: loading all of
        them at every stage emitted O(stages x reductions) dead loads)."""
        def load(name: str):
            r = done[name]
            ty = _acc_type(r)
            acc = fn.load(ty, fn.gep(ty, scratch[name], t), _align(r, ty))
            if ty == "double" and r.dtype.name == "float32":
                acc = fn.cast("fptrunc", acc, "float")
            return (dtype_map.round_to(fn, acc, r.dtype) if r.dtype.is_floating else acc, r.dtype)
        return _LazyRefs(load)

    def columns(body, base_env=env):
        # one vector per iteration: a chunk is at most COLUMN_CHUNK columns, and its loops
        # update memory (no chain through registers for copies to overlap); LLVM's 4
        # interleaved copies tripled the code generation time of the AdamW kernel
        loop = CountedLoop(fn, const("i64", 0), count, interleave=1)
        t, _ = loop.begin()
        point_env = dict(base_env)
        point_env[var] = fn.bin("add", c0, t)
        body(t, point_env)
        loop.end()

    def init(t, _env):  # every accumulator of the chunk, in one loop
        for r in (st for st in k.stages if isinstance(st, Reduce)):
            ty = _acc_type(r)
            fn.store(_reduce_init(r, ty), fn.gep(ty, scratch[r.name], t), _align(r, ty))

    def accumulate(group):
        def over_rows(row_env, carried):
            def body(t, point_env):
                refs = point_refs(t)
                for r in group:
                    ty = _acc_type(r)
                    x = convert(fn, ExprEmitter(fn, emitter.buffers, point_env, refs)(r.value),
                                r.value.dtype, r.dtype)
                    if ty == "double" and x.ty == "float":
                        x = fn.cast("fpext", x, "double")
                    ptr = fn.gep(ty, scratch[r.name], t)
                    fn.store(_combine(fn, r, fn.load(ty, ptr, _align(r, ty)), x), ptr, _align(r, ty))
            columns(body, row_env)
            return []
        return over_rows

    def store(group):
        def body(t, point_env):
            refs = point_refs(t)
            for s in group:
                ex = ExprEmitter(fn, emitter.buffers, point_env, refs)
                value = ex(s.value)
                addr, d = ex.address(s.buffer, s.index)
                value = convert(fn, value, s.value.dtype, d)
                fn.store(dtype_map.store_convert(fn, value, d), addr, max(1, d.itemsize))
        return body

    if any(isinstance(st, Reduce) for st in k.stages):
        columns(init)
    for group in stage_groups(k.stages):
        if isinstance(group[0], Reduce):
            emitter._nest(fn, group[0].loops, env, [], accumulate(group), vectorize=False)
            done.update((r.name, r) for r in group)
        else:
            columns(store(group))
    chunks.end()


def _align(r: Reduce, ty: str) -> int:
    return 8 if ty == "double" else max(1, r.dtype.itemsize)


def stage_groups(stages) -> list[list]:
    """The kernel's stages in runs emitted as one loop each: consecutive stores (one
    column loop for all of them, point by point as the row emitter runs its stages), and
    consecutive reductions over the same rows of which none reads another (one row nest
    accumulating all of them; each one's order of summation is unchanged). The AdamW
    kernel of a training step (14 bias-gradient sums, then the updates) was 37 vectorized
    loops, one per stage and one to clear each accumulator."""
    groups: list[list] = []
    for st in stages:
        last = groups[-1] if groups else None
        if isinstance(st, Store) and last and isinstance(last[0], Store):
            last.append(st)
        elif (isinstance(st, Reduce) and last and isinstance(last[0], Reduce)
              and st.loops == last[0].loops
              and not {e.name for e in walk(st.value) if isinstance(e, ReduceRef)} & {r.name for r in last}):
            last.append(st)
        else:
            groups.append([st])
    return groups


class _LazyRefs(dict):
    """A reduction name -> (value, dtype) map that emits a value's load on first use."""

    def __init__(self, load):
        super().__init__()
        self._load = load

    def __missing__(self, name: str):
        self[name] = value = self._load(name)
        return value

