"""GemmKernel -> Triton source: a tiled `tl.dot` loop with the epilogue fused.

    program id -> (batch, tile): tiles of BLOCK_M x BLOCK_N in grouped order (GROUP_M
                  row-blocks share their B column-blocks in L2, as Triton's tutorial)
    for each BLOCK_K slice: load A and B tiles (K tail masked), acc = tl.dot(a, b, acc)
    epilogue(acc, loads at gb, gi, gj) -> one masked store

Rows past M and columns past N read row `rm % M` (a valid address) instead of being
masked in the K loop; their results are never stored. Operands of float16/bfloat16
use the tensor cores (wgmma on sm_90, MFMA on gfx9), float8 operands are widened to
float16 (exactly) for them, int8 accumulates in int32; float32 follows
`EmitOptions.f32_matmul` ("ieee": exact products on the FMA units, like numpy; "tf32").
Other integer types and bool use a broadcast multiply-and-sum over the K slice.
"""

from __future__ import annotations

import sympy

from kiln.codegen.kernel_ir import GemmKernel
from kiln.codegen.lower import accumulator_dtype
from kiln.codegen.triton.emit import EmitOptions, EmittedKernel, index_bits, kernel_name, module_source
from kiln.codegen.triton.emit_expr import Names, paren, static_int, subst_expr, Tile, index_text, pointer
from kiln.codegen.triton.scalar import ScalarOps, pointer_type, reg_dtype
from kiln.codegen.triton.tiling import Tiles, _tiles
from kiln.ir import dtypes as dt
from kiln.ir.shapes import symbol

