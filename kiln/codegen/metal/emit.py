"""Kernel IR -> Metal Shading Language: pointwise kernels and the five reduction kinds.

Every kernel is one 1-D grid of threadgroups of `threads` threads; a kernel's buffers
are `device` pointers, its symbolic sizes `constant long&`, in `[[buffer(i)]]` order.
A `Kernel` without inner loops is *pointwise*: one thread per point of its outer loops.
A kernel with inner loops (reductions and the stores over the reduced domain after them)
gives each outer point RL lanes (XL points per threadgroup); each lane folds the inner
points lane, lane + RL, ... into a register, and the lanes then combine by the kind that
the shapes call for (`classify`):

    full      no outer points: 1024 lanes fold the whole input; simd_sum-style reduction
              per simdgroup, the 32 partials meet in threadgroup memory
    inner     reduced axis contiguous and long: 256 lanes per point, vec4 loads where the
              layout is aligned, simdgroup reduction then threadgroup memory
    narrow    reduced axis contiguous and at most 32 long: RL <= 32 lanes of one
              simdgroup per point, a simd_shuffle_xor butterfly (no barrier at all)
    outer     the outputs contiguous, the reduced axis strided: 32 neighbouring outputs
              per threadgroup (coalesced reads) x 8 lanes along the reduced axis whose
              partials meet in threadgroup memory
    strided   neither axis contiguous: one simdgroup (32 lanes) per point, simd reduction

Accumulators are the Kernel IR's accumulator dtype, except max/min on half, which are
exact in half and stay there (no needless up-cast).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from kiln.codegen.cfamily import expr as cexpr
from kiln.codegen.cfamily.index import (INDEX_HELPERS, decompose as _decompose, index_c as index_cl,  # noqa: F401
                                        kernel_name, names_of, next_pow2, static_int)
from kiln.codegen.kernel_ir import GemmKernel, Kernel, Load, Op, Reduce, walk
from kiln.codegen.legalize import reduce_identity
from kiln.codegen.metal.scalar import SCALAR_TABLE, SIMD, combine, literal, msl_cast, msl_type
from kiln.errors import KilnBackendContractError
from kiln.ir.shapes import numel, symbol

SIMD_WIDTH = 32
NARROW_MAX = 32
PRELUDE = "#include <metal_stdlib>\nusing namespace metal;\n\n" + INDEX_HELPERS
THREAD_ARGS = ("uint tg [[threadgroup_position_in_grid]]", "uint tid [[thread_index_in_threadgroup]]",
               "uint lane [[thread_index_in_simdgroup]]", "uint sg [[simdgroup_index_in_threadgroup]]")


@dataclass(frozen=True)
class EmittedKernel:
    """MSL for one kernel plus how to launch it: `groups` threadgroups (a sympy expression
    in the size names) of `threads` threads; arguments are the buffers in order, then one
    `long` per entry of `sizes`."""

    name: str
    source: str
    kind: str  # pointwise, full, inner, narrow, outer, strided, gemm
    buffers: tuple
    sizes: tuple
    threads: int
    groups: object
    vec4: bool = False

    def group_count(self, sizes: dict) -> int:
        """The number of threadgroups for a binding of the size names."""
        return int(sympy.sympify(self.groups).subs({symbol(k): v for k, v in sizes.items()}))


# MSL's way of writing what every C-family emitter writes (kiln/codegen/cfamily)
DIALECT = cexpr.Dialect("metal", msl_type, msl_cast, literal, SCALAR_TABLE)


class ExprEmitter(cexpr.ExprEmitter):
    """Binds every node of an expression DAG to a `const` temporary once per scope."""

    def __init__(self, names: dict, buffers: dict):
        super().__init__(DIALECT, names, buffers)


def _coefficients(st, kernel: Kernel):
    """(reduced-axis coefficients, output-axis coefficients) of the stage's loads."""
    r_last, x_last = symbol(st.loops[-1].var), symbol(kernel.outer[-1].var) if kernel.outer else None
    cr, cx = [], []
    for x in walk(st.value):
        if isinstance(x, Load):
            idx = sympy.expand(sympy.sympify(x.index))
            cr.append(idx.coeff(r_last))
            cx.append(idx.coeff(x_last) if x_last is not None else 0)
    return cr, cx


def classify(kernel: Kernel) -> str:
    """pointwise, or the reduction kind the shapes call for: full / inner / narrow / outer /
    strided (see the module docstring), decided by the first stage with inner loops."""
    first = next((s for s in kernel.stages if s.loops), None)
    if first is None:
        return "pointwise"
    xnumel = numel([l.extent for l in kernel.outer]) if kernel.outer else 1
    if static_int(xnumel) == 1:
        return "full"
    cr, cx = _coefficients(first, kernel)
    rnumel = static_int(numel([l.extent for l in first.loops]))
    if any(c == 1 for c in cr) or not cr:
        return "narrow" if rnumel is not None and rnumel <= NARROW_MAX else "inner"
    if any(c == 1 for c in cx):
        return "outer"
    return "strided"


