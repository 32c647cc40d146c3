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
- intermediates live in one of the executor's arenas for these sizes, which the plan
  holds while it lives (counted as arena bytes, as the executor's are);
- outputs of up to 1 MiB are `np.empty`, counted by the CPU caching allocator as eager
  results are (`kn.memory`, the memory fraction); larger ones are its blocks, as the
  executor's are (a dropped output's paged-in block is the next call's).

- an extern (an op run by its numpy reference: random_bits, sort, LAPACK) runs between
  native runs on the typed arrays of its slots, its results checked against their
  buffers (a mismatch sends the call, and every later one, to the general path);
- a launch split over threads is a record of the native run too (the trampoline enters
  the OpenMP region), once its split verdict is known (kiln/codegen/cpu/split_rule.py:
  a candidate's first calls are timed serial and split); until then, and where libgomp
  is missing, it is the kernel's own call on typed arrays, and the plan lays its runs out
  again when every verdict is in (or the thread count changed, or a verdict is to be
  measured again: split_rule's `_stale`, checked at most every RETRY_S). Where a run's
  split launches include measured ones (not `sure`), the plan then times its whole run
  with and without them (the trampoline's `loose` thread count, 1 or more; the sure ones
  stay split in both) and keeps them only where the run is faster with them. A run whose
  splits are all sure is not checked: it splits from its first native call.

A plan applies to the CPU backend's programs of launches, views, constants and externs
whose outputs are fresh buffers (control flow, collectives, an input, constant or view
returned keep the general path), arguments called by pytrees included (a training
step's dicts of parameters). A call that cannot use it (a busy plan on another thread,
a strided argument, a profile running) returns None and the caller takes the general
path, so nothing a guard checks is skipped: the signature is the guard, and a
different one never reaches the plan.

    >>> plan = FastPlan.build(executable, sizes)   # None: the program needs the general path
    >>> outputs = plan.run([x])                     # None: this call takes the general path
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Sequence

import numpy as np

from kiln.runtime import profiler as _profiler
from kiln.runtime.allocator import default_allocator
from kiln.runtime.device import allocator_for
from kiln.codegen.cpu import native_pool
from kiln.codegen.cpu.split_rule import RETRY_S, RUN_WIN, Split, epoch as split_epoch
from kiln.runtime.threads import blas_single_thread, get_num_threads
from kiln.runtime.executor import SMALL_OUTPUT_BYTES, _fresh
from kiln.runtime.program import Collective, Constant, Extern, Launch, View


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

    __slots__ = ("_parts", "_outputs", "_returns", "_n_inputs", "_n_objects", "_lock",
                 "_one_blas", "_executable", "_fixed", "_arena", "_arena_key", "_track", "_broken",
                 "_extern_returns", "_sizes", "_pending", "_watch", "_recheck", "_generation",
                 "_run_split", "_sure", "_return_views", "__weakref__")

    @classmethod
    def build(cls, executable, sizes: dict) -> "FastPlan | None":
        """The plan for `executable` at `sizes`, or None where the program needs the
        general path (see the module docstring)."""
        program = executable.program
        if executable.side is not None or executable.device is not None:
            return None
        if executable.allocator is not default_allocator():
            return None  # another device's memory (an OpenCL program's shared buffers)
        from kiln.codegen.cpu.compiled import CompiledKernel

        if not all(isinstance(k, CompiledKernel) for k in executable.kernels.values()):
            return None  # another backend's kernels (OpenCL, Triton, CuTe) keep their path
        if not all(isinstance(s, (Launch, View, Constant)) or
                   (isinstance(s, Extern) and not isinstance(s, Collective)) for s in program.steps):
            return None
        plan = cls(executable, sizes)
        return plan if plan._parts is not None else None

    def __init__(self, executable, sizes: dict):
        self._executable = executable
        self._lock = threading.Lock()
        self._sizes = dict(sizes)
        self._fixed: list = []  # arrays whose ids are baked into the argument arrays
        self._arena = None  # the executor's arena this plan holds (intermediates)
        self._lay_out()

    def _lay_out(self) -> None:
        """Decide every step's form (again, after `_release`): native runs, kernel
        calls, externs, and the outputs to allocate."""
        executable, sizes = self._executable, self._sizes
        program = executable.program
        self._arena_key = ()
        self._pending: list = []  # split states still measuring: the plan is laid out again
        self._watch: list = []  # measured verdicts of native launches (measured again later)
        self._recheck = 0.0
        self._generation = split_epoch()
        self._run_split = None  # the whole run's split state, where its launches split
        self._sure = False  # does a native run hold a sure split?
        self._parts: list = []  # ("launches", [(fn, args, sizes, total, split)], fills, native) | ("extern", ...)
        self._outputs: list = []  # (object index, shape, dtype, nbytes): allocated per call
        self._track = allocator_for("cpu").track_new
        self._one_blas = False
        self._broken = False  # an extern returned what its buffer is not: general path
        self._n_inputs = self._n_objects = len(program.inputs)
        # the call's objects: its inputs, then outputs and extern results by index
        where: dict[int, tuple] = {s: ("obj", k) for k, s in enumerate(program.inputs)}
        typed: dict[int, tuple] = {s: ("obj", k, None, None) for k, s in enumerate(program.inputs)}
        try:
            self._prepare(executable, program, sizes, where, typed)
        except _NotApplicable:
            self._parts = None
            self._release()
        except BaseException:
            self._release()  # the arena back to the executor; the error is a bug to see
            raise

    def _new_object(self) -> int:
        self._n_objects += 1
        return self._n_objects - 1

    def _prepare(self, executable, program, sizes, where, typed) -> None:
        def shape_of(slot):
            return tuple(int(d) for d in executable._shape_fn(slot)(sizes))

        def dtype_of(slot):
            return np.dtype(program.buffers[slot].dtype.np_dtype)

        def nbytes_of(slot):
            return int(np.prod(shape_of(slot), dtype=np.int64)) * dtype_of(slot).itemsize

        # storage of the memory plan: one of the executor's arenas for these sizes, held
        # while the plan lives (given back when it dies), so intermediates are not kept
        # twice; a storage the arena lacks is made as the executor makes it (first slot)
        self._arena_key = tuple(sorted(sizes.items()))
        self._arena = storages = executable._take_arena(self._arena_key)
        for slot, sid in program.storage.items():
            if sid not in storages:
                storages[sid] = executable.allocator.empty(shape_of(slot), dtype_of(slot), persistent=True)
        outputs = set(program.outputs)
        if len(outputs) != len(program.outputs):
            raise _NotApplicable  # one buffer returned twice: the second is a copy
        extern_results: set[int] = set()
        for step in program.steps:
            if isinstance(step, Constant):
                data = executable._constants[step.name]
                if not (isinstance(data, np.ndarray) and data.flags.c_contiguous) or step.target in outputs:
                    raise _NotApplicable  # a constant returned: the caller's copy
                self._fixed.append(data)
                where[step.target] = ("fix", data)
                typed[step.target] = ("fix", data)
            elif isinstance(step, View):
                if step.source not in where or (step.target in outputs and
                                                step.target not in executable._view_roots):
                    raise _NotApplicable  # a returned view is copied by the general path
                where[step.target] = where[step.source]
                shape, dtype = shape_of(step.target), dtype_of(step.target)
                source = typed[step.source]
                if source[0] == "fix":
                    view = source[1].reshape(-1).view(dtype).reshape(shape)
                    self._fixed.append(view)
                    typed[step.target] = ("fix", view)
                else:
                    typed[step.target] = ("obj", source[1], shape, dtype)
            elif isinstance(step, Launch):
                for slot in step.args:
                    if slot in where:
                        continue
                    sid = program.storage.get(slot)
                    if sid is not None:  # an intermediate: the arena's storage, typed
                        base = storages[sid].reshape(-1)
                        if base.nbytes < nbytes_of(slot):
                            raise _NotApplicable
                        view = base.view(np.uint8)[:nbytes_of(slot)].view(dtype_of(slot)).reshape(shape_of(slot))
                        self._fixed.append(view)
                        where[slot] = typed[slot] = ("fix", view)
                    elif slot in outputs or slot in executable._transient_set:
                        # an output, or a buffer an output views (executor.view_roots):
                        # allocated per call
                        k = self._new_object()
                        self._outputs.append((k, shape_of(slot), dtype_of(slot), nbytes_of(slot)))
                        where[slot] = ("obj", k)
                        typed[slot] = ("obj", k, None, None)
                    else:
                        raise _NotApplicable
                self._launch(executable, step, sizes, where, typed)
            else:
                self._extern(executable, program, step, sizes, where, typed, shape_of, dtype_of)
                extern_results.update(step.outputs)
        self._returns = []
        # [(index in the returns, getter, made by an extern?)]: views of this call's buffers
        self._return_views = None
        fresh = {k for k, *_ in self._outputs}
        made = {typed[s][1] for s in extern_results if typed.get(s, ("",))[0] == "obj"}
        returned = [typed.get(slot) for slot in program.outputs]
        for slot, kind in zip(program.outputs, returned):
            if kind is None or kind[0] != "obj" or kind[1] < self._n_inputs:
                raise _NotApplicable  # an input or constant returned: the caller's copy
            if kind[2] is not None:  # a view: the caller's own if its buffer is this call's
                if slot not in executable._view_roots or (kind[1] not in fresh and kind[1] not in made) or \
                        sum(1 for other in returned if other is not None and other[1] == kind[1]) > 1:
                    raise _NotApplicable  # (a view of arena storage, or returned twice: copied)
                self._return_views = (self._return_views or []) + [(len(self._returns), kind, kind[1] in made)]
            self._returns.append(kind[1])
        self._extern_returns = {typed[s][1] for s in program.outputs if s in extern_results}
        for part in self._parts:
            if part[0] == "launches" and (len(part[1]) > 1 or part[1][0][4] is not None):
                part[3] = _launch_list(part[1], part[2], self._n_objects)
        natives = [part[3] for part in self._parts if part[0] == "launches" and part[3] is not None]
        self._sure = any(native[8] for native in natives)
        if any(native[6] for native in natives):
            # each measured split launch won alone, timed while every candidate alternated;
            # the run keeps them only where it measures faster whole with them than without
            # (a thread asleep after a long serial stretch, data left in another core's
            # cache). Sure splits are not in doubt: a run of only those is not measured
            # (its state is `sure`: split, timed to catch a wait for a core)
            self._run_split = Split(False, 1, None, sure=not any(native[7] for native in natives),
                                    win=RUN_WIN)

    def _launch(self, executable, step, sizes, where, typed) -> None:
        kernel = executable.kernels[step.kernel]
        info = getattr(kernel, "launch_info", None)
        entry = None
        if info is not None and getattr(kernel, "_by_object", False):
            values, total, _ = info(sizes)
            entry = kernel._resolved.get(tuple(values))
        s = None if entry is None else entry[2]
        split = None  # (split function's address, unit, most threads) of a split record
        if s is not None and s.decided() and s.splits() and native_pool.usable():
            most = get_num_threads() if s.max_threads is None else min(s.max_threads, get_num_threads())
            split = ((native_pool.parallel_claim_address() if s.claim else native_pool.parallel_for_address()),
                     s.unit, most, int(s.sure))
        if entry is None or (s is not None and split is None and (not s.decided() or s.splits())):
            # no object entry, a split verdict still measured, or a split without
            # libgomp: the kernel's own call, on the typed arrays of its slots, as the
            # executor calls it
            if s is not None and not s.decided():
                self._pending.append(s)
            self._parts.append(("kernel", kernel, [typed[slot] for slot in step.args], dict(sizes)))
            return
        if s is not None and not s.sure and split_epoch()[1] == "measure":
            self._watch.append(s)  # measured (or serial for now): measured again later
        # BLAS at one thread around kernels that call it (the kernel's own call does so
        # for every GEMM; a micro-kernel calls no library)
        self._one_blas = self._one_blas or bool(entry[3] and getattr(kernel, "calls_blas", True))
        args = _void_ptrs(len(step.args))
        fills = []
        for position, slot in enumerate(step.args):
            kind, ref = where[slot]
            if kind == "fix":
                args[position] = id(ref)
            else:
                fills.append((position, ref))
        if total <= 0:
            return
        if not self._parts or self._parts[-1][0] != "launches":
            self._parts.append(["launches", [], [], None])
        self._parts[-1][1].append((kernel._fn, args, _int64s(values), total, split))
        self._parts[-1][2].append(fills)

    def _extern(self, executable, program, step, sizes, where, typed, shape_of, dtype_of) -> None:
        """An op run by its library reference between native launches: its operands are
        the typed arrays of its slots; each result becomes a call object, checked against
        its buffer's dtype and shape (a mismatch sends this and every later call to the
        general path, which behaves as it always did)."""
        from kiln.ir.emitter import EAGER
        from kiln.ir.interpret import concrete_attrs

        op = step.op
        run = executable.externs.get(op) or (lambda arrays, a: EAGER.apply(op, arrays, a))
        getters = []
        for slot in step.inputs:
            if slot not in typed:
                raise _NotApplicable
            getters.append(typed[slot])
        results = []
        for slot in step.outputs:
            if slot in where:
                raise _NotApplicable  # written in place: not a fresh result
            k = self._new_object()
            where[slot] = ("obj", k)
            typed[slot] = ("obj", k, None, None)
            results.append((k, shape_of(slot), dtype_of(slot)))
        self._parts.append(("extern", run, concrete_attrs(step.attrs, sizes), getters, results))

    # -- the call ---------------------------------------------------------------------

    def run(self, arrays: list) -> list | None:
        """The outputs for `arrays` (C-contiguous, of the plan's signature), or None when
        this call must take the general path (the plan is busy on another thread, or a
        profile is recording)."""
        if _profiler.ACTIVE is not None or self._broken or self._parts is None \
                or not self._lock.acquire(False):
            return None  # (no parts: a layout after a verdict found the program unfit)
        try:
            # (at one thread any layout runs serial: the trampoline's count caps every split)
            if (self._generation != split_epoch() and get_num_threads() > 1) or (
                    self._pending and all(s.decided() for s in self._pending)) or (
                    self._watch and self._retry_due()):
                self._release()  # verdicts in, or the thread count changed: lay out anew
                self._lay_out()
                if self._parts is None:
                    return None
            run_split = self._run_split
            if run_split is not None:  # loose: the measured splits' threads (1: serial)
                loose, timed = run_split.next()
                # sure splits: the threads there are, in serial trials too
                threads = loose if loose > 1 else run_split.cap()
                if loose > 1 or (threads > 1 and self._sure):  # a split will run: sleeping
                    native_pool.wake()  # workers wake while the first launches run serial
            else:
                threads = loose = 1
                timed = False
            objects = arrays + [None] * (self._n_objects - self._n_inputs)
            track = self._track
            for k, shape, dtype, nbytes in self._outputs:
                if nbytes <= SMALL_OUTPUT_BYTES:  # counted while it lives, as eager results
                    out = np.empty(shape, dtype)
                    track(out)
                else:
                    out = self._new_output(shape, dtype, nbytes)
                objects[k] = out
            t0 = time.perf_counter_ns() if timed else 0
            if self._one_blas:
                with blas_single_thread():
                    done = self._call(objects, threads, loose)
            else:
                done = self._call(objects, threads, loose)
            if timed:
                run_split.report(loose, time.perf_counter_ns() - t0)
            if not done:
                return None
            if self._extern_returns:
                out = [objects[k] if k not in self._extern_returns or objects[k].flags.owndata
                       else objects[k].copy() for k in self._returns]
            else:
                out = [objects[k] for k in self._returns]
            if self._return_views is not None:
                for i, getter, by_extern in self._return_views:
                    out[i] = _typed(getter, objects)
                    if by_extern and not objects[getter[1]].flags.owndata:  # as the executor
                        out[i] = out[i].copy()
            return out
        finally:
            self._lock.release()

    def _retry_due(self) -> bool:
        """Is a native launch's verdict to be measured again (an unmeasured serial one
        after RETRY_S, a measured one expired: split_rule's `_stale`; checked at most
        every RETRY_S)? Then the plan lays out anew and the launch is measured again."""
        now = time.monotonic()
        if now < self._recheck:
            return False
        self._recheck = now + RETRY_S
        return not all(s.decided() for s in self._watch)

    def _call(self, objects: list, threads: int, loose: int) -> bool:
        for part in self._parts:
            if part[0] == "extern":
                if not self._run_extern(part, objects):
                    self._broken = True
                    return False
                continue
            if part[0] == "kernel":
                _, kernel, getters, sizes = part
                kernel([_typed(g, objects) for g in getters], sizes)
                continue
            _, launches, fills, native = part
            if native is not None:  # one native call runs every launch of the run
                trampoline, table, n, bound, scratch, used, splits = native[:7]
                for k in used:
                    bound[k] = id(objects[k])
                if splits and native_pool.usable():
                    trampoline(table, n, bound, scratch, threads, loose)
                else:
                    trampoline(table, n, bound, scratch, 1, 1)
                continue
            for (fn, args, sizes, total, _), fill in zip(launches, fills):  # one serial launch
                for position, k in fill:
                    args[position] = id(objects[k])
                fn(args, sizes, 0, total)
        return True

    @staticmethod
    def _run_extern(part, objects: list) -> bool:
        _, run, attrs, getters, results = part
        operands = [_typed(g, objects) for g in getters]
        produced = run(operands, attrs)
        if len(produced) != len(results):
            return False
        for (k, shape, dtype), r in zip(results, produced):
            if r.__class__ is not np.ndarray:
                r = np.asarray(r)  # a 0-d result may come back as a numpy scalar
            if r.dtype != dtype or r.shape != shape:
                return False
            if not r.flags.c_contiguous:
                r = np.ascontiguousarray(r)
            objects[k] = _fresh(r, operands)
        return True

    def _new_output(self, shape, dtype, nbytes: int) -> np.ndarray:
        # a block of the caching allocator: a dropped output's (paged-in) block is the
        # next call's, as the executor's outputs are
        allocator = self._executable.allocator
        out = allocator.empty(shape, dtype)
        allocator.end_call(nbytes)  # the caller's once returned, as the executor counts
        return out

    def _release(self) -> None:
        arena, self._arena = self._arena, None
        if arena is not None:  # the executor's again (it counts and frees its arenas)
            self._executable._return_arena(self._arena_key, arena)
        self._fixed = []

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown: the allocator may be gone
            pass


def _typed(g: tuple, objects: list) -> np.ndarray:
    """The array of a slot: a fixed one, or a call object (reshaped for a view, and
    reinterpreted for a view that changes the dtype, as view_as_real does)."""
    if g[0] == "fix":
        return g[1]
    a = objects[g[1]]
    if g[2] is not None:
        a = (a.reshape(-1).view(g[3]) if a.dtype != g[3] else a).reshape(g[2])
    return a


def _launch_list(launches: list, fills: list, n_objects: int) -> tuple:
    """(trampoline, list, n, objects, args, used object indexes, any split?, any measured
    split?, any sure split?): a run of launches in one native call (launch_list.launch_trampoline); the
    list's words, per launch: the `.np` entry's address, the argument count, the sizes'
    address, the loop count, the split function's address (0: serial), its unit, the most
    threads, whether the split is sure, then each argument (an object's address, or
    -(k + 1) for the call's k-th object)."""
    from kiln.codegen.cpu.launch_list import launch_trampoline

    words: list[int] = []
    widest = 1
    used: set[int] = set()
    for (fn, args, sizes, total, split), fill in zip(launches, fills):
        values = [args[i] or 0 for i in range(len(args))]
        for position, k in fill:
            values[position] = -(k + 1)
            used.add(k)
        words += [ctypes.cast(fn, ctypes.c_void_p).value, len(values), ctypes.addressof(sizes),
                  total, *(split or (0, 1, 1, 1)), *values]
        widest = max(widest, len(values))
    table = (ctypes.c_int64 * len(words))(*words)
    return (launch_trampoline(), table, len(launches), (ctypes.c_void_p * max(1, n_objects))(),
            (ctypes.c_void_p * widest)(), tuple(sorted(used)), any(l[4] is not None for l in launches),
            any(l[4] is not None and not l[4][3] for l in launches),
            any(l[4] is not None and l[4][3] for l in launches))


class _NotApplicable(Exception):
    """The program needs the general path."""
