"""Capture on CUDA: a captured plan's launches recorded into CUDA graphs, through the
driver API of NVIDIA's `cuda-bindings` (never torch).

`CudaGraphLauncher.compile(ops)` is what `kn.capture` asks the backend for when the
program runs on a `cuda` device (kiln/codegen/launchers.py). Each maximal run of kernel
launches and buffer copies becomes one *graph part*: on its first replay the part is
recorded by stream capture (`cuStreamBeginCapture` on a stream of kiln's own, every
kernel launched through Triton's launcher on that stream with the plan's device
pointers, copies as `cuMemcpyAsync`, `cuStreamEndCapture`), instantiated
(`cuGraphInstantiate`) and launched (`cuGraphLaunch`); later replays launch the
instantiated graph, one driver call for the whole part. A graph bakes in its pointers:
a replay whose buffers moved (new input tensors, or a loop's swapped buffers on the
other parity) records the part again and updates the oldest executable graph of the
part in place (`cuGraphExecUpdate`: a pointer update, no re-instantiation) — a few
executable graphs per part are kept, keyed by their pointers, so alternating inputs
and loop parities replay without recording.

Control flow: a `while_loop` whose parts are launches and copies becomes one graph with a
conditional WHILE node (CUDA 12.4+; kiln/runtime/cuda_while_nodes.py): every trip runs on
the device, the flag set into the node's condition by a one-thread kernel, with no host
read and no Python per trip. Where the driver lacks conditional nodes, or the kernel
that sets the condition cannot be loaded, or the loop holds a `cond`, the loop replays
its condition's graph, reads the flag, then the body's graphs, per trip (one graph launch
and one flag read per trip, no Python per kernel); `loop_mode` says which. A `cond`
waits for the stream, reads its index on the host and replays the chosen branch's graphs.

The driver is passed in (`driver=`), so the bookkeeping is tested on a CPU machine with
a fake driver (tests/runtime/test_cuda_graphs.py); on a GPU it is
`cuda.bindings.driver`.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.capture import Copy, Launcher, Loop, NativeLaunch, Swap, Switch

KEEP_EXECS = 4  # executable graphs kept per part (pointer sets: inputs, loop parities)


class KilnCudaGraphError(KilnError, RuntimeError):
    code = "K384"
    title = "a CUDA graph could not be recorded or launched"


def _check(driver, result, what: str):
    """cuda-bindings returns (CUresult, *values): K384 on an error, else the values."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise KilnCudaGraphError(f"CUDA graph capture: {what} failed: {status}",
                                 hint="run the program without kn.capture to see whether its "
                                      "kernels launch at all")
    return values[0] if len(values) == 1 else (values or None)


def default_driver():
    """`cuda.bindings.driver`, initialized (kiln/runtime/gpu_devices.py)."""
    from kiln.runtime.gpu_devices import _cuda

    return _cuda()


