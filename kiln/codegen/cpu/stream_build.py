"""A cold compile's LLVM build started while the program is still being lowered.

Lowering a fused graph to Kernel IR and emitting each kernel's LLVM IR is single-threaded
Python (the small GPT training step: ~0.1 s after fusion, sympy's first uses included),
and the build threads (parallel_build.py) used to start only after the last kernel was
emitted: one core idle for that long. `StreamingBuild` takes the kernels one by one as
`build_program` lowers them (its `sink`), legalizes, plans and emits each at once, and
hands a first module of them to an LLVM thread as soon as they add up to a third of
`CHUNK` of estimated build cost, and another of `CHUNK` whenever that thread is done and
the lowering still runs; `finish` deals the rest over the backend's threads as the plain build does
(`partition`, LPT on `module_cost`) and waits for all. How many early modules there are,
and so which module holds a kernel, depends on how fast the lowering runs beside them. A compile makes the stream before
its graph passes, and the stream starts the process's split glue (native_pool.prepare,
~40 ms of LLVM, nearly all native) on a thread at once: the passes leave a core idle.

What each kernel compiles to does not change: every kernel's functions and helpers stay
internal to its module, so which module holds a kernel changes where code lies, not what
it is (as for the plain build's modules). A program smaller than the first module is
built exactly as before. `finish` checks that the kernels it was fed are, in order, the
distinct kernels of the program it is asked for (`_distinct`, which the load repeats):
otherwise (a caller that fed other kernels) it builds them the plain way.

    stream = backend.stream_build()
    program = build_program(graph, sink=stream.add)
    blob = stream.finish([program.kernels[n] for n in program.kernels])
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from kiln.codegen import cache_elf
from kiln.codegen.build_overlap import Deferred, meanwhile
from kiln.codegen.cpu import jit
from kiln.codegen.cpu.parallel_build import build_objects, module_cost, partition
from kiln.codegen.cpu.shared_bodies import merge_twins, part_key

# estimated build cost (characters of IR, parallel_build.module_cost) of an early module:
# ~0.07 s of LLVM here. The GPT step (~850 K in all, ~1.2 s of LLVM) then starts two while
# it is lowered, and its two last modules came out 23-35 ms of CPU apart in three runs
# (at 90 K, one early module of ~0.12 s: 79-96 ms apart; the last-finishing thread runs
# alone for that long)
CHUNK = 60_000
# the first early module is a third of a chunk: from the end of the graph passes to its
# start the other core is idle (the GPT step: ~30 ms of lowering, sympy's first uses
# included, for 60 K); a few kernels are enough to start LLVM on
FIRST_SHARE = 3
GLUE_WAIT_S = 60.0  # the glue thread builds one small module: a bound, never reached
# top-level nodes of a traced graph from which its graph passes outlast the glue's build
# (the GPT step: 1128 nodes, ~0.1 s of passes); a smaller program does not pay for it
GLUE_NODES = 500


def _quietly(prepare: Callable[[], None]) -> None:
    """`prepare()`, its error dropped: the first split launch builds the glue again and
    reports it there (as a build_overlap task's unread error would be)."""
    try:
        prepare()
    except Exception:  # noqa: BLE001 - see the docstring
        pass


class StreamingBuild:
    """Kernels fed one by one (`add`), LLVM started on them early; `finish` -> payload."""

    def __init__(self, backend, prepare=None, graph_nodes: int = 0):
        self.backend = backend
        self.prepare = prepare
        # the process's split glue (native_pool.prepare: ~40 ms of LLVM at O1, nearly
        # all of it in native code) is built on a thread of its own from now on when the
        # graph is large (the stream is made before the graph passes, which then leave
        # the other core idle for longer than the glue takes); otherwise, as in the plain
        # build, while a build of several modules runs
        self.glue = threading.Thread(target=_quietly, args=(prepare,), name="kiln-glue") \
            if prepare is not None and graph_nodes >= GLUE_NODES else None
        if self.glue is not None:
            self.glue.start()
        self.first: dict = {}  # a kernel less its name -> its index among the distinct ones
        self.unique: list = []  # the distinct legalized kernels, as first fed
        self.parts: list = []  # each one's emitted module (backend._parts)
        self.costs: list[int] = []
        self.sent = 0  # parts[:sent] are in started builds
        self.unsent = 0  # the build cost of parts[sent:]
        self.builds: list = []  # jit.Build of the early modules, in order
        self.taken: set = set()

    def add(self, kernel) -> None:
        """Legalize, plan and emit `kernel` (unless it is a twin of one fed before); start
        an early module when the emitted kernels add up to a chunk and none is running."""
        from kiln.codegen.cpu.backend import _anonymous

        legal = self.backend.legalize(kernel)
        key = _anonymous(legal)
        if key in self.first:
            return
        self.first[key] = len(self.unique)
        self.unique.append(legal)
        (part,) = self.backend._parts([self.backend._plan(legal, self.taken)])
        part_key(part)  # parsed now, between kernels, not all at once in `finish`
        self.parts.append(part)
        self.costs.append(module_cost(part, self.backend._joined))
        self.unsent += self.costs[-1]
        chunk = CHUNK if self.builds else max(1, CHUNK // FIRST_SHARE)
        if self.unsent >= chunk and not any(b.running() for b in self.builds):
            end, size = self.sent, 0
            while end < len(self.parts) and size < chunk:
                size += self.costs[end]
                end += 1
            text = self.backend._joined(merge_twins(self.parts[self.sent:end]))
            self.builds.append(jit.Build(text, self.backend.options.opt_level))
            self.sent, self.unsent = end, self.unsent - size

    def matches(self, unique: Sequence) -> bool:
        """Whether `unique` (the program's distinct legalized kernels) is what was fed."""
        return len(unique) == len(self.unique) and all(a is b or a == b for a, b in zip(unique, self.unique))

    def finish(self, kernels: Sequence) -> bytes:
        """The object-code payload of `kernels` (legalized): the early modules and the rest
        dealt over the backend's threads, waited for (bounded), in that order."""
        from kiln.codegen.cpu.backend import _distinct

        o = self.backend.options
        unique = _distinct(kernels)[0]
        # the glue's thread, waited for while LLVM runs (a bounded wait), or the glue built then
        glue = (Deferred(lambda: self.glue.join(GLUE_WAIT_S)),) if self.glue is not None else \
            (Deferred(self.prepare),) if self.prepare is not None else ()
        if not self.matches(unique):  # fed something else: the plain build of `kernels`
            for b in self.builds:  # not left running beside it (bounded wait)
                try:
                    b.result()
                except Exception:  # noqa: BLE001 - its modules are not used
                    pass
            with meanwhile(*glue):
                return self.backend.build_object_code(kernels)
        with meanwhile(*glue):
            if not self.builds:  # a program smaller than a chunk: the plain build
                return build_objects(self.parts, self.backend._joined, o.opt_level, o.threads)
            size = dict(zip(map(id, self.parts[self.sent:]), self.costs[self.sent:]))
            rest = merge_twins(self.parts[self.sent:])  # kernels that differ only in constants
            groups = partition(rest, lambda p: size.get(id(p)) or module_cost(p, self.backend._joined),
                               o.threads) if rest else []
            builds = list(self.builds)  # each module starts as soon as its text is joined
            for g in groups:
                builds.append(jit.Build(self.backend._joined(g), o.opt_level))
            objects = jit.object_codes([], o.opt_level, started=builds)
        return cache_elf.pack_objects(objects)
