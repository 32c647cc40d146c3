"""Running a `Program`: bind sizes, hand out buffers, execute the steps.

Intermediate buffers come from an arena cached per size binding (the memory plan says
which buffers share storage), so a repeated call allocates only its outputs. Each step
is turned into a small closure once, which keeps the per-call overhead to a few
microseconds.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir.emitter import EAGER
from kiln.ir.interpret import concrete_attrs
from kiln.ir.shapes import evaluate
from kiln.runtime.allocator import Allocator, default_allocator
from kiln.runtime.program import Constant, Control, Extern, Launch, Program, View

KernelFn = Callable[[list, dict], None]


class Executable:
    """A Program with its compiled kernels; call it with arrays bound to its inputs."""

    def __init__(self, program: Program, kernels: dict[str, KernelFn],
                 allocator: Allocator | None = None):
        self.program = program
        self.kernels = kernels
        self.allocator = allocator or default_allocator()
        self._arenas: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self._static_shapes = {s: spec.shape for s, spec in program.buffers.items()
                               if all(isinstance(d, int) for d in spec.shape)}
        self._outputs = frozenset(program.outputs)
        self._bodies = {id(b): Executable(b, kernels, self.allocator)
                        for step in program.steps if isinstance(step, Control) for b in step.bodies}

    def _shape(self, slot: int, sizes: dict) -> tuple:
        shape = self._static_shapes.get(slot)
        if shape is None:
            shape = tuple(evaluate(d, sizes) for d in self.program.buffers[slot].shape)
        return shape

    def _take_arena(self, key):
        with self._lock:
            pool = self._arenas.setdefault(key, [])
            return pool.pop() if pool else {}

    def _return_arena(self, key, arena):
        with self._lock:
            self._arenas[key].append(arena)

    def run(self, arrays: Sequence[np.ndarray], sizes: dict[str, int]) -> list[np.ndarray]:
        program = self.program
        env: dict[int, np.ndarray] = dict(zip(program.inputs, arrays))
        key = tuple(sorted(sizes.items()))
        arena = self._take_arena(key)
        outputs = self._outputs
        try:
            for step in program.steps:
                if isinstance(step, Launch):
                    args = []
                    for s in step.args:
                        array = env.get(s)
                        if array is None:
                            array = self._buffer(s, sizes, arena, s in outputs)
                            env[s] = array
                        args.append(array)
                    self.kernels[step.kernel](args, sizes)
                elif isinstance(step, View):
                    env[step.target] = env[step.source].reshape(self._shape(step.target, sizes))
                elif isinstance(step, Extern):
                    attrs = concrete_attrs(step.attrs, sizes)
                    results = EAGER.apply(step.op, [env[s] for s in step.inputs], attrs)
                    for s, r in zip(step.outputs, results):
                        env[s] = r
                elif isinstance(step, Constant):
                    env[step.target] = program.constants[step.name]
                elif isinstance(step, Control):
                    results = self._control(step, [env[s] for s in step.inputs], sizes)
                    for s, r in zip(step.outputs, results):
                        env[s] = r
        finally:
            self._return_arena(key, arena)
        result = []
        borrowed = {id(a) for a in arrays} | {id(c) for c in program.constants.values()}
        for s in program.outputs:
            array = env[s]
            # an output must be the caller's own: never an input, a constant, or a view
            # into memory the next call reuses
            if not array.flags.owndata or id(array) in borrowed:
                array = array.copy()
            result.append(array)
        return result

    def _buffer(self, slot: int, sizes: dict, arena: dict, is_output: bool) -> np.ndarray:
        spec = self.program.buffers[slot]
        shape = self._shape(slot, sizes)
        storage = self.program.storage.get(slot)
        if storage is None or is_output:
            return self.allocator.empty(shape, spec.dtype.np_dtype)
        array = arena.get(storage)
        if array is None:
            array = self.allocator.empty(shape, spec.dtype.np_dtype, persistent=True)
            arena[storage] = array
        return array.reshape(shape)

    def _control(self, step: Control, operands: list, sizes: dict) -> list:
        bodies = [self._bodies[id(b)] for b in step.bodies]
        if step.op == "cond":
            index, *rest = operands
            k = min(max(int(index), 0), len(bodies) - 1)
            return bodies[k].run(rest, sizes)
        if step.op == "while_loop":
            cond_body, loop_body = bodies
            carried = list(operands)
            while bool(cond_body.run(carried, sizes)[0]):
                carried = loop_body.run(carried, sizes)
            return carried
        raise KilnError(f"internal: unknown control step {step.op}")