def lanes(kind: str, kernel: Kernel) -> tuple[int, int]:
    """(RL, XL): lanes per outer point and points per threadgroup of each kind."""
    if kind == "full":
        return 1024, 1
    if kind == "inner":
        return 256, 1
    if kind == "narrow":
        spaces = [static_int(numel([l.extent for l in s.loops])) for s in kernel.stages if s.loops]
        rl = min(NARROW_MAX, next_pow2(max(spaces)))
        return rl, 256 // rl
    if kind == "outer":
        return 8, 32
    return SIMD_WIDTH, 8  # strided


def signature(kernel, symnames: dict, buffers: dict) -> list[str]:
    """Buffers as `device` pointers, sizes as `constant long&`, then the thread indices."""
    params = []
    for i, b in enumerate(kernel.buffers):
        const = "const " if b.role == "in" else ""
        params.append(f"device {const}{msl_type(b.dtype)}* {buffers[b.name][0]} [[buffer({i})]]")
    for j, s in enumerate(kernel.sizes):
        params.append(f"constant long& {symnames[s]} [[buffer({len(kernel.buffers) + j})]]")
    return params + list(THREAD_ARGS)


def store_cast(value: str, src, dst) -> str:
    return cexpr.store_cast(DIALECT, value, src, dst)


def emit_kernel(kernel) -> EmittedKernel:
    """MSL for one legalized Kernel IR kernel (a `Kernel` or a `GemmKernel`).

        >>> print(emit_kernel(kernel).source)           # doctest: +SKIP
    """
    if isinstance(kernel, GemmKernel):
        from kiln.codegen.metal.emit_gemm import emit_gemm

        return emit_gemm(kernel)
    if not isinstance(kernel, Kernel):
        raise KilnBackendContractError(f"metal backend: cannot compile {type(kernel).__name__}")
    return _emit_loops(kernel)


def _emit_loops(k: Kernel) -> EmittedKernel:
    kind = classify(k)
    fname = kernel_name(k.name)
    symnames, buffers = names_of(k)
    xnumel = numel([l.extent for l in k.outer]) if k.outer else sympy.Integer(1)
    ex = ExprEmitter(symnames, buffers)
    pad = "  "
    xn = index_cl(xnumel, symnames)
    outer_vars = [symnames[l.var] for l in k.outer]
    body: list[str] = []
    vec4 = False
    if kind == "pointwise":
        threads = 256
        body.append(f"{pad}const long xi = long(tg) * {threads} + tid;")
        body.append(f"{pad}if (xi >= {xn}) return;")
        body += _decompose(outer_vars, [l.extent for l in k.outer], "xi", symnames, pad)
        for st in k.stages:
            value = ex.emit(st.value, body, pad)
            cname, d = buffers[st.buffer]
            body.append(f"{pad}{cname}[{index_cl(st.index, symnames)}] = {store_cast(value, st.value.dtype, d)};")
        groups = sympy.ceiling(xnumel / threads)
    else:
        rl, xl = lanes(kind, k)
        threads = rl * xl
        if kind == "outer":  # neighbouring threads take neighbouring outputs (coalesced)
            body.append(f"{pad}const uint lx = tid % {xl}, lr = tid / {xl};")
        else:  # the lanes of one point are neighbours inside one simdgroup
            body.append(f"{pad}const uint lr = tid % {rl}, lx = tid / {rl};")
        body.append(f"{pad}const long xi = long(tg) * {xl} + lx;")
        body.append(f"{pad}const bool valid = xi < {xn};")
        body += _decompose(outer_vars, [l.extent for l in k.outer], "xi", symnames, pad)
        scratch: dict = {}
        for st in k.stages:
            lines, used_vec = _stage(st, k, kind, ex, buffers, symnames, rl, xl, scratch)
            body += lines
            vec4 = vec4 or used_vec
        decls = [f"{pad}threadgroup {t} red_{t}[{n}];" for t, n in sorted(scratch.items())]
        body = decls + body
        groups = sympy.ceiling(xnumel / xl)
    params = signature(k, symnames, buffers)
    head = f"kernel void {fname}(\n    " + ",\n    ".join(params) + ") {"
    doc = _describe(k, kind, threads, vec4)
    source = PRELUDE + f"\n{doc}\n{head}\n" + "\n".join(body) + "\n}\n"
    return EmittedKernel(fname, source, kind, tuple(b.name for b in k.buffers), tuple(k.sizes), threads,
                         groups, vec4)


