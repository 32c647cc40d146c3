"""Prepared calls: a compiled program bound once to one exact argument signature.

A call of a compiled function through the general path rebuilds its cache key,
evaluates the size guards, binds the shape variables, walks the executor's step
closures (each kernel re-checking dtypes and shapes and filling its ctypes arrays),
and allocates its outputs through the caching allocator: ~20-25 us before the first
kernel runs. For a signature seen before (each argument's class, shape and dtype, and
the values of the Python scalars baked in), every one of those answers is already
known, so `FastPlan` decides them once:

- the program's steps as a list of raw kernel calls (`fn(objects, sizes, 0, total)`
  through the kernels' `.np` entries, which read each array's data pointer from the
  numpy object): the ctypes argument arrays are made once, with the ids of the
  constants and intermediates filled in; a call stores only the ids of its inputs and
  outputs;
- a program of several launches runs them in one native call (a trampoline over a flat
  list of entries and arguments, kiln/codegen/cpu/launch_list.py), not one ctypes call
  per kernel;
- views cost nothing (a view's data pointer is its source's);
- intermediates live in storage the plan holds (counted as arena bytes while it lives);
- outputs of up to 1 MiB are `np.empty`, counted by the CPU caching allocator as eager
  results are (`kn.memory`, the memory fraction); larger ones are its blocks, as the
  executor's are (a dropped output's paged-in block is the next call's).

A plan applies to programs of kernel launches, views and constants whose launches run
on one thread (a launch the runtime would split over its pool, an extern, control flow
or a collective keeps the general path), and whose outputs are fresh buffers. A call
that cannot use it (a busy plan on another thread, a strided argument, a profile
running) returns None and the caller takes the general path, so nothing a guard checks
is skipped: the signature is the guard, and a different one never reaches the plan.

    >>> plan = FastPlan.build(executable, sizes)   # None: the program needs the general path
    >>> outputs = plan.run([x])                     # None: this call takes the general path
"""

from __future__ import annotations

import ctypes
import threading
from typing import Sequence

import numpy as np

from kiln.runtime import profiler as _profiler
from kiln.runtime.device import allocator_for
from kiln.runtime.threads import blas_single_thread
from kiln.runtime.program import Constant, Launch, View

# outputs up to this size are np.empty, tracked as eager results are (~1 us with the
# tracking); larger ones are blocks of the caching allocator (~5-10 us a call, its
# accounting and lease included), whose exact-size reuse hands a dropped output's
# paged-in memory to the next call. glibc raises its mmap threshold to the largest
# block freed (up to 32 MiB), so a dropped np.empty output of this size is served again
# from the heap without page faults: measured 64 KiB-4 MiB, allocate + fill took the
# time of filling a kept buffer, 0 minor faults per call
SMALL_OUTPUT_BYTES = 1 << 20

_VOID_PTRS: dict[int, type] = {}
_INT64S: dict[int, type] = {}


def _void_ptrs(n: int):
    t = _VOID_PTRS.get(n)
    if t is None:
        t = _VOID_PTRS[n] = ctypes.c_void_p * max(1, n)
    return t()


def _int64s(values: Sequence[int]):
    t = _INT64S.get(len(values))
    if t is None:
        t = _INT64S[len(values)] = ctypes.c_int64 * max(1, len(values))
    return t(*values)


