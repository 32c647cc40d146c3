"""Launching kiln's CuTeDSL GEMMs on CUDA device buffers: what the cuda backend runs for a
GEMM that select.py gave to CuTeDSL.

A compiled program hands its kernels device addresses, not framework tensors, so the
GEMM is compiled behind a host entry over raw pointers (`PointerEntry`): it lays the
(M, K, L) / (N, K, L) / (M, N, L) tensors over the addresses with the layouts of
layouts.py's plan, the epilogue's operands as flat tensors, and runs the kernel class's
own host code (TMA descriptors, grid, shared memory, launch). Extents the Kernel IR has
as numbers stay static, so the device code is byte for byte compile.py's ahead-of-time
artifact (tests/codegen/cute/test_launch.py compares the PTX); each distinct symbolic
extent (a size, or an operand's element count such as M*N) is one Int32 argument,
evaluated from the program's sizes at every launch.

`CuteGemmKernel(kernel, choice)` has the launch interface of the Triton backend's
kernels (`kernel(arrays, sizes)`, `launch_pointers(pointers, sizes, stream)`,
`launch_info(sizes)`): arrays in a cuda device's memory pass as their addresses with no
copy, other numpy arrays through counted device buffers (triton/runtime.py's
`kernel_arguments`). CuTeDSL's runtime (libcute_dsl_runtime through cuda-bindings) loads
the cubin into the current context on the first launch and launches it on `stream`.
Buffers a TMA cannot take (an address not 16-byte aligned, a wrong element count) are
K422 before anything reaches the GPU.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import sympy

from kiln.codegen.cute.compile import MAX_CTAS, _kernel_module, arch_env
from kiln.codegen.cute.layouts import gemm_layouts, numel
from kiln.codegen.kernel_ir import GemmKernel
from kiln.errors import KilnError
from kiln.ir.shapes import dim_function

TMA_ALIGN = 16  # bytes: a TMA tensor's base address


class KilnCuteLaunchError(KilnError, ValueError):
    code = "K422"
    title = "a CuTeDSL GEMM cannot launch on these buffers"


class Extents:
    """The extents of a GEMM's tensors: ints stay ints, each distinct symbolic extent gets
    a slot of the entry's `dims` argument, evaluated from the sizes at launch."""

    def __init__(self):
        self.symbolic: list = []
        self.functions: list = []

    def key(self, extent):
        """An int, or ("dim", slot) for a symbolic extent."""
        e = sympy.sympify(extent)
        if e.is_Integer:
            return int(e)
        if e not in self.symbolic:
            self.symbolic.append(e)
            self.functions.append(dim_function(e))
        return ("dim", self.symbolic.index(e))

    def values(self, sizes: Mapping[str, int]) -> tuple:
        """The symbolic extents' values for `sizes` (by size name)."""
        return tuple(int(f(sizes)) for f in self.functions)


def _resolve(shape: tuple, dims) -> tuple:
    return tuple(dims[s[1]] if isinstance(s, tuple) else s for s in shape)


def compact_strides(shape: tuple, order: tuple) -> tuple:
    """Element strides of a compact tensor of `shape` whose mode i is the order[i]-th
    fastest (0: unit stride), size-1 modes included, as CuTe's fake compact tensors
    (and numpy) have them: (M, K, L) with order (1, 0, 2) -> (K, 1, M * K). A stride
    that depends on a launch-time extent is 64-bit (M * K may pass 2^31), as the fake
    tensors' symbolic strides are; static ones stay Python ints."""
    import cutlass

    strides, step = [0] * len(shape), 1
    for mode in sorted(range(len(shape)), key=lambda i: order[i]):
        strides[mode] = step
        extent = shape[mode]
        step = step * (extent if isinstance(extent, int) else cutlass.Int64(extent))
    return tuple(strides)