def _narrowed(st: Reduce) -> Reduce:
    """max/min of half values are exact in half: the up-cast the Kernel IR puts before a
    float accumulator is dropped, and the accumulator stays half (a ReduceRef reads it
    back as float, exactly)."""
    v = st.value
    if (st.op in ("max", "min") and isinstance(v, Op) and v.op == "convert" and v.dtype.short == "f32"
            and v.args[0].dtype.short == "f16"):
        return replace(st, value=v.args[0], dtype=v.args[0].dtype)
    if st.op in ("max", "min") and st.value.dtype.short == "f16":
        return replace(st, dtype=st.value.dtype)
    return st


def _vec4_loads(st: Reduce, k: Kernel, symnames: dict) -> list | None:
    """The loads a reduction can read four at a time: one reduced loop, static length a
    multiple of 4, every load contiguous along it with a base aligned to 4 elements."""
    if len(st.loops) != 1 or static_int(st.loops[0].extent) is None or static_int(st.loops[0].extent) % 4:
        return None
    r = symbol(st.loops[0].var)
    loads = [x for x in walk(st.value) if isinstance(x, Load)]
    if not loads or any(x.dtype.is_bool for x in loads):
        return None
    for x in loads:
        idx = sympy.expand(sympy.sympify(x.index))
        if idx.coeff(r) != 1:
            return None
        rest = sympy.expand(idx - r)
        for term in sympy.Add.make_args(rest):
            coeff = term.as_coeff_Mul()[0]
            if not (coeff.is_Integer and int(coeff) % 4 == 0):
                return None
        if x.dtype != k.buffers[[b.name for b in k.buffers].index(x.buffer)].dtype:
            return None
    return loads


def _cross_lanes(st: Reduce, kind: str, acc: str, t: str, d, rl: int, xl: int, scratch: dict, pad: str) -> list:
    """Combine the RL lane partials of each point into `r_<name>`, in every lane."""
    out = f"r_{st.name}"
    lines = []

    def fold(a, x):
        return combine(st.op, d, a, x)

    def simd_all(v):  # all 32 lanes of a simdgroup
        if st.op in ("sum", "prod") and d.is_floating:
            return f"{t}({SIMD[st.op]}({v}))"
        return None

    if kind in ("narrow", "strided"):
        width = rl
        direct = simd_all(acc) if width == SIMD_WIDTH else None
        if direct:
            lines.append(f"{pad}const {t} {out} = {direct};")
            return lines
        lines.append(f"{pad}{t} {out} = {acc};")
        lines.append(f"{pad}for (ushort o = {width // 2}; o > 0; o >>= 1) {{")
        lines.append(f"{pad * 2}const {t} other = simd_shuffle_xor({out}, o);  // every lane shuffles once")
        lines.append(f"{pad * 2}{out} = {fold(out, 'other')};")
        lines.append(f"{pad}}}")
        return lines
    if kind == "outer":  # partials [RL][XL] in threadgroup memory, folded in lane order
        red = f"red_{t}"
        scratch[t] = max(scratch.get(t, 0), rl * xl)
        lines.append(f"{pad}{red}[lr * {xl} + lx] = {acc};")
        lines.append(f"{pad}threadgroup_barrier(mem_flags::mem_threadgroup);")
        lines.append(f"{pad}{t} {out} = {red}[lx];")
        lines.append(f"{pad}for (uint j = 1; j < {rl}; ++j) {out} = {fold(out, f'{red}[j * {xl} + lx]')};")
        lines.append(f"{pad}threadgroup_barrier(mem_flags::mem_threadgroup);  // the scratch is reused")
        return lines
    # full / inner: a simdgroup reduction, then the RL/32 partials through threadgroup memory
    nsg = rl // SIMD_WIDTH
    red = f"red_{t}"
    scratch[t] = max(scratch.get(t, 0), nsg)
    part = f"p_{st.name}"
    direct = simd_all(acc)
    if direct:
        lines.append(f"{pad}const {t} {part} = {direct};")
    else:
        lines.append(f"{pad}{t} {part} = {acc};")
        lines.append(f"{pad}for (ushort o = {SIMD_WIDTH // 2}; o > 0; o >>= 1) {{")
        lines.append(f"{pad * 2}const {t} other = simd_shuffle_xor({part}, o);  // every lane shuffles once")
        lines.append(f"{pad * 2}{part} = {fold(part, 'other')};")
        lines.append(f"{pad}}}")
    lines.append(f"{pad}if (lane == 0) {red}[sg] = {part};")
    lines.append(f"{pad}threadgroup_barrier(mem_flags::mem_threadgroup);")
    lines.append(f"{pad}{t} {out} = {red}[0];")
    lines.append(f"{pad}for (uint j = 1; j < {nsg}; ++j) {out} = {fold(out, f'{red}[j]')};")
    lines.append(f"{pad}threadgroup_barrier(mem_flags::mem_threadgroup);  // the scratch is reused")
    return lines


