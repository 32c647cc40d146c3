"""`CompiledKernel`: the lean Python-side call path of one compiled kernel.

Everything that can be is precomputed at compile time: the ctypes function, the ctypes
arrays for buffer pointers and sizes, expected dtypes, shape checks and the loop count
as small closures (no sympy per call). A call validates dtypes/shapes cheaply, fills
the two arrays, and either calls the function once or splits the flattened outer range
over threads when the estimated work is large.

Which launches split is measured, not assumed (`split_rule.Split`): the cost model names
the candidates (loop kernels above `parallel_threshold` element-operations, batched
GEMMs above `split_rule.BATCH_MACS` multiply-adds, single products cut into row panels
above `autotune.SPLIT_MACS`), and each candidate splits only where its timed first calls
showed splitting faster on this host.

A split launch runs on native threads entered once from native code (kiln's team,
`native_team.py`, on Linux; else GNU OpenMP's where libgomp is present):
`native_pool.parallel_for` (a static cut) for loop kernels, and
`native_pool.parallel_claim` (panels or batch items claimed from an atomic counter, one
BLAS thread each) for GEMMs. A hand-off through kiln's Python `WorkerPool` costs 85-120
us back to back (each worker must take the GIL), which made a 16384-element kernel 9x
slower split than not. The pool stays where neither is available (and in a child forked
after a libgomp region ran): its workers call kernels through `ctypes.CFUNCTYPE`, which releases
the GIL, so they run in parallel; the caller runs the first range itself and waits for
the rest. Both are restarted in a forked child (threads do not survive `fork`).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
import weakref

import numpy as np
import sympy

from kiln.codegen.kernel_ir import BatchKernel, GemmKernel, Kernel, Load, Op, Reduce, walk
from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir.shapes import dim_function, format_shape
from kiln.codegen.cpu.mathlib import F32_FUNCS
from kiln.codegen.cpu.llvm_emit import NUMPY_DATA_OFFSET
from kiln.runtime.threads import blas_single_thread, get_num_threads
from kiln.codegen.cpu.autotune import SPLIT_MACS
from kiln.codegen.cpu.native_pool import parallel_claim, parallel_for
from kiln.codegen.cpu.split_rule import BATCH_MACS, SURE_MACS, SURE_WORK, Split

KERNEL_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


# -- the worker pool ----------------------------------------------------------------

class WorkerPool:
    """`run(fn, bufs, sizes, ranges)` calls fn(bufs, sizes, lo, hi) for every range,
    ranges[1:] on workers and ranges[0] on the calling thread."""

    def __init__(self, workers: int):
        self.size = max(0, workers)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = []
        self._lock = threading.Lock()  # one parallel call at a time shares the workers
        self._forked = False
        self._start(0, self.size)
        _LIVE_POOLS.add(self)

    def _after_fork(self) -> None:
        """In a forked child: the workers did not come along (fork copies one thread),
        and a call would wait for them for ever; the next call starts them anew."""
        self._tasks, self._threads = queue.SimpleQueue(), []
        self._lock = threading.Lock()
        self._forked = True

    def _revive(self) -> None:
        with _POOL_LOCK:
            if self._forked:
                self._forked = False
                self._start(0, self.size)

    def _start(self, first: int, last: int) -> None:
        for i in range(first, last):
            t = threading.Thread(target=self._loop, name=f"kiln-cpu-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def grow(self, workers: int) -> None:
        """Add workers up to `workers` (kn.set_num_threads raised the count)."""
        with self._lock:  # not while a parallel call is using the workers
            if workers > self.size:
                self._start(self.size, workers)
                self.size = workers

    def close(self, timeout: float = 5.0) -> None:
        """Stop this pool's workers (bounded wait): for a pool made apart from kiln's own
        (kiln's lives as long as the process)."""
        with self._lock:
            for _ in self._threads:
                self._tasks.put((None, None, None))
            deadline = time.monotonic() + timeout
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))
            self._threads, self.size = [t for t in self._threads if t.is_alive()], 0

    def _loop(self) -> None:
        while True:
            fn, args, done = self._tasks.get()
            if fn is None:
                return
            try:
                fn(*args)
                done.put(None)
            except BaseException as exc:  # surfaced on the calling thread
                done.put(exc)

    def run(self, fn, bufs, sizes, ranges: list[tuple[int, int]]) -> None:
        if self._forked:
            self._revive()
        if len(ranges) == 1 or not self._lock.acquire(blocking=False):
            with blas_single_thread():
                for lo, hi in ranges:  # busy (nested/concurrent use): run inline
                    fn(bufs, sizes, lo, hi)
            return
        try:
            with blas_single_thread():  # BLAS threads would fight the pool's for cores
                done: queue.SimpleQueue = queue.SimpleQueue()
                for lo, hi in ranges[1:]:
                    self._tasks.put((fn, (bufs, sizes, lo, hi), done))
                fn(bufs, sizes, *ranges[0])
                errors = [done.get() for _ in ranges[1:]]
        finally:
            self._lock.release()
        for err in errors:
            if err is not None:
                raise err


    def run_claimed(self, fn, bufs, sizes, ranges: list[tuple[int, int]], threads: int) -> None:
        """Call fn(bufs, sizes, lo, hi) for every range, claimed one at a time by the
        caller and up to `threads - 1` workers, with BLAS at one thread. Returns once every
        range ran, without waiting for a worker that never got a core: on a busy machine
        the caller takes the ranges a late worker has not claimed, so a large GEMM split
        this way degrades to one thread instead of stalling (OpenBLAS's own threads wait
        for each other at every block)."""
        if self._forked:
            self._revive()
        helpers = min(threads - 1, self.size, len(ranges) - 1)
        if helpers < 1 or not self._lock.acquire(blocking=False):
            with blas_single_thread():
                for lo, hi in ranges:
                    fn(bufs, sizes, lo, hi)
            return
        claim = iter(range(len(ranges))).__next__  # next() of a range iterator is atomic
        left = [len(ranges)]
        errors: list = []
        finished = threading.Event()
        count_lock = threading.Lock()

        def work():
            while True:
                try:
                    i = claim()
                except StopIteration:
                    return
                try:
                    fn(bufs, sizes, *ranges[i])
                except BaseException as exc:  # surfaced on the calling thread
                    errors.append(exc)
                with count_lock:
                    left[0] -= 1
                    if left[0] == 0:
                        finished.set()

        try:
            with blas_single_thread():
                for _ in range(helpers):
                    self._tasks.put((work, (), _Discard))
                work()
                # every range is claimed; wait only for those still running on a worker
                finished.wait()
        finally:
            self._lock.release()
        if errors:
            raise errors[0]