class FastPlan:
    """One program, one size binding, one argument signature: `run(arrays)`."""

    __slots__ = ("_launches", "_fills", "_outputs", "_n_inputs", "_lock", "_one_blas",
                 "_executable", "_fixed", "_held", "_track", "_native", "__weakref__")

    @classmethod
    def build(cls, executable, sizes: dict) -> "FastPlan | None":
        """The plan for `executable` at `sizes`, or None where the program needs the
        general path (see the module docstring)."""
        program = executable.program
        if executable.side is not None or executable.device is not None:
            return None
        if not all(isinstance(s, (Launch, View, Constant)) for s in program.steps):
            return None
        plan = cls(executable, sizes)
        return plan if plan._launches is not None else None

    def __init__(self, executable, sizes: dict):
        program = executable.program
        self._executable = executable
        self._lock = threading.Lock()
        self._fixed: list = []  # arrays whose ids are baked into the argument arrays
        self._held = 0  # persistent bytes (intermediates) charged to the allocator
        self._launches: list = []
        self._fills: list = []
        self._outputs: list = []
        self._track = allocator_for("cpu").track_new
        self._one_blas = False
        self._native = None  # several launches: one native call (launch_list.py)
        self._n_inputs = len(program.inputs)
        # slot -> ("in", k) | ("out", k) | ("fix", array): where its data pointer comes from
        where: dict[int, tuple] = {s: ("in", k) for k, s in enumerate(program.inputs)}
        storages: dict[int, np.ndarray] = {}
        try:
            self._prepare(executable, program, sizes, where, storages)
        except _NotApplicable:
            self._launches = None
            self._release()

    def _prepare(self, executable, program, sizes, where, storages) -> None:
        shape_of = lambda slot: tuple(int(d) for d in executable._shape_fn(slot)(sizes))  # noqa: E731
        nbytes_of = lambda slot: int(np.prod(shape_of(slot), dtype=np.int64)) * \
            np.dtype(program.buffers[slot].dtype.np_dtype).itemsize  # noqa: E731
        # storage of the memory plan: the largest slot on each storage id, as bytes
        need: dict[int, int] = {}
        for slot, sid in program.storage.items():
            need[sid] = max(need.get(sid, 0), nbytes_of(slot))
        for sid, n in need.items():
            array = executable.allocator.empty((max(n, 1),), np.uint8, persistent=True)
            self._held += array.nbytes
            storages[sid] = array
            self._fixed.append(array)
        outputs = set(program.outputs)
        for step in program.steps:
            if isinstance(step, Constant):
                data = executable._constants[step.name]
                if not (isinstance(data, np.ndarray) and data.flags.c_contiguous):
                    raise _NotApplicable
                self._fixed.append(data)
                where[step.target] = ("fix", data)
                if step.target in outputs:
                    raise _NotApplicable  # a constant returned: the caller's copy
            elif isinstance(step, View):
                if step.source not in where or step.target in outputs:
                    raise _NotApplicable  # a returned view is copied by the general path
                where[step.target] = where[step.source]
            else:
                self._launch(executable, program, step, sizes, where, storages, shape_of, outputs)
        if len(set(program.outputs)) != len(program.outputs):
            raise _NotApplicable  # one buffer returned twice: the second is a copy
        for slot in program.outputs:
            kind = where.get(slot)
            if kind is None or kind[0] != "out":
                raise _NotApplicable  # an input or constant returned: the caller's copy
        # the call's objects are the inputs, then the outputs in return order
        returned = {slot: i for i, slot in enumerate(program.outputs)}
        created = self._outputs
        remap = {k: self._n_inputs + returned[slot] for k, (slot, *_rest) in enumerate(created)}
        self._outputs = sorted(created, key=lambda o: returned[o[0]])
        self._fills = [[(pos, remap[src] if is_out else src) for pos, src, is_out in fills]
                       for fills in self._fills]
        if len(self._launches) > 1:
            self._native = self._launch_list(len(program.inputs) + len(program.outputs))

    def _launch_list(self, n_objects: int) -> tuple:
        """(trampoline, list, n, objects, args): every launch in one native call
        (launch_list.launch_trampoline); the list's words, per launch: the `.np` entry's
        address, the argument count, the sizes' address, the loop count, then each
        argument (an object's address, or -(k + 1) for the call's k-th object)."""
        from kiln.codegen.cpu.launch_list import launch_trampoline

        words: list[int] = []
        widest = 1
        for (fn, args, sizes, total), fills in zip(self._launches, self._fills):
            values = [args[i] or 0 for i in range(len(args))]
            for position, k in fills:
                values[position] = -(k + 1)
            words += [ctypes.cast(fn, ctypes.c_void_p).value, len(values),
                      ctypes.addressof(sizes), total, *values]
            widest = max(widest, len(values))
        table = (ctypes.c_int64 * len(words))(*words)
        return (launch_trampoline(), table, len(self._launches),
                (ctypes.c_void_p * max(1, n_objects))(), (ctypes.c_void_p * widest)())

    def _launch(self, executable, program, step, sizes, where, storages, shape_of, outputs) -> None:
        kernel = executable.kernels[step.kernel]
        info = getattr(kernel, "launch_info", None)
        if info is None or not getattr(kernel, "_by_object", False):
            raise _NotApplicable
        values, total, parallel = info(sizes)
        entry = kernel._resolved.get(tuple(values))
        if entry is None or parallel or entry[4] != 0:
            raise _NotApplicable  # split over the pool: the kernel's own call decides
        # BLAS at one thread around kernels that call it (the kernel's own call does so
        # for every GEMM; a micro-kernel calls no library)
        self._one_blas = self._one_blas or bool(entry[3] and getattr(kernel, "calls_blas", True))
        args = _void_ptrs(len(step.args))
        fills = []
        for position, slot in enumerate(step.args):
            if slot not in where:  # first written here: intermediate or output
                sid = program.storage.get(slot)
                if sid is not None:
                    where[slot] = ("fix", storages[sid])
                elif slot in outputs:
                    spec = program.buffers[slot]
                    shape, dtype = shape_of(slot), np.dtype(spec.dtype.np_dtype)
                    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                    where[slot] = ("out", len(self._outputs))
                    self._outputs.append((slot, shape, dtype, nbytes))
                else:
                    raise _NotApplicable
            kind, ref = where[slot]
            if kind == "fix":
                args[position] = id(ref)
            else:
                fills.append((position, ref, kind == "out"))
        if total <= 0:
            return
        self._launches.append((kernel._fn, args, _int64s(values), total))
        self._fills.append(fills)

    # -- the call ---------------------------------------------------------------------

    def run(self, arrays: list) -> list | None:
        """The outputs for `arrays` (C-contiguous, of the plan's signature), or None when
        this call must take the general path (the plan is busy on another thread, or a
        profile is recording)."""
        if _profiler.ACTIVE is not None or not self._lock.acquire(False):
            return None
        try:
            outs = []
            track = self._track
            for output in self._outputs:
                if output[3] <= SMALL_OUTPUT_BYTES:  # counted while it lives, as eager results
                    out = np.empty(output[1], output[2])
                    track(out)
                else:
                    out = self._new_output(*output)
                outs.append(out)
            objects = arrays + outs
            if self._one_blas:
                with blas_single_thread():
                    self._call(objects)
            else:
                self._call(objects)
            return outs
        finally:
            self._lock.release()

    def _call(self, objects: list) -> None:
        native = self._native
        if native is not None:  # one native call runs every launch
            trampoline, table, n, bound, scratch = native
            for k, obj in enumerate(objects):
                bound[k] = id(obj)
            trampoline(table, n, bound, scratch)
            return
        for (fn, args, sizes, total), fills in zip(self._launches, self._fills):
            for position, k in fills:
                args[position] = id(objects[k])
            fn(args, sizes, 0, total)

    def _new_output(self, _slot, shape, dtype, nbytes: int) -> np.ndarray:
        # a block of the caching allocator: a dropped output's (paged-in) block is the
        # next call's, as the executor's outputs are
        allocator = self._executable.allocator
        out = allocator.empty(shape, dtype)
        allocator.end_call(nbytes)  # the caller's once returned, as the executor counts
        return out

    def _release(self) -> None:
        if self._held:
            self._executable.allocator.release_persistent(self._held)
            self._held = 0
        self._fixed = []

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown: the allocator may be gone
            pass


class _NotApplicable(Exception):
    """The program needs the general path."""
