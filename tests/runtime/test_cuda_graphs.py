"""CUDA-graph capture (kiln/runtime/cuda_graphs.py) and the Triton launcher's device
pointers (kiln/codegen/triton/runtime.py), against a fake CUDA driver: the bookkeeping
only — what is recorded, when a graph is re-recorded or updated, what the host reads,
which arguments are copied. The kernels are kiln's CPU kernels wrapped as "GPU" kernels
that the fake driver runs when a graph is launched, so replays are also checked
numerically against the normal call. A real GPU runs the same code in
scripts/gpu_check.py."""

import ctypes
import glob
import shutil
import subprocess
import types

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.compile import compile_graph
from kiln.frontend.export import export
from kiln.ir.shapes import dim_function
from kiln.runtime import transfers
from kiln.runtime.capture import CapturedPlan, KilnCaptureError
from kiln.runtime.cuda_graphs import KEEP_EXECS, CudaGraphLauncher, KilnCudaGraphError

OK, FAIL = 0, 999


class FakeDriver:
    """The cuda.bindings.driver calls the launcher makes: a stream in capture mode
    records work, a graph launch runs it; everything else runs at once."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=OK)
    CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1)
    CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=1)

    def __init__(self):
        self.capturing: dict = {}
        self.calls: dict = {}
        self.direct = 0  # work run outside a graph launch
        self.fail = set()
        self.live_execs = 0

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return FAIL if name in self.fail else OK

    def enqueue(self, stream, work):
        if stream in self.capturing:
            self.capturing[stream].work.append(work)
        else:
            self.direct += 1
            work()

    def cuDriverGetVersion(self):
        return OK, 12080

    def cuStreamCreate(self, flags):
        return self._count("cuStreamCreate"), 7

    def cuStreamDestroy(self, stream):
        return (self._count("cuStreamDestroy"),)

    def cuStreamBeginCapture(self, stream, mode):
        assert stream not in self.capturing, "a capture began inside another"
        self.capturing[stream] = types.SimpleNamespace(work=[])
        return (self._count("cuStreamBeginCapture"),)

    def cuStreamEndCapture(self, stream):
        return self._count("cuStreamEndCapture"), self.capturing.pop(stream)

    def cuMemcpyAsync(self, dst, src, nbytes, stream):
        self.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))
        return (self._count("cuMemcpyAsync"),)

    def cuGraphInstantiate(self, graph, flags):
        status = self._count("cuGraphInstantiate")
        if status == OK:
            self.live_execs += 1
        return status, types.SimpleNamespace(work=list(graph.work))

    def cuGraphExecUpdate(self, graph_exec, graph):
        graph_exec.work = list(graph.work)
        return self._count("cuGraphExecUpdate"), None

    def cuGraphLaunch(self, graph_exec, stream):
        for work in graph_exec.work:
            work()
        return (self._count("cuGraphLaunch"),)

    def cuGraphDestroy(self, graph):
        return (self._count("cuGraphDestroy"),)

    def cuGraphExecDestroy(self, graph_exec):
        self.live_execs -= 1
        return (self._count("cuGraphExecDestroy"),)

    def cuStreamSynchronize(self, stream):
        return (self._count("cuStreamSynchronize"),)


class FakeConditionalDriver(FakeDriver):
    """The fake driver with CUDA 12.4's conditional nodes: a WHILE node runs its body
    graph while its handle is non-zero; the handle is set by the setter kernel, which
    the fake runs by reading the flag byte at the pointer it is given."""

    CUgraphNodeType = types.SimpleNamespace(CU_GRAPH_NODE_TYPE_CONDITIONAL=13)
    CUgraphConditionalNodeType = types.SimpleNamespace(CU_GRAPH_COND_TYPE_WHILE=1)
    CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
                                               CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76)
    MAX_TRIPS = 10_000  # a runaway loop fails the test instead of hanging it

    def __init__(self):
        super().__init__()
        self.handles: dict = {}
        self.trips = 0

    @staticmethod
    def CUgraphNodeParams():  # noqa: N802  (the driver's name)
        return types.SimpleNamespace(type=None, conditional=types.SimpleNamespace(
            handle=None, type=None, size=0, ctx=None, phGraph_out=None))

    def cuCtxGetCurrent(self):
        return OK, "ctx"

    def cuCtxGetDevice(self):
        return OK, 0

    def cuDeviceGetAttribute(self, attr, device):
        return OK, 9 if attr == 75 else 0

    def cuModuleLoadData(self, image):
        assert image == b"\x7fELF fake setter"
        return self._count("cuModuleLoadData"), "module"

    def cuModuleGetFunction(self, module, name):
        return OK, ("setter", name)

    def cuGraphCreate(self, flags):
        return self._count("cuGraphCreate"), types.SimpleNamespace(work=[])

    def cuGraphConditionalHandleCreate(self, graph, ctx, default, flags):
        handle = len(self.handles) + 1
        self.handles[handle] = default
        return self._count("cuGraphConditionalHandleCreate"), handle

    def cuGraphAddChildGraphNode(self, graph, deps, n, child):
        graph.work.extend(list(child.work))  # a clone
        return OK, "child"

    def cuGraphAddNode(self, graph, deps, data, n, params):
        assert params.type == 13 and params.conditional.type == 1 and params.conditional.size == 1
        body, handle = types.SimpleNamespace(work=[]), params.conditional.handle
        params.conditional.phGraph_out = [body]

        def run_while():
            while self.handles[handle]:
                self.trips += 1
                assert self.trips < self.MAX_TRIPS
                for work in body.work:
                    work()
        graph.work.append(run_while)
        return self._count("cuGraphAddNode"), "while"

    def cuStreamBeginCaptureToGraph(self, stream, graph, deps, data, n, mode):
        assert stream not in self.capturing
        self.capturing[stream] = graph
        return (self._count("cuStreamBeginCaptureToGraph"),)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        assert f[0] == "setter" and (gx, bx) == (1, 1)
        (handle, flag), _ = params

        def set_condition():
            self.handles[handle] = int(ctypes.c_uint8.from_address(flag).value != 0)
        self.enqueue(stream, set_condition)
        return (self._count("cuLaunchKernel"),)


class FakeGpuKernel:
    """A CPU kernel launched as a GPU kernel is: on device pointers, on a stream."""

    def __init__(self, cpu_kernel, driver):
        self.cpu, self.driver, self.kernel = cpu_kernel, driver, cpu_kernel.kernel
        self.address = id(self)

    def launch_info(self, sizes):
        values, total, _ = self.cpu.launch_info(sizes)
        return values, total, False

    def launch_pointers(self, pointers, sizes, stream=None):
        arrays = []
        for pointer, buf in zip(pointers, self.kernel.buffers):
            shape = tuple(int(dim_function(d)(sizes)) for d in buf.shape)
            dtype = np.dtype(buf.dtype.np_dtype)
            n = int(np.prod(shape)) * dtype.itemsize
            raw = (ctypes.c_char * max(n, 1)).from_address(pointer)
            arrays.append(np.frombuffer(raw, dtype, int(np.prod(shape))).reshape(shape))
        sizes = dict(sizes)
        self.driver.enqueue(stream, lambda: self.cpu(arrays, sizes))

    def __call__(self, arrays, sizes):  # the executor's normal call (not used by a graph)
        self.cpu(arrays, sizes)


def _plan(fn, *args, driver=None):
    exported = export(fn, args)
    compiled = compile_graph(exported.graph, "cpu")
    driver = driver or FakeDriver()
    kernels = {n: FakeGpuKernel(k, driver) for n, k in compiled.executable.kernels.items()}
    arrays = [np.asarray(a) for a in args]
    launcher = CudaGraphLauncher(driver=driver)
    plan = CapturedPlan(compiled.program, kernels, compiled.executable.externs,
                        compiled.binder(arrays), arrays, launcher)
    return plan, compiled, driver, launcher


def _mlp(x, w):
    h = kn.relu(x @ w)
    return kn.softmax(h, -1) * 2 + 1, h.sum(-1)


def test_replays_launch_one_recorded_graph_and_match_the_normal_call():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((16, 8), np.float32), rng.standard_normal((8, 12), np.float32)
    plan, compiled, driver, launcher = _plan(_mlp, x, w)
    assert plan.native_runs == 1 and len(launcher.parts) == 1
    expected = compiled.executable.run([x, w], {})
    for _ in range(3):
        got = plan.run([x, w])
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
    # recorded once (both kernels in one graph), launched every replay, never directly
    assert driver.calls["cuStreamBeginCapture"] == driver.calls["cuGraphInstantiate"] == 1
    assert driver.calls["cuGraphLaunch"] == 3 and driver.direct == 0
    assert len(driver.calls) and launcher.parts[0].recorded == 1
    # in place change of the same inputs: the graph reads the new values, nothing re-recorded
    x[:] = rng.standard_normal(x.shape, np.float32)
    got = plan.run([x, w])
    np.testing.assert_allclose(got[1], np.maximum(x @ w, 0).sum(-1), rtol=1e-5, atol=1e-5)
    assert driver.calls["cuStreamBeginCapture"] == 1
    with pytest.raises(KilnCaptureError, match="K390.*captured for float32\\[16, 8\\]"):
        plan.run([np.zeros((8, 8), np.float32), w])


def test_new_pointers_record_again_and_update_the_oldest_graph_in_place():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((16, 8), np.float32), rng.standard_normal((8, 12), np.float32)
    plan, _, driver, launcher = _plan(_mlp, x, w)
    inputs = [np.array(x + k, np.float32) for k in range(KEEP_EXECS + 3)]  # distinct memory
    for a in inputs:
        got = plan.run([a, w])
        np.testing.assert_allclose(got[1], np.maximum(a @ w, 0).sum(-1), rtol=1e-5, atol=1e-4)
    part = launcher.parts[0]
    assert part.recorded == len(inputs)
    assert driver.calls["cuGraphInstantiate"] == KEEP_EXECS  # then pointer updates only
    assert part.updated == driver.calls["cuGraphExecUpdate"] == len(inputs) - KEEP_EXECS
    assert len(part.execs) == KEEP_EXECS == driver.live_execs
    plan.run([inputs[-1], w])  # the newest pointer set is kept: no recording
    assert part.recorded == len(inputs)
    launcher.close()
    assert driver.live_execs == 0 and driver.calls["cuStreamDestroy"] == 1


def _newton(a):
    def cond(i, y):
        return ((y * y - a).abs().max() > 1e-4) & (i < 40)

    def body(i, y):
        return i + 1, 0.5 * (y + a / y)
    return kn.while_loop(cond, body, (kn.tensor(0), a))


def test_while_loop_replays_its_graphs_per_trip_reading_only_the_flag():
    a = np.linspace(1.0, 9.0, 64, dtype=np.float32)
    plan, compiled, driver, launcher = _plan(_newton, a)
    trips, expected = compiled.executable.run([a], {})
    with transfers.counting() as seen:
        got_trips, got = plan.run([a])
    assert int(got_trips) == int(trips) >= 3
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(got, np.sqrt(a), rtol=1e-5)
    assert launcher.host_reads == int(trips) + 1 == seen["device_to_host"]  # the flags only
    assert driver.direct == 0
    plan.run([a])  # an odd trip count left the swapped buffers on the other parity
    recorded = sum(p.recorded for p in launcher.parts)
    for _ in range(3):  # both parities seen: later replays record nothing
        np.testing.assert_allclose(plan.run([a])[1], expected, rtol=1e-6)
    assert sum(p.recorded for p in launcher.parts) == recorded
    # the body's graph is recorded at most once per buffer parity, not per trip
    assert all(p.recorded <= 2 for p in launcher.parts)


def test_while_loop_as_a_conditional_node_runs_every_trip_in_one_graph(monkeypatch):
    from kiln.runtime import cuda_while_nodes

    monkeypatch.setattr(cuda_while_nodes, "setter_image", lambda arch: b"\x7fELF fake setter")
    a = np.linspace(1.0, 9.0, 64, dtype=np.float32)
    plan, compiled, driver, launcher = _plan(_newton, a, driver=FakeConditionalDriver())
    assert launcher.loop_mode == "conditional nodes"
    trips, expected = compiled.executable.run([a], {})
    for _ in range(3):
        with transfers.counting() as seen:
            got_trips, got = plan.run([a])
        assert int(got_trips) == int(trips) >= 3
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    # one graph for the whole loop, recorded once: no flag read on the host, no Python per trip
    assert launcher.host_reads == 0 and seen["device_to_host"] == 0 and driver.direct == 0
    assert driver.trips == 3 * int(trips)
    assert sum(p.recorded for p in launcher.parts) == driver.calls["cuGraphAddNode"] == 1
    assert driver.calls["cuModuleLoadData"] == 1 and driver.calls["cuGraphInstantiate"] == 1
    assert len(launcher.parts) == 1 and driver.calls["cuGraphLaunch"] == 3


def test_without_a_toolkit_loops_are_replayed_from_the_host(monkeypatch):
    from kiln.runtime import cuda_while_nodes

    def missing(arch):
        raise RuntimeError("no CUDA toolkit (nvcc) to build the conditional-node kernel")

    monkeypatch.setattr(cuda_while_nodes, "setter_image", missing)
    a = np.linspace(1.0, 9.0, 64, dtype=np.float32)
    plan, compiled, driver, launcher = _plan(_newton, a, driver=FakeConditionalDriver())
    assert launcher.loop_mode == "host: no CUDA toolkit (nvcc) to build the conditional-node kernel"
    trips, expected = compiled.executable.run([a], {})
    np.testing.assert_allclose(plan.run([a])[1], expected, rtol=1e-6)
    assert launcher.host_reads == int(trips) + 1 and "cuGraphAddNode" not in driver.calls


def test_cond_replays_the_branch_its_index_picks():
    def f(p, x):
        return kn.cond(p, lambda v: (v * 2).exp(), lambda v: v.sum(0, keepdim=True) - v, x)

    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    plan, compiled, driver, launcher = _plan(f, np.array(True), x)
    for p in (True, False, True):
        got = plan.run([np.array(p), x])[0]
        want = np.exp(x * 2) if p else x.sum(0, keepdims=True) - x
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert launcher.host_reads == 3 and driver.direct == 0


def test_a_failing_driver_call_is_K384_and_ends_the_capture():
    x, w = np.ones((4, 8), np.float32), np.ones((8, 4), np.float32)
    plan, _, driver, _ = _plan(_mlp, x, w)
    driver.fail.add("cuGraphInstantiate")
    with pytest.raises(KilnCudaGraphError, match="K384.*cuGraphInstantiate failed"):
        plan.run([x, w])
    assert not driver.capturing and driver.calls["cuStreamEndCapture"] == 1
    assert driver.calls["cuGraphDestroy"] == 1  # the recorded graph was not leaked
    driver.fail.clear()
    np.testing.assert_allclose(plan.run([x, w])[1], np.full(4, 32.0))


def test_triton_launches_pass_device_memory_as_pointers_and_copy_host_arrays(monkeypatch):
    """The Triton launcher's bookkeeping with a fake CUDA memory: an array in a `cuda`
    device's segments is its pointer (no copy), a host array is uploaded (an input) or
    downloaded (an output), each counted."""
    from kiln.codegen.triton import runtime
    from kiln.runtime import device as devices
    from kiln.runtime.caching_allocator import RawMemory

    class FakeCudaMemory:
        def __init__(self):
            self.live, self.uploads, self.downloads = {}, [], []

        def alloc(self, nbytes):
            block = np.zeros(nbytes, np.uint8)
            self.live[block.ctypes.data] = block
            return block.ctypes.data

        def free(self, ptr):
            self.live.pop(ptr)

        def upload(self, ptr, host):
            self.uploads.append(host.nbytes)
            ctypes.memmove(ptr, host.ctypes.data, host.nbytes)

        def download(self, host, ptr):
            self.downloads.append(host.nbytes)
            ctypes.memmove(host.ctypes.data, ptr, host.nbytes)

    memory = FakeCudaMemory()
    monkeypatch.setitem(runtime._MEMORY, "cuda", memory)
    saved = devices._KINDS.pop("cuda", None)
    devices._RESOLVED.clear()
    try:
        devices.register_device_kind("cuda", hardware="a fake GPU", raw_memory=lambda i: RawMemory(),
                                     total_memory=lambda i: 1 << 30, available=lambda: True)
        on_device = kn.tensor(np.arange(8, dtype=np.float32)).to("cuda").numpy()
        host_in, host_out = np.ones(8, np.float32), np.zeros(8, np.float32)
        with transfers.counting() as seen:
            args, copies = runtime.kernel_arguments("k", [on_device, host_in, host_out], [2], "cuda")
        assert isinstance(args[0], runtime.DevicePointer)
        assert args[0].data_ptr() == on_device.ctypes.data  # the array's own address
        assert isinstance(args[1], runtime.DeviceBuffer) and memory.uploads == [32]
        assert [h is host_out for h, _ in copies] == [True] and memory.downloads == []
        assert seen["host_to_device"] == 1 and seen["host_to_device_bytes"] == 32
        # what the output copy-back moves (GpuKernel.__call__ after the launch)
        ctypes.memmove(copies[0][1].data_ptr(), on_device.ctypes.data, 32)
        copies[0][1].to_array(host_out)
        np.testing.assert_array_equal(host_out, on_device)
        del args, copies
    finally:
        devices.unregister_device_kind("cuda")
        if saved is not None:
            devices._KINDS["cuda"] = saved
        devices._RESOLVED.clear()


def test_the_condition_setter_builds_with_the_cuda_toolkit(tmp_path, monkeypatch):
    """The kernel that sets a WHILE node's condition (cudaGraphSetConditional, a device-runtime
    call) compiles and links for sm_90 with the toolkit's nvcc and libcudadevrt."""
    from kiln.runtime import cuda_while_nodes

    if cuda_while_nodes._nvcc() is None:
        pytest.skip("needs the CUDA toolkit's nvcc (and libcudadevrt)")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    cuda_while_nodes.setter_image.cache_clear()
    try:
        image = cuda_while_nodes.setter_image("sm_90")
    finally:
        cuda_while_nodes.setter_image.cache_clear()
    assert image.startswith(b"\x7fELF") and b".text.kiln_set_conditional" in image
    assert b"cudaGraphSetConditional" in image  # an extern the driver resolves when it loads


