"""The Metal backend (Apple GPUs): Kernel IR -> Metal Shading Language -> device.

Stages, each dumpable by name (`kiln dump --target metal --stage source`):

    msl    the generated Metal Shading Language (emit.py, emit_gemm.py; needs no Mac)

Targets: "metal" / "metal:N" (and "mps", PyTorch's name for the same GPU). Generating and
printing MSL works everywhere; running it needs macOS with PyObjC's Metal bindings
(kiln/codegen/metal/runtime.py), and elsewhere `build` raises K410 saying so. The kinds
of kernel (pointwise, the five reductions, GEMM on simdgroup_matrix) are described in
emit.py; float64 is not a Metal type (K372 names it: convert to float32 first).

    print(kiln.dump(fn, x, stage="source", target="metal"))   # or: kiln dump --target metal
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from kiln.codegen.backend import Backend, Options
from kiln.codegen.kernel_ir import AnyKernel
from kiln.codegen.metal.emit import emit_kernel
from kiln.codegen.metal.scalar import DTYPES, SCALAR_TABLE
from kiln.errors import KilnArgumentError

_TARGET = re.compile(r"^(metal|mps)(?::(\d+))?$")


@dataclass(frozen=True)
class MetalOptions(Options):
    """Compile options (their text is in every cache key).

    fast_math: passed to MTLCompileOptions (False: every op rounds as numpy's do)."""

    fast_math: bool = False


def split_target(target: str) -> int:
    m = _TARGET.match(target)
    if m is None:
        raise KilnArgumentError(f"metal backend: target must be 'metal[:N]' or 'mps[:N]', got {target!r}")
    return int(m.group(2) or 0)


class MetalBackend(Backend):
    """Backend for "metal[:N]" / "mps[:N]". See the module docstring."""

    name = "metal"
    Options = MetalOptions
    stages = ("msl",)
    dump_stages = {"source": "msl"}
    keep = frozenset({"matmul"})  # matmul becomes the simdgroup_matrix GEMM with its epilogue
    scalar_table = SCALAR_TABLE
    dtypes = DTYPES

    def __init__(self, target: str = "metal", options: MetalOptions | None = None):
        self.index = split_target(target)
        super().__init__(target, options)

    @classmethod
    def supports(cls, target: str) -> bool:
        return _TARGET.match(target) is not None

    def comment(self, stage: str) -> str:
        return "//"

    def emit(self, kernel: AnyKernel):
        """The legalized kernel as MSL plus its launch shape (`EmittedKernel`)."""
        return emit_kernel(self.legalize(kernel))

    def render(self, kernel: AnyKernel, stage: str) -> str:
        return emit_kernel(kernel).source

    def build(self, kernels: Sequence[AnyKernel]) -> list:
        from kiln.codegen.metal.runtime import MetalKernel, metal_device

        dev = metal_device(self.index)
        return [MetalKernel(emit_kernel(k), dev, self.options.fast_math) for k in kernels]
