"""The Triton backend for targets "cuda" and "rocm": Kernel IR -> Triton -> PTX/AMDGCN.

Stages, in order, each dumpable by name with `stage_text(kernel, name)` and by
`kiln dump FILE --stage NAME --target cuda|rocm`:

    source   the generated Triton source (emit.py; needs no triton installed)
    ttir     Triton IR            \\
    ttgir    TritonGPU IR          | ahead of time for the target architecture,
    llir     LLVM IR               | no GPU needed (aot.py, cached on disk)
    asm      PTX (cuda) / AMDGCN  /

    backend = TritonBackend("cuda:sm_100")             # or "cuda", "rocm", "rocm:gfx950"
    print(backend.stage_text(kernel, "asm"))           # PTX for sm_100
    fns = backend.compile_many(kernels)                # on a GPU machine: callables

`compile_many` needs a GPU of the target's vendor (NVIDIA for cuda, AMD for rocm) and
compiles for the GPU present unless an architecture was named; in a process started
with TRITON_INTERPRET=1 it runs the kernels through Triton's CPU interpreter instead.
Elsewhere it raises KilnNoGpuError (K165).
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass, replace
from typing import Sequence

from kiln.codegen.backend import Backend, Options
from kiln.codegen.kernel_ir import AnyKernel, GemmKernel
from kiln.codegen.triton.emit import EmitOptions, EmittedKernel, emit_kernel
from kiln.codegen.triton.scalar import SCALAR_TABLE
from kiln.codegen.triton.targets import ARCHS, DEFAULT_ARCH, KilnNoGpuError, split_spec
from kiln.errors import KilnArgumentError

STAGES = ("source", "ttir", "ttgir", "llir", "asm")
_F32_MATMUL = ("ieee", "tf32", "tf32x3")


@dataclass(frozen=True)
class TritonOptions(Options):
    """Compile options; the hash is part of every cache key.

    arch: the architecture to compile for ("sm_80", "sm_90", "sm_100", "gfx90a",
    "gfx942", "gfx950"); None: the vendor default ahead of time (sm_90 / gfx942) and
    the GPU present when running. `backend="cuda:sm_100"` sets it too.
    fast_math: hardware approximations for division, sqrt, rsqrt, exp, log, sin, cos
    (off: IEEE division and sqrt, libdevice/OCML functions within 1-2 ulp).
    f32_matmul: float32 GEMM products, "ieee" (exact, as numpy; FMA units), "tf32"
    (tensor cores, 10-bit mantissas) or "tf32x3" (tensor cores, ~float32 accuracy).
    fp_fusion: let the compiler contract a*b+c into one FMA (off: every op rounds, as
    numpy and the cpu backend do).
    cuda_gemm: who implements GEMM templates on cuda: "auto" (CuTeDSL where it can,
    else Triton; kiln/codegen/cute/select.py), "cute" or "triton"; default: the
    environment variable KILN_CUDA_GEMM, else "auto"."""

    arch: str | None = None
    fast_math: bool = False
    f32_matmul: str = "ieee"
    fp_fusion: bool = False
    cuda_gemm: str = "auto"

    def __post_init__(self):
        if self.arch is not None and self.arch not in ARCHS:
            raise KilnArgumentError(f"TritonOptions: unknown arch {self.arch!r}; known: {', '.join(ARCHS)}")
        if self.f32_matmul not in _F32_MATMUL:
            raise KilnArgumentError(f"TritonOptions: f32_matmul must be one of {', '.join(_F32_MATMUL)}, "
                                    f"got {self.f32_matmul!r}")
        if self.cuda_gemm not in ("auto", "cute", "triton"):
            raise KilnArgumentError(f"TritonOptions: cuda_gemm must be auto, cute or triton, got {self.cuda_gemm!r}")

    @property
    def emit_options(self) -> EmitOptions:
        return EmitOptions(fast_math=self.fast_math, f32_matmul=self.f32_matmul)


class TritonBackend(Backend):
    """Backend for "cuda" / "rocm" (optionally ":ARCH"). See the module docstring."""

    name = "triton"
    Options = TritonOptions
    stages = STAGES
    # what the generic `kiln dump` stages show for this backend
    dump_stages = {"source": "source", "llvm-optimized": "llir", "asm": "asm"}
    keep = frozenset({"matmul"})  # matmul becomes a tiled tl.dot GEMM with its epilogue
    scalar_table = SCALAR_TABLE

    def __init__(self, target: str = "cuda", options: TritonOptions | None = None):
        self.vendor, explicit = split_spec(target)
        if options is None:
            from kiln.codegen.cute.cuda_gemm import default_force

            options = TritonOptions(cuda_gemm=default_force())
        if explicit and options.arch and options.arch != explicit:
            raise KilnArgumentError(f"triton backend: target {target!r} and TritonOptions(arch="
                                    f"{options.arch!r}) name different architectures")
        super().__init__(target, replace(options, arch=options.arch or explicit))
        if self.options.arch and _vendor(self.options.arch) != self.vendor:
            raise KilnArgumentError(f"triton backend: {self.options.arch} is not a {self.vendor} architecture")
        self._lock = threading.Lock()
        self._emitted: dict = {}

    @classmethod
    def supports(cls, target: str) -> bool:
        from kiln.codegen.triton.targets import supports

        return supports(target)

    @property
    def arch(self) -> str:
        """The architecture ahead-of-time stages compile for."""
        return self.options.arch or DEFAULT_ARCH[self.vendor]

    # -- stages -------------------------------------------------------------------------
    def emit(self, kernel: AnyKernel, arch: str | None = None) -> EmittedKernel:
        """The Triton source of `kernel` (legalized here) for `arch` (default: `self.arch`), memoized."""
        arch = arch or self.arch
        kernel = self.legalize(kernel)
        key = (kernel, arch)
        with self._lock:
            if key not in self._emitted:
                self._emitted[key] = emit_kernel(kernel, arch, self.options.emit_options)
            return self._emitted[key]

    def artifact(self, kernel: AnyKernel):
        """`kernel` compiled ahead of time for `self.arch`: a cached aot.Artifact."""
        _require_triton()
        from kiln.codegen.triton.aot import aot_compile

        e = self.emit(kernel)
        aligned = list(e.signature)[:len(e.buffers)]  # kiln's buffers are 16-byte aligned
        return aot_compile(e.source, e.signature, e.constexprs, self.arch, e.num_warps, e.num_stages,
                           name=e.name, options=self.compile_options, divisible_by_16=aligned)

    @property
    def compile_options(self) -> dict:
        return {"enable_fp_fusion": self.options.fp_fusion}

    def gemm_choice(self, kernel: AnyKernel):
        """For a GEMM on cuda: CuTeDSL or Triton, and why (kiln/codegen/cute); else None."""
        if self.vendor != "cuda" or not isinstance(kernel, GemmKernel):
            return None
        from kiln.codegen.cute import cuda_gemm

        return cuda_gemm.choice(self.legalize(kernel), self.arch, self.options.cuda_gemm)

    def kernel_note(self, kernel: AnyKernel) -> str | None:
        """A line `kiln dump --stage kernels` prints under `kernel` (the GEMM choice)."""
        picked = self.gemm_choice(kernel)
        return picked.note() if picked is not None else None

    def render(self, kernel: AnyKernel, stage: str) -> str:
        """The text of one named stage (see STAGES) for a legalized kernel."""
        picked = self.gemm_choice(kernel) if stage in ("source", "asm") else None
        if picked is not None and picked.impl == "cute":
            from kiln.codegen.cute import cuda_gemm

            return cuda_gemm.render(kernel, picked, stage)
        if stage == "source":
            return self.emit(kernel).source
        art = self.artifact(kernel)
        return art.assembly if stage == "asm" else art.asm[stage]

    def comment(self, stage: str) -> str:
        """The line-comment marker of a stage's language (for dump banners)."""
        if stage == "source":
            return "#"
        if stage == "llir" or (stage == "asm" and self.vendor == "rocm"):
            return ";"
        return "//"

    # -- running ------------------------------------------------------------------------
    def templates(self) -> dict:
        """Templates this backend runs itself rather than through their numpy reference:
        the grouped GEMMs, one persistent Triton launch each (kiln/codegen/triton/grouped_gemm.py)."""
        from kiln.codegen.triton import grouped_gemm

        return {"grouped_gemm": grouped_gemm.run_grouped_matmul,
                "grouped_gemm_dw": grouped_gemm.run_grouped_matmul_dw}

    def build(self, kernels: Sequence[AnyKernel]) -> list:
        """Callables `fn(arrays, sizes)` running `kernels` on this machine's GPU (or through
        Triton's interpreter under TRITON_INTERPRET=1); K165 where neither is possible."""
        _require_triton()
        from kiln.codegen.triton import runtime

        if runtime.interpreter_active():
            return [runtime.InterpretedKernel(k, self.emit(k)) for k in kernels]
        gpu = runtime.device_target(self.vendor)
        if gpu is None:
            raise KilnNoGpuError(
                f"backend {self.target!r} runs kernels on {_VENDOR_NAME[self.vendor]} GPUs, and this machine "
                f"has none that triton can use",
                hint=f"on this machine: `kiln dump FILE --stage source|asm --target {self.vendor}` and "
                     "kiln.codegen.triton.aot.aot_compile build PTX/cubin or AMDGCN/hsaco ahead of time; "
                     "TRITON_INTERPRET=1 (set before Python starts, needs torch) runs the kernels on the CPU; "
                     "backend='cpu' runs them natively")
        from kiln.codegen.triton.aot import target_name

        present = target_name(gpu)
        if self.options.arch and self.options.arch != present:
            raise KilnNoGpuError(f"backend {self.target!r} compiles for {self.options.arch}, but this "
                                 f"machine's GPU is {present}",
                                 hint=f"use backend={self.vendor!r} to compile for the GPU present")
        return [self._gpu_kernel(k, gpu, present) for k in kernels]

    def _gpu_kernel(self, kernel: AnyKernel, gpu, present: str):
        """Triton's kernel for `kernel`, or for a GEMM that select.py gives to CuTeDSL on the
        GPU present (`present`: "sm_90" runs sm_90a kernels), kiln/codegen/cute/launch.py's."""
        from kiln.codegen.triton import runtime

        if self.vendor == "cuda" and isinstance(kernel, GemmKernel):
            from kiln.codegen.cute import cuda_gemm

            legal = self.legalize(kernel)
            picked = cuda_gemm.choice(legal, present, self.options.cuda_gemm)
            if picked.impl == "cute":
                from kiln.codegen.cute.launch import CuteGemmKernel

                return CuteGemmKernel(legal, picked)
        return runtime.GpuKernel(kernel, self.emit(kernel, present), gpu, self.vendor, self.compile_options)


_VENDOR_NAME = {"cuda": "NVIDIA", "rocm": "AMD"}


def _vendor(arch: str) -> str:
    return "cuda" if ARCHS[arch][0] == "cuda" else "rocm"


def _require_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        raise KilnNoGpuError("the cuda and rocm backends need the triton package, which is not installed",
                             hint="pip install 'triton>=3.3'; `kiln dump --stage source` works without it")