def conditional_nodes_supported(driver=None) -> bool:
    """Whether the driver has conditional graph nodes (CUDA 12.4+)."""
    driver = driver or default_driver()
    version = _check(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion")
    return int(version) >= 12040 and hasattr(driver, "cuGraphConditionalHandleCreate")


class _Linear:
    """A run of launches and copies, recorded by stream capture."""

    def __init__(self, ops: Sequence, launcher: "CudaGraphLauncher"):
        self.ops, self.launcher = list(ops), launcher
        self.indices = sorted({i for op in self.ops for i in
                               (op.args if isinstance(op, NativeLaunch) else (op.dst, op.src))})

    def build(self, table):
        driver, stream = self.launcher.driver, self.launcher.stream
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(driver, driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            for op in self.ops:
                if isinstance(op, NativeLaunch):
                    sizes = dict(zip(op.size_names, op.sizes))
                    op.kernel.launch_pointers([table[i] for i in op.args], sizes, stream=int(stream))
                elif op.nbytes:
                    _check(driver, driver.cuMemcpyAsync(table[op.dst], table[op.src], op.nbytes,
                                                        stream), "cuMemcpyAsync")
        finally:  # a failed launch must still end the capture, or the stream stays in it
            graph = _check(driver, driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        return graph


class _GraphPart:
    """A graph replayed per pointer set: a run of launches and copies (`_Linear`) or a
    whole while_loop with a conditional node (kiln/runtime/cuda_while_nodes.py)."""

    def __init__(self, builder, launcher: "CudaGraphLauncher"):
        self.builder = builder
        self.launcher = launcher
        self.indices = builder.indices
        self.execs: OrderedDict = OrderedDict()  # pointers -> executable graph
        self.recorded = 0  # graphs built (a test reads it)
        self.updated = 0  # executable graphs updated in place with new pointers

    def __call__(self, table) -> None:
        key = tuple(table[i] for i in self.indices)
        graph_exec = self.execs.get(key)
        if graph_exec is None:
            graph_exec = self._record(table, key)
        else:
            self.execs.move_to_end(key)
        driver, stream = self.launcher.driver, self.launcher.stream
        _check(driver, driver.cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")
        self.launcher.launches += 1

    def _record(self, table, key):
        driver = self.launcher.driver
        graph = self.builder.build(table)
        self.recorded += 1
        try:
            graph_exec = None
            if len(self.execs) >= KEEP_EXECS:  # refill the oldest: a pointer update
                old_key, old_exec = self.execs.popitem(last=False)
                status = driver.cuGraphExecUpdate(old_exec, graph)
                status = status[0] if isinstance(status, tuple) else status
                if status == driver.CUresult.CUDA_SUCCESS:
                    graph_exec = old_exec
                    self.updated += 1
                else:
                    _check(driver, driver.cuGraphExecDestroy(old_exec), "cuGraphExecDestroy")
            if graph_exec is None:
                graph_exec = _check(driver, driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            _check(driver, driver.cuGraphDestroy(graph), "cuGraphDestroy")
        self.execs[key] = graph_exec
        return graph_exec

    def close(self) -> None:
        driver = self.launcher.driver
        while self.execs:
            _, graph_exec = self.execs.popitem()
            driver.cuGraphExecDestroy(graph_exec)


class CudaGraphLauncher(Launcher):
    """Native runs of a captured plan as CUDA graphs (see the module docstring)."""

    def __init__(self, driver=None, stream=None, conditional: bool | None = None):
        """`conditional`: loops as conditional WHILE nodes (None: where the driver has
        them and the condition-setting kernel can be built; see `loop_mode`)."""
        self.driver = driver or default_driver()
        self._conditional = conditional
        self.loop_mode: str | None = None  # "conditional nodes" or "host: <why>", at the first loop
        self._setter = None
        self._plan = None
        if stream is None:
            flags = self.driver.CUstream_flags.CU_STREAM_NON_BLOCKING
            stream = _check(self.driver, self.driver.cuStreamCreate(int(flags)), "cuStreamCreate")
            self._own_stream = True
        else:
            self._own_stream = False
        self.stream = stream
        self.parts: list[_GraphPart] = []
        self.launches = 0  # graph launches so far
        self.host_reads = 0  # cond indices and loop flags read on the host

    def compile(self, ops: Sequence) -> Callable[[int], None]:
        steps = self._steps(ops)

        def run(table_address: int) -> None:
            table = _Table(table_address, self)
            for step in steps:
                step(table)
            self.synchronize()  # the plan's arrays are read next (outputs, Python steps)

        return run

    def synchronize(self) -> None:
        _check(self.driver, self.driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def _steps(self, ops: Sequence) -> list:
        steps, run = [], []

        def flush():
            if run:
                part = _GraphPart(_Linear(run, self), self)
                self.parts.append(part)
                steps.append(part)
                run.clear()

        for op in ops:
            if isinstance(op, (NativeLaunch, Copy)):
                run.append(op)
                continue
            flush()
            steps.append(self._control(op))
        flush()
        return steps

    def _control(self, op) -> Callable:
        if isinstance(op, Swap):
            return op.exchange
        if isinstance(op, Switch):
            branches = [self._steps(b) for b in op.branches]

            def switch(table):
                k = int(table.read(op.index, op.index_dtype))
                for step in branches[min(max(k, 0), len(branches) - 1)]:
                    step(table)
            return switch
        if isinstance(op, Loop) and self._loops_on_device(op):
            from kiln.runtime.cuda_while_nodes import WhileGraph

            part = _GraphPart(WhileGraph(op, self), self)
            self.parts.append(part)
            return part
        if isinstance(op, Loop):
            init, cond, body, back = (self._steps(p) for p in (op.init, op.cond, op.body, op.back))

            def loop(table):
                for step in init:
                    step(table)
                while True:
                    for step in cond:
                        step(table)
                    if not bool(table.read(op.flag, np.dtype(np.bool_))):
                        break
                    for step in body + back:
                        step(table)
            return loop
        raise KilnError(f"internal: CUDA graph capture cannot run {type(op).__name__}")

    def attach(self, plan) -> None:
        """The plan whose ops this launcher runs (capture.py calls it): a loop's buffer
        exchange inside a graph is a copy of the buffer's size."""
        self._plan = plan

    def nbytes(self, index: int) -> int:
        return self._plan.arrays[index].nbytes

    def _loops_on_device(self, op) -> bool:
        """Whether this loop becomes a conditional WHILE node (the first loop decides,
        for the launcher, whether the driver and toolkit allow it)."""
        from kiln.runtime.cuda_while_nodes import loop_is_linear

        if self.loop_mode is None:
            if self._conditional is False:
                self.loop_mode = "host: conditional nodes turned off"
            elif not conditional_nodes_supported(self.driver):
                self.loop_mode = "host: the driver has no conditional graph nodes (CUDA 12.4+)"
            else:
                try:
                    self.setter()
                    self.loop_mode = "conditional nodes"
                except Exception as exc:  # no toolkit: replay the trips from the host
                    if self._conditional:
                        raise
                    self.loop_mode = f"host: {exc}"
        return self.loop_mode == "conditional nodes" and self._plan is not None and loop_is_linear(op)

    def setter(self):
        """The condition-setting kernel (CUfunction), loaded once."""
        if self._setter is None:
            from kiln.runtime.cuda_while_nodes import SETTER_NAME, setter_image

            driver = self.driver
            device = _check(driver, driver.cuCtxGetDevice(), "cuCtxGetDevice")
            attr = driver.CUdevice_attribute
            major = _check(driver, driver.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute")
            minor = _check(driver, driver.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute")
            module = _check(driver, driver.cuModuleLoadData(setter_image(f"sm_{major}{minor}")),
                            "cuModuleLoadData")
            self._setter = _check(driver, driver.cuModuleGetFunction(module, SETTER_NAME.encode()),
                                  "cuModuleGetFunction")
        return self._setter

    def close(self) -> None:
        """Destroy the executable graphs and kiln's stream."""
        for part in self.parts:
            part.close()
        self.parts.clear()
        if self._own_stream and self.stream is not None:
            self.driver.cuStreamDestroy(self.stream)
            self.stream = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


class _Table:
    """The plan's pointer table (a ctypes array of void*), read and written by index."""

    __slots__ = ("entries", "launcher")

    def __init__(self, address: int, launcher: CudaGraphLauncher):
        self.entries = ctypes.cast(address, ctypes.POINTER(ctypes.c_void_p))
        self.launcher = launcher

    def __getitem__(self, index: int) -> int:
        return self.entries[index] or 0

    def __setitem__(self, index: int, value: int) -> None:
        self.entries[index] = value

    def read(self, index: int, dtype: np.dtype):
        """A scalar the host reads from (managed) device memory, after the stream."""
        self.launcher.synchronize()
        self.launcher.host_reads += 1
        from kiln.runtime.transfers import record

        record("device_to_host", dtype.itemsize)
        raw = (ctypes.c_char * dtype.itemsize).from_address(self[index])
        return np.frombuffer(raw, dtype, 1)[0]
