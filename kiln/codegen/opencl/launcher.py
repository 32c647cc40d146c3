"""Capture and replay for OpenCL programs: a captured plan's native runs as enqueue loops.

`OpenCLLauncher.compile(ops)` prepares, once per capture, everything a replay needs for
each launch -- the cl.Kernel, its global and local work sizes, its size arguments and
the byte length of every buffer argument -- so a replay is one loop that sets each
kernel's buffer arguments from the plan's pointer table and enqueues it on the device's
in-order queue, with a single wait at the end of the run (or before a copy, a branch or
a loop condition reads memory on the host). Buffers the device can use in place (its
SVM, or any host memory where the device executes on the host) go to the kernels as
pointers; others through a device buffer, copied in and back.

    >>> plan = CapturedPlan(program, kernels, externs, sizes, arrays, OpenCLLauncher())
"""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

import numpy as np

from kiln.codegen.opencl.runtime import device_arg
from kiln.ir.shapes import dim_function
from kiln.runtime.transfers import record
from kiln.runtime.capture import Copy, Launcher, Loop, NativeLaunch, Swap, Switch


class _Launch:
    """One prepared kernel launch: everything but the buffer pointers fixed."""

    def __init__(self, op: NativeLaunch):
        k = op.kernel
        sizes = dict(zip(op.size_names, op.sizes))
        self.kernel, self.ctx, self.args = k, k.ctx, op.args
        self.launches = k.launches(sizes)
        self.nbytes = []
        for b in k.kernel.buffers:
            n = 1
            for d in b.shape:
                n *= int(dim_function(d)(sizes))
            self.nbytes.append(n * b.dtype.np_dtype.itemsize)
        self.size_values = [np.int64(sizes[s]) for s in k.emitted.sizes]
        self.outputs = set(k.outputs)

    def enqueue(self, table, held: list, back: list) -> None:
        if not self.launches:
            return
        cl, kernels = self.ctx.cl, self.kernel.cl_kernels
        nargs = len(self.args)
        with self.kernel._lock:
            for i, (index, nbytes) in enumerate(zip(self.args, self.nbytes)):
                view = _view(table[index], nbytes)
                arg, copied = device_arg(self.ctx, view)
                held.append(arg)
                for kernel in kernels:
                    kernel.set_arg(i, arg)
                if copied is not None and i in self.outputs:
                    back.append((copied, view))
            for j, v in enumerate(self.size_values):
                for kernel in kernels:
                    kernel.set_arg(nargs + j, v)
            for kernel, glob, local, offset in self.launches:
                cl.enqueue_nd_range_kernel(self.ctx.queue, kernel, glob, local, global_work_offset=offset)
        for buf, host in back:
            cl.enqueue_copy(self.ctx.queue, host, buf)
            record("device_to_host", host.nbytes)
        back.clear()


def _view(address: int | None, nbytes: int) -> np.ndarray:
    if not address or nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


class OpenCLLauncher(Launcher):
    """The launcher `kn.capture` uses for backend "opencl" / "xpu"."""

    def compile(self, ops: Sequence) -> Callable[[int], None]:
        steps = [self._prepare(op) for op in ops]
        contexts = []
        for op in _launches(ops):
            if op.kernel.ctx not in contexts:
                contexts.append(op.kernel.ctx)
        size = 1 + max(_indices(ops), default=0)

        def run(table_address: int) -> None:
            table = (ctypes.c_void_p * size).from_address(table_address)
            state = _State(contexts)
            for step in steps:
                step(table, state)
            state.wait()

        return run

    def _prepare(self, op) -> Callable:
        if isinstance(op, NativeLaunch):
            launch = _Launch(op)

            def enqueue(table, state):
                launch.enqueue(table, state.held, state.back)
                state.pending = True
            return enqueue
        if isinstance(op, Copy):
            def copy(table, state):
                state.wait()
                if op.nbytes:
                    ctypes.memmove(table[op.dst], table[op.src], op.nbytes)
            return copy
        if isinstance(op, Swap):
            return lambda table, state: op.exchange(table)
        if isinstance(op, Switch):
            branches = [[self._prepare(o) for o in b] for b in op.branches]
            dtype = np.dtype(op.index_dtype)

            def switch(table, state):
                state.wait()
                k = int(_view(table[op.index], dtype.itemsize).view(dtype)[0])
                for step in branches[min(max(k, 0), len(branches) - 1)]:
                    step(table, state)
            return switch
        if isinstance(op, Loop):
            init, cond, body, back = ([self._prepare(o) for o in part]
                                      for part in (op.init, op.cond, op.body, op.back))

            def loop(table, state):
                for step in init:
                    step(table, state)
                while True:
                    for step in cond:
                        step(table, state)
                    state.wait()
                    if not _view(table[op.flag], 1)[0]:
                        break
                    for step in body + back:
                        step(table, state)
            return loop
        raise TypeError(f"opencl launcher: cannot run {type(op).__name__}")


class _State:
    """What one run has in flight: argument objects to keep alive until the wait."""

    def __init__(self, contexts):
        self.contexts, self.held, self.back, self.pending = contexts, [], [], False

    def wait(self) -> None:
        if self.pending:
            for ctx in self.contexts:
                ctx.queue.finish()
            self.held.clear()
            self.pending = False


def _launches(ops):
    for op in ops:
        if isinstance(op, NativeLaunch):
            yield op
        elif isinstance(op, Switch):
            for b in op.branches:
                yield from _launches(b)
        elif isinstance(op, Loop):
            for part in (op.init, op.cond, op.body, op.back):
                yield from _launches(part)


def _indices(ops):
    for op in ops:
        if isinstance(op, NativeLaunch):
            yield from op.args
        elif isinstance(op, Copy):
            yield op.dst
            yield op.src
        elif isinstance(op, Swap):
            a, b = op.members()
            yield from a
            yield from b
        elif isinstance(op, Switch):
            yield op.index
            for b in op.branches:
                yield from _indices(b)
        elif isinstance(op, Loop):
            yield op.flag
            for part in (op.init, op.cond, op.body, op.back):
                yield from _indices(part)
