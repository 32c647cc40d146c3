"""The CuTeDSL GEMMs as the Triton backend's GEMM template on target cuda.

The Triton backend serves "cuda"; for a `GemmKernel` it asks `choice(...)` which
implementation the kernel gets (select.py) and, when that is CuTeDSL, shows this
module's stages instead of Triton's:

    source   what is compiled: the CuTeDSL kernel class, its tile and the epilogue
    asm      the PTX, compiled ahead of time for sm_90a / sm_100a (compile.py, artifact cache)

`note(...)` is the line `kiln dump --target cuda --stage kernels` prints under each
GEMM: the implementation chosen and why.
"""

from __future__ import annotations

import os
import threading

from kiln.codegen.cute.select import FORCES, Choice, choose
from kiln.codegen.kernel_ir import GemmKernel, format_kernel
from kiln.errors import KilnArgumentError

ENV = "KILN_CUDA_GEMM"
_LOCK = threading.Lock()
_CHOICES: dict = {}


def default_force() -> str:
    """The `cuda_gemm` option's default: $KILN_CUDA_GEMM, else "auto" (K103 on a bad value)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in FORCES:
        raise KilnArgumentError(f"{ENV}={value!r}: expected one of {', '.join(FORCES)}")
    return value


def choice(kernel: GemmKernel, arch: str, force: str) -> Choice:
    """The implementation of `kernel` on `arch` (memoized per kernel, arch and force)."""
    key = (kernel, arch, force)
    with _LOCK:
        found = _CHOICES.get(key)
    if found is None:
        found = choose(kernel, arch, force)
        with _LOCK:
            _CHOICES[key] = found
    return found


def note(kernel, arch: str, force: str) -> str | None:
    """The `kiln dump --stage kernels` line for `kernel` (None for a loop kernel)."""
    return choice(kernel, arch, force).note() if isinstance(kernel, GemmKernel) else None


def render(kernel: GemmKernel, picked: Choice, stage: str) -> str:
    """Stage `stage` ("source" or "asm") of a kernel CuTeDSL compiles."""
    if stage == "source":
        kernel_class = "sm100_gemm.py Sm100Gemm" if picked.arch == "sm_100a" else "sm90_gemm.py Sm90Gemm"
        return (f"# CuTeDSL GEMM: kiln/codegen/cute/{kernel_class}(tile_mn={picked.tile}), "
                f"compiled for {picked.arch}\n# {picked.note()}\n"
                "# epilogue, applied to each float32 accumulator before the store:\n"
                + "\n".join(f"#   {line}" for line in format_kernel(kernel).splitlines()) + "\n")
    from kiln.codegen.cute.compile import compile_gemm

    art = compile_gemm(kernel, picked.arch, picked.tile)
    return (f"// kiln: CuTeDSL {art.arch} GEMM {art.name}, tile {art.tile[0]}x{art.tile[1]}, "
            f"cubin {len(art.cubin)} bytes\n{art.ptx}")
