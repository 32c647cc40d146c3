"""The CPU backend (LLVM via llvmlite): see backend.py and docs/cpu-backend.md."""

from kiln.codegen.cpu.backend import CpuBackend, CpuOptions
from kiln.codegen.cpu.compiled import CompiledKernel

__all__ = ["CpuBackend", "CpuOptions", "CompiledKernel"]
