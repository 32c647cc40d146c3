"""Compiled `cond`/`switch` steps on the CPU dispatch in native code: the branch index is
read, clamped and branched on inside one LLVM function that then launches the chosen
branch's kernels, so a call costs one native call beyond the executor's entry.

The executor runs a `cond` step by reading the index in Python, running the branch as a
sub-program (its closures, its arena, its outputs handed out and remembered) and handing
its outputs to the parent. For a branch that is one large kernel that is a few tens of
microseconds of Python around it. Here the step is captured once per size binding, as
`kn.capture` captures a program (kiln/runtime/capture.py): every branch is flattened
into the same table of buffer pointers, the branches' intermediates get memory once,
and a `Switch` op (kiln/codegen/cpu/launch_list.py) chooses among them natively.

Unlike a replay (which copies its outputs out of captured buffers), a branch's kernels
write the step's outputs in place: an output's table entry is bound, per call, to an
array this call hands to the caller. That array is one the caller dropped (the
previous output, referenced only here, so already paged in) or a new one from the
caching allocator. A branch output that is not a kernel's own result (an operand
passed through, a constant, a view) is copied into it natively.

When: CPU kernels only, no collective, every op native (an extern in a branch keeps the
Python way), from the second call of a size binding. A capture busy on another thread
runs the Python way, so concurrent calls stay correct.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir.shapes import dim_function
from kiln.runtime.native_loops import PerBinding, adaptive_launcher
from kiln.runtime.program import Control, Launch, Program

_KEEP = 2  # outputs remembered per output position, for reuse once the caller drops them


def _written_by_launch(body: Program, slot: int) -> bool:
    """Is `slot` first written by a kernel launch of `body` (not an input, view, constant
    or extern result)?"""
    if slot in body.inputs or slot in body.storage:
        return False
    for step in body.steps:
        if isinstance(step, Launch):
            if slot in step.args:
                return True
        elif slot in getattr(step, "outputs", ()) or slot == getattr(step, "target", None):
            return False
    return False


class _SwitchPlan:
    """One size binding's native dispatch: the table, the function, the bind."""

    def __init__(self, program: Program, step: Control, kernels: dict, externs: dict,
                 sizes: dict, launcher):
        from kiln.runtime.capture import Copy, Switch, _Flattener, is_native

        flat = _Flattener(kernels, externs, sizes, launcher)
        index = flat.new(None)
        operands = [flat.new(None) for _ in step.inputs[1:]]
        outputs = [flat.new(None) for _ in step.outputs]
        flat.dynamic.update([index, *operands, *outputs])
        self.out_specs = []
        for slot in step.outputs:
            spec = program.buffers[slot]
            shape = tuple(int(dim_function(d)(sizes)) for d in spec.shape)
            self.out_specs.append((shape, np.dtype(spec.dtype.np_dtype)))
        branches = []
        for body in step.bodies:
            env = dict(zip(body.inputs, operands))
            direct: dict[int, int] = {}  # output position -> body slot its kernel writes
            for k, slot in enumerate(body.outputs):
                if slot not in direct.values() and _written_by_launch(body, slot):
                    env[slot] = outputs[k]
                    direct[k] = slot
            ops = flat.flatten(body, env)
            for k, slot in enumerate(body.outputs):
                if k not in direct:
                    shape, dtype = self.out_specs[k]
                    ops.append(Copy(outputs[k], env[slot], int(np.prod(shape)) * dtype.itemsize))
            branches.append(tuple(ops))
        flat.finish()
        op = Switch(index, np.dtype(program.buffers[step.inputs[0]].dtype.np_dtype), tuple(branches))
        if not is_native(op):
            raise KilnError("internal: a branch has a step native code cannot run")
        self.arrays = flat.arrays  # captured buffers stay alive with the plan
        self.table = (ctypes.c_void_p * len(flat.arrays))()
        for i, array in enumerate(flat.arrays):
            if array is not None:
                self.table[i] = array.ctypes.data
        self.table_address = ctypes.addressof(self.table)
        self.launcher = launcher  # owns the native code
        # with a split and a one-thread version when a launch is large enough to split
        # (native_loops.adaptive_launcher): a split launch waits at its end for every thread
        self.run_native = launcher.compile([op])
        bound = [index, *operands, *outputs]
        self.aliases = [(t, s) for t, s, _ in flat.aliases]
        self.bind = launcher.bind(bound, self.aliases)
        self.objects = (ctypes.c_void_p * len(bound))()
        self.objects_address = ctypes.addressof(self.objects)
        self.bound = bound
        self.kept: list[list[np.ndarray]] = [[] for _ in step.outputs]
        self.lock = threading.Lock()


class NativeSwitch(PerBinding):
    """One `cond` step of a program, dispatched natively per size binding."""

    op = "cond"

    def __init__(self, program: Program, step: Control, kernels: dict, externs: dict, allocator):
        super().__init__()
        self.program, self.step = program, step
        self.kernels, self.externs, self.allocator = kernels, externs, allocator

    def run(self, operands: Sequence[np.ndarray], sizes: dict) -> list[np.ndarray] | None:
        """The step's results (arrays the caller owns), or None: run it the Python way."""
        plan = self.plan_for(sizes, lambda: self._build(sizes))
        if plan is None or not plan.lock.acquire(blocking=False):  # another thread is in it
            return None
        try:
            return self._run(plan, operands)
        finally:
            plan.lock.release()

    def _run(self, plan: _SwitchPlan, operands: Sequence[np.ndarray]) -> list[np.ndarray] | None:
        arrays = [a if a.__class__ is np.ndarray else np.asarray(a) for a in operands]
        for a in arrays:
            if not a.flags.c_contiguous:
                return None
        outputs, fresh = [], 0
        for kept, (shape, dtype) in zip(plan.kept, plan.out_specs):
            out = _reclaim(kept, shape, dtype)
            if out is None:
                out = self.allocator.empty(shape, dtype)
                fresh += out.nbytes
            outputs.append(out)
        try:
            everything = [*arrays, *outputs]
            if plan.bind is not None:
                objects = plan.objects
                for k, a in enumerate(everything):
                    objects[k] = id(a)
                plan.bind(plan.table_address, plan.objects_address)
            else:
                table = plan.table
                for i, a in zip(plan.bound, everything):
                    table[i] = a.ctypes.data
                for target, source in plan.aliases:
                    table[target] = table[source]
            plan.run_native(plan.table_address)
        finally:
            if fresh:
                self.allocator.end_call(fresh)
        for kept, out in zip(plan.kept, outputs):
            if not any(o is out for o in kept):
                kept.append(out)
                if len(kept) > _KEEP:
                    del kept[0]
        return outputs

    def _build(self, sizes: dict):
        try:
            return _SwitchPlan(self.program, self.step, self.kernels, self.externs, sizes,
                               adaptive_launcher()())
        except KilnError:  # a step native code cannot take: the executor runs it
            return False


def _reclaim(kept: list, shape: tuple, dtype: np.dtype):
    """An output handed out before that the caller has dropped (only `kept` and this
    frame hold it), or None. The caller holds the plan's lock. The newest first: the
    output of the last call is the likeliest still in cache."""
    for k in range(len(kept) - 1, -1, -1):
        array = kept[k]
        # referenced by the list, the loop variable and getrefcount's argument
        if sys.getrefcount(array) == 3 and array.shape == shape and array.dtype == dtype:
            del kept[k]
            return array
    return None
