"""Capture and replay: a compiled program's launches recorded once, replayed without
Python per kernel.

`CapturedPlan` takes a `Program` whose sizes are now fixed and turns it into a flat
*plan* over one table of buffer pointers: every buffer gets its storage once, at capture
time, and every step becomes an op over table indices — a kernel launch with its size
values and loop count precomputed, a byte copy, an N-way `Switch`, a `Loop`. Runs of ops
a backend can execute natively are handed to its *launcher* (for the CPU, an LLVM
function that calls the kernels' raw entries one after the other, branches and loops
included), so a replay is: bind the inputs into the table, call the native code, copy
the outputs out. Steps that cannot be native (a launch large enough to be split over the
worker pool, an extern such as sort or LAPACK, a collective) run as Python steps between
native runs, on the same captured buffers. This is CUDA graphs' model on a CPU: the
same buffers, the same launches, every replay.

Semantics kept from the executor: `cond` takes branch `clamp(int(index))`; a
`while_loop` carries its values in buffers of its own (copied in once per loop, copied
back from the body's outputs after each trip, through scratch buffers when an output is
another carried value); outputs are copies the caller owns. A replay with an input of
another shape or dtype than the captured one is K390 — never a silent wrong result.
"""

from __future__ import annotations

import abc
import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir.emitter import EAGER
from kiln.ir.interpret import concrete_attrs
from kiln.ir.shapes import dim_function
from kiln.runtime.program import Collective, Constant, Control, Extern, Launch, Program, View


class KilnCaptureError(KilnError, ValueError):
    code = "K390"
    title = "replay arguments do not match the capture"


# -- the plan's ops: table indices, no arrays ------------------------------------------------

@dataclass(frozen=True)
class NativeLaunch:
    """Call a kernel's raw entry `fn(void **args, int64 *sizes, 0, total)`."""
    address: int
    args: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int
    kernel: Any  # the compiled kernel, for a launcher-less run
    size_names: tuple[str, ...]
    threads: int = 1  # > 1: the loop range is split over that many native threads


@dataclass(frozen=True)
class Copy:
    """memmove(table[dst], table[src], nbytes)."""
    dst: int
    src: int
    nbytes: int


@dataclass(frozen=True)
class Switch:
    """Branch `clamp(int(table[index]), 0, n - 1)` runs its ops (ending in the copies
    of its outputs into the parent's)."""
    index: int
    index_dtype: np.dtype
    branches: tuple[tuple, ...]


@dataclass(frozen=True)
class Loop:
    """`init`; then while table[flag] after `cond`: `body`, then `back` (the copies of
    the body's outputs into the carried buffers)."""
    init: tuple
    cond: tuple
    flag: int
    body: tuple
    back: tuple


