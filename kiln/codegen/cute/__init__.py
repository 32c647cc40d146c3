"""CuTeDSL GEMMs for NVIDIA GPUs (nvidia-cutlass-dsl), compiled ahead of time without a GPU.

The Triton backend hands target cuda's GEMM templates here when select.py allows
(cuda_gemm.py is that seam); compile.py builds PTX + cubin for sm_90a / sm_100a with
fake tensors; sm90_gemm.py (wgmma) and sm100_gemm.py (tcgen05) are the kernels (their
shared tile and pipeline setup in builders.py),
epilogue.py turns the Kernel IR epilogue into the per-element function they apply. See docs/cute-backend.md.
"""
