"""Running a `Program`: bind sizes, hand out buffers, execute the steps.

Each step is turned into a small closure once, when the Executable is built, so a
call does no interpretation beyond a loop over closures: a small compiled function
costs a few microseconds on top of its kernels. Intermediate buffers come from an
arena cached per size binding (the memory plan says which buffers share storage),
so a repeated call allocates only its outputs.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Callable, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir.emitter import EAGER
from kiln.ir.interpret import concrete_attrs
from kiln.ir.shapes import dim_function
from kiln.runtime import profiler as _profiler
from kiln.runtime.allocator import Allocator, default_allocator
from kiln.runtime.device import allocator_for
from kiln.runtime.program import Collective, Constant, Control, Extern, Launch, Program, View
from kiln.runtime.native_loops import NativeLoop
from kiln.runtime.native_switch import NativeSwitch

KernelFn = Callable[[list, dict], None]

# outputs up to this size are np.empty, tracked as eager results are (~1 us with the
# tracking); larger ones are blocks of the caching allocator (~5-10 us a call, its
# accounting and lease included), whose exact-size reuse hands a dropped output's
# paged-in memory to the next call. glibc raises its mmap threshold to the largest
# block freed (up to 32 MiB), so a dropped np.empty output of this size is served again
# from the heap without page faults: measured 64 KiB-4 MiB, allocate + fill took the
# time of filling a kept buffer, 0 minor faults per call
SMALL_OUTPUT_BYTES = 1 << 20


class Executable:
    """A Program with its compiled kernels; `run(arrays, sizes)` returns the outputs."""

    def __init__(self, program: Program, kernels: dict[str, KernelFn],
                 allocator: Allocator | None = None, externs: dict | None = None,
                 device=None, side=None):
        """`device`: a device (not the CPU) whose memory every buffer is in; the host
        boundary is then crossed only where the program needs the host (see
        kiln/runtime/device_programs.py). `side` is the parent's (sub-programs)."""
        self.program = program
        self.kernels = kernels
        # ops the backend runs itself (a GPU grouped GEMM) instead of their numpy
        # reference: op -> fn(arrays, attrs) -> results
        self.externs = dict(externs or {})
        self.allocator = allocator or default_allocator()
        if side is None and device is not None:
            from kiln.runtime.device_programs import DeviceSide

            side = DeviceSide(device, self.allocator)
        self.side = side
        self.device = device if side is None else side.device
        # a program on a device reads its constants from device memory (copied once)
        self._constants = program.constants if side is None else \
            {name: side.constant(c) for name, c in program.constants.items()}
        self._arenas: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self._nslots = max(program.buffers, default=-1) + 1
        self._static = {s: spec.shape for s, spec in program.buffers.items()
                        if all(isinstance(d, int) for d in spec.shape)}
        self._borrowed_constants = {id(c) for c in self._constants.values()}
        self._transient: list[int] = []  # slots allocated fresh on every call (outputs)
        self._returned: dict[int, list] = {}  # output slot -> arrays handed out before
        self._output_slots = frozenset(program.outputs)
        self._first_writers = _first_writers(program)
        self._steps = [self._compile_step(i, step) for i, step in enumerate(program.steps)]
        self._timed: list | None = None  # the steps with profiler timing, made on first use
        self._transient_set = frozenset(self._transient)
        self._extern_results = extern_results(program) if self.side is None else frozenset()
        self._view_roots = view_roots(program, self._transient_set, self._extern_results) \
            if self.side is None else {}
        self._uses_arena = bool(program.storage)

    # -- building the closures ----------------------------------------------------------

    def _shape_fn(self, slot: int):
        static = self._static.get(slot)
        if static is not None:
            return lambda sizes: static
        dims = [dim_function(d) for d in self.program.buffers[slot].shape]
        return lambda sizes: tuple(d(sizes) for d in dims)

    def _allocator_for(self, slot: int):
        """A function giving a fresh buffer for `slot` (outputs) or its arena storage."""
        dtype = self.program.buffers[slot].dtype.np_dtype
        shape_of = self._shape_fn(slot)
        storage = self.program.storage.get(slot)
        allocator = self.allocator
        if storage is None:
            self._transient.append(slot)
            # small outputs of a host program: np.empty, counted as eager results are (see
            # kiln/runtime/fast_call.py, whose prepared calls allocate them the same way)
            track = allocator_for("cpu").track_new if self.side is None and \
                allocator is default_allocator() else None
            itemsize = np.dtype(dtype).itemsize

            def fresh(sizes, arena):
                # a while_loop body may hand back last-but-one trip's output to refill
                recycled = arena.pop(("out", slot), None) if arena else None
                shape = shape_of(sizes)
                if recycled is not None and recycled.shape == shape:
                    return recycled
                if track is not None and math.prod(shape) * itemsize <= SMALL_OUTPUT_BYTES:
                    out = np.empty(shape, dtype)
                    track(out)
                    return out
                reclaimed = self._reclaim(slot, shape)
                return reclaimed if reclaimed is not None else allocator.empty(shape, dtype)

            return fresh

        def from_arena(sizes, arena):
            shape = shape_of(sizes)
            array = arena.get(storage)
            if array is None:
                array = arena[storage] = allocator.empty(shape, dtype, persistent=True)
            return array.reshape(shape)

        return from_arena

    def _compile_step(self, index: int, step):
        if isinstance(step, Launch):
            kernel = self.kernels[step.kernel]
            args = step.args
            fresh = [(position, slot, self._allocator_for(slot))
                     for position, slot in enumerate(args) if self._first_write(slot, index)]

            def launch(env, sizes, arena):
                for _, slot, make in fresh:
                    env[slot] = make(sizes, arena)
                kernel([env[s] for s in args], sizes)

            return launch
        if isinstance(step, View):
            shape_of, source, target = self._shape_fn(step.target), step.source, step.target
            buffers = self.program.buffers
            if buffers[source].dtype != buffers[target].dtype:  # view_as_real/_complex
                np_dtype = buffers[target].dtype.np_dtype

                def retyped(env, sizes, arena):
                    flat = env[source].reshape(-1)  # a view: buffers are contiguous
                    env[target] = flat.view(np_dtype).reshape(shape_of(sizes))

                return retyped

            def view(env, sizes, arena):
                env[target] = env[source].reshape(shape_of(sizes))

            return view
        if isinstance(step, Collective):  # before Extern, its base class
            run_step, op, attrs = _collective_runner(), step.op, step.attrs
            inputs, outputs, side = step.inputs, step.outputs, self.side

            def collective(env, sizes, arena):
                operands = [env[s] for s in inputs]
                if side is not None:
                    side.host_read(operands)
                results = run_step(op, operands, concrete_attrs(attrs, sizes))
                for s, r in zip(outputs, results):
                    env[s] = _fresh(r, operands) if side is None else side.to_device(r)

            return collective
        if isinstance(step, Extern):
            op, attrs, inputs, outputs = step.op, step.attrs, step.inputs, step.outputs

            run = self.externs.get(op) or (lambda arrays, a: EAGER.apply(op, arrays, a))
            side = self.side

            def extern(env, sizes, arena):
                operands = [env[s] for s in inputs]
                if side is not None:  # computed on the host: read there, written back
                    side.host_read(operands)
                results = run(operands, concrete_attrs(attrs, sizes))
                for s, r in zip(outputs, results):
                    env[s] = _fresh(r, operands) if side is None else side.to_device(r)

            return extern
        if isinstance(step, Constant):
            data, target = self._constants[step.name], step.target

            def constant(env, sizes, arena):
                env[target] = data

            return constant
        if isinstance(step, Control):
            bodies = [Executable(b, self.kernels, self.allocator, self.externs, side=self.side)
                      for b in step.bodies]
            inputs, outputs, op, side = step.inputs, step.outputs, step.op, self.side
            # a CPU while_loop may run as a native launch list, no Python per trip, and a
            # CPU cond/switch dispatches natively, writing the step's outputs in place
            native = None
            if side is None and NativeLoop.applies(step, self.kernels):
                native = NativeLoop(self.program, step, self.kernels, self.externs)
            elif side is None and NativeSwitch.applies(step, self.kernels):
                native = NativeSwitch(self.program, step, self.kernels, self.externs, self.allocator)

            def control(env, sizes, arena):
                operands = [env[s] for s in inputs]
                results = native.run(operands, sizes) if native is not None else None
                if results is None:
                    results = _run_control(op, bodies, operands, sizes, env[-1], side)
                else:  # arrays made for this call (copies, or outputs): the caller's own
                    env[-1].update((id(r), r) for r in results)
                for s, r in zip(outputs, results):
                    env[s] = r

            return control
        raise KilnError(f"internal: unknown program step {type(step).__name__}")

    def _first_write(self, slot: int, index: int) -> bool:
        """Does step `index` produce `slot` (rather than read it)?"""
        return self._first_writers.get(slot, index) >= index

    # -- running ---------------------------------------------------------------------------

    def run(self, arrays: Sequence[np.ndarray], sizes: dict[str, int],
            borrow: bool = False, recycle: Sequence[np.ndarray] = (),
            remember: bool = False, made: dict | None = None) -> list[np.ndarray]:
        """The outputs; `borrow=True` (sub-programs of control flow) may return an input
        or a constant itself, since the parent program still checks its own outputs.
        `recycle` offers arrays (a loop's outputs from two trips ago, which nothing reads
        any more) to be overwritten as this run's outputs instead of allocating.
        `remember=True` (a `cond` branch, whose outputs become its parent's) keeps the
        outputs it allocated for reuse once every holder has dropped them, as a top-level
        run does (see `_reclaim`). `made` (id -> array) collects the outputs this call
        allocated, across control-flow sub-programs, so a parent hands a branch's fresh
        output to its caller as it is instead of copying it."""
        program = self.program
        # one global read per run: a profile swaps in timed copies of the steps
        steps = self._steps if _profiler.ACTIVE is None else self._timed_steps()
        env = [None] * (self._nslots + 1)
        made = env[-1] = {} if made is None else made  # read by the control steps
        for slot, array in zip(program.inputs, arrays):
            env[slot] = array
        offered = {("out", s): a for s, a in zip(program.outputs, recycle)
                   if a is not None} if recycle else None
        if self._uses_arena:
            key = tuple(sorted(sizes.items()))
            arena = self._take_arena(key)
            context = {**arena, **offered} if offered else arena
            try:
                for step in steps:
                    step(env, sizes, context)
            finally:
                if offered:  # keep storages the run created; drop unused offers
                    arena.update({k: v for k, v in context.items() if not isinstance(k, tuple)})
                self._return_arena(key, arena)
        else:
            context = offered or None
            for step in steps:
                step(env, sizes, context)
        if self.side is not None and not borrow:
            self.side.finish()
        if self._transient:
            self.allocator.end_call(sum(env[s].nbytes for s in self._transient
                                        if env[s] is not None and env[s].nbytes > SMALL_OUTPUT_BYTES))
            if not borrow or remember:
                self._remember_outputs(env)
        result = []
        borrowed = None
        fresh = self._transient_set
        handed: set[int] = set()
        for slot in program.outputs:
            array = env[slot]
            if (slot in fresh or made.get(id(array)) is array) and id(array) not in handed:
                # allocated (or reclaimed) for this call, here or in a branch or loop body
                # run by it: the caller's own (once: a second output of it is a copy)
                handed.add(id(array))
                made[id(array)] = array
                result.append(array)
                continue
            root = self._view_roots.get(slot)
            if root is not None and id(env[root]) not in handed and \
                    (root not in self._extern_results or env[root].flags.owndata):
                # a view (z.real's pairs as complex, a reshape) of a buffer allocated for
                # this call that nothing else returns: the caller's own, not copied
                handed.add(id(env[root]))
                made[id(array)] = array
                result.append(array)
                continue
            # any other output must be the caller's own too: never an input, a constant,
            # or a view into memory the next call reuses
            copy = np.copy if self.side is None else self.side.copy  # on the program's device
            if not array.flags.owndata or id(array) in handed:  # (handed: returned twice)
                array = copy(array)
            elif not borrow:
                if borrowed is None:
                    borrowed = {id(a) for a in arrays} | self._borrowed_constants
                if id(array) in borrowed:
                    array = copy(array)
            result.append(array)
        return result

    def _timed_steps(self) -> list:
        """The step closures wrapped to record profiler events (kernels, externs, control
        flow; collectives are recorded by the Flight Recorder, see kiln.runtime.profiler)."""
        if self._timed is None:
            from kiln.codegen.kernel_cost import flops_function
            from kiln.runtime.profiler import timed_step

            timed, name = [], self.program.name
            for step, fn in zip(self.program.steps, self._steps):
                if isinstance(step, Launch):
                    kernel = self.program.kernels.get(step.kernel)
                    stage = "gemm" if type(kernel).__name__ == "GemmKernel" else "kernel"
                    flops = flops_function(kernel) if kernel is not None else None
                    fn = timed_step(fn, step.kernel, stage, step.args, flops, name)
                elif isinstance(step, Extern) and not isinstance(step, Collective):
                    fn = timed_step(fn, step.op, "extern", step.inputs + step.outputs, None, name)
                elif isinstance(step, Control):
                    fn = timed_step(fn, step.op, "control", step.inputs + step.outputs, None, name)
                timed.append(fn)
            self._timed = timed
        return self._timed

    # -- output reuse -----------------------------------------------------------------------
    # A large fresh output costs its page faults on every call (numpy's big buffers are
    # mmapped anew each time): for a 32 MiB layer_norm that is 4x the kernel. An output
    # array handed to the caller is remembered; once the caller has dropped every
    # reference to it (only this list holds it), the next call writes into it instead.

    _KEEP = 2  # remembered arrays per output slot

    def _remember_outputs(self, env) -> None:
        outputs = self._output_slots
        for slot in self._transient:
            array = env[slot]
            if slot in outputs and array is not None and array.flags.owndata \
                    and array.nbytes > SMALL_OUTPUT_BYTES:  # np.empty ones: freed when dropped
                kept = self._returned.get(slot)
                if kept is None:
                    kept = self._returned.setdefault(slot, [])
                kept.append(array)  # list operations are atomic: no lock on this path
                if len(kept) > self._KEEP:
                    del kept[0]

    def _reclaim(self, slot: int, shape: tuple):
        kept = self._returned.get(slot)
        if not kept:
            return None
        for _ in range(len(kept)):
            try:
                array = kept.pop()  # atomic: two threads never get the same array
            except IndexError:
                return None
            # referenced only here (the local and getrefcount's argument): the caller
            # dropped it, so this call may overwrite it
            if sys.getrefcount(array) == 2 and array.shape == shape:
                return array
            kept.insert(0, array)
        return None

    def __del__(self):
        held = sum(a.nbytes for pool in self._arenas.values() for arena in pool for a in arena.values())
        if held:
            self.allocator.release_persistent(held)

    def _take_arena(self, key):
        with self._lock:
            pool = self._arenas.setdefault(key, [])
            return pool.pop() if pool else {}

    def _return_arena(self, key, arena):
        with self._lock:
            self._arenas[key].append(arena)


