"""Generated OpenCL C checked by clang for an Intel target, and SPIR / SPIR-V through it.

`clang -cl-std=CL2.0 -target spir64` with clang's opencl-c.h and the extensions of an
Intel GPU driver enabled compiles OpenCL C for the SPIR target with every built-in
declared (subgroup functions, `intel_sub_group_block_read`), so kernels a CPU OpenCL driver cannot build (PoCL has no
subgroups) are still type-checked here. `spir_text` gives the SPIR LLVM IR (the `spir`
stage of `kiln dump`); `spirv_binary` SPIR-V, where llvm-spirv is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from kiln.codegen.opencl.errors import KilnOpenCLBuildError, KilnOpenCLUnavailableError

_CLANGS = ("clang-15", "clang")
_SPIRV = ("llvm-spirv-15", "llvm-spirv")
# what an Intel GPU driver reports, declared for the check (subgroups, block reads, fp64)
_EXTENSIONS = "+cl_khr_subgroups,+cl_intel_subgroups,+cl_khr_fp64"


def clang() -> str | None:
    """The clang that compiles OpenCL C for spir64 here, or None."""
    return next((c for c in map(shutil.which, _CLANGS) if c), None)


def llvm_spirv() -> str | None:
    return next((c for c in map(shutil.which, _SPIRV) if c), None)


def _run(args: list[str], what: str) -> bytes:
    try:
        done = subprocess.run(args, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise KilnOpenCLBuildError(f"opencl backend: {what} took more than 120 s") from None
    if done.returncode != 0:
        raise KilnOpenCLBuildError(f"opencl backend: {what} failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
    return done.stdout


def compile_spir(source: str, std: str = "CL2.0", emit: str = "-S", opt: str = "-O2") -> bytes:
    """clang's output for `source` on spir64 (`emit` "-S": LLVM IR text, "-c": bitcode)."""
    cc = clang()
    if cc is None:
        raise KilnOpenCLUnavailableError("opencl backend: the spir stages need clang (apt-get install clang)")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.cl")
        with open(src, "w") as f:
            f.write(source)
        # opencl-c.h included by hand: -finclude-default-header's precompiled form ignores
        # -cl-ext, so it would not declare the Intel subgroup functions
        return _run([cc, f"-cl-std={std}", "-target", "spir64", "-Xclang", f"-cl-ext={_EXTENSIONS}",
                     "-Xclang", "-include", "-Xclang", "opencl-c.h", opt, emit, "-emit-llvm", "-o", "-", src], "clang -target spir64")


def spir_text(source: str) -> str:
    """SPIR (LLVM IR for spir64) of an OpenCL C program."""
    return compile_spir(source).decode()


def spirv_binary(source: str) -> bytes:
    """SPIR-V of an OpenCL C program (clang to SPIR bitcode, then llvm-spirv)."""
    tool = llvm_spirv()
    if tool is None:
        raise KilnOpenCLUnavailableError("opencl backend: SPIR-V needs llvm-spirv (apt-get install llvm-spirv-15)")
    bitcode = compile_spir(source, emit="-c", opt="-O0")  # llvm-spirv takes no `freeze`
    with tempfile.TemporaryDirectory() as tmp:
        bc, out = os.path.join(tmp, "k.bc"), os.path.join(tmp, "k.spv")
        with open(bc, "wb") as f:
            f.write(bitcode)
        _run([tool, "--spirv-ext=+SPV_INTEL_subgroups", bc, "-o", out], "llvm-spirv")
        with open(out, "rb") as f:
            return f.read()
