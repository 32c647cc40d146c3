"""GemmKernel -> MSL: a GEMM on `simdgroup_matrix` 8 x 8 tiles with the epilogue fused.

    threadgroup of 4 simdgroups (128 threads) -> a 32 x 32 block of the output
    for each 8-deep slice of K: the threadgroup stages A[32][8] and B[8][32] in threadgroup
        memory (rows/columns past M, N, K load 0), barrier; simdgroup s (2 x 2 layout)
        loads its two A and two B tiles and does four simdgroup_multiply_accumulate
        into its 16 x 16 quadrant (2 x 2 accumulators), barrier
    the accumulators go to threadgroup memory (simdgroup_store); every thread then applies
    epilogue(acc, loads at gb, gi, gj) to its outputs with one guarded store each

Operand strides (batch, row, k) / (batch, k, col) come from the Kernel IR, so a
transposed operand needs no copy. simdgroup_matrix holds float and half; an integer or
bool GEMM (exact sums) runs the same tiling with scalar multiply-adds instead.
"""

from __future__ import annotations

import sympy

from kiln.codegen.cfamily.index import index_c as index_cl
from kiln.codegen.kernel_ir import GemmKernel
from kiln.codegen.lower import accumulator_dtype
from kiln.codegen.metal.emit import (PRELUDE, EmittedKernel, ExprEmitter, kernel_name, signature,
                                     store_cast)
from kiln.codegen.metal.scalar import UNSIGNED, msl_type

BM = BN = 32
BK = 8
THREADS = 128


