"""GemmKernel -> OpenCL C: a tiled GEMM with local-memory blocking and the epilogue fused.

    work-group (TX, TY) -> a BM x BN block of the output (BM = TY*WM, BN = TX*WN), batch in dim 2
    for each BK slice of K: the group stages A[BM, BK] and B[BK, BN] in local memory
        (rows/columns past M, N, K load 0), barrier, then each work-item accumulates its
        WM x WN micro-tile from local memory in private registers, barrier
    epilogue(acc, loads at gb, gi, gj) -> one guarded store per output

Operand strides (batch, row, k) / (batch, k, col) come from the Kernel IR, so a
transposed operand needs no copy. The group is 16 x 16 work-items where the device
allows 256 (8 x 8 otherwise) and the tiles fit its local memory.
"""

from __future__ import annotations

from kiln.codegen.kernel_ir import GemmKernel
from kiln.codegen.lower import accumulator_dtype
from kiln.codegen.opencl.emit import (EmittedKernel, ExprEmitter, Limits, _signature, _store_cast,
                                      kernel_name, prelude, uses_f64)
from kiln.codegen.opencl.scalar import cl_type, index_cl

WM = WN = 4  # outputs per work-item along rows / columns
BK = 16


def gemm_shape(limits: Limits, acc_bytes: int) -> tuple[int, int]:
    """(TX, TY): 16 x 16 work-items where the device allows, else 8 x 8 (or smaller)."""
    t = 16
    while t > 1 and (t * t > limits.max_work_group_size
                     or 2 * BK * t * WM * acc_bytes > limits.local_mem_size):
        t //= 2
    return t, t


def emit_gemm(k: GemmKernel, limits: Limits) -> EmittedKernel:
    symnames = {s: f"s_{s}" for s in k.sizes}
    symnames.update({"gb": "gb", "gi": "gi", "gj": "gj"})
    buffers = {b.name: (f"b_{b.name}", b.dtype) for b in k.buffers}
    in_dtype = buffers[k.a][1]
    acc_d = k.acc_dtype or accumulator_dtype(in_dtype)
    at = cl_type(acc_d)
    tx, ty = gemm_shape(limits, acc_d.np_dtype.itemsize)
    bm, bn = ty * WM, tx * WN
    ix = lambda e: index_cl(e, symnames)  # noqa: E731
    a, b = buffers[k.a][0], buffers[k.b][0]
    sa, sb = [ix(s) for s in k.a_strides], [ix(s) for s in k.b_strides]
    p = "  "
    from kiln.codegen.opencl import subgroups

    if subgroups.gemm_eligible(k, in_dtype, limits):
        return _emit_block_read(k, symnames, buffers, a, b, sa, sb, limits)
    lines = [
        f"{p}__local {at} As[{BK}][{bm}];",
        f"{p}__local {at} Bs[{BK}][{bn}];",
        f"{p}const long M = {ix(k.m)}, N = {ix(k.n)}, K = {ix(k.k)};",
        f"{p}const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * {tx} + tx;",
        f"{p}const long gb = get_group_id(2);",
        f"{p}const long bm0 = (long)get_group_id(1) * {bm}, bn0 = (long)get_group_id(0) * {bn};",
        f"{p}{at} acc[{WM}][{WN}];",
        f"{p}for (int i = 0; i < {WM}; ++i) for (int j = 0; j < {WN}; ++j) acc[i][j] = ({at})0;",
        f"{p}for (long k0 = 0; k0 < K; k0 += {BK}) {{",
        f"{p * 2}for (int l = tid; l < {bm * BK}; l += {tx * ty}) {{",
        f"{p * 3}const int r = l / {BK}, kk = l % {BK};",
        f"{p * 3}const long gr = bm0 + r, gk = k0 + kk;",
        f"{p * 3}As[kk][r] = (gr < M && gk < K) ? ({at}){a}[gb * {sa[0]} + gr * {sa[1]} + gk * {sa[2]}] : ({at})0;",
        f"{p * 2}}}",
        f"{p * 2}for (int l = tid; l < {bn * BK}; l += {tx * ty}) {{",
        f"{p * 3}const int kk = l / {bn}, c = l % {bn};",
        f"{p * 3}const long gc = bn0 + c, gk = k0 + kk;",
        f"{p * 3}Bs[kk][c] = (gc < N && gk < K) ? ({at}){b}[gb * {sb[0]} + gk * {sb[1]} + gc * {sb[2]}] : ({at})0;",
        f"{p * 2}}}",
        f"{p * 2}barrier(CLK_LOCAL_MEM_FENCE);",
        f"{p * 2}for (int kk = 0; kk < {BK}; ++kk) {{",
        f"{p * 3}{at} av[{WM}], bv[{WN}];",
        f"{p * 3}for (int i = 0; i < {WM}; ++i) av[i] = As[kk][ty + i * {ty}];",
        f"{p * 3}for (int j = 0; j < {WN}; ++j) bv[j] = Bs[kk][tx + j * {tx}];",
        f"{p * 3}for (int i = 0; i < {WM}; ++i) for (int j = 0; j < {WN}; ++j) "
        f"acc[i][j] = {_mac('acc[i][j]', 'av[i]', 'bv[j]', acc_d)};",
        f"{p * 2}}}",
        f"{p * 2}barrier(CLK_LOCAL_MEM_FENCE);",
        f"{p}}}",
        f"{p}for (int i = 0; i < {WM}; ++i) {{",
        f"{p * 2}const long gi = bm0 + ty + i * {ty};",
        f"{p * 2}if (gi >= M) break;",
        f"{p * 2}for (int j = 0; j < {WN}; ++j) {{",
        f"{p * 3}const long gj = bn0 + tx + j * {tx};",
        f"{p * 3}if (gj >= N) break;",
        f"{p * 3}const {at} accv = acc[i][j];",
    ]
    ex = ExprEmitter(symnames, buffers)
    ex.acc = "accv"
    value = ex.emit(k.epilogue, lines, p * 3)
    out, od = buffers[k.out]
    lines.append(f"{p * 3}{out}[(gb * M + gi) * N + gj] = {_store_cast(value, k.epilogue.dtype, od)};")
    lines += [f"{p * 2}}}", f"{p}}}"]
    fname = kernel_name(k.name)
    attr = f"__attribute__((reqd_work_group_size({tx}, {ty}, 1)))"
    head = f"__kernel {attr}\nvoid {fname}({', '.join(_signature(k, symnames, buffers))}) {{"
    doc = (f"/* gemm [{k.batch}] x [{k.m}, {k.k}] @ [{k.k}, {k.n}]: {bm} x {bn} blocks, {BK}-deep "
           f"local-memory slices, {WM} x {WN} outputs per work-item, epilogue fused */")
    f64 = uses_f64(k)
    source = prelude(f64) + f"\n{doc}\n{head}\n" + "\n".join(lines) + "\n}\n"
    work = ((k.n, bn, tx), (k.m, bm, ty), (k.batch, 1, 1))
    return EmittedKernel(fname, source, "gemm", tuple(b.name for b in k.buffers), tuple(k.sizes),
                         (tx, ty, 1), work, f64)


