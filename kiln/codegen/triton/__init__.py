"""The Triton backend: Kernel IR -> Triton source -> PTX/cubin (NVIDIA) or AMDGCN/hsaco (AMD).

targets.py    target names ("sm_90", "gfx942", "cuda", "rocm:gfx950") and K165, without triton
emit.py       Kernel IR -> Triton source: pointwise and reduction kernels (one @triton.jit each)
emit_gemm.py  GemmKernel -> a tl.dot loop with the epilogue fused
emit_expr.py  scalar expressions over a tile; scalar.py: dtypes and primitives as Triton
tiling.py     block sizes, warps and stages (`_tiles`, the tile selector's seam)
aot.py        ahead-of-time compilation for an explicit GPU target, cached on disk
backend.py    TritonBackend: options, named stages, compile_many
runtime.py    device buffers and launches on a GPU; the CPU interpreter path

Importing this package imports no triton; the modules that need it import it themselves
(aot.py and runtime.py).
"""