def emit_gemm(k: GemmKernel) -> EmittedKernel:
    symnames = {s: f"s_{s}" for s in k.sizes}
    symnames.update({"gb": "gb", "gi": "gi", "gj": "gj"})
    buffers = {b.name: (f"b_{b.name}", b.dtype) for b in k.buffers}
    in_dtype = buffers[k.a][1]
    acc_d = k.acc_dtype or accumulator_dtype(in_dtype)
    at = msl_type(acc_d)
    simd = acc_d.short in ("f32", "f16")
    ix = lambda e: index_cl(e, symnames)  # noqa: E731
    a, b = buffers[k.a][0], buffers[k.b][0]
    sa, sb = [ix(s) for s in k.a_strides], [ix(s) for s in k.b_strides]
    p = "  "
    tiles_n = f"(({ix(k.n)} + {BN - 1}) / {BN})"
    tiles_m = f"(({ix(k.m)} + {BM - 1}) / {BM})"
    lines = [
        f"{p}threadgroup {at} As[{BM} * {BK}];",
        f"{p}threadgroup {at} Bs[{BK} * {BN}];",
        f"{p}threadgroup {at} Cs[{BM} * {BN}];",
        f"{p}const long M = {ix(k.m)}, N = {ix(k.n)}, K = {ix(k.k)};",
        f"{p}const long tn = {tiles_n}, tm = {tiles_m};",
        f"{p}const long gb = long(tg) / (tm * tn);",
        f"{p}const long bm0 = ((long(tg) / tn) % tm) * {BM}, bn0 = (long(tg) % tn) * {BN};",
        f"{p}const uint qr = (sg / 2) * 16, qc = (sg % 2) * 16;  // this simdgroup's quadrant",
    ]
    if simd:
        lines += [f"{p}simdgroup_matrix<{at}, 8, 8> acc[2][2];",
                  f"{p}for (int i = 0; i < 2; ++i) for (int j = 0; j < 2; ++j) "
                  f"acc[i][j] = simdgroup_matrix<{at}, 8, 8>(0);"]
    else:
        lines += [f"{p}for (uint l = tid; l < {BM * BN}; l += {THREADS}) Cs[l] = {at}(0);"]
    lines += [
        f"{p}for (long k0 = 0; k0 < K; k0 += {BK}) {{",
        f"{p * 2}for (uint l = tid; l < {BM * BK}; l += {THREADS}) {{",
        f"{p * 3}const long gr = bm0 + l / {BK}, gk = k0 + l % {BK};",
        f"{p * 3}As[l] = (gr < M && gk < K) ? {at}({a}[gb * {sa[0]} + gr * {sa[1]} + gk * {sa[2]}]) : {at}(0);",
        f"{p * 2}}}",
        f"{p * 2}for (uint l = tid; l < {BK * BN}; l += {THREADS}) {{",
        f"{p * 3}const long gk = k0 + l / {BN}, gc = bn0 + l % {BN};",
        f"{p * 3}Bs[l] = (gc < N && gk < K) ? {at}({b}[gb * {sb[0]} + gk * {sb[1]} + gc * {sb[2]}]) : {at}(0);",
        f"{p * 2}}}",
        f"{p * 2}threadgroup_barrier(mem_flags::mem_threadgroup);",
    ]
    if simd:
        lines += [
            f"{p * 2}simdgroup_matrix<{at}, 8, 8> ta[2], tb[2];",
            f"{p * 2}for (int i = 0; i < 2; ++i) simdgroup_load(ta[i], As + (qr + 8 * i) * {BK}, {BK});",
            f"{p * 2}for (int j = 0; j < 2; ++j) simdgroup_load(tb[j], Bs + qc + 8 * j, {BN});",
            f"{p * 2}for (int i = 0; i < 2; ++i) for (int j = 0; j < 2; ++j) "
            "simdgroup_multiply_accumulate(acc[i][j], ta[i], tb[j], acc[i][j]);",
        ]
    else:
        lines += [f"{p * 2}for (uint l = tid; l < {BM * BN}; l += {THREADS}) {{",
                  f"{p * 3}{at} s = Cs[l];",
                  f"{p * 3}for (uint kk = 0; kk < {BK}; ++kk) s = {_mac('s', f'As[(l / {BN}) * {BK} + kk]', f'Bs[kk * {BN} + l % {BN}]', acc_d)};",
                  f"{p * 3}Cs[l] = s;",
                  f"{p * 2}}}"]
    lines += [f"{p * 2}threadgroup_barrier(mem_flags::mem_threadgroup);", f"{p}}}"]
    if simd:
        lines += [f"{p}for (int i = 0; i < 2; ++i) for (int j = 0; j < 2; ++j) "
                  f"simdgroup_store(acc[i][j], Cs + (qr + 8 * i) * {BN} + qc + 8 * j, {BN});",
                  f"{p}threadgroup_barrier(mem_flags::mem_threadgroup);"]
    lines += [
        f"{p}for (uint l = tid; l < {BM * BN}; l += {THREADS}) {{",
        f"{p * 2}const long gi = bm0 + l / {BN}, gj = bn0 + l % {BN};",
        f"{p * 2}if (gi >= M || gj >= N) continue;",
        f"{p * 2}const {at} accv = Cs[l];",
    ]
    ex = ExprEmitter(symnames, buffers)
    ex.acc = "accv"
    value = ex.emit(k.epilogue, lines, p * 2)
    out, od = buffers[k.out]
    lines.append(f"{p * 2}{out}[(gb * M + gi) * N + gj] = {store_cast(value, k.epilogue.dtype, od)};")
    lines.append(f"{p}}}")
    fname = kernel_name(k.name)
    head = f"kernel void {fname}(\n    " + ",\n    ".join(signature(k, symnames, buffers)) + ") {"
    how = "simdgroup_matrix 8x8 tiles" if simd else "scalar multiply-adds (no simdgroup_matrix for this type)"
    doc = (f"// gemm [{k.batch}] x [{k.m}, {k.k}] @ [{k.k}, {k.n}]: {BM} x {BN} blocks per threadgroup of "
           f"{THREADS}, {BK}-deep slices, {how}, epilogue fused")
    source = PRELUDE + f"\n{doc}\n{head}\n" + "\n".join(lines) + "\n}\n"
    groups = sympy.sympify(k.batch) * sympy.ceiling(sympy.sympify(k.m) / BM) * sympy.ceiling(sympy.sympify(k.n) / BN)
    return EmittedKernel(fname, source, "gemm", tuple(x.name for x in k.buffers), tuple(k.sizes), THREADS, groups)


def _mac(acc: str, x: str, y: str, d) -> str:
    """acc + x * y, wrapping for signed ints (as numpy), or/and for bool."""
    t = msl_type(d)
    if d.is_bool:
        return f"bool({acc} | ({x} & {y}))"
    if d.short in UNSIGNED and not d.is_floating:
        u = UNSIGNED[d.short]
        return f"{t}({u}({acc}) + {u}({x}) * {u}({y}))"
    return f"{t}({acc} + {x} * {y})"