def _make_entry_class():
    import cutlass.cute as cute

    class PointerEntry:
        """The host entry: (a, b, c, operands, dims, sizes, stream) as device addresses and Int32s."""

        def __init__(self, gemm, shapes: tuple, orders: tuple, operand_shapes: tuple, max_ctas: int):
            self.gemm, self.shapes, self.orders = gemm, shapes, orders
            self.operand_shapes, self.max_ctas = operand_shapes, max_ctas

        @cute.jit
        def __call__(self, a_ptr, b_ptr, c_ptr, operands, dims, sizes, stream):
            a, b, c = (cute.make_tensor(p, cute.make_layout(shape, stride=compact_strides(shape, order)))
                       for p, shape, order in zip((a_ptr, b_ptr, c_ptr), (_resolve(s, dims) for s in self.shapes),
                                                  self.orders))
            tensors = tuple(cute.make_tensor(p, cute.make_layout(_resolve(s, dims)))
                            for p, s in zip(operands, self.operand_shapes))
            self.gemm(a, b, c, tensors, sizes, self.max_ctas, stream)

    return PointerEntry


class CuteGemmKernel:
    """`kernel` compiled with CuTeDSL for `choice.arch` / `choice.tile`, launched on device
    addresses. Compiles on construction (seconds; no GPU needed to compile)."""

    def __init__(self, kernel: GemmKernel, choice, *, compile_now: bool = True):
        self.kernel, self.arch, self.tile = kernel, choice.arch, tuple(choice.tile)
        if self.arch not in MAX_CTAS:
            raise KilnCuteLaunchError(f"CuTeDSL GEMM {kernel.name}: no kernel for {self.arch} "
                                      f"(kiln's are for {', '.join(MAX_CTAS)})")
        from kiln.codegen.cute.epilogue import make_epilogue

        self.epilogue, self.operand_names, self.size_names = make_epilogue(kernel)
        plan = gemm_layouts(kernel)
        self.extents = Extents()
        self.shapes = tuple(tuple(self.extents.key(d) for d in s) for s in (plan.a_shape, plan.b_shape, plan.c_shape))
        self.orders = (plan.a_order, plan.b_order, (1, 0, 2))
        self.buffers = {b.name: b for b in kernel.buffers}
        self.index = {b.name: i for i, b in enumerate(kernel.buffers)}
        self.operand_shapes = tuple((self.extents.key(numel(self.buffers[n])),) for n in self.operand_names)
        self.outputs = [i for i, b in enumerate(kernel.buffers) if b.role == "out"]
        self.compiled = self.compile() if compile_now else None
        self.address = id(self)  # capture's mark that this kernel can be launched on a stream

    def _pointer(self, name: str, address: int, align: int):
        from cutlass.cute import AddressSpace
        from cutlass.cute.runtime import make_ptr

        from kiln.codegen.cute.epilogue import cutlass_type

        return make_ptr(cutlass_type(self.buffers[name].dtype), int(address), AddressSpace.gmem, assumed_align=align)

    def _align(self, name: str) -> int:
        return TMA_ALIGN if name in (self.kernel.a, self.kernel.b, self.kernel.out) else self.buffers[name].dtype.itemsize

    def compile(self):
        """The CuTeDSL-compiled entry (a JitCompiledFunction) for this kernel."""
        arch_env()
        import cutlass

        from kiln.codegen.cute.compile import run_compile

        module = _kernel_module(self.arch)
        gemm = (module.Sm100Gemm if self.arch == "sm_100a" else module.Sm90Gemm)(self.tile, self.epilogue)
        entry = _make_entry_class()(gemm, self.shapes, self.orders, self.operand_shapes, MAX_CTAS[self.arch])
        # stand-in addresses: compiling reads only their types and alignments
        names = (self.kernel.a, self.kernel.b, self.kernel.out)
        ptrs = tuple(self._pointer(n, 1 << 20, self._align(n)) for n in names)
        operands = tuple(self._pointer(n, 1 << 20, self._align(n)) for n in self.operand_names)
        dims = tuple(cutlass.Int32(1) for _ in self.extents.symbolic) or (cutlass.Int32(0),)
        sizes = tuple(cutlass.Int32(1) for _ in self.size_names) or (cutlass.Int32(0),)
        compiled, self.compile_seconds = run_compile(entry, (*ptrs, operands, dims, sizes), self.arch)
        return compiled

    def extents_of(self, sizes: Mapping[str, int]) -> dict:
        """{"m", "n", "k", "batch"} for `sizes`."""
        return {what: int(dim_function(getattr(self.kernel, what))(sizes)) for what in ("m", "n", "k", "batch")}

    def launch_info(self, sizes: Mapping[str, int]) -> tuple:
        """(size values, output tiles, parallel) for capture (kiln/runtime/capture.py)."""
        d = self.extents_of(sizes)
        tiles = -(-d["m"] // self.tile[0]) * -(-d["n"] // self.tile[1]) * d["batch"]
        return tuple(int(sizes[s]) for s in self.size_names), tiles, False

    def arguments(self, pointers: Sequence[int], sizes: Mapping[str, int]) -> tuple:
        """The entry's arguments (a, b, c, operands, dims, sizes) over buffer addresses in
        `kernel.buffers` order; K422 for an address TMA or the epilogue cannot take."""
        import cutlass

        for name in (self.kernel.a, self.kernel.b, self.kernel.out, *self.operand_names):
            address, align = int(pointers[self.index[name]]), self._align(name)
            if address == 0 or address % align:
                raise KilnCuteLaunchError(
                    f"CuTeDSL GEMM {self.kernel.name}: buffer {name!r} is at {address:#x}, which is not "
                    f"{align}-byte aligned" + (" (a TMA tensor's base address must be)" if align == TMA_ALIGN else ""),
                    hint="kiln's allocators align every buffer to 256 bytes; an offset view of another "
                         "buffer cannot be a GEMM operand here (copy it, or force KILN_CUDA_GEMM=triton)")
        ptr = lambda n: self._pointer(n, pointers[self.index[n]], self._align(n))  # noqa: E731
        dims = tuple(cutlass.Int32(v) for v in self.extents.values(sizes)) or (cutlass.Int32(0),)
        values = tuple(cutlass.Int32(int(sizes[s])) for s in self.size_names) or (cutlass.Int32(0),)
        return (ptr(self.kernel.a), ptr(self.kernel.b), ptr(self.kernel.out),
                tuple(ptr(n) for n in self.operand_names), dims, values)

    def check_arrays(self, arrays: Sequence, sizes: Mapping[str, int]) -> None:
        """K422 unless every array holds its buffer's element count of its dtype's size."""
        for b, a in zip(self.kernel.buffers, arrays):
            expected = int(dim_function(numel(b))(sizes))
            size, itemsize = getattr(a, "size", None), getattr(getattr(a, "dtype", None), "itemsize", None)
            if size is not None and (size != expected or itemsize != b.dtype.itemsize):
                raise KilnCuteLaunchError(
                    f"CuTeDSL GEMM {self.kernel.name}: buffer {b.name!r} should hold {expected} elements of "
                    f"{b.dtype.itemsize} bytes ({b.dtype.name}), got {size} of {itemsize}")

    def launch_pointers(self, pointers: Sequence[int], sizes: Mapping[str, int], stream: int | None = None) -> None:
        """Launch on device addresses (no copies), asynchronously on `stream` (None: the
        default stream)."""
        d = self.extents_of(sizes)
        if d["m"] == 0 or d["n"] == 0 or d["batch"] == 0:
            return
        from cuda.bindings import driver

        self.compiled(*self.arguments(pointers, sizes), driver.CUstream(int(stream or 0)))

    def __call__(self, arrays: Sequence, sizes: Mapping[str, int]) -> None:
        from kiln.codegen.triton.runtime import _address, kernel_arguments

        self.check_arrays(arrays, sizes)
        device_args, copies = kernel_arguments(self.kernel.name, arrays, self.outputs, "cuda")
        self.launch_pointers([_address(a) for a in device_args], sizes)
        if copies:
            from kiln.runtime.transfers import record

            for host, buf in copies:
                buf.to_array(host)
                record("device_to_host", host.nbytes)