@dataclass(frozen=True)
class Swap:
    """Exchange two buffers: every table entry on buffer `a` (views included) gets
    buffer `b`'s pointer and the other way round. A loop hands its body's fresh output
    back as the carried value this way, without copying it."""
    a: int  # root indices
    b: int
    groups: dict = field(compare=False, repr=False)  # root -> table indices on it

    def members(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.groups[self.a], self.groups[self.b]

    def exchange(self, table) -> None:
        """Point every entry of `table` on one buffer at the other (both ways)."""
        members_a, members_b = self.members()
        pa, pb = table[self.a], table[self.b]
        for m in members_a:
            table[m] = pb
        for m in members_b:
            table[m] = pa


@dataclass(frozen=True)
class PyStep:
    """A step only Python runs: `run(arrays)` reads and writes captured buffers."""
    run: Callable[[list], None]
    label: str


def is_native(op) -> bool:
    if isinstance(op, (NativeLaunch, Copy, Swap)):
        return True
    if isinstance(op, Switch):
        return all(is_native(o) for branch in op.branches for o in branch)
    if isinstance(op, Loop):
        return all(is_native(o) for part in (op.init, op.cond, op.body, op.back) for o in part)
    return False


class Launcher(abc.ABC):
    """What a backend gives capture: `compile(ops)` turns a run of native ops into a
    function of the table's address; `bind(inputs, aliases)`, optionally, a function of
    (table address, address of an array of numpy object pointers) that fills the input
    entries from the arrays' objects and then the alias entries (views of inputs).
    `parallel`: launches whose work the runtime would split over threads can be native
    too (the launcher splits them itself)."""

    parallel = False

    @abc.abstractmethod
    def compile(self, ops: Sequence) -> Callable[[int], None]:
        """A function of the table's address that runs `ops` (all native) in order."""

    def bind(self, inputs: Sequence[int], aliases: Sequence[tuple[int, int]]):
        return None


# -- capture: storage for every buffer, steps to ops -----------------------------------------

class _Flattener:
    def __init__(self, kernels: dict, externs: dict, sizes: dict, launcher: Launcher | None,
                 device=None):
        self.kernels, self.externs, self.sizes = kernels, externs, sizes
        self.device = device or "cpu"  # whose memory every captured buffer is
        self.native = launcher is not None
        self.parallel = bool(launcher is not None and launcher.parallel)
        self.arrays: list = []  # table index -> array (None: an input, bound per call)
        self.dynamic: set[int] = set()  # indices whose pointer changes with the inputs
        self.aliases: list[tuple[int, int, tuple]] = []  # (target, source, shape), bind order
        self.root: list[int] = []  # table index -> the index whose memory it is
        self.frozen: set[int] = set()  # roots that must keep their memory (constants)
        self.groups: dict[int, tuple[int, ...]] = {}  # filled by finish()
        self.swapped: list[Swap] = []

    def finish(self) -> None:
        """Every swap's buffers get their table entries (views made after the loop too)."""
        members: dict[int, list[int]] = {}
        for index, root in enumerate(self.root):
            members.setdefault(root, []).append(index)
        self.groups.update({root: tuple(m) for root, m in members.items()})

    def buffer(self, shape, dtype) -> np.ndarray:
        """A captured buffer, from the caching allocator of the program's device: counted
        by kn.memory and held to the memory fraction while the capture lives. Every op
        writes a buffer before reading it, so none needs clearing."""
        from kiln.runtime.device import allocator_for

        return allocator_for(self.device).array(shape, dtype, what="a captured program's buffer")

    def new(self, array, root: int | None = None) -> int:
        self.arrays.append(array)
        self.root.append(len(self.arrays) - 1 if root is None else root)
        return len(self.arrays) - 1

    def shape(self, program: Program, slot: int) -> tuple[int, ...]:
        return tuple(int(dim_function(d)(self.sizes)) for d in program.buffers[slot].shape)

    def storage(self, program: Program, slot: int, shared: dict) -> int:
        spec = program.buffers[slot]
        shape, dtype = self.shape(program, slot), np.dtype(spec.dtype.np_dtype)
        sid = program.storage.get(slot)
        if sid is None:
            return self.new(self.buffer(shape, dtype))
        base, base_index = shared[sid]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self.new(base[:nbytes].view(dtype).reshape(shape), base_index)

    def flatten(self, program: Program, env: dict[int, int]) -> list:
        shared = self._shared_storage(program)
        ops: list = []
        for step in program.steps:
            ops.extend(self.step(program, step, env, shared))
        return ops

    def _shared_storage(self, program: Program) -> dict:
        need: dict[int, int] = {}
        for slot, sid in program.storage.items():
            spec = program.buffers[slot]
            nbytes = int(np.prod(self.shape(program, slot))) * np.dtype(spec.dtype.np_dtype).itemsize
            need[sid] = max(need.get(sid, 0), nbytes)
        shared = {}
        for sid, nbytes in need.items():
            base = self.buffer((max(nbytes, 1),), np.uint8)
            shared[sid] = (base, self.new(base))
        return shared

    def index(self, env: dict, program: Program, slot: int, shared: dict) -> int:
        if slot not in env:
            env[slot] = self.storage(program, slot, shared)
        return env[slot]

    def step(self, program: Program, step, env: dict, shared: dict) -> list:
        if isinstance(step, Launch):
            args = tuple(self.index(env, program, s, shared) for s in step.args)
            kernel = self.kernels[step.kernel]
            info = getattr(kernel, "launch_info", None)
            if info is not None and self.native and getattr(kernel, "address", 0):
                values, total, parallel = info(self.sizes)
                if total <= 0:
                    return []
                if not parallel or self.parallel:
                    threads = getattr(kernel, "_threads", 1) if parallel else 1
                    return [NativeLaunch(kernel.address, args, values, total, kernel,
                                         tuple(kernel.kernel.sizes), threads)]
            sizes = self.sizes
            return [PyStep(lambda arrays: kernel([arrays[i] for i in args], sizes), step.kernel)]
        if isinstance(step, View):
            source = env[step.source]
            shape = self.shape(program, step.target)
            array = self.arrays[source]
            if array is not None and array.dtype != program.buffers[step.target].dtype.np_dtype:
                array = array.reshape(-1).view(program.buffers[step.target].dtype.np_dtype)
            array = None if array is None else array.reshape(shape)
            target = env[step.target] = self.new(array, self.root[source])
            if source in self.dynamic:
                self.dynamic.add(target)
                self.aliases.append((target, source, shape))
            return []
        if isinstance(step, Constant):
            data = np.ascontiguousarray(program.constants[step.name])
            if self.device != "cpu":  # in the device's memory, copied once at capture
                from kiln.runtime.device import kind_of

                on_device = self.buffer(data.shape, data.dtype)
                kind_of(self.device).copy(on_device, data)
                data = on_device
            env[step.target] = self.new(data)
            self.frozen.add(env[step.target])
            return []
        if isinstance(step, Extern):
            return [self._extern(program, step, env, shared)]
        if isinstance(step, Control):
            return self._control(program, step, env, shared)
        raise KilnError(f"internal: capture met an unknown program step {type(step).__name__}")

    def _extern(self, program: Program, step: Extern, env: dict, shared: dict) -> PyStep:
        inputs = tuple(env[s] for s in step.inputs)
        outputs = tuple(self.index(env, program, s, shared) for s in step.outputs)
        attrs = concrete_attrs(step.attrs, self.sizes)
        op = step.op
        if isinstance(step, Collective):
            from kiln.distributed.graph_collectives import run_step as run_collective

            run = lambda arrays, a: run_collective(op, arrays, a)  # noqa: E731
        else:
            run = self.externs.get(op) or (lambda arrays, a: EAGER.apply(op, arrays, a))

        def extern(arrays):
            results = run([arrays[i] for i in inputs], attrs)
            for i, r in zip(outputs, results):
                target = arrays[i]
                r = np.asarray(r)
                if r.shape != target.shape or r.dtype != target.dtype:
                    raise KilnError(f"internal: captured {op} returned {r.dtype}{list(r.shape)}, "
                                    f"its buffer is {target.dtype}{list(target.shape)}")
                np.copyto(target, r)

        return PyStep(extern, op)

    def _nbytes(self, index: int) -> int:
        array = self.arrays[index]
        return array.nbytes

    def _control(self, program: Program, step: Control, env: dict, shared: dict) -> list:
        if step.op == "cond":
            index, operands = env[step.inputs[0]], [env[s] for s in step.inputs[1:]]
            outs = [self.index(env, program, s, shared) for s in step.outputs]
            branches = []
            for body in step.bodies:
                sub = dict(zip(body.inputs, operands))
                ops = self.flatten(body, sub)
                ops += [Copy(o, sub[b], self._nbytes(o)) for o, b in zip(outs, body.outputs)]
                branches.append(tuple(ops))
            dtype = np.dtype(program.buffers[step.inputs[0]].dtype.np_dtype)
            return [Switch(index, dtype, tuple(branches))]
        if step.op == "while_loop":
            cond_body, loop_body = step.bodies
            carried = [self.storage(loop_body, s, {}) for s in loop_body.inputs]
            init = tuple(Copy(k, env[s], self._nbytes(k)) for k, s in zip(carried, step.inputs))
            cond_env = dict(zip(cond_body.inputs, carried))
            cond_ops = self.flatten(cond_body, cond_env)
            body_env = dict(zip(loop_body.inputs, carried))
            body_ops = self.flatten(loop_body, body_env)
            back = self._back_copies(carried, [body_env[s] for s in loop_body.outputs])
            for slot, k in zip(step.outputs, carried):
                env[slot] = k
            return [Loop(init, tuple(cond_ops), cond_env[cond_body.outputs[0]], tuple(body_ops), back)]
        raise KilnError(f"internal: capture met an unknown control step {step.op}")

    def _back_copies(self, carried: list[int], outs: list[int]) -> tuple:
        """The body's outputs handed back as the carried values. A fresh output buffer of
        the body is swapped with its carried buffer (no copy); an output that is (a view
        of) another carried value goes through a scratch buffer, so no copy reads a
        buffer an earlier copy of the same trip overwrote; anything else is copied."""
        carried_roots = {self.root[k]: i for i, k in enumerate(carried)}
        out_roots = [self.root[o] for o in outs]
        first, then, swaps = [], [], []
        for i, (k, o) in enumerate(zip(carried, outs)):
            r = self.root[o]
            j = carried_roots.get(r)
            if o == k:
                continue  # passed through unchanged
            if j is not None:
                scratch = self.new(self.buffer(self.arrays[k].shape, self.arrays[k].dtype))
                first.append(Copy(scratch, o, self._nbytes(k)))
                then.append(Copy(k, scratch, self._nbytes(k)))
            elif (r not in self.frozen and r not in self.dynamic and out_roots.count(r) == 1
                    and self.arrays[r].nbytes == self.arrays[k].nbytes and k == self.root[k]
                    and self.arrays[r] is not None):
                swap = Swap(k, r, self.groups)
                self.swapped.append(swap)
                swaps.append(swap)
            else:
                then.append(Copy(k, o, self._nbytes(k)))
        return tuple(first + then + swaps)


# -- running a plan ----------------------------------------------------------------------------

class _Block:
    """A list of ops made runnable: native runs compiled, the rest in Python."""

    def __init__(self, ops: Sequence, launcher: Launcher | None, plan: "CapturedPlan"):
        self.parts: list = []
        self.native_parts = 0
        run: list = []

        def flush():
            if run:
                self.parts.append(("native", launcher.compile(list(run))))
                self.native_parts += 1
                run.clear()

        for op in ops:
            if launcher is not None and is_native(op):
                run.append(op)
                continue
            flush()
            self.parts.append(("op", op if isinstance(op, PyStep) else _python_op(op, launcher, plan)))
        flush()

    def __call__(self, plan: "CapturedPlan") -> None:
        for kind, part in self.parts:
            if kind == "native":
                part(plan.table_address)
                if plan.swaps and len(self.parts) > 1:
                    plan.sync()
            else:
                part.run(plan.arrays) if isinstance(part, PyStep) else part(plan)


def _python_op(op, launcher, plan):
    """An op run from Python (its sub-blocks may still be native)."""
    if isinstance(op, NativeLaunch):  # no launcher: call the kernel as the executor does
        sizes = dict(zip(op.size_names, op.sizes))
        return PyStep(lambda arrays: op.kernel([arrays[i] for i in op.args], sizes), "launch")
    if isinstance(op, Copy):
        def copy(plan):
            if op.nbytes:
                ctypes.memmove(plan.table[op.dst], plan.table[op.src], op.nbytes)
        return copy
    if isinstance(op, Swap):
        def swap(plan):
            op.exchange(plan.table)
            plan.swap_arrays(op)
        return swap
    if isinstance(op, Switch):
        branches = [_Block(b, launcher, plan) for b in op.branches]

        def switch(plan):
            k = int(plan.arrays[op.index].reshape(()) if plan.arrays[op.index].size == 1
                    else plan.arrays[op.index])
            branches[min(max(k, 0), len(branches) - 1)](plan)
        return switch
    if isinstance(op, Loop):
        init, cond, body, back = (_Block(p, launcher, plan) for p in (op.init, op.cond, op.body, op.back))

        def loop(plan):
            init(plan)
            while True:
                cond(plan)
                if not bool(plan.arrays[op.flag].reshape(())):
                    break
                body(plan)
                back(plan)
        return loop
    raise KilnError(f"internal: capture cannot run {type(op).__name__}")


class CapturedPlan:
    """A program captured for fixed input shapes: `run(arrays)` replays it."""

    def __init__(self, program: Program, kernels: dict, externs: dict, sizes: dict,
                 example: Sequence[np.ndarray], launcher: Launcher | None = None,
                 device=None):
        self.program, self.sizes = program, dict(sizes)
        self.launcher = launcher  # owns the native code the plan calls
        self.device = device  # None: host memory; else every buffer is this device's
        flat = _Flattener(kernels, externs, self.sizes, launcher, device)
        env = {}
        for slot in program.inputs:
            env[slot] = flat.new(None)
            flat.dynamic.add(env[slot])
        ops = flat.flatten(program, env)
        flat.finish()
        self.swaps = flat.swapped
        self._shapes = [None if a is None else a.shape for a in flat.arrays]
        self.input_index = [env[s] for s in program.inputs]
        self.output_index = [env[s] for s in program.outputs]
        self.input_specs = [(tuple(np.shape(a)), np.dtype(np.asarray(a).dtype)) for a in example]
        self.arrays = flat.arrays
        self._aliases = flat.aliases
        self._alias_of = {t: (src, shape) for t, src, shape in flat.aliases}
        self.table = (ctypes.c_void_p * max(1, len(self.arrays)))()
        for i, array in enumerate(self.arrays):
            if array is not None:
                self.table[i] = array.ctypes.data
        self.table_address = ctypes.addressof(self.table)
        self.ops = ops
        if launcher is not None and hasattr(launcher, "attach"):  # what it reads of the plan
            launcher.attach(self)
        self._block = _Block(ops, launcher, self)
        self._needs_arrays = any(kind != "native" for kind, _ in self._block.parts)
        self._bind = None
        if launcher is not None and not self._needs_arrays:
            self._bind = launcher.bind(self.input_index, [(t, s) for t, s, _ in self._aliases])
        self._objects = (ctypes.c_void_p * max(1, len(self.input_index)))()
        self._objects_address = ctypes.addressof(self._objects)
        self._lock = threading.Lock()

    @property
    def native_runs(self) -> int:
        return self._block.native_parts

    def check(self, arrays: Sequence[np.ndarray], name: str = "replay") -> list[np.ndarray]:
        if len(arrays) != len(self.input_specs):
            raise KilnCaptureError(f"{name}: the capture took {len(self.input_specs)} inputs, got {len(arrays)}")
        out = []
        for i, (a, (shape, dtype)) in enumerate(zip(arrays, self.input_specs)):
            if a.shape != shape or a.dtype != dtype:
                raise KilnCaptureError(
                    f"{name}: input {i} is {a.dtype}{list(a.shape)}, but the program was captured "
                    f"for {dtype}{list(shape)}",
                    hint="capture again for the new shape (kn.capture), or call the compiled "
                         "function, which specializes per shape")
            out.append(a if a.flags.c_contiguous else np.ascontiguousarray(a))
        return out

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        arrays = self.check(arrays)
        with self._lock:
            if self._bind is not None:
                objects, held = self._objects, self.arrays
                for k, (i, a) in enumerate(zip(self.input_index, arrays)):
                    objects[k] = id(a)
                    held[i] = a
                self._bind(self.table_address, self._objects_address)
            else:
                table, held = self.table, self.arrays
                for i, a in zip(self.input_index, arrays):
                    held[i] = a
                    table[i] = a.ctypes.data
                for target, source, shape in self._aliases:
                    held[target] = held[source].reshape(shape)
                    table[target] = table[source]
            try:
                self._block(self)
                if self.swaps:
                    self.sync()
                return [self._output(i) for i in self.output_index]
            finally:
                for i in self.input_index:  # keep no caller memory alive past the call
                    self.arrays[i] = None
                for target, _, _ in self._aliases:
                    self.arrays[target] = None

    def swap_arrays(self, swap: Swap) -> None:
        """Exchange the arrays of a swap's two buffers (the table is the caller's)."""
        arrays, shapes = self.arrays, self._shapes
        members_a, members_b = swap.members()
        root_a, root_b = arrays[swap.a], arrays[swap.b]
        for m in members_a:
            arrays[m] = root_b.reshape(shapes[m])
        for m in members_b:
            arrays[m] = root_a.reshape(shapes[m])

    def sync(self) -> None:
        """After native code swapped buffers, point the arrays where the table points."""
        table, arrays = self.table, self.arrays
        for swap in self.swaps:
            if table[swap.a] != arrays[swap.a].__array_interface__["data"][0]:
                self.swap_arrays(swap)

    def _output(self, index: int) -> np.ndarray:
        array = self.arrays[index]
        if array is None:  # a view of an input, bound natively: make it from the input
            source, shape = self._alias_of[index]
            return self._output(source).reshape(shape)
        if self.device is not None:  # the caller's copy, in the device's memory
            from kiln.runtime.device import allocator_for, kind_of

            out = allocator_for(self.device).array(array.shape, array.dtype, "a replay's output")
            kind_of(self.device).copy(out, np.ascontiguousarray(array))
            return out
        return array.copy()
