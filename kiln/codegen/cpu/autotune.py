"""Choosing how to run a GEMM on the CPU: an analytical model, optionally measured.

Model (zero measurements, the default): time = fixed cost + flops / throughput.
  - BLAS panels: ~2 us per cblas call (argument checks, buffer setup, thread wake-up)
    per panel, plus 2*m*n*k / 60 GFLOP/s (OpenBLAS sgemm on 2 AVX-512 cores; float64
    half that), plus packing traffic for operands BLAS cannot take as they are.
  - generated loop nest (`gemm_as_kernel`): no call overhead, 2*m*n*k / 3 GFLOP/s
    (a vectorized dot product per output, no register blocking).
With these numbers the crossover sits near m*n*k ~ 32^3, where BLAS call overhead
stops dominating. Symbolic sizes are costed at `assumed_dim` (a batch/sequence dim is
usually large). `measure=True` (mode="max-autotune") compiles both and times them on
random inputs when the sizes are static, and keeps the faster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import sympy

from kiln.codegen.kernel_ir import GemmKernel
from kiln.ir.shapes import evaluate

from kiln.codegen.cpu.gemm import blas_capable, panel_count

BLAS_CALL_S = 2e-6
BLAS_FLOPS = 60e9
LOOP_FLOPS = 3e9
PACK_BYTES_PER_S = 5e9


@dataclass(frozen=True)
class GemmChoice:
    use_blas: bool
    panel_rows: int
    predicted_blas_s: float
    predicted_loop_s: float
    measured: bool = False


def _static(d, assumed: int) -> int:
    d = sympy.sympify(d)
    if d.is_Integer:
        return int(d)
    return evaluate(d, {s.name: assumed for s in d.free_symbols})


def panel_rows_for(m: int, n: int, k: int) -> int:
    """Rows per BLAS call. Each call re-packs all of B (k*n), so a panel must be tall
    enough to amortize that: packing ~8 bytes/element at ~10 GB/s vs 2*rows*k*n flops at
    ~150 GFLOP/s is 60/rows overhead, i.e. ~6% at 1024 rows. Then the epilogue reads a
    panel that sits in L2/L3 rather than DRAM. Clamped to [16, 1024], multiple of 16."""
    del n, k  # the ratio above is independent of n and k
    rows = min(1024, max(16, m))
    return -(-rows // 16) * 16


def choose_gemm(g: GemmKernel, assumed_dim: int = 256) -> GemmChoice:
    """Rank BLAS panels vs the generated loop nest with the analytical model."""
    batch, m, n, k = (_static(d, assumed_dim) for d in (g.batch, g.m, g.n, g.k))
    esize = 8 if any(b.dtype.bits == 64 for b in g.buffers if b.name == g.a) else 4
    rows = panel_rows_for(m, n, k)
    flops = 2.0 * batch * m * n * k
    panels = batch * max(1, -(-m // rows))
    peak = BLAS_FLOPS / (2 if esize == 8 else 1)
    packed = 0 if all(b.dtype.bits >= 32 for b in g.buffers if b.name in (g.a, g.b)) else 1
    blas_s = panels * BLAS_CALL_S + flops / peak + packed * batch * (m * k + k * n) * 4 / PACK_BYTES_PER_S
    loop_s = flops / LOOP_FLOPS
    use_blas = blas_capable(g) and blas_s < loop_s
    return GemmChoice(use_blas, rows, blas_s, loop_s)


def measure_gemm(g: GemmKernel, choice: GemmChoice, compile_variant, repeats: int = 5) -> GemmChoice:
    """Time both variants (`compile_variant(use_blas) -> CompiledKernel`) on random data;
    only for static sizes (symbolic ones keep the model's choice)."""
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
    for use_blas in (True, False):
        ck = compile_variant(use_blas)
        ck(arrays, {})
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            ck(arrays, {})
            best = min(best, time.perf_counter() - t0)
        times[use_blas] = best
    return GemmChoice(times[True] <= times[False], choice.panel_rows, times[True], times[False], True)


def gemm_outer_extents(g: GemmKernel, use_blas: bool, panel_rows: int) -> tuple:
    """The flattened outer space the compiled GEMM runs over (for the runtime)."""
    return (panel_count(g, panel_rows),) if use_blas else (g.batch, g.m, g.n)
