"""`kn.compile`: trace once per specialization, optimize, generate code, run fast.

A compiled function keeps a cache of specializations keyed by guards: the argument
structure, every tensor's dtype, its static dims (dims declared dynamic by a
ShapeVar are wildcards, checked against their constraints instead) and the Python
values baked in. `stats()` reports compiles, cache hits and each recompile's reason.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import sympy

from kiln.errors import KilnError, KilnTracedStateError, KilnTraceError
from kiln.ir.graph import Graph
from kiln.frontend import pytree
from kiln.frontend.dispatch import to_array
from kiln.frontend.fast_dispatch import MAX_SIGNATURES, SEEN_ONCE, prepare, signature
from kiln.frontend.tensor import Tensor
from kiln.frontend.tracing import _leaf, is_tensor_like, trace_function
from kiln.frontend.graph_compile import CompiledGraph, compile_graph  # noqa: F401 (imported from here)


class KilnRecompileLimitError(KilnError):
    code = "K180"
    title = "too many recompiles"


@dataclass
class _Entry:
    compiled: CompiledGraph
    out_spec: Any
    static_positions: tuple
    guards: Any = None  # recompiles.SpecializationGuards: leaf paths, where guards came from
    write_back: Any = None  # arg_mutation.WriteBack: arguments changed in place, returned ones
    shape_guards: tuple = ()  # shape_guards.ShapeGuard: size decisions the range left open
    next: Any = None  # another specialization of the same key, tried when a guard fails
    device: Any = None  # the device its program runs on (None: the host; device_programs.py)

    def chain(self) -> list:
        out, entry = [], self
        while entry is not None:
            out.append(entry)
            entry = entry.next
        return out


class CompiledFunction:
    """The callable `kn.compile` returns. `stats()` says what the cache did."""

    def __init__(self, fn: Callable, backend: str = "cpu", mode: str = "default",
                 fullgraph: bool = True, dynamic_shapes=None, recompile_limit: int = 8,
                 trace_dir: str | None = None):
        self.fn = fn
        self.trace_dir = trace_dir  # kiln report's traces (else $KILN_TRACE_DIR)
        self.backend = backend
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic_shapes = dynamic_shapes
        self.recompile_limit = recompile_limit
        # set by kn.compile (see auto_dynamic.py and recompiles.py)
        self.dynamic: bool | None = None  # PyTorch's default: automatic dynamic
        self.explain = False  # print each recompile's explanation (or KILN_LOGS=recompiles)
        self.strict = False  # a recompile after the first compile is K321
        self._auto_dims: dict[int, set] = {}  # dims automatic dynamic made symbolic
        self._duck = False  # keys carry the equal-size pattern of automatic dims
        self._dynamic_fallbacks: list[str] = []
        self._cache: dict = {}
        self._dynamic: dict[int, frozenset] | None = None
        self._compiles = 0
        self._hits = 0
        self._eager_calls = 0
        self._recompiles: list[dict] = []
        self._functionalized = None  # fn changes state it does not receive: functionalize.py
        self._fast: dict = {}  # exact signature -> FastCall, False or SEEN_ONCE (fast_dispatch.py)
        self._fast_epoch = 0  # self._compiles when self._fast was last cleared
        functools.update_wrapper(self, fn)

    # -- the call path: keep it lean ------------------------------------------------------

    def __call__(self, *args):
        if self._functionalized is not None:
            return self._functionalized(*args)
        sig, fast_leaves = signature(args)  # a signature seen before runs its prepared call
        if sig is not None:
            call = self._fast.get(sig)
            if call:
                result = call(fast_leaves)
                if result is not None:
                    self._hits += 1
                    return result
        for a in args:  # flat tensor arguments (the common case) skip the pytree walk
            if a.__class__ is not Tensor and a.__class__ is not np.ndarray:
                if a.__class__.__name__ == "DTensor":  # sharded: one SPMD program per rank
                    from kiln.frontend.spmd import call_spmd

                    return call_spmd(self, args)
                leaves, spec = pytree.flatten(tuple(args), _leaf)
                break
        else:
            leaves, spec = args, None
            if len(args) > 1:
                from kiln.frontend.arg_mutation import aliases

                if aliases(args):  # the same tensor twice: one handle, its own specialization
                    spec = pytree.flatten(tuple(args), _leaf)[1]
        key = self._key(leaves, spec)
        entry = self._cache.get(key)
        hit = entry is not None
        if entry is None:
            entry = self._compile(args, key)
            if entry is None and self._functionalized is not None:
                return self._functionalized(*args)
            if entry is None:  # fell back to eager (fullgraph=False)
                self._eager_calls += 1
                return self.fn(*_as_tensors(args))
        else:
            self._hits += 1
        statics = entry.static_positions
        arrays = [leaf._x if type(leaf) is Tensor else (leaf if type(leaf) is np.ndarray else to_array(leaf))
                  for i, leaf in enumerate(leaves) if i not in statics]
        if entry.shape_guards:  # decisions on symbolic sizes (shape_guards.py)
            entry, sizes = self._guarded(entry, args, key, arrays, hit)
            if entry is None:  # fell back to eager (fullgraph=False)
                self._eager_calls += 1
                return self.fn(*_as_tensors(args))
        device = entry.device
        if device is not None:  # device memory in, device tensors out (device_programs.py)
            from kiln.runtime.device_programs import bind_arguments

            arrays = bind_arguments(arrays, device, entry.compiled.executable.allocator)
        else:  # a view's array or a numpy argument may be strided (z.real, a.T); host kernels
            # read contiguous buffers (np.require keeps 0-d arrays 0-d; ascontiguousarray would not)
            arrays = [a if a.flags.c_contiguous else np.require(a, requirements="C") for a in arrays]
        if entry.shape_guards:
            outputs = entry.compiled.executable.run(arrays, sizes)
        else:
            outputs, sizes = entry.compiled.run_trusted(arrays), None
        if sig is not None and device is None:
            self._remember_call(sig, leaves, entry, arrays, sizes)
        plan = entry.write_back
        if plan is not None:  # arguments changed in place, or returned (arg_mutation.py)
            from kiln.frontend.arg_mutation import write_back

            made = write_back(plan, leaves, outputs, lambda: self._paths(args), device)
        else:
            made = [Tensor._make(o, None, device) for o in outputs]
        if entry.out_spec == "*":
            return made[0]
        return pytree.unflatten(entry.out_spec, made)

    def _remember_call(self, sig, leaves, entry, arrays, sizes) -> None:
        """Prepare the call `entry` just ran for `sig` when the signature comes back (its
        second general-path call: preparing costs ~50 us, which a signature seen once,
        such as a size changing every call, should not pay). The cache of prepared calls
        is emptied whenever a specialization was added since it was last filled, and when
        it holds MAX_SIGNATURES."""
        fast = self._fast
        if self._fast_epoch != self._compiles or len(fast) >= MAX_SIGNATURES:
            fast.clear()
            self._fast_epoch = self._compiles
        state = fast.get(sig)
        if state is None:
            fast[sig] = SEEN_ONCE
        elif state is SEEN_ONCE:
            fast[sig] = prepare(leaves, entry, arrays, sizes)

    def _key(self, leaves, spec):
        dynamic = self._dynamic
        parts = []
        device = None  # tensors on a device: a specialization of their own (device_programs.py)
        for i, leaf in enumerate(leaves):
            cls = leaf.__class__
            if cls is Tensor:
                if leaf._device is not None:
                    device = leaf._device
                if leaf._builder is not None:
                    raise KilnTraceError("a compiled function was called with a traced tensor; "
                                         "call it outside kn.trace or trace the inner function")
                if leaf._view is not None:  # a view re-reads its base if that changed
                    leaf._view.refresh(leaf)
                array = leaf._x
            elif cls is np.ndarray:
                array = leaf
            elif is_tensor_like(leaf):
                array = to_array(leaf)
            else:
                parts.append(("static", cls.__name__, leaf))
                continue
            wild = dynamic.get(i) if dynamic else None
            shape = array.shape if not wild else tuple(
                None if a in wild else n for a, n in enumerate(array.shape))
            parts.append((array.dtype, shape))
        if self._duck:
            from kiln.frontend.auto_dynamic import refine_key

            parts = refine_key(parts, leaves, dynamic)
        # a pytree spec is nested lists and dicts: its JSON text is the hashable key; the
        # same tensor passed twice is one handle in the trace, so aliasing is keyed too
        if spec is None:
            return (None if device is None else f"on {device}"), tuple(parts)
        from kiln.frontend.arg_mutation import aliases

        same = aliases(leaves)
        return (json.dumps(spec) + (f" aliases {same}" if same else "")
                + ("" if device is None else f" on {device}")), tuple(parts)

    # -- compiling ----------------------------------------------------------------------

    def _guarded(self, entry, args, key, arrays, hit: bool):
        """The specialization of `key` whose size guards hold for `arrays` (compiling a new
        one when none does), and the shape-variable values to run it with."""
        from kiln.frontend.shape_guards import first_failure

        failed = None
        for candidate in entry.chain():
            sizes = candidate.compiled.binder(arrays)
            failure = first_failure(candidate.shape_guards, sizes)
            if failure is None:
                return candidate, sizes
            failed = failed or (failure, sizes)
        if hit:
            self._hits -= 1
        failure, sizes = failed
        values = ", ".join(f"{n}={v}" for n, v in sorted(sizes.items()))
        new = self._compile(args, key, reason=f"size guard {failure.describe()} failed ({values})")
        if new is None:
            return None, None
        return new, new.compiled.binder(arrays)

    def _specializations(self) -> list:
        return [e for head in self._cache.values() for e in head.chain()]

    def _compile(self, args, key, reason: str | None = None):
        from kiln.frontend import recompiles

        from kiln.runtime.device_programs import call_device

        device = call_device(_leaves_and_spec(args)[0])  # K380 for mixed devices
        if reason is None and self._cache:
            reason = self._reason(key, args)
            if all(e.device != device for e in self._specializations()):
                reason = f"the arguments are on {device or 'cpu'} (a program of its own per device)"
        if reason is not None and self.strict:
            raise recompiles.strict_error(self.fn, reason)
        count = len(self._specializations())
        if count >= self.recompile_limit:
            if self.fullgraph:
                raise KilnRecompileLimitError(
                    f"{getattr(self.fn, '__name__', 'function')}: {count} specializations "
                    f"reached recompile_limit={self.recompile_limit}; the latest because {reason}",
                    hint="declare the changing dims dynamic with ShapeVar (dynamic_shapes=) or "
                         "raise recompile_limit")
            return None
        recorder = None  # unless tracing for `kiln report` (kiln.report imports networkx:
        if self.trace_dir or os.environ.get("KILN_TRACE_DIR"):  # ~0.2 s, only when asked)
            from kiln.report.trace import recorder_for

            recorder = recorder_for(self)
        self._newly_dynamic: list = []
        shapes, auto = self._shapes_for(args, key)
        try:
            traced, auto = self._trace(args, shapes, auto)
        except KilnTracedStateError:  # lift the outside state into inputs (functionalize.py)
            from kiln.frontend.functionalize import Functionalized

            self._functionalized = Functionalized(self, args)
            return None
        except KilnTraceError:
            if self.fullgraph:
                raise
            self._recompiles.append({"reason": "the function could not be traced; it runs eagerly"})
            return None
        if auto or self._dynamic is None:
            merged = dict(self._dynamic or {})
            for leaf, dims in _dynamic_positions(traced.graph, traced.static_args).items():
                merged[leaf] = merged.get(leaf, frozenset()) | dims
            self._dynamic, self._duck = merged, self._duck or auto
            key = self._key(*_leaves_and_spec(args))
        if reason is not None:
            if auto and self.dynamic is None and self._newly_dynamic:
                paths = self._paths(args)
                dims = ", ".join(f"`{paths[leaf]}` dim {axis}" for leaf, axis in self._newly_dynamic)
                reason += f"; automatic dynamic: {dims} symbolic from now on"
            self._recompiles.append({"reason": reason})
            if recompiles.logging_enabled(self.explain):
                recompiles.report(self.fn, reason, len(self._specializations()) + 1)
        if recorder is not None:
            recorder.traced()
        if device is None:
            compiled = compile_graph(traced.graph, self.backend, self.mode, verified=False)
        else:
            from kiln.runtime.device_programs import backend_on

            compiled = compile_graph(traced.graph, backend_on(device, self.backend), self.mode,
                                     device=device, verified=False)
        if recorder is not None:
            recorder.compiled(compiled, reason=self._recompiles[-1]["reason"] if self._cache else None,
                              guards=guard_summary(traced.graph))
        self._compiles += 1
        plan = self._write_back
        out_spec = plan.out_spec
        statics = tuple(i for i, _ in traced.static_args)
        entry = _Entry(compiled, out_spec, statics, self._guards(args, traced, statics),
                       None if plan.trivial else plan, tuple(self._shape_guards.guards),
                       device=device)
        if key in self._cache:  # a size guard failed: one more specialization of this key
            self._cache[key].chain()[-1].next = entry
        else:
            self._cache[key] = entry
        return entry

    def _reason(self, key, args) -> str:
        """Why `key` needs a new specialization: every guard of the nearest one that it
        fails, naming the argument, the dim and the user line (see recompiles.py)."""
        from kiln.frontend.recompiles import explain

        entries = [(k, e.guards) for k, e in self._cache.items()]
        return explain(key, entries, self._paths(args))

    def _paths(self, args) -> list[str]:
        from kiln.frontend.recompiles import leaf_paths

        leaves, spec = _leaves_and_spec(args)
        return leaf_paths(self.fn, spec, len(leaves))

    def _shapes_for(self, args, key) -> tuple:
        """The dynamic_shapes to trace with, and whether automatic dynamic chose them."""
        from kiln.frontend import auto_dynamic

        declared = self.dynamic_shapes is not None or \
            getattr(self.fn, "__kiln_dynamic_spec__", None) is not None
        if declared or self.dynamic is False:
            return self.dynamic_shapes, False
        if self.dynamic is True:
            marked = auto_dynamic.ALL
        else:  # automatic: the dims that changed since the last specializations
            tensors = auto_dynamic.top_level_tensors(tuple(args))
            for leaf, axes in auto_dynamic.changed_dims(key, list(self._cache)).items():
                if leaf in tensors:  # tensors inside pytrees stay static
                    self._newly_dynamic += [(leaf, a) for a in sorted(axes)]
                    self._auto_dims.setdefault(leaf, set()).update(axes)
            marked = self._auto_dims
        self._marked = marked
        spec = auto_dynamic.auto_spec(tuple(args), marked) if marked else None
        return (spec, True) if spec is not None else (self.dynamic_shapes, False)

    def _trace(self, args, shapes, auto: bool):
        """Trace with `shapes`. When code cannot run on the symbolic dims automatic
        dynamic chose (a dim meets a static one in a matmul, a Python `int` of a size),
        those dims are specialized, found by retracing: dims are made static from the
        last one back until the trace succeeds, then each but the last is tried symbolic
        again. Every dim made static is reported in `stats()["dynamic_fallbacks"]`."""
        from kiln.frontend import auto_dynamic
        from kiln.frontend.recompiles import LocatingBuilder

        self._builders: list = []

        def locating(graph):
            self._builders.append(LocatingBuilder(graph))
            self._shape_guards.graph = graph  # the sizes guards are decided with
            return self._builders[-1]

        from kiln.frontend.arg_mutation import WriteBack, aliases, tracing_wrapper
        from kiln.frontend.shape_guards import ShapeGuards, collecting

        leaves = _leaves_and_spec(args)[0]
        same = aliases(leaves)
        concrete = [np.shape(leaf) if not isinstance(leaf, Tensor) else leaf.shape
                    for leaf in leaves if is_tensor_like(leaf)]

        def attempt(spec):
            self._builders.clear()
            self._write_back = WriteBack()  # filled by the trace (arg_mutation.py)
            # and shape_guards.py; automatic dynamic makes a dim used as an int static instead
            self._shape_guards = ShapeGuards(concrete, self.strict, ints=not auto)
            with collecting(self._shape_guards):
                return trace_function(tracing_wrapper(self.fn, same, self._write_back),
                                      tuple(args), spec, builder_cls=locating,
                                      verify_graph=False)  # compile_graph verifies

        try:
            return attempt(shapes), auto
        except (KilnError, TypeError, ValueError) as exc:
            if not auto:
                raise
            error = exc
        kept = auto_dynamic.symbolic_dims(tuple(args), self._marked)
        dropped, traced = [], None
        while kept and traced is None:
            dropped.append(kept.pop())
            traced = self._try(attempt, auto_dynamic.auto_spec(tuple(args), _by_leaf(kept)))
        for dim in dropped[:-1]:  # the last one dropped is the one the code needs static
            again = self._try(attempt, auto_dynamic.auto_spec(tuple(args), _by_leaf(kept + [dim])))
            if again is not None:
                kept.append(dim)
                traced = again
        static = [dim for dim in dropped if dim not in kept]
        for leaf, axis in static:
            self._auto_dims.get(leaf, set()).discard(axis)
        paths = self._paths(args)
        self._dynamic_fallbacks.append(
            "static dims: the code needs concrete sizes for "
            + ", ".join(f"`{paths[leaf]}` dim {axis}" for leaf, axis in static) + f" ({error})")
        if traced is None:  # nothing symbolic: the plain trace raises the user's real error
            return attempt(self.dynamic_shapes), False
        return traced, bool(kept)

    def _try(self, attempt, spec):
        try:
            return attempt(spec) if spec is not None else None
        except (KilnError, TypeError, ValueError):
            return None

    def _guards(self, args, traced, statics):
        from kiln.frontend.recompiles import SpecializationGuards

        paths = self._paths(args)
        sources = iter(self._builders[-1].sources() if self._builders else [])
        return SpecializationGuards(paths, {i: next(sources, None) for i in range(len(paths))
                                            if i not in statics})

    def stats(self) -> dict:
        """Compiles, cache hits, eager fallbacks, recompiles with their reasons, and the
        guards of each specialization (which dims are static, and why)."""
        return {"compiles": self._compiles, "hits": self._hits, "eager_calls": self._eager_calls,
                "recompiles": list(self._recompiles),
                "specializations": len(self._specializations()),
                "guards": [guard_summary(e.compiled.graph) for e in self._specializations()],
                "size_guards": [[g.describe() for g in e.shape_guards]
                                for e in self._specializations()],
                "dynamic_fallbacks": list(self._dynamic_fallbacks)}

    def compiled_graphs(self) -> list[CompiledGraph]:
        return [e.compiled for e in self._specializations()]


def guard_summary(graph: Graph) -> list[str]:
    """One line per input: its dtype, and per dim either the ShapeVar that serves every
    allowed size or the static size it is specialized to, with the reason.

    >>> guard_summary(g)   # ['%x: f32, dim 0 dynamic (B in [0, 64]), dim 1 == 8 (not declared dynamic)']
    """
    lines = []
    for value in graph.inputs:
        dims = []
        for axis, d in enumerate(value.type.shape):
            if isinstance(d, int):
                dims.append(f"dim {axis} == {d} (not declared dynamic)")
            elif isinstance(d, sympy.Symbol):
                dims.append(f"dim {axis} dynamic ({graph.shape_vars[d.name].describe()})")
            else:
                dims.append(f"dim {axis} == {d}")
        lines.append(", ".join([f"%{value.name}: {value.type.dtype.short}"] + dims))
    return lines


def _as_tensors(args: tuple) -> tuple:
    """`args` with numpy arrays wrapped as kn.Tensors: an eager fallback computes with
    kiln's semantics and returns kn.Tensors, as the compiled path does."""
    leaves, spec = pytree.flatten(tuple(args), _leaf)
    return pytree.unflatten(spec, [Tensor._make(leaf) if type(leaf) is np.ndarray else leaf
                                   for leaf in leaves])