def _first_writers(program: Program) -> dict[int, int]:
    """slot -> the index of the first step that names it among what it writes (every
    argument of a launch, the outputs or target of another step); the program's inputs
    map to -1 (never written here). One pass over the steps: asking each launch argument
    by a scan of the steps before it was quadratic (~4 ms of building a training step)."""
    first = dict.fromkeys(program.inputs, -1)
    for index, step in enumerate(program.steps):
        written = (step.args if isinstance(step, Launch) else
                   getattr(step, "outputs", ()) or ((step.target,) if hasattr(step, "target") else ()))
        for slot in written:
            first.setdefault(slot, index)
    return first


def view_roots(program: Program, transient: frozenset,
               extern_results: frozenset = frozenset()) -> dict[int, int]:
    """output slot -> the slot it views (through View steps only), for outputs that are
    views of a buffer made fresh on every call that is not itself an output: `transient`
    (a launch's first write), or an extern's result (`extern_results`: an embedding's
    lookup reshaped to the tokens' shape). Such an output is the caller's own memory, and
    the run returns it as it is instead of copying it (a complex result read as float32
    pairs, a reshape); an extern's result only where it owns its data (checked per call:
    `_fresh` made it memory of its own). Views of inputs, constants or arena storage are
    not here."""
    source = {step.target: step.source for step in program.steps if isinstance(step, View)}
    outputs = set(program.outputs)
    roots = {}
    for slot in program.outputs:
        root, seen = slot, 0
        while root in source and seen <= len(source):
            root, seen = source[root], seen + 1
        if root != slot and (root in transient or root in extern_results) and root not in outputs:
            roots[slot] = root
    return roots


