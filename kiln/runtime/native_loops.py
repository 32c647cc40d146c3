"""Compiled `while_loop`s on the CPU run as native launch lists: no Python per trip.

The executor runs a loop's condition and body as sub-programs, a trip through Python
each (~20 us: the step closures, buffer hand-outs, the flag read). A loop that runs many
short trips (a data-dependent iteration on small tensors) is dominated by that. Here
the loop step is captured once per size binding, as `kn.capture` captures a program
(kiln/runtime/capture.py, kiln/codegen/cpu/launch_list.py): its buffers get memory once
and one LLVM function runs every trip, condition and branches included.

When: CPU kernels only, no collective in the loop, carried bytes at most
`MAX_CARRIED_BYTES` (a replay returns copies of the loop's results: for large tensors
those copies would cost what the Python trips save), and from the second call of a
size binding (a one-off call does not pay the capture's build). A loop whose capture is
busy on another thread runs the Python way, so concurrent calls stay correct.
"""

from __future__ import annotations

import dataclasses
import threading
from functools import lru_cache
from typing import Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.program import Collective, Control, Program
from kiln.runtime.threads import backing_off, get_num_threads, parallel_threads

MAX_CARRIED_BYTES = 1 << 20
_BUILD_AFTER = 2  # calls of one size binding before its capture is built


def _is_cpu_kernel(kernel) -> bool:
    return type(kernel).__module__.startswith("kiln.codegen.cpu")


def _has_collective(program: Program) -> bool:
    for step in program.steps:
        if isinstance(step, Collective):
            return True
        if isinstance(step, Control) and any(_has_collective(b) for b in step.bodies):
            return True
    return False


class PerBinding:
    """The native plans of one control step of a program, one per size binding, each
    built on its binding's `_BUILD_AFTER`-th call (a one-off call does not pay the
    build); `op` is the step kind a subclass takes."""

    op = ""

    def __init__(self):
        self._plans: dict[tuple, object] = {}  # sizes -> plan, or False: not possible
        self._calls: dict[tuple, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def applies(cls, step: Control, kernels: dict) -> bool:
        return (step.op == cls.op and bool(kernels)
                and all(_is_cpu_kernel(k) for k in kernels.values())
                and not any(_has_collective(b) for b in step.bodies))

    def plan_for(self, sizes: dict, build):
        """The plan of `sizes` (`build()` makes it, once), or None: not yet, or not possible."""
        key = tuple(sorted(sizes.items())) if sizes else ()
        plan = self._plans.get(key)
        if plan is None:
            with self._lock:
                calls = self._calls[key] = self._calls.get(key, 0) + 1
                if calls < _BUILD_AFTER or key in self._plans:
                    return None
                self._plans[key] = plan = build()
        return plan or None


class NativeLoop(PerBinding):
    """One `while_loop` step of a program, replayed natively per size binding."""

    op = "while_loop"

    def __init__(self, program: Program, step: Control, kernels: dict, externs: dict):
        super().__init__()
        slots = {*step.inputs, *step.outputs}
        self.program = Program(f"{program.name}_while", list(step.inputs), list(step.outputs),
                               {s: program.buffers[s] for s in slots}, [step], program.kernels,
                               program.constants, program.shape_vars)
        self.kernels, self.externs = kernels, externs

    def run(self, operands: Sequence[np.ndarray], sizes: dict) -> list[np.ndarray] | None:
        """The loop's results (arrays the caller owns), or None: run it the Python way."""
        if sum(getattr(a, "nbytes", 0) for a in operands) > MAX_CARRIED_BYTES:
            return None
        plan = self.plan_for(sizes, lambda: self._build(operands, sizes))
        if plan is None or plan._lock.locked():  # another thread is replaying it
            return None
        return plan.run(list(operands))

    def _build(self, operands, sizes):
        from kiln.runtime.capture import CapturedPlan

        arrays = [np.require(a, requirements="C") for a in operands]  # 0-d stays 0-d
        try:
            return CapturedPlan(self.program, self.kernels, self.externs, sizes, arrays,
                                adaptive_launcher()())
        except KilnError:  # a step the capture cannot take: the executor runs it
            return False


def one_thread(ops) -> list:
    """`ops` with every launch on the calling thread. A launch split over threads waits at
    its end for every thread to have run its share: on a machine whose other cores are
    busy (other processes) that wait is a scheduler time slice, milliseconds, for a
    kernel of a few hundred microseconds (the 4-way switch over 2^20 floats measured
    0.2 ms split on an idle machine, 6-8 ms median split at load 9 on 2 CPUs, 0.34 ms
    on one thread)."""
    from kiln.runtime.capture import Loop, NativeLaunch, Switch

    out = []
    for op in ops:
        if isinstance(op, NativeLaunch) and op.threads > 1:
            op = dataclasses.replace(op, threads=1)
        elif isinstance(op, Switch):
            op = dataclasses.replace(op, branches=tuple(tuple(one_thread(b)) for b in op.branches))
        elif isinstance(op, Loop):
            op = Loop(*(tuple(one_thread(part)) for part in (op.init, op.cond)), op.flag,
                      *(tuple(one_thread(part)) for part in (op.body, op.back)))
        out.append(op)
    return out


@lru_cache(maxsize=None)
def adaptive_launcher():
    """The CPU launcher class whose native runs come in versions when a launch is large
    enough to split over threads: the split one runs while `threads.parallel_threads()`
    allows more than one thread (other processes leave a CPU idle). Otherwise, on kiln's
    native team, a quiet split one: its regions split as well (a team region never waits
    for a worker that did not come: the caller runs every unit nobody claimed), and the
    workers sleep right after each region instead of spinning, so they hold no core that
    other processes want between calls. Without the team (libgomp, whose regions wait for
    every thread), the one-thread version."""
    from kiln.codegen.cpu.launch_list import CpuLauncher
    from kiln.codegen.cpu.native_pool import on_team

    class AdaptiveLauncher(CpuLauncher):
        def compile(self, ops, quiet: bool = False):
            ops = list(ops)
            if quiet:  # the quiet split version alone
                return super().compile(ops, quiet=True)
            serial_ops = one_thread(ops)
            serial = super().compile(serial_ops)
            if serial_ops == ops:
                return serial
            split = super().compile(ops)
            # beside busy processes: split with quiet workers (kiln's team only)
            hushed = super().compile(ops, quiet=True) if on_team() else serial

            def run(table: int) -> None:
                if parallel_threads() > 1:
                    split(table)
                elif get_num_threads() > 1 and not backing_off():
                    hushed(table)  # (a back-off: a split just waited for a core)
                else:
                    serial(table)

            return run

    return AdaptiveLauncher