class _Discard:
    """The `done` queue of a claimed task: the caller waits on its own event instead."""

    @staticmethod
    def put(_item) -> None:
        return None


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()
_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _pools_after_fork() -> None:
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()  # another thread may have held it at the fork
    for p in list(_LIVE_POOLS):
        p._after_fork()


os.register_at_fork(after_in_child=_pools_after_fork)


def pool(threads: int) -> WorkerPool:
    """kiln's one intra-op pool, grown to at least `threads - 1` workers (the caller is
    the last thread): every kernel shares it, so threads never multiply per kernel."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = WorkerPool(threads - 1)
        elif _POOL.size < threads - 1:
            _POOL.grow(threads - 1)
        return _POOL


def default_threads() -> int:
    """kiln's intra-op thread count (kn.get_num_threads: the CPUs this process may use,
    affinity and cgroup quota included, unless kn.set_num_threads changed it)."""
    return get_num_threads()


def split(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[0, total) cut into `parts` near-equal ranges, boundaries multiples of `align`."""
    parts = max(1, min(parts, total // max(1, align) or 1))
    step = -(-total // parts)
    step = -(-step // align) * align
    return [(lo, min(total, lo + step)) for lo in range(0, total, step)] or [(0, 0)]


# -- compiled kernels --------------------------------------------------------------

def _data_field_ok() -> bool:
    """Does a numpy array keep its data pointer at NUMPY_DATA_OFFSET (CPython, 64-bit)?"""
    probe = np.zeros(3)
    return ctypes.c_void_p.from_address(id(probe) + NUMPY_DATA_OFFSET).value == probe.ctypes.data


def _product(closures):
    def f(env):
        out = 1
        for c in closures:
            out *= c(env)
        return out
    return f


def _expr_cost(e) -> int:
    """Rough per-element cost: loads and transcendentals dominate."""
    cost = 1
    for node in walk(e):
        if isinstance(node, Load):
            cost += 1
        elif isinstance(node, Op) and node.op in F32_FUNCS:
            cost += 8
    return cost


def stage_costs(kernel: Kernel) -> list[int]:
    """Estimated element-operations per point of each stage: plain data, which a
    program-cache entry keeps so that a load need not walk the expressions again."""
    return [_expr_cost(s.value) + (0 if isinstance(s, Reduce) else 1) for s in kernel.stages]


def _work_per_point(kernel: Kernel, costs: list | None = None):
    """Closure: estimated element-operations per outer point (`costs`: `stage_costs`,
    kept from when the kernel was built; ValueError unless one int >= 0 per stage)."""
    if costs is None:
        costs = stage_costs(kernel)
    elif len(costs) != len(kernel.stages) or not all(type(c) is int and c >= 0 for c in costs):
        raise ValueError(f"{kernel.name}: stage costs {costs!r} do not fit its stages")
    parts = [(_product([dim_function(l.extent) for l in s.loops]), c) for s, c in zip(kernel.stages, costs)]
    return lambda env: sum(e(env) * c for e, c in parts)


_DATA_FIELD_OK = _data_field_ok()


class CompiledKernel:
    """Call as `compiled(arrays, sizes)`: runs the kernel in place on contiguous numpy
    arrays ordered as `kernel.buffers`; `sizes` binds every name of `kernel.sizes`."""

    # whether a GEMM kernel calls BLAS (the backend clears it for kiln's micro-kernel):
    # BLAS is set to one thread around the call only then (a 3-10 us toggle per call)
    calls_blas = True

    def __init__(self, kernel, address: int, owner, *, threads: int, threshold: int,
                 outer_extents: tuple, serial: bool = False, object_address: int = 0,
                 work_costs: list | None = None):
        self.kernel = kernel
        self.name = kernel.name
        self._owner = owner  # keeps the JIT engine (and so the code) alive
        self.address = address  # raw-pointer entry: fn(void **bufs, int64 *sizes, lo, hi)
        # arrays are passed as objects (the `.np` entry) where the layout check passed
        self._by_object = bool(object_address) and _DATA_FIELD_OK
        self._entry = object_address if self._by_object else address
        self._fn = KERNEL_FN(self._entry)
        self._n = len(kernel.buffers)
        self._size_names = tuple(kernel.sizes)
        self._dtypes = tuple(np.dtype(b.dtype.np_dtype) for b in kernel.buffers)
        self._static_shapes = []
        for b in kernel.buffers:
            dims = tuple(sympy.sympify(d) for d in b.shape)
            if all(d.is_Integer for d in dims):
                self._static_shapes.append(tuple(int(d) for d in dims))
            else:
                self._static_shapes.append(tuple(dim_function(d) for d in dims))
        self._count = _product([dim_function(e) for e in outer_extents])
        if isinstance(kernel, GemmKernel) or serial:
            self._work = None
        elif isinstance(kernel, BatchKernel):  # members' work averaged over its points
            from kiln.codegen.cpu.batch_emit import batch_work

            self._work = batch_work(kernel)
        else:
            self._work = _work_per_point(kernel, work_costs)
        self._max_threads, self._threshold = threads, threshold
        self._splittable = threads > 1 and self._work is not None
        self._gemm_dims = None
        if isinstance(kernel, GemmKernel):  # sizes of a product, to judge small/batched
            self._gemm_dims = [dim_function(d) for d in (kernel.batch, kernel.m, kernel.n, kernel.k)]
        self._bufs = (ctypes.c_void_p * max(1, self._n))()
        self._sizes = (ctypes.c_int64 * max(1, len(self._size_names)))()
        self._busy = threading.Lock()
        self._resolved: dict = {}

    @property
    def _threads(self) -> int:
        """Threads a launch may split over: the compiled count capped by kn.set_num_threads
        (a call also caps it by the CPUs other processes leave idle, parallel_threads)."""
        return min(self._max_threads, get_num_threads())

    def _check(self, i: int, a, env) -> None:
        b = self.kernel.buffers[i]
        if not isinstance(a, np.ndarray):
            raise KilnArgumentError(f"{self.name}: buffer {b.name} must be a numpy array, got "
                                    f"{type(a).__name__}")
        if a.dtype != self._dtypes[i]:
            raise KilnDTypeError(f"{self.name}: buffer {b.name} must be {b.dtype.name}, got {a.dtype}")
        want = self._static_shapes[i]
        if want and not isinstance(want[0], int):
            want = tuple(c(env) for c in want)
        if a.shape != want and a.size != int(np.prod(want)):
            raise KilnShapeError(f"{self.name}: buffer {b.name} must have shape {want} "
                                 f"({format_shape(b.shape)}), got {a.shape}")
        if not a.flags.c_contiguous or (b.role == "out" and not a.flags.writeable):
            raise KilnArgumentError(f"{self.name}: buffer {b.name} must be a C-contiguous"
                                    + (" writeable" if b.role == "out" else "") + " array",
                                    hint="pass np.ascontiguousarray(x)")

    def _resolve(self, key: tuple):
        """(shapes, loop count, split, one BLAS thread?) for one binding of the sizes,
        memoized: a program calls a kernel with the same sizes over and over. `split` is
        None (always serial) or the launch's `split_rule.Split` (a candidate)."""
        env = dict(zip(self._size_names, key))
        shapes = tuple(s if not s or isinstance(s[0], int) else tuple(c(env) for c in s)
                       for s in self._static_shapes)
        total = self._count(env)
        split_state = None
        work = total * self._work(env) if self._splittable and total > 1 else 0
        if work >= self._threshold and work > 0:
            split_state = Split(False, 64 if total >= 1024 else 1, self._max_threads, work >= SURE_WORK)
        one_blas = False
        if self._gemm_dims is not None:
            batch, m, n, k = (int(f(env)) for f in self._gemm_dims)
            # every BLAS call kiln makes runs on one BLAS thread: kiln's pool is the
            # parallelism (large products below). OpenBLAS's own threads busy-wait for each
            # other per block: at load ~12 on 2 CPUs the GPT step's mid-size products
            # (2^21..2^23 multiply-adds) with 2 BLAS threads took 256-404 ms a step
            # against 14 ms with one (benchmarks/bench_stress.py)
            one_blas = self.calls_blas
            macs = batch * m * n * k
            if batch > 1 and total >= batch and macs >= BATCH_MACS:
                # instead a batch is split over kiln's threads, whole batch items claimed
                # one at a time (B is packed once per item), one BLAS thread each
                split_state = Split(True, total // batch, None, macs >= SURE_MACS)
            elif batch == 1 and total > 1 and macs >= SPLIT_MACS:
                # one large product cut into row panels (autotune.panel_rows_for): kiln's
                # threads claim them, one BLAS thread each
                split_state = Split(True, 1, None, macs >= SURE_MACS)
        entry = (shapes, total, split_state, one_blas)
        if len(self._resolved) > 64:
            self._resolved.clear()
        self._resolved[key] = entry
        return entry

    def launch_info(self, sizes: dict) -> tuple[tuple[int, ...], int, bool]:
        """(size values in the kernel's order, loop count, split?) for `sizes`: what a
        native launch list needs to call the raw entry itself (kiln.runtime.capture).
        Split: a loop kernel the policy or its verdict splits, or one still unmeasured (a
        captured plan runs no trials: the model's candidates keep their split there); a
        GEMM's claimed split is the kernel's own call only."""
        key = tuple(sizes[name] for name in self._size_names)
        entry = self._resolved.get(key) or self._resolve(key)
        s = entry[2]
        return key, entry[1], s is not None and not s.claim and (s.splits() or not s.decided())

    def _launch(self, s: Split, threads: int, bufs, csizes, total: int) -> None:
        """One call of the kernel over [0, total) on `threads` threads (1: serial)."""
        if threads <= 1:
            self._fn(bufs, csizes, 0, total)
        elif s.claim:
            native = parallel_claim()
            if native is not None:  # OpenMP threads claim units from an atomic counter
                native(self._entry, bufs, csizes, total, s.unit, threads)
            else:
                units = [(lo, min(total, lo + s.unit)) for lo in range(0, total, s.unit)]
                pool(threads).run_claimed(self._fn, bufs, csizes, units, threads)
        else:
            native = parallel_for()
            if native is not None:  # OpenMP threads, entered once from native code
                native(self._entry, bufs, csizes, total, s.unit, threads)
            else:
                pool(threads).run(self._fn, bufs, csizes, split(total, threads, s.unit))

    def __call__(self, arrays, sizes=None) -> None:
        if len(arrays) != self._n:
            raise KilnArgumentError(f"{self.name}: expected {self._n} arrays, got {len(arrays)}")
        try:
            key = tuple([sizes[name] for name in self._size_names]) if self._size_names else ()
        except (KeyError, TypeError):
            raise KilnArgumentError(f"{self.name}: sizes must bind {', '.join(self._size_names)}; "
                                    f"got {sizes!r}") from None
        entry = self._resolved.get(key)
        shapes, total, s, one_blas = entry if entry is not None else self._resolve(key)
        own = self._busy.acquire(False)
        bufs = self._bufs if own else (ctypes.c_void_p * max(1, self._n))()
        csizes = self._sizes if own else (ctypes.c_int64 * max(1, len(self._size_names)))()
        try:
            for k, v in enumerate(key):
                csizes[k] = v
            dtypes = self._dtypes
            for i, a in enumerate(arrays):
                if a.__class__ is not np.ndarray or a.dtype != dtypes[i] or a.shape != shapes[i] \
                        or not a.flags.c_contiguous:
                    self._check(i, a, dict(zip(self._size_names, key)))
                # the .np entry point reads the data pointer from the array object itself
                bufs[i] = id(a) if self._by_object else a.ctypes.data
            if total <= 0:
                return
            if s is None:
                if one_blas:
                    with blas_single_thread():
                        self._fn(bufs, csizes, 0, total)
                else:
                    self._fn(bufs, csizes, 0, total)
                return
            threads, timed = s.next()
            t0 = time.perf_counter_ns() if timed else 0
            if one_blas:
                with blas_single_thread():
                    self._launch(s, threads, bufs, csizes, total)
            else:
                self._launch(s, threads, bufs, csizes, total)
            if timed:
                s.report(threads, time.perf_counter_ns() - t0)
        finally:
            if own:
                self._busy.release()
