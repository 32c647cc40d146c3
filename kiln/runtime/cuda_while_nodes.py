"""A captured `while_loop` as one CUDA graph with a conditional WHILE node (CUDA 12.4+):
every trip runs on the device, with no host round trip and no Python per trip.

The graph (built by `WhileGraph`, kiln/runtime/cuda_graphs.py replays it):

    parent:  [prologue: init copies, cond kernels, set(handle, flag)] -> WHILE(handle)
    body:    loop body kernels, hand-back copies, cond kernels, set(handle, flag)

The condition handle (`cuGraphConditionalHandleCreate`) is set on the device by a
one-thread kernel that reads the loop's flag buffer and calls `cudaGraphSetConditional`
— a device-runtime function, so that kernel is compiled once per GPU architecture by the
CUDA toolkit's nvcc and linked with libcudadevrt (`setter_image`, cached in kiln's
artifact cache). Where no toolkit is found the launcher replays the loop per trip from
the host instead (cuda_graphs.py says which, `CudaGraphLauncher.loop_mode`). Inside a
graph buffers cannot change places, so a loop's buffer exchange (`Swap`) becomes a copy
of the body's output into the carried buffer.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import shutil
import subprocess
import tempfile

from kiln.runtime.capture import Copy, NativeLaunch, Swap

SETTER_NAME = "kiln_set_conditional"
SETTER_SOURCE = r"""
#include <cuda_runtime.h>
extern "C" __global__ void kiln_set_conditional(cudaGraphConditionalHandle handle,
                                                const unsigned char *flag) {
    cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}
"""

# what nvcc 13.0 emits for SETTER_SOURCE (`nvcc -arch=sm_90 -ptx`), as a template: used
# where no toolkit is installed, for the driver to JIT (`cudaGraphSetConditional` stays an
# extern that the driver resolves at load time, as it does with a cubin's)
SETTER_PTX = """
.version {version}
.target {arch}
.address_size 64
.extern .func cudaGraphSetConditional
(
    .param .b64 cudaGraphSetConditional_param_0,
    .param .b32 cudaGraphSetConditional_param_1
)
;
.visible .entry kiln_set_conditional(
    .param .u64 kiln_set_conditional_param_0,
    .param .u64 kiln_set_conditional_param_1
)
{{
    .reg .pred %p<2>;
    .reg .b16 %rs<2>;
    .reg .b32 %r<2>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [kiln_set_conditional_param_0];
    ld.param.u64 %rd2, [kiln_set_conditional_param_1];
    cvta.to.global.u64 %rd3, %rd2;
    ld.global.u8 %rs1, [%rd3];
    setp.ne.s16 %p1, %rs1, 0;
    selp.u32 %r1, 1, 0, %p1;
    {{
    .param .b64 param0;
    st.param.b64 [param0+0], %rd1;
    .param .b32 param1;
    st.param.b32 [param1+0], %r1;
    call.uni cudaGraphSetConditional, (param0, param1);
    }}
    ret;
}}
"""


def _nvcc() -> str | None:
    """The CUDA toolkit's nvcc: $CUDA_HOME, PATH, then /usr/local/cuda*."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    found = shutil.which("nvcc")
    candidates += [found] if found else []
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@functools.lru_cache(maxsize=None)
def setter_image(arch: str) -> bytes:
    """The condition-setting kernel for `arch` ("sm_90"): a cubin built by the CUDA
    toolkit (nvcc, linked against libcudadevrt) where there is one, else its PTX for the
    driver to compile. Raises RuntimeError when a build fails."""
    from kiln.codegen import artifact_cache

    key = artifact_cache.content_key("cuda-while-setter", arch, SETTER_SOURCE)

    def validate(blob: bytes) -> None:
        if not blob.startswith(b"\x7fELF"):
            raise ValueError("not a cubin")

    cached = artifact_cache.load(key, "cuda_graph", validate=validate)
    if cached is not None:
        return cached
    nvcc = _nvcc()
    if nvcc is None:  # PTX ISA 8.4 is CUDA 12.4's, the first with conditional nodes
        return SETTER_PTX.format(version="8.4", arch=arch).encode() + b"\0"
    with tempfile.TemporaryDirectory(prefix="kiln-while-") as work:
        source, obj, image = (os.path.join(work, n) for n in ("set.cu", "set.o", "set.cubin"))
        with open(source, "w") as f:
            f.write(SETTER_SOURCE)
        for command in ([nvcc, f"-arch={arch}", "-rdc=true", "-c", source, "-o", obj],
                        [nvcc, f"-arch={arch}", "-dlink", obj, "-lcudadevrt", "-cubin", "-o", image]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"building the conditional-node kernel failed: {done.stderr[-400:]}")
        with open(image, "rb") as f:
            blob = f.read()
    validate(blob)
    artifact_cache.store(key, blob, "cuda_graph")
    return blob


