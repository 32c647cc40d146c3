"""Running generated Triton kernels: on a GPU, or on the CPU through Triton's interpreter.

On a GPU (`GpuKernel`): each kernel is compiled with `triton.compile` for the GPU of
this machine (specialized, as Triton's JIT does, on 16-byte aligned pointers and sizes
that are multiples of 16) and launched through Triton's own launcher. What a launch
needs at run time:

- NVIDIA: the driver (libcuda.so.1) and the triton package; no torch. Device memory
  comes from the CUDA driver API through ctypes (`DeviceBuffer`).
- AMD: ROCm (libamdhip64.so) and triton; Triton's HIP driver only activates where a
  ROCm build of torch is importable, so that torch is needed too.

Arrays in a kiln device's memory (the `cuda`/`rocm` device kinds' managed segments,
kiln/runtime/gpu_devices.py: what a compiled program on device tensors hands its
kernels, kiln/runtime/device_programs.py) go to the kernel as their device pointers,
with no copy. Any other numpy array is host memory: it is copied to a device buffer,
and an output copied back, each copy counted (kiln/runtime/transfers.py). Device buffers
(`DeviceBuffer`, or anything with `data_ptr()` returning a device address: torch CUDA
tensors, CuPy arrays via a wrapper) launch in place too.

On the CPU (`InterpretedKernel`): in a process started with TRITON_INTERPRET=1 (set
before triton is imported), the same source runs through Triton's interpreter on CPU
torch tensors that share memory with the numpy arrays. Two gaps of the interpreter
are filled so that it computes what the GPU computes: libdevice has no interpreter
implementation (its functions are bound to numpy equivalents), and its conversions
to and from bfloat16 / float8 and its bfloat16 `tl.dot` work on the bits instead of the
values (they are replaced by ml_dtypes' round-to-nearest-even conversions, as `cvt.rn`
does on the GPU, and a float32 product of the values). Reductions with kiln's combine
helpers (NaN-propagating max/min, prod, and, or) run as one numpy reduction instead of
the interpreter's element-by-element calls of the combine function.
"""

from __future__ import annotations

import ctypes
import math
import threading
import types
from typing import Sequence

import numpy as np

from kiln.codegen.triton.emit import EmittedKernel
from kiln.ir.shapes import dim_function


def interpreter_active() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (its library is interpreted)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def device_target(vendor: str):
    """The triton GPUTarget of this machine's GPU for "cuda" / "rocm", or None."""
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception:  # no driver, no device, or a driver of the other vendor: nothing to run on
        return None
    want = "cuda" if vendor == "cuda" else "hip"
    return target if target.backend == want else None


