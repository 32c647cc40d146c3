"""The registered backends: one registration line each (kiln/codegen/backend.py is the contract).

"cpu" is the LLVM backend; "reference" runs Kernel IR with numpy (the oracle, and a way
to test lowering without LLVM); "cuda" and "rocm" are the Triton backend
(kiln/codegen/triton), optionally with an architecture: "cuda:sm_100", "rocm:gfx950"
(default sm_90 / gfx942 ahead of time, the GPU present when running). A backend's
module is imported only when it is first asked for, so `import kiln` stays fast.

    >>> get_backend("cuda:sm_100").name
    'triton'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence

from kiln.codegen.backend import Backend, get_backend, register_backend, registered_backends  # noqa: F401
from kiln.codegen.kernel_ir import REDUCE_OPS, AnyKernel


class _RegistryTable(Mapping):
    """Every elementwise op of the registry, by name, to its numpy reference, plus every
    Kernel IR reduction: the reference backend runs them all as they are defined."""

    def _ops(self) -> dict:
        from kiln.ir import registry
        from kiln.ir.registry import ELEMENTWISE

        ops = {n: o.reference for n, o in registry.all_ops().items() if o.kind == ELEMENTWISE}
        ops.update({f"reduce.{r}": r for r in REDUCE_OPS})
        return ops

    def __getitem__(self, key: str):
        return self._ops()[key]

    def __iter__(self):
        return iter(self._ops())

    def __len__(self) -> int:
        return len(self._ops())


class ReferenceBackend(Backend):
    """Kernel IR evaluated by numpy (kiln.codegen.kernel_eval)."""

    name = "reference"
    stages = ("kernel",)
    dump_stages = {"source": "kernel", "llvm-optimized": "kernel", "asm": "kernel"}
    scalar_table = _RegistryTable()

    def build(self, kernels: Sequence[AnyKernel]) -> list:
        from kiln.codegen.kernel_eval import run_kernel

        def make(kernel):
            return lambda arrays, sizes: run_kernel(kernel, arrays, sizes)

        return [make(k) for k in kernels]

    def render(self, kernel: AnyKernel, stage: str) -> str:
        from kiln.codegen.kernel_ir import format_kernel

        return format_kernel(kernel)


def _triton_supports(target: str) -> bool:
    from kiln.codegen.triton.targets import supports

    return supports(target)


register_backend("cpu", "kiln.codegen.cpu.backend:CpuBackend")
register_backend("reference", ReferenceBackend)
register_backend("triton", "kiln.codegen.triton.backend:TritonBackend", supports=_triton_supports,
                 example="cuda, rocm")
register_backend("opencl", "kiln.codegen.opencl.backend:OpenCLBackend", supports=lambda t: t.split(":")[0] in ("opencl", "xpu"))
register_backend("metal", "kiln.codegen.metal.backend:MetalBackend", supports=lambda t: t.split(":")[0] in ("metal", "mps"))

TARGETS = ("cpu", "reference", "cuda", "rocm")
