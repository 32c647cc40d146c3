"""CuTeDSL GEMMs for NVIDIA GPUs (nvidia-cutlass-dsl), compiled ahead of time without a GPU.

The Triton backend hands target cuda's GEMM templates here when select.py allows
(cuda_gemm.py is that seam); compile.py builds PTX + cubin for sm_90a with fake
tensors, sm90_gemm.py is the kernel, epilogue.py turns the Kernel IR epilogue into the
per-element function the kernel applies. See docs/cute-backend.md.
"""
