"""Kernel IR -> OpenCL C: pointwise kernels and reductions with local-memory trees.

A `Kernel` without inner loops is *pointwise*: one work-item per point of its outer
(parallel) loops, flattened into one global index and decomposed back with `/` and
`%`. A kernel with inner loops (a reduction, and the stores over the reduced domain
that follow it) runs on two-dimensional work-groups of RL x XL work-items:

    XL outer points per group (dim 1), RL lanes per point (dim 0)
    each lane folds the inner points lane, lane + RL, ... into a private accumulator
    the RL partial values meet in local memory and combine in a log2(RL) tree
    every lane reads the result; stores over the inner space split over lanes again

Inner reductions (contiguous along the reduced axis) take RL wide and XL = 1; outer
reductions (contiguous along the outer axis) take XL wide so neighbouring work-items
read neighbouring addresses; a full reduction is one row. The group shape comes from
`Limits` -- the device's maximum work-group size and local memory, read at run time
(`DEFAULT_LIMITS` when printing without a device). Sizes of symbolic dims are `long`
kernel arguments, so one program serves every size; index math is `long`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from kiln.codegen.cfamily import expr as cexpr
from kiln.codegen.cfamily.index import (decompose as _decompose, kernel_name, names_of,  # noqa: F401
                                        next_pow2, static_int)
from kiln.codegen.kernel_ir import GemmKernel, Kernel, Load, Reduce, walk
from kiln.codegen.legalize import reduce_identity
from kiln.codegen.opencl.scalar import HELPERS, SCALAR_TABLE, cl_cast, cl_type, combine, index_cl, literal
from kiln.errors import KilnBackendContractError
from kiln.ir.shapes import numel, symbol


@dataclass(frozen=True)
class Limits:
    """What of a device decides work-group shapes (read from the device at run time)."""

    max_work_group_size: int = 256
    local_mem_size: int = 32768
    compute_units: int = 8
    subgroups: bool = False  # cl_khr_subgroups or cl_intel_subgroups
    intel_subgroups: bool = False  # cl_intel_subgroups (block reads)
    cpu: bool = False  # a CPU device (PoCL): work-items of a group run in one thread


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class EmittedKernel:
    """OpenCL C for one kernel plus how to launch it.

    `launch(sizes)` gives (global size, local size) for a binding of the size symbols;
    the arguments are the buffers in order, then one `long` per entry of `sizes`."""

    name: str
    source: str
    kind: str  # pointwise, reduction_inner, reduction_outer, reduction_full, gemm
    buffers: tuple
    sizes: tuple
    local: tuple
    # per launch dim: (extent expr, extent items per group, work-items per group)
    work: tuple = field(hash=False)
    uses_f64: bool = False
    tail_name: str | None = None  # pointwise: the bounds-checked entry for the last group


def pow2_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def uses_f64(kernel) -> bool:
    values = [kernel.epilogue] if isinstance(kernel, GemmKernel) else [st.value for st in kernel.stages]
    dts = {b.dtype.short for b in kernel.buffers} | {x.dtype.short for v in values for x in walk(v)}
    dts |= {st.dtype.short for st in getattr(kernel, "stages", ()) if isinstance(st, Reduce)}
    if isinstance(kernel, GemmKernel) and kernel.acc_dtype is not None:
        dts.add(kernel.acc_dtype.short)
    return "f64" in dts


def prelude(f64: bool) -> str:
    """What every program starts with: no FMA contraction (every op rounds, as numpy), the
    float64 extension where used, and the index helpers."""
    lines = ["#pragma OPENCL FP_CONTRACT OFF"]
    if f64:
        lines.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
    return "\n".join(lines) + "\n" + HELPERS


# OpenCL C's way of writing what every C-family emitter writes (kiln/codegen/cfamily)
DIALECT = cexpr.Dialect("opencl", cl_type, cl_cast, literal, SCALAR_TABLE)


class ExprEmitter(cexpr.ExprEmitter):
    """Binds every node of an expression DAG to a `const` temporary once per scope."""

    def __init__(self, names: dict, buffers: dict):
        super().__init__(DIALECT, names, buffers)


def classify(kernel: Kernel) -> str:
    """pointwise, or which reduction layout: inner / outer / full."""
    first = next((s for s in kernel.stages if s.loops), None)
    if first is None:
        return "pointwise"
    if not kernel.outer:
        return "reduction_full"
    r_last, x_last = symbol(first.loops[-1].var), symbol(kernel.outer[-1].var)
    cr, cx = [], []
    for x in walk(first.value):
        if isinstance(x, Load):
            idx = sympy.expand(sympy.sympify(x.index))
            cr.append(idx.coeff(r_last))
            cx.append(idx.coeff(x_last))
    if any(c == 1 for c in cr):
        return "reduction_inner"
    if any(c == 1 for c in cx):
        return "reduction_outer"
    return "reduction_inner"


def group_shape(kind: str, xnumel, rnumel, limits: Limits, acc_bytes: int) -> tuple[int, int]:
    """(RL, XL): lanes per outer point and outer points per work-group, powers of two
    within the device's work-group size and local memory (one accumulator per lane).
    GPUs take wide rows (inner) or wide columns (outer); CPU devices few lanes per row."""
    lanes = pow2_floor(min(256, limits.max_work_group_size))
    lanes = max(1, min(lanes, pow2_floor(max(1, limits.local_mem_size // max(1, acc_bytes)))))
    xs, rs = static_int(xnumel), static_int(rnumel)
    if kind == "pointwise":
        return 1, lanes
    if kind == "reduction_outer":
        rl = 1 if limits.cpu else min(8, lanes)
    elif limits.cpu and kind == "reduction_inner":
        # a CPU driver runs a group's work-items in one thread, vectorized across them,
        # and pays for every barrier: few lanes per row, many rows per group (measured on
        # PoCL: 4 lanes x 64 rows ran softmax 1024^2 ~5x faster than 256 lanes x 1 row)
        rl = min(4, lanes)
    else:
        rl = lanes
    if rs is not None:
        rl = max(1, min(rl, next_pow2(rs)))
    xl = max(1, lanes // rl)
    if kind == "reduction_full":
        xl = 1
    if xs is not None:
        xl = max(1, min(xl, next_pow2(xs)))
    return rl, xl


def emit_kernel(kernel, limits: Limits = DEFAULT_LIMITS) -> EmittedKernel:
    """OpenCL C for one legalized Kernel IR kernel (a `Kernel` or a `GemmKernel`).

        >>> print(emit_kernel(kernel).source)           # doctest: +SKIP
    """
    if isinstance(kernel, GemmKernel):
        from kiln.codegen.opencl.emit_gemm import emit_gemm

        return emit_gemm(kernel, limits)
    if not isinstance(kernel, Kernel):
        raise KilnBackendContractError(f"opencl backend: cannot compile {type(kernel).__name__}")
    return _emit_loops(kernel, limits)


def _signature(kernel, symnames: dict, buffers: dict) -> list[str]:
    params = []
    for b in kernel.buffers:
        const = "const " if b.role == "in" else ""
        params.append(f"__global {const}{cl_type(b.dtype)} *{buffers[b.name][0]}")
    params += [f"const long {symnames[s]}" for s in kernel.sizes]
    return params


def _emit_loops(k: Kernel, limits: Limits) -> EmittedKernel:
    kind = classify(k)
    fname = kernel_name(k.name)
    symnames, buffers = names_of(k)
    xnumel = numel([l.extent for l in k.outer]) if k.outer else 1
    spaces = [numel([l.extent for l in st.loops]) for st in k.stages if st.loops]
    rmax = None if any(static_int(r) is None for r in spaces) else max((static_int(r) for r in spaces), default=1)
    acc_bytes = max([st.dtype.np_dtype.itemsize for st in k.stages if isinstance(st, Reduce)], default=1)
    rl, xl = group_shape(kind, xnumel, rmax if rmax is not None else sympy.Symbol("R"), limits, acc_bytes)
    ex = ExprEmitter(symnames, buffers)
    body: list[str] = []
    pad = "  "
    xn = index_cl(xnumel, symnames)
    uses_sg = False
    outer_vars = [symnames[l.var] for l in k.outer]
    tail_body = None
    if kind == "pointwise":
        local = (xl,)
        body.append(f"{pad}const long xi = get_global_id(0);")
        body += _decompose(outer_vars, [l.extent for l in k.outer], "xi", symnames, pad)
        for st in k.stages:
            value = ex.emit(st.value, body, pad)
            cname, d = buffers[st.buffer]
            body.append(f"{pad}{cname}[{index_cl(st.index, symnames)}] = {_store_cast(value, st.value.dtype, d)};")
        work = ((xnumel, xl, xl),)
        # no bounds check in the main kernel (a branch there stops the driver vectorizing
        # across work-items: 6x on PoCL); a second entry checks it for the last group
        xs = static_int(xnumel)
        if xs is None or xs % xl:
            tail_body = body[:1] + [f"{pad}if (xi >= {xn}) return;"] + body[1:]
    else:
        local = (rl, xl)
        body.append(f"{pad}const long xi = get_global_id(1);")
        body.append(f"{pad}const int lr = get_local_id(0), lx = get_local_id(1);")
        body.append(f"{pad}const int valid = xi < {xn};")
        body += _decompose(outer_vars, [l.extent for l in k.outer], "xi", symnames, pad)
        scratch: dict = {}
        sg = limits.subgroups and xl == 1
        for st in k.stages:
            body += _stage(st, ex, buffers, symnames, rl, xl, scratch, sg)
        decls = [f"{pad}__local {t} {name}[{rl * xl}];" for name, t in sorted(scratch.items())]
        body = decls + body
        uses_sg = any(name.startswith("red_sg_") for name in scratch)
        work = ((1, 1, rl), (xnumel, xl, xl))
    params = _signature(k, symnames, buffers)
    attr = f"__attribute__((reqd_work_group_size({', '.join(map(str, local + (1,) * (3 - len(local))))})))"
    head = f"__kernel {attr}\nvoid {fname}({', '.join(params)}) {{"
    doc = _describe(k, kind, rl, xl)
    f64 = uses_f64(k)
    ext = ""
    if kind != "pointwise" and uses_sg:
        from kiln.codegen.opencl.subgroups import pragma

        ext = pragma(limits)
        doc = doc.replace("local-memory tree", "subgroup reductions, one partial per subgroup in local memory")
    source = prelude(f64) + ext + f"\n{doc}\n{head}\n" + "\n".join(body) + "\n}\n"
    tail = None
    if tail_body is not None:
        tail = f"{fname}_tail"
        source += (f"\n/* the same, bounds-checked: the last, partial group */\n"
                   f"{head.replace(fname + '(', tail + '(')}\n" + "\n".join(tail_body) + "\n}\n")
    return EmittedKernel(fname, source, kind, tuple(b.name for b in k.buffers), tuple(k.sizes), local, work, f64,
                         tail)


def _store_cast(value: str, src, dst) -> str:
    return cexpr.store_cast(DIALECT, value, src, dst)


def _stage(st, ex: ExprEmitter, buffers: dict, symnames: dict, rl: int, xl: int, scratch: dict,
           subgroups: bool = False) -> list[str]:
    pad, lines = "  ", []
    rnumel = numel([l.extent for l in st.loops]) if st.loops else 1
    rvars = [symnames[l.var] for l in st.loops]

    def loop(inner: list[str]) -> list[str]:
        head = f"{pad}for (long rf = lr; valid && rf < {index_cl(rnumel, symnames)}; rf += {rl}) {{"
        return [head] + _decompose(rvars, [l.extent for l in st.loops], "rf", symnames, pad * 2) + inner + [f"{pad}}}"]

    if isinstance(st, Reduce):
        t = cl_type(st.dtype)
        acc = f"acc_{st.name}"
        ident = literal(reduce_identity(st.op, st.dtype), st.dtype)
        if not st.loops:  # a reduction over nothing: the value itself
            v = ex.emit(st.value, lines, pad)
            lines.append(f"{pad}const {t} r_{st.name} = {_store_cast(v, st.value.dtype, st.dtype)};")
            ex.refs[st.name] = f"r_{st.name}"
            return lines
        lines.append(f"{pad}{t} {acc} = {ident};")
        inner: list[str] = []
        v = ex.emit(st.value, inner, pad * 2)
        inner.append(f"{pad * 2}{acc} = {combine(st.op, st.dtype, acc, _store_cast(v, st.value.dtype, st.dtype))};")
        lines += loop(inner)
        from kiln.codegen.opencl.subgroups import reduce_eligible, subgroup_tree

        if subgroups and reduce_eligible(st.op, st.dtype):
            scratch[f"red_sg_{t}"] = t
            lines += subgroup_tree(st.op, st.dtype, acc, st.name, pad)
            ex.refs[st.name] = f"r_{st.name}"
            return lines
        red = f"red_{t}"
        scratch[red] = t
        lines.append(f"{pad}{red}[lx * {rl} + lr] = {acc};")
        lines.append(f"{pad}barrier(CLK_LOCAL_MEM_FENCE);")
        if rl > 1:
            lines.append(f"{pad}for (int s = {rl // 2}; s > 0; s >>= 1) {{")
            lines.append(f"{pad * 2}if (lr < s) {red}[lx * {rl} + lr] = "
                         f"{combine(st.op, st.dtype, f'{red}[lx * {rl} + lr]', f'{red}[lx * {rl} + lr + s]')};")
            lines.append(f"{pad * 2}barrier(CLK_LOCAL_MEM_FENCE);")
            lines.append(f"{pad}}}")
        lines.append(f"{pad}const {t} r_{st.name} = {red}[lx * {rl}];")
        lines.append(f"{pad}barrier(CLK_LOCAL_MEM_FENCE);  /* the scratch is reused */")
        ex.refs[st.name] = f"r_{st.name}"
        return lines
    cname, d = buffers[st.buffer]
    if not st.loops:
        inner = []
        v = ex.emit(st.value, inner, pad * 2)
        inner.append(f"{pad * 2}{cname}[{index_cl(st.index, symnames)}] = {_store_cast(v, st.value.dtype, d)};")
        return [f"{pad}if (valid && lr == 0) {{"] + inner + [f"{pad}}}"]
    inner = []
    v = ex.emit(st.value, inner, pad * 2)
    inner.append(f"{pad * 2}{cname}[{index_cl(st.index, symnames)}] = {_store_cast(v, st.value.dtype, d)};")
    return loop(inner)


def _describe(k: Kernel, kind: str, rl: int, xl: int) -> str:
    outer = ", ".join(f"{l.var} < {l.extent}" for l in k.outer) or "one point"
    if kind == "pointwise":
        return f"/* pointwise over {outer}: one work-item per point, {xl} per group */"
    return (f"/* {kind.replace('_', ' ')}: parallel {outer}; {xl} point(s) x {rl} lanes per group, "
            "local-memory tree */")
