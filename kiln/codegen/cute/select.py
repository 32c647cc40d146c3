"""Which implementation a GEMM template gets on target cuda: CuTeDSL or Triton, and why.

`choose(kernel, arch, force)` returns a `Choice`. The CuTeDSL GEMM is taken when every
rule below holds; the first rule broken is the reason Triton gets the kernel instead:

- the architecture has a CuTeDSL kernel here: sm_90 (compiled as sm_90a: persistent,
  warp-specialized wgmma + TMA) or sm_100 (sm_100a: TMA + tcgen05 into tensor memory);
- nvidia-cutlass-dsl is importable;
- a and b are both float16 or both bfloat16, or both float8 (e4m3fn/e5m2); the
  accumulator is float32 (float32 operands stay on Triton: wgmma would round them to
  tf32, and kiln's float32 GEMMs are exact by default);
- TMA can move the operands (layouts.py: compact matrices, 16-byte row pitches);
- the epilogue has a CuTeDSL form (epilogue.py).

Among CuTeDSL's tiles (M in 64/128, N in 64/128/256) the Triton backend's analytical
model (kiln/codegen/triton/tile_selector.py) picks the fastest for the shape, and
Triton's own best config is estimated beside it; both appear in the reason, so
`kiln dump --target cuda --stage kernels` shows what was compared. Symbolic sizes are
modelled at the selector's representative value.

`force` ("auto", "cute", "triton") comes from `TritonOptions.cuda_gemm` (default: the
environment variable KILN_CUDA_GEMM). "triton" always takes Triton; "cute" takes
CuTeDSL wherever the rules allow and otherwise falls back with the reason (a forced
choice never produces a kernel that would compute a wrong answer).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import sympy

from kiln.codegen.kernel_ir import GemmKernel

FORCES = ("auto", "cute", "triton")
CUTE_ARCHS = {"sm_90": "sm_90a", "sm_100": "sm_100a"}
CUTE_TILES = ((128, 256), (128, 128), (128, 64), (64, 256), (64, 128), (64, 64))
_DOT_DTYPES = {"f16", "bf16", "f8e4m3fn", "f8e5m2"}


@dataclass(frozen=True)
class Choice:
    """impl: "cute" or "triton"; arch: the CuTeDSL arch ("sm_90a") when cute; tile (M, N)."""

    impl: str
    reason: str
    arch: str | None = None
    tile: tuple | None = None

    def note(self) -> str:
        """One line for `kiln dump --stage kernels`."""
        where = f"CuTeDSL {self.arch} tile {self.tile[0]}x{self.tile[1]}" if self.impl == "cute" else "Triton"
        return f"cuda gemm: {where} ({self.reason})"


def refusal(kernel: GemmKernel, arch: str) -> str | None:
    """Why CuTeDSL cannot take `kernel` on `arch`, or None when it can."""
    from kiln.codegen.cute.epilogue import unsupported
    from kiln.codegen.cute.layouts import LayoutRefused, gemm_layouts

    if arch not in CUTE_ARCHS:
        return f"no CuTeDSL GEMM for {arch} here (CuTeDSL kernels: {', '.join(CUTE_ARCHS)})"
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not installed"
    dtypes = {b.name: b.dtype for b in kernel.buffers}
    a, b = dtypes[kernel.a], dtypes[kernel.b]
    if a.short not in _DOT_DTYPES or b.short not in _DOT_DTYPES:
        return (f"operands {a.name} x {b.name}: the CuTeDSL GEMM takes float16, bfloat16 or float8 "
                "(float32 would be rounded to tf32 by wgmma)")
    if a.itemsize != b.itemsize or (a.itemsize == 2 and a != b):
        return f"operands {a.name} x {b.name} differ; wgmma needs both the same 16-bit type or both float8"
    acc = kernel.acc_dtype
    if acc is not None and acc.short != "f32":
        return f"accumulator {acc.name}: the CuTeDSL GEMM accumulates in float32"
    if dtypes[kernel.out].short not in ("f32", "f16", "bf16"):
        return f"output {dtypes[kernel.out].name}: the TMA store epilogue writes float32, float16 or bfloat16"
    try:
        gemm_layouts(kernel)
    except LayoutRefused as e:
        return str(e)
    return unsupported(kernel)


def _static(x, default: int) -> int:
    e = sympy.sympify(x)
    return int(e) if e.is_Integer else default


def rank_tiles(kernel: GemmKernel, arch: str) -> list[tuple[float, tuple]]:
    """(estimated seconds, tile) for every CuTeDSL tile, fastest first, and Triton's best
    estimate as (seconds, None) among them."""
    from kiln.codegen.triton import tile_selector as ts

    dtypes = {b.name: b.dtype for b in kernel.buffers}
    in_name, out_name = dtypes[kernel.a].name, dtypes[kernel.out].name
    rep = ts.REPRESENTATIVE
    m, n, k = _static(kernel.m, rep["m"]), _static(kernel.n, rep["n"]), _static(kernel.k, rep["k"])
    batch = _static(kernel.batch, 1)
    dev = ts.device_model(arch)
    cls = ts.dtype_class(in_name)
    out_bytes = dtypes[kernel.out].itemsize
    groups = ts._Groups(np.array([max(m, 1)]), np.array([batch]),
                        max(n, 1), max(k, 1))
    block_k = 128 if cls == "fp8" else 64
    out = []
    for tm, tn in CUTE_TILES:
        consumers = 2 if tm == 128 and tn > 128 else 1
        stage_bytes = (tm + tn) * block_k * ts._BYTES[cls]
        stages = max(2, (dev.smem_per_block - 1024 - 4 * 32 * 128 * out_bytes) // stage_bytes)
        cfg = ts.Config(tm, tn, block_k, 1, 4 * (1 + consumers), int(min(stages, 8)))
        out.append((ts._gemm_estimate(dev, cls, out_bytes, cfg, groups, True).time, (tm, tn)))
    triton = ts.rank("gemm", m * batch, n, k, in_name, arch, out_dtype=out_name)
    if triton:
        out.append((triton[0].time, None))
    return sorted(out, key=lambda t: (t[0], t[1] is None))


def choose(kernel: GemmKernel, arch: str, force: str = "auto") -> Choice:
    """The implementation of `kernel` on `arch` ("sm_90", "sm_100", ...); see the module docstring."""
    if force == "triton":
        return Choice("triton", "forced by cuda_gemm='triton' / KILN_CUDA_GEMM=triton")
    why = refusal(kernel, arch)
    if why is not None:
        return Choice("triton", f"fallback: {why}")
    ranked = rank_tiles(kernel, arch)
    cute_best = next(r for r in ranked if r[1] is not None)
    triton_best = next((r for r in ranked if r[1] is None), None)
    model = f"model: CuTeDSL {cute_best[0] * 1e6:.1f} us"
    if triton_best is not None:
        model += f", Triton {triton_best[0] * 1e6:.1f} us"
    how = "forced by cuda_gemm='cute'" if force == "cute" else "TMA-aligned, supported dtypes and epilogue"
    return Choice("cute", f"{how}; {model}", CUTE_ARCHS[arch], cute_best[1])
