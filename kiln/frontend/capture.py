"""`kn.capture`: record a compiled program's launches once, replay them with no Python
per kernel (CUDA graphs' idea, on every backend kiln runs).

    >>> g = kn.capture(lambda x, a, b: kn.gelu(x * a + b) * kn.sigmoid(x), x, a, b)
    >>> y = g(x, a, b)          # same shapes and dtypes as at capture: a replay

The function is traced and compiled for the example arguments' shapes (the sizes of a
`dynamic_spec` are fixed to the examples'), every buffer gets its memory once, and the
backend's launcher turns the launch sequence into native code (on the CPU, one LLVM
function that calls every kernel, loops and branches included). A replay binds the
inputs by pointer, runs the plan and returns copies of the outputs; arguments of another
shape or dtype are K390.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.errors import KilnArgumentError
from kiln.frontend import pytree
from kiln.frontend.dispatch import to_array
from kiln.frontend.export import export
from kiln.frontend.tensor import Tensor
from kiln.runtime.capture import CapturedPlan


def _leaf(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray))


class CapturedFunction:
    """The callable `kn.capture` returns: replays the captured plan."""

    def __init__(self, fn: Callable, example_args: tuple, backend: str):
        from kiln.codegen.launchers import launcher_for
        from kiln.frontend.compile import compile_graph
        from kiln.runtime.device_programs import backend_on, call_device

        self.fn = getattr(fn, "fn", fn)  # a kn.compile'd function: capture what it wraps
        # tensors on a device: the program of that device's backend, on its memory
        self.device = call_device(pytree.flatten(tuple(example_args), _leaf)[0], op="capture")
        if self.device is not None:
            backend = backend_on(self.device, backend)
        exported = export(self.fn, tuple(example_args), backend=backend)
        self.graph = exported.graph
        self.in_spec, self.out_spec = exported.in_spec, exported.out_spec
        self.static_args = dict(exported.static_args)
        compiled = compile_graph(exported.graph, backend, device=self.device)
        arrays = self._arrays(example_args)
        executable = compiled.executable
        self.plan = CapturedPlan(compiled.program, executable.kernels, executable.externs,
                                 compiled.binder(arrays), arrays, launcher_for(backend),
                                 device=self.device)
        self.backend = backend
        self._flat = spec_is_flat(self.in_spec) and not self.static_args

    def _arrays(self, args: tuple) -> list[np.ndarray]:
        leaves, spec = pytree.flatten(tuple(args), _leaf)
        if spec != self.in_spec:
            raise KilnArgumentError(f"capture: arguments have structure {spec}, the program was "
                                    f"captured with {self.in_spec}")
        arrays = []
        for i, leaf in enumerate(leaves):
            if i in self.static_args:
                if leaf != self.static_args[i]:
                    raise KilnArgumentError(f"capture: argument leaf {i} is {leaf!r} but the program "
                                            f"was captured with {self.static_args[i]!r}")
            else:
                arrays.append(to_array(leaf))
        return arrays

    def __call__(self, *args):
        if self._flat and len(args) == len(self.plan.input_specs):
            arrays = [a._x if a.__class__ is Tensor and a._builder is None else to_array(a) for a in args]
        else:
            arrays = self._arrays(args)
        device = self.device
        if device is not None:  # device memory in (host arrays copied, counted), device tensors out
            from kiln.runtime.device_programs import bind_arguments, call_device, runtime_allocator

            if call_device(pytree.flatten(tuple(args), _leaf)[0], op="capture replay") != device:
                from kiln.runtime.device import KilnDeviceMismatchError

                raise KilnDeviceMismatchError(f"capture replay: the program was captured on {device}; "
                                              "its arguments must be there too",
                                              hint=f"move them with x.to({str(device)!r})")
            arrays = bind_arguments(self.plan.check(arrays), device, runtime_allocator(device))
        outputs = [Tensor._make(a, None, device) for a in self.plan.run(arrays)]
        return pytree.unflatten(self.out_spec, outputs)

    @property
    def native_runs(self) -> int:
        """How many native launch lists a replay calls (1: no Python between kernels)."""
        return self.plan.native_runs


def spec_is_flat(spec) -> bool:
    return isinstance(spec, dict) and list(spec) == ["tuple"] and all(s == "*" for s in spec["tuple"])


def capture(fn: Callable, *example_args, backend: str = "cpu") -> CapturedFunction:
    """Trace and compile `fn` for `example_args`, capture its launch sequence, and return
    a function that replays it. Replays take arguments of the captured shapes and dtypes
    (K390 otherwise) and return new tensors, like the compiled function.

    >>> g = kn.capture(lambda x: (x * 2).sum(), kn.ones(8))
    >>> float(g(kn.ones(8)))
    16.0
    """
    return CapturedFunction(fn, example_args, backend)
