"""Backend lookup: the object that turns Kernel IR into callables for a target.

Each backend has `supports(target)` and `compile_many(kernels) -> [fn, ...]` (one per
kernel, in order) where `fn(arrays, sizes)` runs the kernel in place. "cpu" is the LLVM backend; "reference"
runs Kernel IR with numpy (the oracle, and a way to test lowering without LLVM);
"cuda" and "rocm" are the Triton backend (kiln/codegen/triton), optionally with an
architecture: "cuda:sm_100", "rocm:gfx950" (default sm_90 / gfx942 ahead of time, the
GPU present when running). GPU backends are imported only when asked for, so
`import kiln` stays fast.
"""

from __future__ import annotations

from functools import lru_cache

from kiln.errors import KilnArgumentError


class ReferenceBackend:
    """Kernel IR evaluated by numpy (kiln.codegen.kernel_eval)."""

    name = "reference"

    @staticmethod
    def supports(target: str) -> bool:
        return target == "reference"

    def compile_many(self, kernels) -> list:
        from kiln.codegen.kernel_eval import run_kernel

        def make(kernel):
            return lambda arrays, sizes: run_kernel(kernel, arrays, sizes)

        return [make(k) for k in kernels]

    def stage_text(self, kernel, stage: str) -> str:
        from kiln.codegen.kernel_ir import format_kernel

        return format_kernel(kernel)


TARGETS = ("cpu", "reference", "cuda", "rocm")


@lru_cache(maxsize=None)
def get_backend(target: str):
    """The backend object for `target` (created once per process)."""
    if target == "reference":
        return ReferenceBackend()
    if target == "cpu":
        from kiln.codegen.cpu.backend import CpuBackend

        return CpuBackend()
    from kiln.codegen.triton.targets import supports

    if supports(target):
        from kiln.codegen.triton.backend import TritonBackend

        return TritonBackend(target)
    raise KilnArgumentError(f"compile: unknown backend {target!r}; kiln compiles for "
                            f"{', '.join(TARGETS)} (and 'cuda:ARCH' / 'rocm:ARCH', e.g. 'cuda:sm_100')")