def test_without_nvcc_the_setter_is_ptx_for_the_driver(monkeypatch, tmp_path):
    from kiln.runtime import cuda_while_nodes

    monkeypatch.setattr(cuda_while_nodes, "_nvcc", lambda: None)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    cuda_while_nodes.setter_image.cache_clear()
    try:
        image = cuda_while_nodes.setter_image("sm_90")
    finally:
        cuda_while_nodes.setter_image.cache_clear()
    text = image.rstrip(b"\0").decode()
    assert image.endswith(b"\0") and ".version 8.4" in text and ".target sm_90" in text
    assert ".visible .entry kiln_set_conditional(" in text
    assert "call.uni cudaGraphSetConditional, (param0, param1);" in text
    nvcc = shutil.which("nvcc") or next(iter(glob.glob("/usr/local/cuda*/bin/nvcc")), None)
    if nvcc is None:
        return
    # the template says what nvcc says: the same instructions as its own PTX of the source
    source = tmp_path / "set.cu"
    source.write_text(cuda_while_nodes.SETTER_SOURCE)
    subprocess.run([nvcc, "-arch=sm_90", "-ptx", str(source), "-o", str(tmp_path / "set.ptx")],
                   check=True, timeout=300, capture_output=True)

    def instructions(ptx):
        words = " ".join(line.split("//")[0] for line in ptx.splitlines()).split()
        return [w for w in words if w[0].isalpha() and "." in w and not w.startswith(".")]

    assert instructions((tmp_path / "set.ptx").read_text()) == instructions(text)
