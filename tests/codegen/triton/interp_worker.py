"""A subprocess that runs Triton kernels through Triton's CPU interpreter, for the tests.

Triton decides at import whether its own library (tl.sum, tl.zeros, ...) is compiled or
interpreted (TRITON_INTERPRET=1), so interpreted and ahead-of-time work cannot share a
process. The test process keeps compiling ahead of time; this worker, started once per
session with TRITON_INTERPRET=1, receives requests over a pipe:

    ("kernel", kernel_ir, arrays, sizes, options)   -> arrays after the kernel ran
    ("graph", kir_bytes, arrays, backend)           -> outputs of the graph compiled for backend
    ("eval", python_source)                         -> the value of `result` it sets

Messages are length-prefixed pickles between two processes of this test run.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import traceback


def _send(stream, obj) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(blob)) + blob)
    stream.flush()


def _recv(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the interpreter worker closed its pipe")
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def _handle(request):
    kind = request[0]
    if kind == "kernel":
        from kiln.codegen.triton.backend import TritonBackend, TritonOptions

        _, kernel, arrays, sizes, options = request
        (fn,) = TritonBackend("cuda", TritonOptions(**options)).compile_many([kernel])
        fn(arrays, sizes)
        return arrays
    if kind == "graph":
        import io

        from kiln.frontend.compile import compile_graph
        from kiln.ir.archive import load_graph

        _, blob, arrays, backend = request
        graph, _ = load_graph(io.BytesIO(blob))
        return compile_graph(graph, backend).run(arrays)
    if kind == "eval":
        scope: dict = {}
        exec(request[1], scope)
        return scope.get("result")
    raise ValueError(f"unknown request {kind!r}")


def serve() -> None:
    """The worker's loop: answer ("ok", value) or ("error", type name, message, traceback)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the pipe
    while True:
        try:
            request = _recv(stdin)
        except EOFError:
            return
        try:
            _send(stdout, ("ok", _handle(request)))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the test
            _send(stdout, ("error", type(e).__name__, str(e), traceback.format_exc()))


class WorkerError(Exception):
    def __init__(self, kind: str, message: str, trace: str):
        super().__init__(f"{kind}: {message}\n--- worker traceback ---\n{trace}")
        self.kind, self.message = kind, message


class InterpreterWorker:
    """The parent's handle: `run_kernel(kernel, arrays, sizes)` and friends."""

    def __init__(self, root: str):
        env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="0", PYTHONPATH=root)
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.codegen.triton.interp_worker import serve; "
                                      "serve()"], cwd=root, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)

    def request(self, *message):
        _send(self.proc.stdin, message)
        reply = _recv(self.proc.stdout)
        if reply[0] == "error":
            raise WorkerError(*reply[1:])
        return reply[1]

    def run_kernel(self, kernel, arrays, sizes, **options):
        return self.request("kernel", kernel, arrays, sizes, options)

    def run_graph(self, graph, arrays, backend: str = "cuda"):
        """Outputs of `graph` (a kiln Graph, sent as a .kir archive) compiled for `backend`."""
        import io

        from kiln.ir.archive import save_graph

        blob = io.BytesIO()
        save_graph(graph, blob)
        return self.request("graph", blob.getvalue(), arrays, backend)

    def eval(self, source: str):
        return self.request("eval", source)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
