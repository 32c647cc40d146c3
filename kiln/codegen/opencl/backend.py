"""The OpenCL backend (Intel XPU and any OpenCL device): Kernel IR -> OpenCL C -> device.

Stages, each dumpable by name (`kiln dump --target opencl --stage source|opencl-c|spirv`):

    opencl-c   the generated OpenCL C (emit.py, emit_gemm.py; needs no device)
    spir       LLVM IR for `spir64` through clang (what a SPIR-consuming runtime takes;
               SPIR-V proper needs llvm-spirv, which Debian 12's clang does not ship)

Targets: "opencl" / "opencl:N" (the N-th OpenCL device), "xpu" / "xpu:N" (the N-th Intel
GPU). Work-group shapes come from the device's limits read at run time; printing without
a device uses `DEFAULT_LIMITS`. `compile_many` builds for the device and returns callables
`fn(arrays, sizes)` (kiln/codegen/opencl/runtime.py).

    fn = kn.compile(lambda x: (x * 2).sum(-1), backend="opencl")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from kiln.codegen.backend import Backend, Options
from kiln.codegen.kernel_ir import AnyKernel
from kiln.codegen.opencl.emit import DEFAULT_LIMITS, Limits, emit_kernel
from kiln.codegen.opencl.scalar import DTYPES, SCALAR_TABLE
from kiln.errors import KilnArgumentError

_TARGET = re.compile(r"^(opencl|xpu)(?::(\d+))?$")


@dataclass(frozen=True)
class OpenCLOptions(Options):
    """Compile options (their text is in every cache key).

    subgroups: "auto" uses the cl_khr_subgroups / cl_intel_subgroups kernel variants when
    the device reports them, "off" never does."""

    subgroups: str = "auto"

    def __post_init__(self):
        if self.subgroups not in ("auto", "off"):
            raise KilnArgumentError(f"OpenCLOptions: subgroups must be 'auto' or 'off', got {self.subgroups!r}")


def split_target(target: str) -> tuple[str, int]:
    m = _TARGET.match(target)
    if m is None:
        raise KilnArgumentError(f"opencl backend: target must be 'opencl[:N]' or 'xpu[:N]', got {target!r}")
    return m.group(1), int(m.group(2) or 0)


class OpenCLBackend(Backend):
    """Backend for "opencl[:N]" and "xpu[:N]". See the module docstring."""

    name = "opencl"
    Options = OpenCLOptions
    stages = ("opencl-c", "spir")
    dump_stages = {"source": "opencl-c", "asm": "spir"}
    keep = frozenset({"matmul"})  # matmul becomes the tiled local-memory GEMM with its epilogue
    scalar_table = SCALAR_TABLE
    dtypes = DTYPES

    def __init__(self, target: str = "opencl", options: OpenCLOptions | None = None):
        self.kind, self.index = split_target(target)
        self._allocator = None
        self._limits: Limits | None = None
        super().__init__(target, options)

    @classmethod
    def supports(cls, target: str) -> bool:
        return _TARGET.match(target) is not None

    def comment(self, stage: str) -> str:
        return ";" if stage == "spir" else "//"

    def native(self, op: str, arg_dtypes, out) -> bool:
        """The table's answer, except float32 erf on a CPU device: PoCL's erf is scalar
        (2^22 of them took 300 ms, its exp 2.7 ms), so there it takes kiln's vectorizable
        polynomial from legalize (within ~1e-7 absolute, as on every backend without one)."""
        if op == "erf" and out.short == "f32" and self.limits().cpu:
            return False
        return super().native(op, arg_dtypes, out)

    def limits(self) -> Limits:
        """The device's limits when it is here, else the defaults printing uses."""
        from kiln.codegen.opencl.runtime import all_devices, context

        if self._limits is not None:
            return self._limits
        limits = DEFAULT_LIMITS
        if all_devices():
            try:
                limits = context(self.kind, self.index).limits
            except Exception:  # e.g. xpu without an Intel GPU: print for the defaults
                limits = DEFAULT_LIMITS
        if self.options.subgroups == "off":
            limits = Limits(limits.max_work_group_size, limits.local_mem_size, limits.compute_units,
                            cpu=limits.cpu)
        self._limits = limits
        return limits

    def emit(self, kernel: AnyKernel, limits: Limits | None = None):
        return emit_kernel(self.legalize(kernel), limits or self.limits())

    def render(self, kernel: AnyKernel, stage: str) -> str:
        emitted = emit_kernel(kernel, self.limits())
        if stage == "opencl-c":
            return emitted.source
        from kiln.codegen.opencl.clang_check import spir_text

        return spir_text(emitted.source)

    def runtime_allocator(self):
        """The runtime allocator compiled programs take their buffers from: this device's
        caching allocator (SVM), so intermediates stay on the device between kernels and
        count in its memory statistics."""
        from kiln.runtime.allocator import Allocator
        from kiln.runtime.device import allocator_for

        if self._allocator is None:
            self._allocator = Allocator(device_allocator=allocator_for(f"{self.kind}:{self.index}"))
        return self._allocator

    def build(self, kernels: Sequence[AnyKernel]) -> list:
        from kiln.codegen.opencl.runtime import OpenCLKernel, context

        ctx = context(self.kind, self.index)
        limits = ctx.limits if self.options.subgroups == "auto" else self.limits()
        return [OpenCLKernel(emit_kernel(k, limits), ctx, k) for k in kernels]