_LOCALS = ("M", "N", "K", "pid", "tiles", "grid_m", "grid_n", "width", "group", "group_size", "pid_m",
           "pid_n", "rm", "rn", "rk", "ram", "rbn", "a_ptrs", "b_ptrs", "acc", "a", "b", "kk", "gb", "gi", "gj",
           "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
_DOT = {"f16", "bf16", "f32", "f64", "i8", "f8e4m3fn", "f8e5m2"}


def emit_gemm(k: GemmKernel, target: str, options: EmitOptions, tiles: Tiles | None) -> EmittedKernel:
    names = Names()
    for n in _LOCALS:
        names.get(n)
    buffers = {b.name: b.dtype for b in k.buffers}
    # parameters are named after the buffers, renamed where one would shadow a local
    buffer_names = {b.name: names.get(b.name) for b in k.buffers}
    symbols = {s: names.get(f"size_{s}") for s in k.sizes}
    symbols.update({"gb": "gb", "gi": "gi", "gj": "gj"})
    in_dtype = buffers[k.a]
    acc_dtype = k.acc_dtype or accumulator_dtype(in_dtype)
    tiles = tiles or _tiles("gemm", static_int(k.m), static_int(k.n), static_int(k.k), in_dtype, target)
    blocks = tiles.blocks
    bits = index_bits(k)
    batch_static = static_int(k.batch)
    text = lambda e: index_text(e, symbols)  # noqa: E731

    top: list[str] = [f'"""gemm [{k.batch}] x [{k.m}, {k.k}] @ [{k.k}, {k.n}] with the epilogue fused"""']
    top += [f"M = {text(k.m)}", f"N = {text(k.n)}", f"K = {text(k.k)}"]
    top.append("pid = tl.program_id(0)" + (".to(tl.int64)" if bits == 64 else ""))
    top += ["grid_m = tl.cdiv(M, BLOCK_M)", "grid_n = tl.cdiv(N, BLOCK_N)"]
    if batch_static != 1:
        top += ["tiles = grid_m * grid_n", "gb = pid // tiles", "pid = pid % tiles"]
    top += ["# grouped order: GROUP_M row-blocks in a row reuse the same B column-blocks from L2",
            "width = GROUP_M * grid_n", "group = pid // width",
            "group_size = tl.minimum(grid_m - group * GROUP_M, GROUP_M)",
            "pid_m = group * GROUP_M + (pid % width) % group_size",
            "pid_n = (pid % width) // group_size",
            "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
            "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
            "rk = tl.arange(0, BLOCK_K)"]
    m_even = _divisible(k.m, blocks["BLOCK_M"])
    n_even = _divisible(k.n, blocks["BLOCK_N"])
    k_even = _divisible(k.k, blocks["BLOCK_K"])
    top.append("ram = " + ("tl.max_contiguous(tl.multiple_of(rm, BLOCK_M), BLOCK_M)" if m_even else "rm % M"))
    top.append("rbn = " + ("tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)" if n_even else "rn % N"))
    sab, sam, sak = k.a_strides
    sbb, sbk, sbn = k.b_strides

    def times(v: str, stride) -> str:
        return v if sympy.sympify(stride) == 1 else f"{v} * {paren(text(stride), stride)}"

    a_terms = ([times("gb", sab)] if batch_static != 1 else []) + [times("ram[:, None]", sam), times("rk[None, :]", sak)]
    b_terms = ([times("gb", sbb)] if batch_static != 1 else []) + [times("rk[:, None]", sbk), times("rbn[None, :]", sbn)]
    top.append(f"a_ptrs = {buffer_names[k.a]} + ({' + '.join(a_terms)})")
    top.append(f"b_ptrs = {buffer_names[k.b]} + ({' + '.join(b_terms)})")
    use_dot = in_dtype.short in _DOT
    acc_reg = _acc_register(in_dtype, acc_dtype, use_dot)
    top.append(f"acc = tl.zeros((BLOCK_M, BLOCK_N), dtype={acc_reg})")
    top.append("for kk in range(0, tl.cdiv(K, BLOCK_K)):")
    kmask_a = "" if k_even else ", mask=rk[None, :] < K - kk * BLOCK_K, other=0"
    kmask_b = "" if k_even else ", mask=rk[:, None] < K - kk * BLOCK_K, other=0"
    widen = ".to(tl.float16)" if in_dtype.short in ("f8e4m3fn", "f8e5m2") else ""
    loop = [f"a = tl.load(a_ptrs{kmask_a}){widen}", f"b = tl.load(b_ptrs{kmask_b}){widen}"]
    if use_dot:
        precision = f', input_precision="{options.f32_matmul}"' if in_dtype == dt.float32 else ""
        loop.append(f"acc = tl.dot(a, b, acc{precision})")
    else:
        cast = f".to({acc_reg})"
        loop.append(f"acc += tl.sum(a{cast}[:, :, None] * b{cast}[None, :, :], 1)")
    loop += [f"a_ptrs += {times('BLOCK_K', sak)}", f"b_ptrs += {times('BLOCK_K', sbk)}"]
    top += ["    " + line for line in loop]
    top += ["gi = rm[:, None]", "gj = rn[None, :]"]

    # the epilogue: a tile over (gi, gj), gb a scalar
    subs = {symbol("gb"): 0} if batch_static == 1 else {}
    epilogue = subst_expr(k.epilogue, subs, {})
    var_dim = {"gi": 0, "gj": 1}
    shapes = {frozenset({0, 1}): "[BLOCK_M, BLOCK_N]", frozenset({0}): "[BLOCK_M, 1]",
              frozenset({1}): "[1, BLOCK_N]"}
    masks = {0: None if m_even else "gi < M", 1: None if n_even else "gj < N"}
    tile = Tile(names, buffers, symbols, var_dim, shapes, masks, options.fast_math, buffer_names)
    tile.top = top
    tile.memo_inner = {}
    acc_value = "acc"
    if acc_reg != reg_dtype(acc_dtype):  # int8 products accumulate in int32, wrap once at the end
        acc_value = tile.bind(ScalarOps(top.append, names.temp).convert("acc", _dtype_of(acc_reg), acc_dtype),
                               frozenset({0, 1}))
    tile.acc = (acc_value, acc_dtype)
    value, deps = tile.value(epilogue)
    out_dtype = buffers[k.out]
    value = tile.convert(value, epilogue.dtype, out_dtype, deps)
    value = tile.broadcast(value, deps, {0, 1}, reg_dtype(out_dtype))
    out_index = sympy.expand(symbol("gb") * k.m * k.n + symbol("gi") * k.n + symbol("gj")).subs(subs)
    store_mask = tile.mask({0, 1})
    top.append(f"tl.store({pointer(buffer_names[k.out], text(out_index))}, {value}" + (f", mask={store_mask})" if store_mask else ")"))

    fname = kernel_name(k.name)
    signature = {buffer_names[b.name]: pointer_type(b.dtype) for b in k.buffers}
    signature.update({symbols[s]: "i64" for s in k.sizes})
    signature.update({b: "constexpr" for b in blocks})
    params = [f"{n}: tl.constexpr" if t == "constexpr" else n for n, t in signature.items()]
    source = module_source(tile.helpers, ["@triton.jit", f"def {fname}({', '.join(params)}):"]
                     + [f"    {line}" for line in top])
    grid = ((k.m, blocks["BLOCK_M"]), (k.n, blocks["BLOCK_N"]), (k.batch, 1))
    return EmittedKernel(fname, source, "gemm", signature, dict(blocks), tuple(b.name for b in k.buffers),
                         tuple(k.sizes), grid, tiles.num_warps, tiles.num_stages)


def _divisible(size, block: int) -> bool:
    s = static_int(size)
    return s is not None and s % block == 0


def _acc_register(in_dtype, acc_dtype, use_dot: bool) -> str:
    if in_dtype == dt.int8 and use_dot:
        return "tl.int32"
    if acc_dtype.is_bool:
        return "tl.int32"  # a bool product is an or of ands: count in int32, test != 0
    return reg_dtype(acc_dtype)


def _dtype_of(tl_name: str):
    return {"tl.int32": dt.int32, "tl.float32": dt.float32, "tl.float64": dt.float64}[tl_name]