def extern_results(program: Program) -> frozenset:
    """Slots an extern step (not a collective) writes: arrays its reference made in
    that call, which `_fresh` keeps from aliasing an operand."""
    return frozenset(s for step in program.steps
                     if isinstance(step, Extern) and not isinstance(step, Collective) for s in step.outputs)


def _fresh(result, operands: list):
    """An extern's result as memory of its own. The memory plan counts an extern's
    outputs as new buffers and reuses an operand's storage after its last read, so a
    result that is a view of an operand (a reference such as dynamic_slice of the whole
    operand, or a collective over one rank, returns its input) is copied."""
    if isinstance(result, np.ndarray) and result.size and any(
            isinstance(a, np.ndarray) and np.may_share_memory(result, a) for a in operands):
        return result.copy()
    return result


def _run_control(op: str, bodies: list[Executable], operands: list, sizes: dict,
                 made: dict, side=None) -> list:
    """Run a cond or while_loop step; `made` collects the outputs its bodies allocated
    (see `Executable.run`); `side` (a program on a device) waits for the device before
    the host reads the branch index or the loop flag, and counts the read."""
    if op == "cond":
        index, *rest = operands
        if side is not None:
            side.host_read([index])
        k = min(max(int(index), 0), len(bodies) - 1)
        # the branch's fresh outputs are reused on its next run once nothing holds them:
        # a new 4 MiB output costs its page faults, as much as the kernel (issue 22)
        return bodies[k].run(rest, sizes, borrow=True, remember=True, made=made)
    if op == "while_loop":
        cond_body, loop_body = bodies
        carried = list(operands)
        outside = {id(a) for a in operands}
        previous: list = []
        # a value the body passes through unchanged is not copied on every trip, and the
        # outputs of two trips ago are refilled instead of touching new memory each trip
        owned: dict = {}  # the carried arrays this call allocated (only those: bounded)
        while _flag(cond_body.run(carried, sizes, borrow=True)[0], side):
            live = {id(a) for a in carried} | outside
            recycle = [a if a is not None and id(a) not in live else None for a in previous]
            previous = carried
            trip: dict = {}
            carried = loop_body.run(carried, sizes, borrow=True, recycle=recycle, made=trip)
            owned = {id(a): a for a in carried
                     if trip.get(id(a)) is a or owned.get(id(a)) is a}
        made.update(owned)
        return carried
    raise KilnError(f"internal: unknown control step {op}")


def _flag(value, side) -> bool:
    if side is not None:
        side.host_read([value])
    return bool(value)


def _collective_runner() -> Callable:
    """The process-group bridge, imported only by programs that communicate."""
    from kiln.distributed.graph_collectives import run_step

    return run_step
