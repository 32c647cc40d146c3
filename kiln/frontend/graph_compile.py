"""A graph compiled for a backend: optimize with the backend's graph passes, fuse, lower,
build, and bind input arrays to shape variables at each call.

`kn.compile` (compile.py) keeps a guarded cache of these per specialization; `kn.export`
loaders, `kiln run` and the tests compile graphs directly with `compile_graph`.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy

from kiln.errors import KilnError, KilnShapeSpecError
from kiln.frontend.kernel_cache import compile_kernels, load_cached
from kiln.ir.graph import Graph
from kiln.ir.verifier import verify


@dataclass
class CompiledGraph:
    """A graph compiled for a backend: run it with `run(arrays)`."""

    graph: Graph
    optimized: Graph
    program: Any
    executable: Any
    binder: Callable
    stages: dict = field(default_factory=dict)
    stage_seconds: dict = field(default_factory=dict)  # per graph pass (kiln report)

    def __getattr__(self, name: str):
        # a program from the whole-program cache skipped the graph passes: its optimized
        # graph and stage dumps are made when first asked for (kiln dump, kiln report)
        redo = self.__dict__.get("_redo")
        if name in ("optimized", "stages") and redo is not None:
            self.optimized, self.stages = redo()
            del self.__dict__["_redo"]
            return self.__dict__[name]
        raise AttributeError(name)

    def run(self, arrays: list) -> list:
        """Run on arrays from anywhere: dtypes, ranks and static dims are checked."""
        from kiln.ir.interpret import bind_shapes

        return self.executable.run(arrays, bind_shapes(self.graph, arrays))

    def run_trusted(self, arrays: list) -> list:
        """Run on arrays a guard already matched (kn.compile's cache key): only the
        symbolic dims are bound and checked against their constraints."""
        return self.executable.run(arrays, self.binder(arrays))


def make_binder(graph: Graph) -> Callable[[list], dict]:
    """A fast function from input arrays to shape-variable values (checks constraints)."""
    plain, derived = [], []
    for i, value in enumerate(graph.inputs):
        for axis, d in enumerate(value.type.shape):
            if isinstance(d, sympy.Symbol):
                plain.append((i, axis, d.name, graph.shape_vars[d.name]))
            elif not isinstance(d, int):
                derived.append((i, axis, d))
    if not plain and not derived:
        return lambda arrays: {}

    def bind(arrays):
        sizes: dict[str, int] = {}
        for i, axis, name, var in plain:
            n = arrays[i].shape[axis]
            if n < var.min or (var.max is not None and n > var.max) or n % var.multiple_of:
                raise KilnShapeSpecError(
                    f"@{graph.name} input {i} (%{graph.inputs[i].name}): dim {axis} ({name}) is {n}, "
                    f"which breaks {var.describe()}", hint=f"the spec requires {var.check(n)}")
            if sizes.setdefault(name, n) != n:
                raise KilnShapeSpecError(f"@{graph.name} input {i}: dim {axis} is {n} but {name} "
                                         f"is {sizes[name]} elsewhere")
        for i, axis, d in derived:
            from kiln.ir.shapes import evaluate

            if evaluate(d, sizes) != arrays[i].shape[axis]:
                raise KilnShapeSpecError(f"@{graph.name} input {i}: dim {axis} must be {d} = "
                                         f"{evaluate(d, sizes)}, got {arrays[i].shape[axis]}")
        return sizes

    return bind


_PAUSE_LOCK = threading.Lock()
_PAUSE = {"depth": 0, "reenable": False}


@contextlib.contextmanager
def paused_gc():
    """Python's cycle collector off while a trace or a compile runs, back on after.

    A compile allocates ~10^5 long-lived objects (graph nodes, Kernel IR, a decoded
    program) at once; the collector, triggered every 700 allocations, traverses them
    again and again as they age through its generations: 75 collections, 40-150 ms of a
    0.25 s warm compile of the GPT step (bench_compile.py). Paused, the same garbage
    (~13k objects of reference cycles the compile leaves) is found by the first
    collection after it. Nesting and threads share one depth count; the collector is
    re-enabled only if it was on when the outermost pause began."""
    with _PAUSE_LOCK:
        if _PAUSE["depth"] == 0:
            _PAUSE["reenable"] = gc.isenabled()
            gc.disable()
        _PAUSE["depth"] += 1
    try:
        yield
    finally:
        with _PAUSE_LOCK:
            _PAUSE["depth"] -= 1
            if _PAUSE["depth"] == 0 and _PAUSE["reenable"]:
                gc.enable()


def compile_graph(graph: Graph, backend: str = "cpu", mode: str = "default",
                  build: bool = True, device=None, verified: bool = True) -> CompiledGraph:
    """Optimize (with the backend's own graph passes), fuse, lower and build `graph` for
    `backend`; `build=False` stops at the program (no machine code, executable None).
    `device` (not the CPU): every buffer of the program is in that device's memory
    (kiln/runtime/device_programs.py). `verified=False`: `graph` comes from a trace
    that left verification to this call (kn.compile), which verifies it unless the
    whole-program cache has its program (the comment at the hit below says why)."""
    with paused_gc():
        return _compile_graph(graph, backend, mode, build, device, verified)


def _program_key(program_cache, graph: Graph, target, mode: str, verified: bool):
    """The whole-program cache key of `graph`; an unverified graph whose key cannot be
    computed gets the verifier's error first (a malformed graph is reported as such)."""
    try:
        return program_cache.program_key(graph, target, mode)
    except Exception:
        if not verified:
            verify(graph)
        raise


def _compile_graph(graph: Graph, backend: str, mode: str, build: bool, device,
                   verified: bool) -> CompiledGraph:
    from kiln.codegen.backends import get_backend
    from kiln.codegen.kernel_ir import template_externs
    from kiln.frontend import program_cache
    from kiln.runtime.executor import Executable

    if mode not in ("default", "max-autotune"):
        raise KilnError(f"compile: mode must be 'default' or 'max-autotune', got {mode!r}")
    target = get_backend(backend)

    key = _program_key(program_cache, graph, target, mode, verified) \
        if build and program_cache.enabled(target, mode, device) else None
    cached = program_cache.load(key) if key is not None else None
    compiled = None
    if cached is not None:  # a hit: no graph passes, no lowering, no per-kernel keys
        program, names, blob, legal, hints = cached
        compiled = program_cache.load_kernels(target, program, names, blob, legal, hints)
    if compiled is not None:
        # Not verifying an unverified traced graph here is sound: an entry is stored only
        # after its graph was verified (below, before the passes ran, or before this call by
        # whoever passed verified=True: a trace, kn.load's archive reader), and
        # the key holds the graph's canonical text (every op, attribute, operand position,
        # result type, region and shape-variable constraint; a value used out of scope
        # prints as undefined) and its constants' bytes, with the source of kiln/ir (the
        # verifier and every type rule) in the source hash: this graph is the one that
        # passed, under the same rules. Saves a verify of every node (7 ms of the GPT step).
        optimized = stages = None
        seconds: dict = {}
    else:
        if not verified:
            verify(graph)
        from kiln.codegen.build_program import build_program  # a hit needs no lowering

        # an uncacheable program's machine code stored by an earlier process (see _build)
        ready = _uncacheable_objects(key) if build and key is not None else None
        # a cold build with a cache entry to make: LLVM may start on the first kernels
        # while the rest are lowered, and the backend may ready its native glue on another
        # thread while the graph passes run (cpu/stream_build.py)
        stream = getattr(target, "stream_build", lambda *_, **__: None)(len(graph.body.nodes), graph=graph) \
            if ready is not None and ready[1] is None and mode == "default" and device is None else None
        stages = {}
        pipeline = graph_pipeline(target)
        optimized = pipeline.run(graph, dump=stages)
        seconds = {r.name: r.seconds for r in pipeline.records}
        program = build_program(optimized, sink=stream.add if stream is not None else None)
        if not build:
            return CompiledGraph(graph, optimized, program, None, make_binder(graph), stages, seconds)
        names = list(program.kernels)
        compiled = _build(target, graph.name, program, names, key, mode, stream, ready)
    allocator = target.runtime_allocator()  # None: host memory; opencl: the device's SVM
    if device is not None:
        from kiln.runtime.device_programs import runtime_allocator

        allocator = runtime_allocator(device)
    executable = Executable(program, dict(zip(names, compiled)), allocator=allocator,
                            externs=template_externs(target), device=device)
    result = CompiledGraph(graph, optimized, program, executable, make_binder(graph), stages, seconds)
    if optimized is None:
        def redo():
            done: dict = {}
            return graph_pipeline(target).run(graph, dump=done), done

        result._redo = redo
        del result.optimized, result.stages
    return result


def _uncacheable_objects(key: str) -> tuple[str, bytes | None]:
    """(the key of an uncacheable program's objects, derived from its program key; the
    object code stored under it, or None)."""
    from kiln.codegen import artifact_cache

    alone = artifact_cache.content_key("uncacheable program", key)
    return alone, artifact_cache.load(alone)


def _build(target, name: str, program, names: list, key: str | None, mode: str, stream=None,
           ready: tuple | None = None) -> list:
    """The compiled kernels of `program` (a whole-program cache miss), stored under `key`.

    With a key, the program's entry holds its machine code: one entry, no per-kernel keys.
    The entry's Python work (encoding the program and checking it decodes equal, the load
    hints: ~50 ms of the GPT step) runs while LLVM's build threads compile
    (build_overlap.py), not before them with a core idle. A program the entry's format
    cannot hold (`uncacheable`) has its objects stored under a key derived from `key`
    (kind `objects`, checked on load as every kernel object), found here by the next
    process. Without a key: the per-kernel-set object cache (a fingerprint of every
    kernel). `stream`: the backend's build already fed the kernels as they were lowered
    (its early modules may be compiling); it makes the object code of a key's entry.
    `ready`: `_uncacheable_objects(key)`, looked up before the lowering."""
    from kiln.codegen import artifact_cache
    from kiln.codegen.build_overlap import Deferred, meanwhile
    from kiln.frontend import program_cache
    from kiln.progress import working  # a bar on a terminal when the build takes a while

    kernels = [program.kernels[n] for n in names]
    if key is None:
        objects = None
        entry = None
    else:
        objects = []
        entry = Deferred(lambda: _entry(target, program, kernels))
        alone, blob = ready if ready is not None else _uncacheable_objects(key)
        cached = load_cached(target, kernels, alone, blob) if blob is not None else None
        if cached is not None:
            return cached
    with working(f"kiln: compiling {name} ({len(names)} kernel{'' if len(names) == 1 else 's'})"), \
            meanwhile(*([entry] if entry is not None else []), *_young_garbage()):
        compiled = compile_kernels(target, kernels, mode, objects, stream)
    if objects:
        text, legal, hints = entry.result()
        if text is not None:
            program_cache.store(key, text, names, objects[0], legal, hints)
        else:
            artifact_cache.store(alone, objects[0])
    return compiled


def _young_garbage() -> tuple:
    """A task that collects the compile's garbage while LLVM's threads run, when the
    collector comes back on after this compile (`paused_gc`): its first collection then
    ran right after the compile, before the first step, on every object the compile had
    made (the GPT step: 17 ms of CPU, 27k objects freed, with the build threads done and
    the other core idle). Only young objects: what survives is what the collector would
    have kept, one generation older."""
    with _PAUSE_LOCK:
        if _PAUSE["depth"] == 0 or not _PAUSE["reenable"]:
            return ()  # the caller disabled the collector, or no pause is on
    from kiln.codegen.build_overlap import Deferred

    return (Deferred(lambda: gc.collect(0)),)


def _entry(target, program, kernels: list) -> tuple:
    """(encoded program or None, all kernels legal, load hints) of the program's entry."""
    from kiln.frontend import program_cache

    text = program_cache.encode(program)
    if text is None:
        return None, False, None
    legal = program_cache.all_legal(target, kernels)
    return text, legal, program_cache.load_hints(target, kernels, legal)


def graph_pipeline(target):
    """The graph passes `target` compiles with: its own list, then fusion, collective
    scheduling and (where the backend batches kernels) batching."""
    from kiln.passes.fusion import fuse
    from kiln.passes.manager import Pipeline
    from kiln.passes.schedule_collectives import schedule_collectives

    pipeline = Pipeline(list(target.graph_passes(target.options))).extend(
        [("fuse", fuse), ("schedule_collectives", schedule_collectives)])
    if target.batches_kernels:  # small independent kernels share launches
        from kiln.passes.batch_updates import batch_updates
        from kiln.passes.batching import batch_kernels

        pipeline.append("batch", batch_kernels)
        pipeline.append("batch_updates", batch_updates)  # the optimizer's updates: one launch
    return pipeline
