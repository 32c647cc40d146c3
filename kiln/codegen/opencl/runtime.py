"""The OpenCL runtime through pyopencl: devices, contexts, queues, programs, launches.

Devices are numbered across every platform the ICD loader lists (`opencl:N` is the
N-th); `xpu:N` is the N-th Intel GPU among them. Each device gets one context and one
in-order queue. Programs are built once per device and source, and their binaries are
kept in kiln's authenticated artifact cache (kind "opencl"), keyed by the source, the
build options and the device's identity and driver version; a cached binary is
checked (header, device identity, size) before the driver sees it, and a binary the
driver refuses is rebuilt from source.

Kernels take shared virtual memory pointers: arrays in the device's own segments
(kiln/runtime/opencl_device.py), or any host array where the device has fine-grained
*system* SVM (PoCL on the CPU has it), go to the kernel without a copy; other host
arrays are copied through a buffer, in and back out. Host arrays are counted either way
(kiln/runtime/transfers.py: a copy, or a host operand used in place).
"""

from __future__ import annotations

import functools
import struct
import threading

import numpy as np

from kiln.codegen.opencl.emit import EmittedKernel, Limits
from kiln.codegen.opencl.errors import (KilnOpenCLBuildError, KilnOpenCLFeatureError,
                                        KilnOpenCLLaunchError, KilnOpenCLUnavailableError)
from kiln.ir.shapes import dim_function
from kiln.runtime.transfers import record

_BLOB_MAGIC = b"KILNCL1\0"


def pyopencl():
    """The pyopencl module; K400 naming the install when it is missing."""
    try:
        import pyopencl as cl
    except ImportError as exc:
        raise KilnOpenCLUnavailableError(
            f"the opencl backend needs the pyopencl package ({exc})",
            hint="pip install 'kiln[opencl]' and an OpenCL driver (on Debian: apt-get install "
                 "pocl-opencl-icd ocl-icd-libopencl1)") from None
    return cl


@functools.lru_cache(maxsize=1)
def all_devices() -> tuple:
    """Every OpenCL device of every platform, in the loader's order (empty without any)."""
    try:
        cl = pyopencl()
        platforms = cl.get_platforms()
    except Exception:  # no ICD loader, no platform: no device
        return ()
    out = []
    for p in platforms:
        try:
            out.extend(p.get_devices())
        except Exception:
            continue
    return tuple(out)


def intel_gpus() -> tuple:
    """The Intel GPUs among `all_devices()` (what `xpu:N` numbers)."""
    cl = pyopencl() if all_devices() else None
    return tuple(d for d in all_devices()
                 if "intel" in d.vendor.lower() and d.type & cl.device_type.GPU)


def device_for(kind: str, index: int):
    devices = intel_gpus() if kind == "xpu" else all_devices()
    if not devices:
        what = "an Intel GPU" if kind == "xpu" else "an OpenCL device"
        raise KilnOpenCLUnavailableError(
            f"opencl backend: this machine has no {what} that pyopencl can see",
            hint="install an OpenCL driver (on Debian: apt-get install pocl-opencl-icd "
                 "ocl-icd-libopencl1; Intel GPUs: intel-opencl-icd), or use backend='cpu'")
    if index >= len(devices):
        raise KilnOpenCLUnavailableError(f"opencl backend: {kind}:{index} does not exist; this machine has "
                                         f"{len(devices)} {kind} device(s)")
    return devices[index]


