"""Launching kiln's CuTeDSL GEMMs on device addresses (kiln/codegen/cute/launch.py), checked
without a GPU: the pointer entry compiles to exactly the ahead-of-time kernel (same PTX),
symbolic extents become launch-time Int32s evaluated from the sizes, and a launch hands
CuTeDSL's runtime the buffers' addresses with their element types and alignments, the
extents and sizes, and a CUDA stream — recorded here by a stand-in for the compiled
function. Buffers a TMA cannot take are K422 before anything reaches the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.cute.compile import compile_gemm
from kiln.codegen.cute.launch import CuteGemmKernel, KilnCuteLaunchError
from kiln.codegen.cute.select import Choice
from kiln.ir.shapes import symbol
from tests.codegen.cute.gemms import full_epilogue, gemm


def cute(arch: str, tile=(128, 128)) -> Choice:
    return Choice("cute", "test", arch, tile)


class Recorder:
    """Stands in for CuTeDSL's compiled function: records each launch's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def aligned(shape, dtype, align=256):
    """A C-contiguous array whose data starts at an `align`-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@pytest.mark.parametrize("arch, make", [("sm_90a", full_epilogue), ("sm_100a", gemm)])
def test_pointer_entry_compiles_to_the_ahead_of_time_kernel(arch, make):
    k = make()
    launched = CuteGemmKernel(k, cute(arch))
    assert launched.compiled.artifacts.PTX == compile_gemm(k, arch, (128, 128)).ptx


def test_a_launch_passes_addresses_extents_sizes_and_a_stream():
    from cutlass import Float32, Int32

    m = symbol("M")
    k = full_epilogue(m, 512, 384)  # M symbolic: a (M, 384), row_scale [M], res [M * 512]
    launched = CuteGemmKernel(k, cute("sm_90a"))
    assert "wgmma.mma_async" in launched.compiled.artifacts.PTX
    assert launched.extents.symbolic == [m, m * 512]  # one launch-time Int32 each
    launched.compiled = Recorder()
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    shapes = {"a": ((300, 384), bf16), "b": ((384, 512), bf16), "bias": ((512,), bf16),
              "row_scale": ((300,), np.float32), "col_scale": ((512,), np.float32), "res": ((300, 512), bf16),
              "y": ((300, 512), bf16)}
    arrays = {name: aligned(*shapes[name]) for name in shapes}
    pointers = [arrays[b.name].ctypes.data for b in k.buffers]
    launched.launch_pointers(pointers, {"M": 300}, stream=0)
    (a, b, c, operands, dims, sizes, stream), = launched.compiled.calls
    for ptr, name in ((a, "a"), (b, "b"), (c, "y")):
        assert ptr._pointer == arrays[name].ctypes.data and ptr._assumed_align == 16
    assert [p._pointer for p in operands] == [arrays[n].ctypes.data for n in ("bias", "row_scale", "col_scale", "res")]
    assert operands[1].dtype is Float32 and operands[1]._assumed_align == 4
    assert [int(d) for d in dims] == [300, 300 * 512] and all(isinstance(d, Int32) for d in dims)
    assert [int(s) for s in sizes] == [300]
    assert int(stream) == 0
    assert launched.launch_info({"M": 300}) == ((300,), 3 * 4, False)  # ceil(300/128) x 512/128 tiles


def test_empty_problems_launch_nothing():
    launched = CuteGemmKernel(gemm(symbol("M"), 256, 128), cute("sm_100a"), compile_now=False)
    launched.compiled = Recorder()
    launched.launch_pointers([1 << 20] * 3, {"M": 0})
    assert launched.compiled.calls == []


def test_buffers_tma_cannot_take_are_k422():
    k = full_epilogue()
    launched = CuteGemmKernel(k, cute("sm_90a"), compile_now=False)
    launched.compiled = Recorder()
    good = [1 << 20] * len(k.buffers)
    bad = list(good)
    bad[[b.name for b in k.buffers].index("b")] += 8
    with pytest.raises(KilnCuteLaunchError, match=r"\[K422\] CuTeDSL GEMM gemm_epilogue: buffer 'b' is at "
                                                  r"0x100008, which is not 16-byte aligned \(a TMA"):
        launched.launch_pointers(bad, {})
    arrays = [np.zeros(int(np.prod([int(d) for d in b.shape])), np.uint16 if b.dtype.itemsize == 2 else np.float32)
              for b in k.buffers]
    arrays[0] = arrays[0][:-1]
    with pytest.raises(KilnCuteLaunchError, match=r"buffer 'a' should hold 98304 elements of 2 bytes \(bfloat16\), "
                                                  r"got 98303 of 2"):
        launched.check_arrays(arrays, {})
    assert launched.compiled.calls == []


def test_the_cuda_backend_runs_cute_gemms_on_the_gpu_present(monkeypatch):
    """TritonBackend.build on an (imitated) sm_90 GPU: an aligned GEMM becomes a
    CuteGemmKernel compiled for sm_90a, an unaligned one and KILN_CUDA_GEMM=triton stay Triton."""
    from triton.backends.compiler import GPUTarget

    from kiln.codegen.triton import runtime
    from kiln.codegen.triton.backend import TritonBackend, TritonOptions

    monkeypatch.setattr(runtime, "interpreter_active", lambda: False)
    monkeypatch.setattr(runtime, "device_target", lambda vendor: GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(runtime, "GpuKernel", lambda kernel, *args: ("triton", kernel.name))
    aligned_gemm, unaligned = gemm(name="aligned"), gemm(n=500, name="unaligned")  # 500 bf16: 1000-byte rows
    built = TritonBackend("cuda").build([aligned_gemm, unaligned])
    from kiln.codegen.cute.select import choose

    assert isinstance(built[0], CuteGemmKernel) and built[0].arch == "sm_90a"
    assert built[0].tile == choose(aligned_gemm, "sm_90").tile  # the selector's tile
    assert "wgmma.mma_async" in built[0].compiled.artifacts.PTX
    assert built[1] == ("triton", "unaligned")
    forced = TritonBackend("cuda", TritonOptions(cuda_gemm="triton")).build([aligned_gemm])
    assert forced == [("triton", "aligned")]


@pytest.mark.parametrize("a_rows, b_rows, batch", [(True, True, 1), (False, True, 3), (True, False, 2)])
def test_entry_layouts_are_the_buffers_numpy_layouts(a_rows, b_rows, batch):
    """The (shape, strides) the entry lays over each address are those of the buffer's own
    memory viewed as (M, K, L) / (N, K, L) / (M, N, L) (run.bind's torch views, no copy)."""
    import torch

    from kiln.codegen.cute.launch import compact_strides
    from kiln.codegen.cute.run import bind

    k = gemm(128, 64, 256, a_rows=a_rows, b_rows=b_rows, batch=batch)
    launched = CuteGemmKernel(k, cute("sm_90a"), compile_now=False)
    arrays = {b.name: torch.zeros(tuple(int(d) for d in b.shape), dtype=torch.bfloat16) for b in k.buffers}
    views = bind(k, arrays)[:3]
    for view, shape, order in zip(views, launched.shapes, launched.orders):
        assert (tuple(view.shape), tuple(view.stride)) == (shape, compact_strides(shape, order))