def _stage(st, k: Kernel, kind: str, ex: ExprEmitter, buffers: dict, symnames: dict, rl: int, xl: int,
           scratch: dict) -> tuple[list[str], bool]:
    pad, lines = "  ", []
    rnumel = numel([l.extent for l in st.loops]) if st.loops else 1
    rvars = [symnames[l.var] for l in st.loops]
    rn = index_cl(rnumel, symnames)

    def loop(inner: list[str]) -> list[str]:
        head = f"{pad}for (long rf = lr; valid && rf < {rn}; rf += {rl}) {{"
        return [head] + _decompose(rvars, [l.extent for l in st.loops], "rf", symnames, pad * 2) + inner + [f"{pad}}}"]

    if isinstance(st, Reduce):
        st = _narrowed(st)
        d = st.dtype
        t = msl_type(d)
        acc = f"acc_{st.name}"
        if not st.loops:  # a reduction over nothing: the value itself
            v = ex.emit(st.value, lines, pad)
            lines.append(f"{pad}const {t} r_{st.name} = {store_cast(v, st.value.dtype, d)};")
            ex.refs[st.name] = f"r_{st.name}"
            return lines, False
        lines.append(f"{pad}{t} {acc} = {literal(reduce_identity(st.op, d), d)};")
        loads = _vec4_loads(st, k, symnames) if kind in ("inner", "full") else None
        if loads:
            lines += _vec4_fold(st, loads, ex, buffers, symnames, rl, acc, d, rn, pad)
        else:
            inner: list[str] = []
            v = ex.emit(st.value, inner, pad * 2)
            inner.append(f"{pad * 2}{acc} = {combine(st.op, d, acc, store_cast(v, st.value.dtype, d))};")
            lines += loop(inner)
        lines += _cross_lanes(st, kind, acc, t, d, rl, xl, scratch, pad)
        ex.refs[st.name] = f"r_{st.name}"
        return lines, bool(loads)
    cname, dd = buffers[st.buffer]
    inner = []
    v = ex.emit(st.value, inner, pad * 2)
    inner.append(f"{pad * 2}{cname}[{index_cl(st.index, symnames)}] = {store_cast(v, st.value.dtype, dd)};")
    if not st.loops:
        return [f"{pad}if (valid && lr == 0) {{"] + inner + [f"{pad}}}"], False
    return loop(inner), False


def _vec4_fold(st, loads, ex: ExprEmitter, buffers: dict, symnames: dict, rl: int, acc: str, d, rn: str,
               pad: str) -> list[str]:
    """The fold loop reading each contiguous operand as one 4-wide vector per step."""
    var = symnames[st.loops[0].var]
    lines = [f"{pad}for (long rf = long(lr) * 4; valid && rf < {rn}; rf += {4 * rl}) {{",
             f"{pad * 2}const long {var} = rf;"]
    vecs = {}
    for i, x in enumerate(dict.fromkeys(loads)):
        cname, bd = buffers[x.buffer]
        vt = f"{msl_type(bd)}4"
        lines.append(f"{pad * 2}const {vt} q{i} = *((device const {vt}*)({cname} + {index_cl(x.index, symnames)}));")
        vecs[x] = f"q{i}"
    for j, comp in enumerate("xyzw"):
        lines.append(f"{pad * 2}{{")
        lines.append(f"{pad * 3}const long {var}_{j} = rf + {j};")
        ex.override = {x: f"{v}.{comp}" for x, v in vecs.items()}
        saved = ex.names[st.loops[0].var]
        ex.names[st.loops[0].var] = f"{var}_{j}"
        v = ex.emit(st.value, lines, pad * 3)
        ex.names[st.loops[0].var] = saved
        ex.override = {}
        lines.append(f"{pad * 3}{acc} = {combine(st.op, d, acc, store_cast(v, st.value.dtype, d))};")
        lines.append(f"{pad * 2}}}")
    lines.append(f"{pad}}}")
    return lines


def _describe(k: Kernel, kind: str, threads: int, vec4: bool) -> str:
    outer = ", ".join(f"{l.var} < {l.extent}" for l in k.outer) or "one point"
    if kind == "pointwise":
        return f"// pointwise over {outer}: one thread per point, {threads} per threadgroup"
    return (f"// {kind} reduction: parallel {outer}; {threads} threads per threadgroup"
            + (", vec4 loads" if vec4 else ""))
