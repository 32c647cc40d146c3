"""Which launcher captures a backend's programs (`kn.capture`).

A launcher turns runs of a captured plan's ops into native code (see
kiln/runtime/capture.py). The CPU's is an LLVM launch list, OpenCL's an enqueue loop,
CUDA's a set of CUDA graphs (kiln/runtime/cuda_graphs.py); a backend without one is
still captured — its plan runs from Python over the captured buffers, with every size,
shape and buffer decided at capture time.
"""

from __future__ import annotations

from kiln.runtime.capture import Launcher


def launcher_for(backend: str) -> Launcher | None:
    """The native launcher for `backend`, or None."""
    if backend == "cpu":
        from kiln.codegen.cpu.launch_list import CpuLauncher

        return CpuLauncher()
    if backend.split(":")[0] in ("opencl", "xpu"):  # an enqueue loop per native run
        from kiln.codegen.opencl.launcher import OpenCLLauncher

        return OpenCLLauncher()
    if backend.split(":")[0] == "cuda":  # CUDA graphs through cuda-bindings
        from kiln.runtime.cuda_graphs import CudaGraphLauncher

        return CudaGraphLauncher()
    return None