class DeviceContext:
    """One device's context, in-order queue, limits and program cache."""

    def __init__(self, device):
        cl = pyopencl()
        self.cl, self.device = cl, device
        self.context = cl.Context([device])
        self.queue = cl.CommandQueue(self.context)
        p = device.platform
        ext = set(device.extensions.split())
        self.extensions = ext
        self.limits = Limits(int(device.max_work_group_size), int(device.local_mem_size),
                             int(device.max_compute_units),
                             "cl_khr_subgroups" in ext or "cl_intel_subgroups" in ext,
                             "cl_intel_subgroups" in ext, bool(device.type & cl.device_type.CPU))
        self.fp64 = "cl_khr_fp64" in ext or bool(getattr(device, "double_fp_config", 0))
        try:
            svm = int(device.svm_capabilities)
        except Exception:
            svm = 0
        self.svm_fine = bool(svm & cl.device_svm_capabilities.FINE_GRAIN_BUFFER)
        self.svm_system = bool(svm & cl.device_svm_capabilities.FINE_GRAIN_SYSTEM)
        # PoCL's CPU devices run kernels on the host, in the process's own memory: any host
        # pointer is as good as SVM there (what fine-grained system SVM promises elsewhere)
        self.host_pointers = self.svm_system or (
            bool(device.type & cl.device_type.CPU) and "portable computing language" in p.name.lower())
        options = []
        try:
            if device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
                options.append("-cl-fp32-correctly-rounded-divide-sqrt")  # IEEE / and sqrt, as numpy
        except Exception:
            pass
        self.build_options = tuple(options)
        self.identity = "|".join([p.name, p.version, device.name, device.version, device.driver_version,
                                  device.opencl_c_version])
        self._programs: dict = {}
        self._lock = threading.Lock()
        self.stats = {"built": 0, "cached": 0}

    def program(self, source: str):
        """The built program of `source` on this device (memoized; binaries cached on disk)."""
        with self._lock:
            prog = self._programs.get(source)
            if prog is None:
                prog = self._programs[source] = self._build(source)
            return prog

    def _build(self, source: str):
        from kiln.codegen import artifact_cache

        cl = self.cl
        key = artifact_cache.content_key("opencl", self.identity, " ".join(self.build_options), source)
        blob = artifact_cache.load(key, "opencl", validate=self._validate)
        if blob is not None:
            try:
                prog = cl.Program(self.context, [self.device], [_unwrap(blob)]).build(
                    options=list(self.build_options))
                self.stats["cached"] += 1
                return prog
            except Exception:
                pass  # a binary this driver no longer takes: rebuild from source
        try:
            prog = cl.Program(self.context, source).build(options=list(self.build_options))
        except cl.Error as exc:
            raise KilnOpenCLBuildError(
                f"opencl backend: {self.device.name} rejected a generated program: {exc}",
                hint="this is a kiln bug; `kiln dump --target opencl --stage source` prints the source") from None
        self.stats["built"] += 1
        binaries = prog.binaries
        if binaries and binaries[0]:
            artifact_cache.store(key, self._wrap(bytes(binaries[0])), "opencl")
        return prog

    def _wrap(self, binary: bytes) -> bytes:
        ident = self.identity.encode()
        return _BLOB_MAGIC + struct.pack("<II", len(ident), len(binary)) + ident + binary

    def _validate(self, blob: bytes) -> None:
        """An entry is ours, for this device and driver, and whole (ValueError otherwise)."""
        if not blob.startswith(_BLOB_MAGIC) or len(blob) < len(_BLOB_MAGIC) + 8:
            raise ValueError("not an OpenCL program entry")
        n_ident, n_bin = struct.unpack_from("<II", blob, len(_BLOB_MAGIC))
        start = len(_BLOB_MAGIC) + 8
        if blob[start:start + n_ident] != self.identity.encode() or n_bin == 0 \
                or len(blob) != start + n_ident + n_bin:
            raise ValueError("an OpenCL program entry for another device or driver, or truncated")


def _unwrap(blob: bytes) -> bytes:
    n_ident, _ = struct.unpack_from("<II", blob, len(_BLOB_MAGIC))
    return blob[len(_BLOB_MAGIC) + 8 + n_ident:]


def context(kind: str = "opencl", index: int = 0) -> DeviceContext:
    """The context of device `kind:index` ("opencl" or "xpu"), made once per process."""
    return _context(kind, int(index))


@functools.lru_cache(maxsize=None)
def _context(kind: str, index: int) -> DeviceContext:
    device = device_for(kind, index)
    for (k, i), ctx in _BY_DEVICE.items():  # xpu:0 and opencl:N may be one device: one context
        if ctx.device == device:
            return ctx
    ctx = _BY_DEVICE[(kind, index)] = DeviceContext(device)
    return ctx


_BY_DEVICE: dict = {}


