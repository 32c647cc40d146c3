"""Choosing how to run a GEMM on the CPU: an analytical model, optionally measured.

Model (zero measurements, the default): time = fixed cost + flops / throughput.
  - BLAS panels: ~2 us per cblas call (argument checks, buffer setup, thread wake-up)
    per panel, plus 2*m*n*k / 60 GFLOP/s (OpenBLAS sgemm on 2 AVX-512 cores; float64
    half that), plus packing traffic for operands BLAS cannot take as they are.
  - kiln's micro-kernel (microkernel.py): no library call, ~0.3 us of setup, the padded
    tile flops at 100 GFLOP/s with 512-bit vectors (50 with 256-bit; float64 half),
    plus packing (~2 elements per ns).
  - generated loop nest (`gemm_as_kernel`): no call overhead, 2*m*n*k / 3 GFLOP/s
    (a vectorized dot product per output, no register blocking).
The cheapest wins; tiny products (m*n*k below ~10^3) stay a loop nest. Measured on the
2-core Xeon (Sapphire Rapids) this was calibrated on, OpenBLAS's call costs only
~0.3 us, and it matched or beat the 6-row micro-kernel on every float32/float16/bfloat16
shape tried; the 8-row tile AVX-512 allows (microkernel.py) beats it on the small and
batched float32 products (`micro_beats_blas`: below 2^23 multiply-adds per item). So
where OpenBLAS is loaded it takes every float product the loop nest and that rule do
not, and the micro-kernel takes its place where it is absent (a numpy without its
bundled OpenBLAS) instead of the
3 GFLOP/s loop nest. Symbolic sizes are costed at `assumed_dim` (a batch/sequence dim
is usually large). `measure=True` (mode="max-autotune") compiles every candidate and
times them on random inputs when the sizes are static, and keeps the fastest, so a
machine where the micro-kernel wins gets it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import sympy

from kiln.codegen.kernel_ir import GemmKernel
from kiln.ir.shapes import evaluate

from kiln.codegen.cpu.gemm import MERGED_ROWS, blas_capable, panel_count
from kiln.codegen.cpu.microkernel import micro_capable, tile, vector_bits

BLAS_CALL_S = 0.5e-6  # measured ~0.3 us per cblas call of a small product, plus ours
BLAS_FLOPS = 60e9
LOOP_FLOPS = 3e9
PACK_BYTES_PER_S = 5e9
MICRO_CALL_S = 0.3e-6
MICRO_FLOPS_512 = 100e9  # float32, 512-bit vectors, one thread (measured 100-150 on small
# and batched shapes); scales with the width, float64 half
MICRO_PACK_PER_S = 2e9  # elements packed (strided read, convert, contiguous write)
# a single product of at least this many multiply-adds (~0.1 ms on one core) is cut into
# one tile per kiln thread, rows or columns as panel_tiles_for chooses, each a one-thread
# BLAS call; tiles of at least MIN_SPLIT_ROWS rows and MIN_SPLIT_COLS columns
SPLIT_MACS = 1 << 23
MIN_SPLIT_ROWS = 64
MIN_SPLIT_COLS = 64
CHUNKS_PER_THREAD = 1
PANEL_ROWS = MERGED_ROWS  # most rows of a tile: the epilogue's panel (gemm.py)


@dataclass(frozen=True)
class GemmChoice:
    use_blas: bool
    panel_rows: int
    predicted_blas_s: float
    predicted_loop_s: float
    measured: bool = False
    kind: str = ""  # "blas", "micro" or "loop" (empty: from use_blas, for older callers)
    predicted_micro_s: float = float("inf")
    panel_cols: int = 0  # columns per tile; 0: full rows (see panel_tiles_for)

    @property
    def variant(self) -> str:
        return self.kind or ("blas" if self.use_blas else "loop")


def _static(d, assumed: int) -> int:
    d = sympy.sympify(d)
    if d.is_Integer:
        return int(d)
    return evaluate(d, {s.name: assumed for s in d.free_symbols})


def panel_rows_for(m: int, n: int, k: int, threads: int = 1, batch: int = 1) -> int:
    """Rows per BLAS call (the row part of `panel_tiles_for`)."""
    return panel_tiles_for(m, n, k, threads, batch)[0]


def panel_tiles_for(m: int, n: int, k: int, threads: int = 1, batch: int = 1,
                    static: tuple[bool, bool] = (True, True)) -> tuple[int, int]:
    """(rows, columns) of the tiles a BLAS GEMM runs in; columns 0 means full rows.

    Unsplit (one thread, a batch, or a product below SPLIT_MACS): panels of up to 1024
    rows, so the epilogue reads a panel that sits in L2/L3 rather than DRAM; consecutive
    panels of one call go to BLAS as one call (gemm.MERGED_ROWS).

    A single product of at least SPLIT_MACS multiply-adds is cut into one tile per
    thread (`threads * CHUNKS_PER_THREAD`), which kiln's pool threads claim, each a
    one-thread BLAS call (compiled.py): OpenBLAS's own threads meet at a barrier per
    block and stall when one of them is descheduled; kiln's do not. Every call packs the
    A rows and B columns it reads, so R x C tiles pack R*k*n + C*m*k elements, R the
    calls down a column: the row panels, at least one per 1024 rows (a column tile's
    panels are calls of their own, each packing its B columns again): the grid with the
    least is chosen (columns when n > m: an MLP's 512 x 4096 hidden layer; rows at
    2048^3, whose column tiles would be 2 calls each), tiles at least MIN_SPLIT_ROWS x
    MIN_SPLIT_COLS. Measured on 2 threads
    (benchmarks/results/cpu.md, gemm_partition): 4 row panels cost 10-31% more CPU time
    than one thread's single call, the best 2 tiles 3-8%.

    Tile sizes are constants of the compiled code, so a symbolic dim (`static` is for m
    and n) is never cut finer than unsplit: its size is a guess, and tiles sized for the
    guess would multiply at a larger size (every one re-packing the other operand).
    With m symbolic its panels keep 1024 rows (those of a large m are the parallelism)
    and only a static n is cut in columns."""
    rows = min(PANEL_ROWS, max(16, m))
    cols = 0
    tiles = threads * CHUNKS_PER_THREAD
    if threads > 1 and batch == 1 and m * n * k >= SPLIT_MACS:
        if not static[0]:
            rows = PANEL_ROWS
        best = None
        for r in range(1, tiles + 1):
            if tiles % r:
                continue
            c = tiles // r
            if r > 1 and (m < r * MIN_SPLIT_ROWS or not static[0]) \
                    or c > 1 and (n < c * MIN_SPLIT_COLS or not static[1]):
                continue
            packed = max(r, -(-m // PANEL_ROWS)) * k * n + c * m * k
            if best is None or packed < best[0]:
                best = (packed, r, c)
        if best is None:  # too narrow for a full grid: row panels of MIN_SPLIT_ROWS
            rows = min(rows, MIN_SPLIT_ROWS) if static[0] else rows
        else:
            _, r, c = best
            rows = min(rows, -(-m // r)) if static[0] else rows
            if c > 1:
                cols = -(-(-(-n // c)) // 16) * 16
    return -(-rows // 16) * 16, cols


def choose_gemm(g: GemmKernel, assumed_dim: int = 256, blas_available: bool | None = None,
                threads: int = 1) -> GemmChoice:
    """Rank BLAS panels, kiln's micro-kernel and the generated loop nest with the
    analytical model (`blas_available`: None asks whether OpenBLAS loaded; `threads`:
    the kernel's thread count, which sets how a large product is cut into panels)."""
    batch, m, n, k = (_static(d, assumed_dim) for d in (g.batch, g.m, g.n, g.k))
    esize = 8 if any(b.dtype.bits == 64 for b in g.buffers if b.name == g.a) else 4
    static_batch = sympy.sympify(g.batch).is_Integer
    static = tuple(sympy.sympify(d).is_Integer for d in (g.m, g.n))
    rows, cols = panel_tiles_for(m, n, k, threads, batch if static_batch else 2, static)
    flops = 2.0 * batch * m * n * k
    panels = batch * max(1, -(-m // rows)) * (max(1, -(-n // cols)) if cols else 1)
    peak = BLAS_FLOPS / (2 if esize == 8 else 1)
    packed = 0 if all(b.dtype.bits >= 32 for b in g.buffers if b.name in (g.a, g.b)) else 1
    blas_s = panels * BLAS_CALL_S + flops / peak + packed * batch * (m * k + k * n) * 4 / PACK_BYTES_PER_S
    loop_s = flops / LOOP_FLOPS
    micro_s = micro_seconds(batch, m, n, k, esize) if micro_capable(g) else float("inf")
    if blas_available is None:
        from kiln.codegen.cpu.jit import ensure_blas_loaded

        blas_available = ensure_blas_loaded()
    # measured here (benchmarks/results/cpu.md): OpenBLAS is as fast or faster than the
    # micro-kernel at every float size (its call costs ~0.3 us), so with BLAS present the
    # micro-kernel is not a candidate; without it, it replaces BLAS
    if blas_available and blas_capable(g):
        costs = {"loop": loop_s, "blas": blas_s}
    else:
        costs = {"loop": loop_s, "micro": micro_s}
    kind = min(costs, key=costs.get)
    if kind == "blas" and micro_capable(g) and micro_beats_blas(g, batch, m, n, k, esize):
        kind = "micro"
    return GemmChoice(kind == "blas", rows, blas_s, loop_s, kind=kind, predicted_micro_s=micro_s,
                      panel_cols=cols)


# Where kiln's micro-kernel beats OpenBLAS (one thread, round-robin, min us, this
# Sapphire Rapids host; benchmarks/bench_call.py has the compiled rows):
# - with AVX-512 (MR = 8: 16 accumulators, no padded rows for m = 32) every float32
#   product below 2^23 multiply-adds per item (where a single product starts being cut
#   into panels for kiln's pool, SPLIT_MACS), any layout: 16 x 32x64x256 NN 126 vs 146,
#   8 x 128x128x64 NN 104 vs 145, 128^3 29 vs 38, 2 x 256x256x64 102 vs 129, 64 x 32x32x16
#   NT 20 vs 37, 16 x 64^3 TN 53 vs 55, at 6.3M: 512x192x64 78 vs 100, 4 x 128x256x192
#   350 vs 385, 512x128x96 NT 90 vs 99 and TN 95 vs 96; from 256^3 BLAS is as fast or
#   faster (256^3 NT 285 vs 242, TN 259 vs 223, 1024x256x256 938 vs 850). It also needs
#   no BLAS thread toggle around the call (~10 us).
# - with MR = 6 (AVX2 hosts; measured here with MR forced to 6) only the small batched
#   NT products (B transposed: attention scores, q @ k^T), where OpenBLAS's small NT path
#   is 1.1-1.6x slower than its NN one: 64 x 32x32x16 30 vs 47, 16 x 64^3 95 vs 109,
#   8 x 128x128x64 165 vs 184; NN, TN and TT stayed with BLAS.
MICRO_MNK = SPLIT_MACS - 1
SMALL_NT_K = 64
SMALL_NT_MN = 128 * 128


def micro_beats_blas(g: GemmKernel, batch: int, m: int, n: int, k: int, esize: int) -> bool:
    """Does kiln's micro-kernel run this float32 product faster than OpenBLAS here?"""
    from kiln.codegen.cpu.microkernel import MR_AVX512, rows_per_tile

    if esize != 4:
        return False  # float64: not measured against dgemm
    if rows_per_tile() == MR_AVX512:
        return m * n * k <= MICRO_MNK
    return small_nt(g, batch, m, n, k)


def small_nt(g: GemmKernel, batch: int, m: int, n: int, k: int) -> bool:
    """A batched NT product small enough for the MR = 6 micro-kernel to beat OpenBLAS."""
    from kiln.codegen.cpu.gemm import _layout

    a_lay, b_lay = _layout(g.a_strides, 1, 2), _layout(g.b_strides, 1, 2)
    return (a_lay is not None and not a_lay[0] and b_lay is not None and b_lay[0]
            and batch > 1 and k <= SMALL_NT_K and m * n <= SMALL_NT_MN)


def micro_seconds(batch: int, m: int, n: int, k: int, esize: int) -> float:
    """The model's time for kiln's micro-kernel: padded tile flops plus packing."""
    mr, nr, _ = tile(esize)
    padded = 2.0 * batch * (-(-m // mr) * mr) * (-(-n // nr) * nr) * k
    rate = MICRO_FLOPS_512 * vector_bits() / 512 / (2 if esize == 8 else 1)
    return MICRO_CALL_S + padded / rate + batch * (m * k + k * n) / MICRO_PACK_PER_S


def measure_gemm(g: GemmKernel, choice: GemmChoice, compile_variant, repeats: int = 5) -> GemmChoice:
    """Time every variant (`compile_variant(kind) -> CompiledKernel`, kind "blas",
    "micro" or "loop") on random data; only for static sizes (symbolic ones keep the
    model's choice)."""
    if not blas_capable(g):
        return choice
    dims = [sympy.sympify(d) for b in g.buffers for d in b.shape]
    if g.sizes or any(not d.is_Integer for d in dims):
        return choice
    rng = np.random.default_rng(0)
    arrays = []
    for b in g.buffers:
        shape = tuple(int(d) for d in b.shape)
        arrays.append(rng.standard_normal(shape).astype(b.dtype.np_dtype) if b.dtype.is_floating
                      else np.zeros(shape, b.dtype.np_dtype))
    times = {}
    for kind in ("blas", "micro", "loop"):
        if kind == "micro" and not micro_capable(g):
            continue
        ck = compile_variant(kind)
        ck(arrays, {})
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            ck(arrays, {})
            best = min(best, time.perf_counter() - t0)
        times[kind] = best
    kind = min(times, key=times.get)
    return GemmChoice(kind == "blas", choice.panel_rows, times["blas"], times["loop"], True, kind,
                      times.get("micro", float("inf")), choice.panel_cols)


def gemm_outer_extents(g: GemmKernel, use_blas: bool, panel_rows: int, panel_cols: int = 0) -> tuple:
    """The flattened outer space the compiled GEMM runs over (for the runtime)."""
    return (panel_count(g, panel_rows, panel_cols),) if use_blas else (g.batch, g.m, g.n)