def _emit_block_read(k: GemmKernel, symnames: dict, buffers: dict, a: str, b: str, sa: list, sb: list,
                     limits: Limits) -> EmittedKernel:
    """The Intel subgroup variant (kiln/codegen/opencl/subgroups.py) with the same epilogue."""
    from kiln.codegen.opencl.subgroups import SG, SG_GROUPS, SG_ROWS, gemm_main_loop, pragma

    p = "  "
    ix = lambda e: index_cl(e, symnames)  # noqa: E731
    lines = [f"{p}const long M = {ix(k.m)}, N = {ix(k.n)}, K = {ix(k.k)};"]
    lines += gemm_main_loop(a, b, sa, sb, p)
    ex = ExprEmitter(symnames, buffers)
    ex.acc = "accv"
    value = ex.emit(k.epilogue, lines, p * 3)
    out, od = buffers[k.out]
    lines.append(f"{p * 3}{out}[(gb * M + gi) * N + gj] = {_store_cast(value, k.epilogue.dtype, od)};")
    lines += [f"{p * 2}}}", f"{p}}}"]
    fname = kernel_name(k.name)
    attr = (f"__attribute__((intel_reqd_sub_group_size({SG}))) "
            f"__attribute__((reqd_work_group_size({SG}, {SG_GROUPS}, 1)))")
    head = f"__kernel {attr}\nvoid {fname}({', '.join(_signature(k, symnames, buffers))}) {{"
    doc = (f"/* gemm [{k.batch}] x [{k.m}, {k.k}] @ [{k.k}, {k.n}], Intel subgroups: one column per lane, "
           f"{SG_ROWS} rows per subgroup, block reads of A and B rows, epilogue fused */")
    source = prelude(uses_f64(k)) + pragma(limits) + f"\n{doc}\n{head}\n" + "\n".join(lines) + "\n}\n"
    work = ((k.n, SG, SG), (k.m, SG_GROUPS * SG_ROWS, SG_GROUPS), (k.batch, 1, 1))
    return EmittedKernel(fname, source, "gemm", tuple(bb.name for bb in k.buffers), tuple(k.sizes),
                         (SG, SG_GROUPS, 1), work, uses_f64(k))


def _mac(acc: str, x: str, y: str, d) -> str:
    """acc + x * y, each op rounded (no FMA contraction), wrapping for wide ints."""
    if d.short in ("i32", "i64"):
        u = {"i32": "uint", "i64": "ulong"}[d.short]
        return f"({cl_type(d)})(({u}){acc} + ({u}){x} * ({u}){y})"
    if d.is_bool:
        return f"(uchar)({acc} | ({x} & {y}))"
    return f"({cl_type(d)})({acc} + {x} * {y})"