class OpenCLKernel:
    """fn(arrays, sizes): one generated kernel launched on one device (waits for it)."""

    def __init__(self, emitted: EmittedKernel, ctx: DeviceContext, kernel=None):
        if emitted.uses_f64 and not ctx.fp64:
            raise KilnOpenCLFeatureError(f"opencl backend: kernel {emitted.name} computes in float64, and "
                                         f"{ctx.device.name} has no cl_khr_fp64",
                                         hint="compute in float32 on this device, or use backend='cpu'")
        self.emitted, self.ctx = emitted, ctx
        self.kernel = kernel  # a Kernel IR kernel (capture reads its sizes)
        program = ctx.program(emitted.source)
        # a kernel object of its own (getattr on the program would warn on a second build)
        self.cl_kernels = [ctx.cl.Kernel(program, emitted.name)]
        if emitted.tail_name:
            self.cl_kernels.append(ctx.cl.Kernel(program, emitted.tail_name))
        self.cl_kernel = self.cl_kernels[0]
        self.work = [(dim_function(e), per, items) for e, per, items in emitted.work]
        self.local = tuple(emitted.local)
        self.outputs = [i for i, b in enumerate(kernel.buffers) if b.role == "out"] if kernel is not None else []
        self._lock = threading.Lock()
        # capture's mark that this kernel can join a native run (kiln/codegen/opencl/launcher.py
        # enqueues it; nothing calls the value as a function address)
        self.address = id(self)

    def launch_info(self, sizes: dict) -> tuple:
        """(size values, work-items, parallel) for capture (kiln/runtime/capture.py)."""
        launch = self.launch_sizes(sizes)
        total = 0 if launch is None else int(np.prod(launch[0]))
        return tuple(int(sizes[s]) for s in self.emitted.sizes), total, False

    def launch_sizes(self, sizes: dict) -> tuple | None:
        """(global, local) work sizes for a size binding; None when there is nothing to do."""
        glob = []
        for fn, per, items in self.work:
            extent = int(fn(sizes))
            if extent <= 0:
                return None
            glob.append(-(-extent // per) * items)
        return tuple(glob), self.local

    def launches(self, sizes: dict) -> list:
        """[(cl.Kernel, global, local, offset)] for a size binding: the unchecked main
        kernel over whole groups, then the bounds-checked tail entry for the rest."""
        launch = self.launch_sizes(sizes)
        if launch is None:
            return []
        glob, local = launch
        if len(self.cl_kernels) == 1:
            return [(self.cl_kernel, glob, local, None)]
        n, width = int(self.work[0][0](sizes)), local[0]
        main = n // width * width
        out = [(self.cl_kernels[0], (main,), local, None)] if main else []
        if n > main:
            out.append((self.cl_kernels[1], (width,), local, (main,)))
        return out

    def set_args(self, arrays: list, sizes: dict) -> tuple[list, list]:
        """Set every argument; returns the (device buffer, host array) pairs to copy back
        and every argument object (the caller keeps them alive until the kernel is done)."""
        ctx = self.ctx
        back, held = [], []
        for i, a in enumerate(arrays):
            arg, copied = device_arg(ctx, a)
            held.append(arg)
            for kernel in self.cl_kernels:
                kernel.set_arg(i, arg)
            if copied is not None and i in self.outputs:
                back.append((copied, a))
        for j, name in enumerate(self.emitted.sizes):
            for kernel in self.cl_kernels:
                kernel.set_arg(len(arrays) + j, np.int64(sizes[name]))
        return back, held

    def __call__(self, arrays: list, sizes: dict) -> None:
        launches = self.launches(sizes)
        if not launches:
            return
        cl = self.ctx.cl
        with self._lock:
            back, held = self.set_args(arrays, sizes)
            try:
                for kernel, glob, local, offset in launches:
                    cl.enqueue_nd_range_kernel(self.ctx.queue, kernel, glob, local, global_work_offset=offset)
                for buf, host in back:  # the queue is in order: after the kernel
                    cl.enqueue_copy(self.ctx.queue, host, buf)
                    record("device_to_host", host.nbytes)
                self.ctx.queue.finish()
            except cl.Error as exc:
                raise KilnOpenCLLaunchError(f"opencl backend: launching {self.emitted.name} on "
                                            f"{self.ctx.device.name} failed: {exc}") from None
            del held


_EMPTY = np.zeros(16, np.uint8)


def device_arg(ctx: DeviceContext, array: np.ndarray):
    """(kernel argument, device buffer or None): an SVM pointer where the device can use
    the array's memory in place, else a buffer holding a copy."""
    cl = ctx.cl
    if array.size == 0:
        array = _EMPTY
    elif not owns(ctx, array):  # host memory (counted: kiln/runtime/transfers.py)
        if ctx.host_pointers:
            record("host_operands", array.nbytes)
        else:
            if not array.flags.c_contiguous:
                raise KilnOpenCLLaunchError("opencl backend: kernel arguments must be contiguous arrays")
            record("host_to_device", array.nbytes)
            buf = cl.Buffer(ctx.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                            hostbuf=array)
            return buf, buf
    return cl.SVM(array), None


def owns(ctx: DeviceContext, array: np.ndarray) -> bool:
    """Whether `array` lies in SVM this device allocated (kiln/codegen/opencl/device.py)."""
    from kiln.runtime.opencl_device import svm_owner

    return svm_owner(array) is ctx


def no_device_reason() -> str | None:
    """Why OpenCL kernels cannot run here (for skips and messages), or None."""
    try:
        pyopencl()
    except KilnOpenCLUnavailableError:
        return "pyopencl is not installed"
    if not all_devices():
        return "no OpenCL device (install pocl-opencl-icd for the CPU one)"
    return None