def _leaves_and_spec(args):
    from kiln.frontend.tensor import Tensor

    if all(type(a) is Tensor or type(a) is np.ndarray for a in args):
        from kiln.frontend.arg_mutation import aliases

        if len(args) < 2 or not aliases(args):  # aliased: keyed by the structure (_key)
            return args, None
    return pytree.flatten(tuple(args), _leaf)


def _dynamic_positions(graph: Graph, static_args) -> dict[int, frozenset]:
    """Leaf position -> dims that are symbolic in the traced graph."""
    statics = {i for i, _ in static_args}
    positions, k = {}, 0
    total = len(graph.inputs) + len(statics)
    for leaf in range(total):
        if leaf in statics:
            continue
        value = graph.inputs[k]
        k += 1
        dims = frozenset(a for a, d in enumerate(value.type.shape) if not isinstance(d, int))
        if dims:
            positions[leaf] = dims
    return positions


def compile(fn: Callable | None = None, *, backend: str = "cpu", mode: str = "default",
            fullgraph: bool = True, dynamic_shapes=None, recompile_limit: int = 8,
            trace_dir: str | None = None, dynamic: bool | None = None, explain: bool = False,
            strict: bool = False):
    """Compile `fn` (tensors in, tensors out) into fused native kernels.

    `dynamic`: True makes every dim of every tensor argument symbolic from the first
    call, False keeps every dim static, None (the default) compiles static first and
    makes the dims that changed symbolic at the first recompile (see auto_dynamic.py).
    `explain=True` (or KILN_LOGS=recompiles) prints why each recompile happened;
    `strict=True` raises K321 instead of recompiling (see recompiles.py).

    An object whose type defines `__kiln_compile__(obj, **options)` compiles itself:
    `compile` returns what that method returns for these keyword options (a kn.nn.Module
    does so, and its parameters and buffers become graph inputs: kiln/nn/compiled.py).

    >>> @kn.compile
    ... def f(x, w, b):
    ...     return kn.gelu(x @ w + b)
    >>> f(x, w, b); f.stats()["compiles"]
    1
    """
    from kiln.frontend.gil_guard import require_gil

    require_gil("kn.compile")  # at the call, not at the first run: see gil_guard.py
    if dynamic not in (None, True, False):
        raise KilnError(f"compile: dynamic must be True, False or None, got {dynamic!r}")
    if fn is None:
        return lambda f: compile(f, backend=backend, mode=mode, fullgraph=fullgraph,
                                 dynamic_shapes=dynamic_shapes, recompile_limit=recompile_limit,
                                 trace_dir=trace_dir, dynamic=dynamic, explain=explain,
                                 strict=strict)
    compiles_itself = getattr(type(fn), "__kiln_compile__", None)
    if compiles_itself is not None:  # kn.nn.Module: its parameters become graph inputs
        return compiles_itself(fn, backend=backend, mode=mode, fullgraph=fullgraph,
                               dynamic_shapes=dynamic_shapes, recompile_limit=recompile_limit,
                               trace_dir=trace_dir, dynamic=dynamic, explain=explain,
                               strict=strict)
    return _configure(CompiledFunction(fn, backend, mode, fullgraph, dynamic_shapes,
                                       recompile_limit, trace_dir), dynamic, explain, strict)


def _by_leaf(dims: list) -> dict[int, set]:
    out: dict[int, set] = {}
    for leaf, axis in dims:
        out.setdefault(leaf, set()).add(axis)
    return out


def _configure(compiled: CompiledFunction, dynamic, explain: bool, strict: bool) -> CompiledFunction:
    compiled.dynamic, compiled.explain, compiled.strict = dynamic, bool(explain), bool(strict)
    return compiled