def grid_size(emitted: EmittedKernel, sizes: dict) -> int:
    total = 1
    for extent, block in emitted.grid:
        total *= -(-dim_function(extent)(sizes) // block)
    return total


# -- device memory ----------------------------------------------------------------------------

class _Cuda:
    """The few CUDA driver API calls a buffer needs (in the primary context triton uses)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2"):
            getattr(self.lib, name).restype = ctypes.c_int

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"CUDA driver: {what} failed with error {status}")

    def alloc(self, nbytes: int) -> int:
        from triton.runtime import driver

        driver.active.get_current_device()  # makes the primary context current in this thread
        ptr = ctypes.c_uint64(0)
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self.lib.cuMemFree_v2(ctypes.c_uint64(ptr))

    def upload(self, ptr: int, host: np.ndarray) -> None:
        self._check(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), host.ctypes.data_as(ctypes.c_void_p),
                                             ctypes.c_size_t(host.nbytes)), "cuMemcpyHtoD")

    def download(self, host: np.ndarray, ptr: int) -> None:
        # synchronous: waits for the kernels launched before it on the default stream
        self._check(self.lib.cuMemcpyDtoH_v2(host.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(ptr),
                                             ctypes.c_size_t(host.nbytes)), "cuMemcpyDtoH")


class _Hip:
    """The HIP runtime calls a buffer needs."""

    def __init__(self):
        self.lib = ctypes.CDLL("libamdhip64.so")

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"HIP runtime: {what} failed with error {status}")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p(0)
        self._check(self.lib.hipMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "hipMalloc")
        return ptr.value or 0

    def free(self, ptr: int) -> None:
        self.lib.hipFree(ctypes.c_void_p(ptr))

    def upload(self, ptr: int, host: np.ndarray) -> None:
        self._check(self.lib.hipMemcpy(ctypes.c_void_p(ptr), host.ctypes.data_as(ctypes.c_void_p),
                                       ctypes.c_size_t(host.nbytes), 1), "hipMemcpy H2D")

    def download(self, host: np.ndarray, ptr: int) -> None:
        self._check(self.lib.hipMemcpy(host.ctypes.data_as(ctypes.c_void_p), ctypes.c_void_p(ptr),
                                       ctypes.c_size_t(host.nbytes), 2), "hipMemcpy D2H")


_MEMORY: dict = {}
_MEMORY_LOCK = threading.Lock()


def _memory(vendor: str):
    with _MEMORY_LOCK:
        if vendor not in _MEMORY:
            _MEMORY[vendor] = _Cuda() if vendor == "cuda" else _Hip()
        return _MEMORY[vendor]


class DeviceBuffer:
    """`nbytes` of device memory, freed with the object; `data_ptr()` is what triton's
    launcher reads.

        >>> buf = DeviceBuffer.from_array(x, "cuda")        # doctest: +SKIP
        >>> kernel([buf, out_buf], sizes); out_buf.to_array(out)  # doctest: +SKIP
    """

    def __init__(self, nbytes: int, vendor: str = "cuda"):
        self.nbytes, self.vendor = int(nbytes), vendor
        self._mem = _memory(vendor)
        # a zero-byte allocation fails in both APIs; 16 keeps the pointer valid and aligned
        self.ptr = self._mem.alloc(max(self.nbytes, 16))

    @classmethod
    def from_array(cls, array: np.ndarray, vendor: str = "cuda") -> "DeviceBuffer":
        buf = cls(array.nbytes, vendor)
        buf.upload(array)
        return buf

    def data_ptr(self) -> int:
        return self.ptr

    def upload(self, array: np.ndarray) -> None:
        if array.nbytes:
            self._mem.upload(self.ptr, np.ascontiguousarray(array))

    def to_array(self, out: np.ndarray) -> np.ndarray:
        """Copy the buffer into the contiguous numpy array `out` (and return it)."""
        if out.nbytes:
            self._mem.download(out, self.ptr)
        return out

    def __del__(self):
        if getattr(self, "ptr", 0):
            self._mem.free(self.ptr)
            self.ptr = 0


def _address(arg) -> int:
    return arg.data_ptr() if hasattr(arg, "data_ptr") else 0


class DevicePointer:
    """A kiln device array's address, as a kernel argument (no copy)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def kernel_arguments(name: str, arrays: Sequence, outputs, vendor: str) -> tuple[list, list]:
    """(launch arguments, (host array, device buffer) pairs to copy back after the launch).
    An array in a `cuda`/`rocm` device's memory passes as its pointer; another numpy
    array goes through a device buffer (uploaded unless it is an output: kernels write
    outputs whole), counted."""
    from kiln.runtime.device import memory_owner
    from kiln.runtime.transfers import record

    kinds = ("cuda",) if vendor == "cuda" else ("rocm",)
    device_args, copies = [], []
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            device_args.append(a)
            continue
        if memory_owner(a, kinds) is not None:
            device_args.append(DevicePointer(a.__array_interface__["data"][0]))
            continue
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: buffer {i} is not C-contiguous")
        buf = DeviceBuffer(a.nbytes, vendor)
        if i not in outputs:  # outputs are written whole by the kernel
            buf.upload(a)
            record("host_to_device", a.nbytes)
        else:
            copies.append((a, buf))
        device_args.append(buf)
    return device_args, copies


# -- launching on a GPU -----------------------------------------------------------------------

class GpuKernel:
    """One generated kernel on this machine's GPU: `kernel(arrays, sizes)` runs it."""

    def __init__(self, kernel, emitted: EmittedKernel, gpu_target, vendor: str, compile_options: dict):
        from kiln.codegen.triton.aot import as_jit_function, load_source

        self.kernel, self.emitted, self.target, self.vendor = kernel, emitted, gpu_target, vendor
        self.options = dict(compile_options, num_warps=emitted.num_warps, num_stages=emitted.num_stages)
        self.jit_fn = as_jit_function(load_source(emitted.source, emitted.name))
        self.variants: dict = {}
        self.lock = threading.Lock()
        names = list(emitted.signature)
        self.pointer_args = names[:len(emitted.buffers)]
        self.size_args = names[len(emitted.buffers):len(emitted.buffers) + len(emitted.sizes)]
        self.outputs = [i for i, b in enumerate(kernel.buffers) if b.role == "out"]
        self.compile_variant(tuple(self.pointer_args))  # the aligned variant, so errors show at compile time
        # capture's mark that this kernel can join a CUDA graph (kiln/runtime/cuda_graphs.py
        # launches it on the capture stream; nothing calls the value as a function address)
        self.address = id(self)

    def launch_info(self, sizes: dict) -> tuple:
        """(size values, programs, parallel) for capture (kiln/runtime/capture.py)."""
        return tuple(int(sizes[s]) for s in self.emitted.sizes), grid_size(self.emitted, sizes), False

    def compile_variant(self, divisible: tuple):
        """The compiled kernel for one specialization (which arguments are multiples of 16)."""
        with self.lock:
            if divisible not in self.variants:
                from kiln.codegen.triton.aot import compile_kernel

                e = self.emitted
                self.variants[divisible] = compile_kernel(self.jit_fn, e.signature, e.constexprs, self.target,
                                                          self.options, divisible)
            return self.variants[divisible]

    def __call__(self, arrays: Sequence, sizes: dict) -> None:
        e = self.emitted
        programs = grid_size(e, sizes)
        if programs == 0:
            return
        device_args, copies = kernel_arguments(e.name, arrays, self.outputs, self.vendor)
        self.launch_pointers([_address(a) for a in device_args], sizes)
        if copies:
            from kiln.runtime.transfers import record

            for host, buf in copies:
                buf.to_array(host)
                record("device_to_host", host.nbytes)


    def launch_pointers(self, pointers: Sequence[int], sizes: dict, stream: int | None = None) -> None:
        """Launch on device addresses (no copies), asynchronously, on `stream` (None:
        triton's current stream): what a CUDA-graph capture records."""
        e = self.emitted
        programs = grid_size(e, sizes)
        if programs == 0:
            return
        size_values = [int(sizes[s]) for s in e.sizes]
        divisible = tuple(n for n, a in zip(self.pointer_args, pointers) if a % 16 == 0)
        divisible += tuple(n for n, v in zip(self.size_args, size_values) if v % 16 == 0)
        compiled = self.compile_variant(divisible)
        args = list(pointers) + size_values + [e.constexprs[b] for b in e.constexprs]
        if stream is None:
            compiled[(programs, 1, 1)](*args)
        else:
            compiled[(programs, 1, 1)](*args, stream=stream)


# -- the CPU interpreter ----------------------------------------------------------------------

def _interpreter_libdevice():
    """libdevice for Triton's interpreter: numpy with the same IEEE semantics."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def lift(fn):
        def call(*args):
            data = [a.handle.data if hasattr(a, "handle") else np.asarray(a) for a in args]
            like = next(a for a in args if hasattr(a, "handle"))  # a literal argument takes its type
            with np.errstate(all="ignore"):
                out = np.asarray(fn(*data)).astype(like.handle.data.dtype)
            return tl.core.tensor(TensorHandle(out, like.handle.dtype.scalar), like.type)
        return call

    erf = np.vectorize(math.erf, otypes=[np.float64])
    table = {"exp": np.exp, "expm1": np.expm1, "log": np.log, "log1p": np.log1p, "sin": np.sin,
             "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan,
             "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh, "erf": lambda x: erf(x),
             "pow": np.power, "atan2": np.arctan2, "fmod": np.fmod, "rint": np.rint, "trunc": np.trunc}
    return types.SimpleNamespace(**{name: lift(fn) for name, fn in table.items()})


_EXACT_CASTS_INSTALLED = []


def _install_exact_casts() -> None:
    """Make the interpreter's casts (and dots) that involve bfloat16 / float8 work on values."""
    if _EXACT_CASTS_INSTALLED:
        return
    import ml_dtypes
    import triton.language as tl
    from triton.runtime import interpreter

    narrow = {tl.bfloat16: ml_dtypes.bfloat16, tl.float8e4nv: ml_dtypes.float8_e4m3fn,
              tl.float8e5: ml_dtypes.float8_e5m2}
    builder = interpreter.InterpreterBuilder
    plain_cast, plain_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def exact(self, src, dst_type, *rest, fallback):
        s, d = src.dtype.scalar, dst_type.scalar
        if s not in narrow and d not in narrow:
            return fallback(self, src, dst_type, *rest)
        value = src.data.view(narrow[s]) if s in narrow else src.data
        with np.errstate(all="ignore"):
            out = value.astype(narrow.get(d, interpreter._get_np_dtype(d)))
        if d in narrow:
            out = out.view(interpreter._get_np_dtype(d))
        return interpreter.TensorHandle(np.asarray(out), d)

    plain_dot = builder.create_dot

    def dot(self, a, b, d, *rest):
        def widen(x):
            s = x.dtype.scalar
            return interpreter.TensorHandle(x.data.view(narrow[s]).astype(np.float32), tl.float32) \
                if s in narrow else x
        return plain_dot(self, widen(a), widen(b), d, *rest)

    builder.create_dot = dot

    vectorized = {"_kiln_maximum": np.max, "_kiln_minimum": np.min, "_kiln_mul": np.prod,
                  "_kiln_and": np.bitwise_and.reduce, "_kiln_or": np.bitwise_or.reduce}
    reduce_ops = interpreter.ReduceOps
    plain_apply = reduce_ops.apply_impl

    def apply_impl(self, input):
        fn = vectorized.get(getattr(getattr(self.combine_fn, "fn", None), "__name__", ""))
        if fn is None or len(input) != 1 or self.axis is None:
            return plain_apply(self, input)
        data = input[0].handle.data
        with np.errstate(all="ignore"):
            out = np.asarray(fn(data, axis=self.axis, keepdims=self.keep_dims)).astype(data.dtype)
        return self.to_tensor(out, input[0].dtype)

    reduce_ops.apply_impl = apply_impl
    builder.cast_impl = lambda self, src, dst, *rest: exact(self, src, dst, *rest, fallback=plain_cast)
    builder.create_fp_to_fp = lambda self, src, dst, *rest: exact(self, src, dst, *rest, fallback=plain_fp_to_fp)
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui", "create_fp_ext",
                 "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst: self.cast_impl(src, dst))
    _EXACT_CASTS_INSTALLED.append(True)


_TORCH_VIEWS = {"bf16": ("uint16", "bfloat16"), "f8e4m3fn": ("uint8", "float8_e4m3fn"),
                "f8e5m2": ("uint8", "float8_e5m2")}


def _torch_view(array: np.ndarray, dtype):
    """A CPU torch tensor sharing memory with `array` (ml_dtypes types through their bits)."""
    import torch

    flat = array.reshape(-1)
    if dtype.short in _TORCH_VIEWS:
        bits, name = _TORCH_VIEWS[dtype.short]
        return torch.from_numpy(flat.view(bits)).view(getattr(torch, name))
    return torch.from_numpy(flat)


class InterpretedKernel:
    """One generated kernel run by Triton's interpreter on numpy arrays, in place."""

    def __init__(self, kernel, emitted: EmittedKernel):
        from kiln.codegen.triton.aot import load_source

        self.kernel, self.emitted = kernel, emitted
        _install_exact_casts()
        raw = load_source(emitted.source, emitted.name)
        raw.__globals__["libdevice"] = _interpreter_libdevice()
        self.fn = raw.__globals__[emitted.name]  # the module's InterpretedFunction

    def __call__(self, arrays: Sequence, sizes: dict) -> None:
        e = self.emitted
        programs = grid_size(e, sizes)
        if programs == 0:
            return
        tensors = []
        for a, b in zip(arrays, self.kernel.buffers):
            if not a.flags.c_contiguous:
                raise ValueError(f"{e.name}: buffer {b.name} is not C-contiguous")
            tensors.append(_torch_view(a, b.dtype))
        size_values = [int(sizes[s]) for s in e.sizes]
        self.fn[(programs,)](*tensors, *size_values, **e.constexprs)
