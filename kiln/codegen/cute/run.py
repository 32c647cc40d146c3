"""Running a CuTeDSL GEMM on real buffers: what a GPU session (scripts/gpu_check_cute.py)
uses to launch the kernels compile.py builds ahead of time.

`bind(kernel, arrays)` turns the kernel's buffers (DLPack-capable arrays: torch tensors
on the GPU, or on the CPU to check the binding) into the arguments the kernel class
takes: A as (M, K, L), B as (N, K, L), C as (M, N, L) views of the same memory (no
copies; a batch dimension of 1 is added where the buffer has none), the epilogue's
operands flat, and the symbolic sizes as Int32. `GemmLauncher` compiles once for those
arguments' layouts and launches on a CUDA stream:

    launch = GemmLauncher(kernel, "sm_90a", (128, 256), arrays)   # compiles
    launch(arrays, stream)                                        # runs (GPU only)
"""

from __future__ import annotations

from typing import Mapping

from kiln.codegen.cute.compile import MAX_CTAS, _kernel_module, arch_env
from kiln.codegen.cute.epilogue import make_epilogue
from kiln.codegen.cute.layouts import gemm_layouts
from kiln.codegen.kernel_ir import GemmKernel
from kiln.ir.shapes import dim_function


def _size(expr, sizes: Mapping[str, int]) -> int:
    return int(dim_function(expr)(sizes))  # kiln's size symbols (integer, nonnegative), by name


def bind(kernel: GemmKernel, arrays: Mapping, sizes: Mapping[str, int] | None = None) -> tuple:
    """(a, b, c, operands, sizes) CuTe tensors/values for `kernel` over `arrays` (by buffer name)."""
    arch_env()
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    sizes = dict(sizes or {})
    plan = gemm_layouts(kernel)
    m, n, k = (_size(d, sizes) for d in (kernel.m, kernel.n, kernel.k))
    batch = _size(kernel.batch, sizes)

    def view(x, rows, cols, row_major: bool):
        """(rows, cols, L) over a contiguous buffer of L row- (or column-) major matrices."""
        if row_major:
            return x.reshape(batch, rows, cols).permute(1, 2, 0)
        return x.reshape(batch, cols, rows).permute(2, 1, 0)

    a = view(arrays[kernel.a], m, k, plan.a_k_major)
    b = view(arrays[kernel.b], k, n, not plan.b_k_major).permute(1, 0, 2)  # (K, N, L) -> (N, K, L)
    c = view(arrays[kernel.out], m, n, True)
    _, operand_names, size_names = make_epilogue(kernel)
    tensors = [from_dlpack(t, assumed_align=16) for t in (a, b, c)]
    operands = tuple(from_dlpack(arrays[name].reshape(-1), assumed_align=arrays[name].element_size())
                     for name in operand_names)
    values = tuple(cutlass.Int32(sizes[s]) for s in size_names) or (cutlass.Int32(0),)
    return (*tensors, operands, values)


class GemmLauncher:
    """One CuTeDSL GEMM compiled for real arguments' layouts; call it to launch."""

    def __init__(self, kernel: GemmKernel, arch: str, tile: tuple, arrays: Mapping,
                 sizes: Mapping[str, int] | None = None):
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        self.kernel, self.sizes = kernel, dict(sizes or {})
        fn, _, _ = make_epilogue(kernel)
        module = _kernel_module(arch)
        gemm = (module.Sm100Gemm if arch == "sm_100a" else module.Sm90Gemm)(tuple(tile), fn)
        a, b, c, operands, values = bind(kernel, arrays, self.sizes)
        self.compiled = cute.compile(gemm, a, b, c, operands, values, MAX_CTAS[arch], make_fake_stream(),
                                     options=f"--gpu-arch {arch}")

    def __call__(self, arrays: Mapping, stream) -> None:
        """Launch on `stream` (a `cuda.bindings.driver.CUstream`) over `arrays`."""
        a, b, c, operands, values = bind(self.kernel, arrays, self.sizes)
        self.compiled(a, b, c, operands, values, stream)


class GroupedLauncher:
    """The MoE grouped GEMM (compile.compile_grouped_gemm's kernels) compiled for real tensors:
    x [T, K], w [E, K, N] (or [E, N, K] with transpose_rhs), y [T, N], group_sizes int32 [E],
    optional bias [E, N] and row_scale [T]; call it with the same tensors and a stream."""

    def __init__(self, arch: str, x, w, y, group_sizes, *, bias=None, row_scale=None, activation: str = "none",
                 alpha: float = 1.0, transpose_rhs: bool = False, tile: tuple = (128, 128)):
        arch_env()
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from kiln.codegen.cute import grouped_gemm, sm90_grouped

        self.arch, self.transpose_rhs = arch, transpose_rhs
        kind = grouped_gemm.Sm100GroupedGemm if arch == "sm_100a" else sm90_grouped.Sm90GroupedGemm
        gemm = kind(tuple(tile), activation, alpha, bias is not None, row_scale is not None)
        self.dummy = x.new_zeros((1, 1)).float()  # stands in for an absent bias / row_scale (never read)
        args = self._args(x, w, y, group_sizes, bias, row_scale)
        extra = (MAX_CTAS[arch],) if arch == "sm_90a" else ()
        self.compiled = cute.compile(gemm, *args, *extra, make_fake_stream(), options=f"--gpu-arch {arch}")

    def _args(self, x, w, y, group_sizes, bias, row_scale) -> tuple:
        from cutlass.cute.runtime import from_dlpack

        t, k = x.shape
        wv = w.permute(1, 2, 0) if self.transpose_rhs else w.permute(2, 1, 0)  # (N, K, E)
        b = bias if bias is not None else self.dummy
        r = row_scale if row_scale is not None else self.dummy.reshape(-1)
        return (from_dlpack(x.reshape(1, t, k).permute(1, 2, 0), assumed_align=16), from_dlpack(wv, assumed_align=16),
                from_dlpack(y.reshape(1, *y.shape).permute(1, 2, 0), assumed_align=16),
                from_dlpack(group_sizes, assumed_align=4), from_dlpack(b, assumed_align=4),
                from_dlpack(r, assumed_align=4))

    def __call__(self, x, w, y, group_sizes, stream, *, bias=None, row_scale=None) -> None:
        self.compiled(*self._args(x, w, y, group_sizes, bias, row_scale), stream)