def loop_is_linear(op) -> bool:
    """Whether every part of a Loop is launches, copies and swaps (no nested control)."""
    return all(isinstance(o, (NativeLaunch, Copy, Swap)) for part in (op.init, op.cond, op.body, op.back)
               for o in part)


class WhileGraph:
    """What `_Replayable` (cuda_graphs.py) needs to build a loop's graph: its table
    indices and `build(table) -> CUgraph`."""

    def __init__(self, op, launcher):
        self.op, self.launcher = op, launcher
        parts = (op.init, op.cond, op.body, op.back)
        indices = {op.flag}
        for part in parts:
            for o in part:
                if isinstance(o, NativeLaunch):
                    indices.update(o.args)
                elif isinstance(o, Copy):
                    indices.update((o.dst, o.src))
                else:
                    indices.update(i for group in o.members() for i in group)
        self.indices = sorted(indices)

    def build(self, table):
        from kiln.runtime.cuda_graphs import _check

        launcher, op = self.launcher, self.op
        driver, stream = launcher.driver, launcher.stream
        ctx = _check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        parent = _check(driver, driver.cuGraphCreate(0), "cuGraphCreate")
        try:
            handle = _check(driver, driver.cuGraphConditionalHandleCreate(parent, ctx, 0, 0),
                            "cuGraphConditionalHandleCreate")
            mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            _check(driver, driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
            try:
                self._launch(table, list(op.init) + list(op.cond), handle)
            finally:
                prologue = _check(driver, driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
            try:
                first = _check(driver, driver.cuGraphAddChildGraphNode(parent, None, 0, prologue),
                               "cuGraphAddChildGraphNode")
            finally:
                _check(driver, driver.cuGraphDestroy(prologue), "cuGraphDestroy")  # the node holds a clone
            params = driver.CUgraphNodeParams()
            params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
            params.conditional.handle = handle
            params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
            params.conditional.size = 1
            params.conditional.ctx = ctx
            _check(driver, driver.cuGraphAddNode(parent, [first], None, 1, params), "cuGraphAddNode")
            body = params.conditional.phGraph_out[0]
            _check(driver, driver.cuStreamBeginCaptureToGraph(stream, body, None, None, 0, mode),
                   "cuStreamBeginCaptureToGraph")
            try:
                self._launch(table, list(op.body) + list(op.back) + list(op.cond), handle)
            finally:
                _check(driver, driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        except BaseException:
            driver.cuGraphDestroy(parent)
            raise
        return parent

    def _launch(self, table, ops: list, handle) -> None:
        """Launch `ops` on the capturing stream, then the condition setter."""
        from kiln.runtime.cuda_graphs import _check

        launcher = self.launcher
        driver, stream = launcher.driver, launcher.stream
        for o in ops:
            if isinstance(o, NativeLaunch):
                sizes = dict(zip(o.size_names, o.sizes))
                o.kernel.launch_pointers([table[i] for i in o.args], sizes, stream=int(stream))
                continue
            if isinstance(o, Swap):  # buffers stay put in a graph: copy the output back
                dst, src, nbytes = o.a, o.b, launcher.nbytes(o.a)
            else:
                dst, src, nbytes = o.dst, o.src, o.nbytes
            if nbytes:
                _check(driver, driver.cuMemcpyAsync(table[dst], table[src], nbytes, stream),
                       "cuMemcpyAsync")
        args = ((int(handle), table[self.op.flag]), (ctypes.c_ulonglong, ctypes.c_void_p))
        _check(driver, driver.cuLaunchKernel(launcher.setter(), 1, 1, 1, 1, 1, 1, 0, stream, args, 0),
               "cuLaunchKernel (condition setter)")
