"""The CPU backend: Kernel IR -> LLVM IR -> optimized IR -> machine code, via llvmlite.

Stages, in order, each dumpable by name with `stage_text(kernel, name)`:

    llvm       the generated LLVM IR text (llvm_emit.py, gemm.py, mathlib.py)
    optimized  after the O3 new-pass-manager pipeline (loop + SLP vectorization)
    asm        the host assembly

    backend = CpuBackend()
    compiled = backend.compile(kernel)          # CompiledKernel
    compiled([x, y], {"B": 5})                  # runs in place on numpy arrays

It implements the backend contract (kiln/codegen/backend.py): `compile_many` puts many
kernels in one module (one optimize, one JIT), `object_code` / `load_object_code` let
the runtime cache machine code on disk by content hash (the key includes `options`),
and `SCALAR_TABLE` (scalar_ops.py) says which scalar ops it emits natively; the shared
legalize pass rewrites the rest before any of these see a kernel.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Sequence

from kiln.codegen.backend import Backend, Options
from kiln.codegen.kernel_ir import AnyKernel, BatchKernel, GemmKernel, Kernel
from kiln.errors import KilnArgumentError

from kiln.codegen.cpu import jit
from kiln.codegen.cpu.batch_emit import emit_batch
from kiln.codegen.cpu.autotune import choose_gemm, gemm_outer_extents, measure_gemm
from kiln.codegen.cpu.jit import require_blas
from kiln.codegen.cpu.compiled import CompiledKernel, stage_costs
from kiln.codegen.cpu.gemm import check_strides, emit_gemm, gemm_as_kernel
from kiln.codegen.cpu.ir_builder import Module, join_modules
from kiln.codegen.cpu.llvm_emit import emit_kernel
from kiln.codegen.cpu.microkernel import emit_micro_gemm, row_blocks
from kiln.codegen.cpu.parallel_build import MICRO_TEXT_WEIGHT, Engines, build_objects
from kiln.codegen.cpu.shared_bodies import share_module
from kiln.codegen.cpu.stream_build import StreamingBuild
from kiln.codegen.cpu import native_pool
from kiln.codegen.build_overlap import Deferred, meanwhile
from kiln.codegen.cpu.compiled import default_threads
from kiln.codegen.cpu.scalar_ops import SCALAR_TABLE

STAGES = ("llvm", "optimized", "asm")


@dataclass(frozen=True)
class CpuOptions(Options):
    """Compile options; the hash is part of every cache key.

    opt_level: LLVM optimization level (0-3). threads: total threads a kernel may use
    (caller + workers). parallel_threshold: estimated element-operations above which a
    call is split over threads. vector_width: 0 lets LLVM choose (256-bit on this host);
    otherwise forces the vectorizer's width. mode: "default" (analytical autotuning) or
    "max-autotune" (also measures GEMM variants). f32_math: float32 transcendentals,
    "native" (float32 polynomials, ~2 ulp, full vector width) or "double" (float64
    internally, correctly rounded, half the width); None takes the process default that
    `mathlib.float32_math` sets (resolved when the options are made, so the value, not
    a global, is in the cache key). blas: the BLAS that GEMMs call, "mkl" or "openblas"
    (blas.py); None or "auto" takes the process's (`KILN_BLAS`, else MKL on Intel CPUs
    where it is installed), resolved when the options are made."""

    opt_level: int = 3
    threads: int = field(default_factory=default_threads)
    parallel_threshold: int = 1 << 17
    vector_width: int = 0
    mode: str = "default"
    f32_math: str | None = None
    blas: str | None = None

    def __post_init__(self):
        if self.f32_math is None:
            from kiln.codegen.cpu.mathlib import default_f32_math

            object.__setattr__(self, "f32_math", default_f32_math())
        if self.f32_math not in ("native", "double"):
            raise KilnArgumentError(f"CpuOptions: f32_math must be 'native' or 'double', got {self.f32_math!r}")
        from kiln.codegen.cpu import blas

        object.__setattr__(self, "blas", blas.default_name() if self.blas is None
                           else blas.resolve(blas.check_name(self.blas, "CpuOptions: blas")))
        if self.mode not in ("default", "max-autotune"):
            raise KilnArgumentError(f"CpuOptions: mode must be 'default' or 'max-autotune', got {self.mode!r}")
        if not 0 <= self.opt_level <= 3 or self.threads < 1:
            raise KilnArgumentError("CpuOptions: opt_level must be 0-3 and threads >= 1")


@dataclass(frozen=True)
class _Plan:
    """How one kernel is emitted: its exported symbol, outer extents and GEMM choice."""

    kernel: AnyKernel
    symbol: str
    outer_extents: tuple
    blas: bool = False
    panel_rows: int = 0
    micro: bool = False  # kiln's register-blocked micro-kernel (microkernel.py)
    panel_cols: int = 0  # a BLAS GEMM's columns per tile (0: full rows; autotune.panel_tiles_for)


def _symbol(name: str, taken: set) -> str:
    base = "kiln_" + re.sub(r"[^A-Za-z0-9_]", "_", name)
    symbol, i = base, 1
    while symbol in taken:
        symbol, i = f"{base}_{i}", i + 1
    taken.add(symbol)
    return symbol


def template_warmers(graph) -> list:
    """Callables building the native template entries `graph`'s nodes will call at run
    time, in node order (each template module's `warmer(node)`; scatter_native's is the
    one so far: the other templates' first use is cheap or not in a training step)."""
    from kiln.codegen.cpu import scatter_native

    found: list = []
    stack = [graph.body]
    while stack:
        for node in stack.pop().nodes:
            warm = scatter_native.warmer(node)
            if warm is not None:
                found.append(warm)
            stack.extend(node.regions)
    return found


class CpuBackend(Backend):
    """LLVM backend for target "cpu". See the module docstring for the stages."""

    name = "cpu"
    Options = CpuOptions
    stages = STAGES
    dump_stages = {"source": "llvm", "llvm-optimized": "optimized", "asm": "asm"}
    keep = frozenset({"matmul"})  # matmul becomes a GEMM template call with its epilogue
    scalar_table = SCALAR_TABLE
    caches_object_code = True
    batches_kernels = True  # a BatchKernel is one function over its members (batch_emit.py)

    def __init__(self, options: CpuOptions | None = None, target: str = "cpu"):
        super().__init__(target, options)
        self._cache: dict = {}
        self._lock = threading.Lock()

    def graph_passes(self, options=None) -> list:
        """The standard list plus `fold_transpose` after `canonicalize`: GEMMs read
        transposed operands in place (BLAS's transpose flag), never a copy."""
        from kiln.passes.fold_transpose import fold_transpose

        from kiln.passes.complex_decompose import decompose_complex_blas

        passes = super().graph_passes(options)
        # a large complex matmul stays whole: one cblas_cgemm call (complex_decompose.py)
        passes = [(name, decompose_complex_blas if name == "complex" else fn) for name, fn in passes]
        at = next((i + 1 for i, (name, _) in enumerate(passes) if name == "canonicalize"), len(passes))
        return passes[:at] + [("fold_transpose", fold_transpose)] + passes[at:]

    def templates(self) -> dict:
        """An extern `matmul` (a complex product the `complex` pass kept whole) runs as
        complex BLAS tiles over kiln's threads (gemm_complex.py), others as numpy's;
        `random_bits` as native Threefry over kiln's threads (random_native.py),
        `scatter_along`'s sums natively (scatter_native.py), `convolution` as im2col
        blocks and BLAS GEMMs over kiln's threads (conv_native.py), `take`/`take_along` as
        native gathers (gather_native.py), `cumsum` as a native scan (scan_native.py), a
        topk (`sort` with a small limit) as one native pass a line (topk_native.py), `fft`
        through MKL's DFTI where MKL is the BLAS (fft_native.py)."""
        from kiln.codegen.cpu.conv_native import run_convolution
        from kiln.codegen.cpu.fft_native import run_fft
        from kiln.codegen.cpu.gather_native import run_take, run_take_along
        from kiln.codegen.cpu.gemm_complex import run_matmul
        from kiln.codegen.cpu.random_native import run_random_bits
        from kiln.codegen.cpu.scan_native import run_cumsum
        from kiln.codegen.cpu.topk_native import run_sort
        from kiln.codegen.cpu.scatter_native import run_scatter_along

        return {"gemm": run_matmul, "random_bits": run_random_bits, "scatter": run_scatter_along,
                "conv": run_convolution, "take": run_take, "take_along": run_take_along,
                "scan": run_cumsum, "sort": run_sort, "fft": run_fft}

    # -- planning and emission --------------------------------------------------------
    def _plan(self, k: AnyKernel, taken: set, variant: str | bool | None = None) -> _Plan:
        """How `k` is emitted; for a GEMM `variant` ("blas", "micro", "loop"; True/False
        meaning blas/loop) overrides the cost model's choice."""
        symbol = _symbol(k.name, taken)
        if isinstance(k, Kernel):
            return _Plan(k, symbol, tuple(l.extent for l in k.outer))
        if isinstance(k, BatchKernel):  # one index space: the members' concatenated
            return _Plan(k, symbol, (sum(k.points()),))
        if not isinstance(k, GemmKernel):
            raise KilnArgumentError(f"cpu backend: cannot compile {type(k).__name__}")
        check_strides(k)
        choice = choose_gemm(k, threads=self.options.threads)
        if isinstance(variant, bool):
            variant = "blas" if variant else "loop"
        kind = variant or choice.variant
        if kind == "blas":
            require_blas(self.options.blas)
            return _Plan(k, symbol, gemm_outer_extents(k, True, choice.panel_rows, choice.panel_cols), True,
                         choice.panel_rows, panel_cols=choice.panel_cols)
        if kind == "micro":
            return _Plan(k, symbol, (row_blocks(k),), micro=True)
        loop = gemm_as_kernel(k)
        return _Plan(loop, symbol, tuple(l.extent for l in loop.outer))

    def _module_text(self, plans: Sequence[_Plan]) -> str:
        module = Module(f32_math=self.options.f32_math)
        for p in plans:
            self._emit(module, p)
        return self._finish(module.text())

    def _emit(self, module: Module, p: _Plan) -> None:
        if p.blas:
            emit_gemm(module, p.kernel, p.symbol, p.panel_rows, p.panel_cols, self.options.blas)
        elif p.micro:
            emit_micro_gemm(module, p.kernel, p.symbol)
        elif isinstance(p.kernel, BatchKernel):
            emit_batch(module, p.kernel, p.symbol)
        else:
            emit_kernel(module, p.kernel, p.symbol)

    def _parts(self, plans: Sequence[_Plan]) -> list[Module]:
        """Each plan emitted into a module of its own, which join into one module text
        (`_joined`) in any grouping without emitting the kernels again."""
        parts = []
        for p in plans:
            module = Module(f32_math=self.options.f32_math)
            self._emit(module, p)
            if p.micro:
                module.text_weight = MICRO_TEXT_WEIGHT
            parts.append(share_module(module))
        return parts

    def _joined(self, parts: Sequence[Module]) -> str:
        return self._finish(join_modules(list(parts)))

    def _finish(self, text: str) -> str:
        if self.options.vector_width:
            text = text.replace('!"llvm.loop.vectorize.enable", i1 true}',
                                f'!"llvm.loop.vectorize.enable", i1 true, !"llvm.loop.vectorize.width", '
                                f'i32 {self.options.vector_width}}}')
        return text

    def _optimized(self, text: str):
        mod = jit.parse(text)
        jit.optimize(mod, self.options.opt_level)
        return mod

    def render(self, kernel: AnyKernel, stage: str) -> str:
        """The text of one named stage ("llvm", "optimized" or "asm") for a legalized kernel."""
        text = self._module_text([self._plan(kernel, set())])
        if stage == "llvm":
            return text
        mod = self._optimized(text)
        return str(mod) if stage == "optimized" else jit.assembly(mod, self.options.opt_level)

    # -- compilation ------------------------------------------------------------------
    def _wrap(self, plans, owner, costs: list | None = None) -> list[CompiledKernel]:
        o = self.options
        out = [CompiledKernel(p.kernel, owner.address(p.symbol), owner,
                              object_address=owner.address(p.symbol + ".np"),
                              threads=1 if p.blas or p.micro else o.threads,
                              threshold=o.parallel_threshold, outer_extents=p.outer_extents,
                              serial=p.blas or p.micro, work_costs=costs[i] if costs else None)
               for i, p in enumerate(plans)]
        for c, p in zip(out, plans):  # a prepared call (runtime/fast_call.py) sets BLAS to
            c.calls_blas = p.blas  # one thread only around kernels that call it
        return out

    def compile(self, kernel: AnyKernel, measure: bool | None = None) -> CompiledKernel:
        """Compile one kernel. `measure` (default: options.mode == "max-autotune") times
        the GEMM variants instead of trusting the analytical model."""
        measure = self.options.mode == "max-autotune" if measure is None else measure
        kernel = self.legalize(kernel)
        key = (kernel, measure)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        if measure and isinstance(kernel, GemmKernel):
            choice = measure_gemm(kernel, choose_gemm(kernel, threads=self.options.threads),
                                  lambda kind: self._compile_plans([self._plan(kernel, set(), kind)])[0])
            compiled = self._compile_plans([self._plan(kernel, set(), choice.variant)])[0]
        else:
            compiled = self.build([kernel])[0]
        with self._lock:
            self._cache[key] = compiled
        return compiled

    def _compile_plans(self, plans) -> list[CompiledKernel]:
        mod = self._optimized(self._module_text(plans))
        return self._wrap(plans, jit.Jitted(mod, opt_level=self.options.opt_level))

    def build(self, kernels: Sequence[AnyKernel]) -> list[CompiledKernel]:
        """Compile legalized kernels into ONE LLVM module: one optimize and one JIT for all
        (a kernel identical to another but for its name is compiled once, `_distinct`)."""
        unique, index = _distinct(kernels)
        taken: set = set()
        return _renamed(kernels, index, self._compile_plans([self._plan(k, taken) for k in unique]))

    # -- object code cache hooks ------------------------------------------------------
    def build_object_code(self, kernels: Sequence[AnyKernel]) -> bytes:
        """Relocatable machine code of `kernels` compiled together (cache by content)."""
        taken: set = set()
        plans = [self._plan(k, taken) for k in _distinct(kernels)[0]]
        # several LLVM modules compiled on threads at once (parallel_build.py), joined from
        # the kernels' modules emitted once each (their texts also estimate the build cost);
        # meanwhile this thread readies the OpenMP glue the first split launch would build
        glue = (Deferred(native_pool.prepare),) if self.options.threads > 1 else ()
        with meanwhile(*glue):
            return build_objects(self._parts(plans), self._joined, self.options.opt_level, self.options.threads)

    def stream_build(self, graph_nodes: int = 0, graph=None) -> StreamingBuild | None:
        """A build fed kernels as they are lowered, LLVM started on the first ones while
        the rest are (stream_build.py); None for one thread (nothing to overlap with).
        `graph_nodes`: the traced graph's top-level nodes (a large one has the split glue
        built on a thread while its graph passes run, and with it the native template
        entries its nodes will call: `template_warmers`)."""
        if self.options.threads < 2:
            return None
        warmers = template_warmers(graph) if graph is not None else []

        def prepare() -> None:
            native_pool.prepare()
            for warm in warmers:
                warm()

        return StreamingBuild(self, prepare, graph_nodes)

    def load_built_object_code(self, kernels: Sequence[AnyKernel], blob: bytes,
                               hints: tuple | None = None) -> list[CompiledKernel]:
        """CompiledKernels from bytes made by `object_code(kernels)` with these options.
        `hints`: (distinct kernels, index, costs) rebuilt from `load_hints` kept since
        the build (the program cache checks their form; costs are checked here)."""
        unique, index, costs = hints if hints is not None else (*_distinct(kernels), None)
        taken: set = set()
        plans = [self._plan(k, taken) for k in unique]
        # one object, or one per module built at once (parallel_build.py)
        return _renamed(kernels, index, self._wrap(plans, Engines(blob, self.options.opt_level), costs))

    def load_hints(self, kernels: Sequence[AnyKernel]) -> tuple[list[int], list]:
        """What a load of `kernels`' code recomputes, as plain data: each kernel's index
        among the distinct ones (`_distinct`), each distinct one's `stage_costs` (None:
        not a loop kernel)."""
        unique, index = _distinct(kernels)
        plans = [self._plan(k, set()) for k in unique]
        return index, [stage_costs(p.kernel) if isinstance(p.kernel, Kernel) else None for p in plans]


def _anonymous(k: AnyKernel) -> AnyKernel:
    """`k` less its name (and its batch members' names): kernels are frozen dataclasses,
    so equal fields mean equal code."""
    import dataclasses

    if isinstance(k, BatchKernel):
        members = tuple(dataclasses.replace(m, name=f"m{i}") for i, m in enumerate(k.members))
        return dataclasses.replace(k, name="k", members=members)
    return dataclasses.replace(k, name="k")


def _distinct(kernels: Sequence[AnyKernel]) -> tuple[list, list[int]]:
    """(the kernels that differ in more than their name, each kernel's index among them).
    A model's repeated layers lower to identical kernels: compile each once."""
    first: dict = {}
    unique, index = [], []
    for k in kernels:
        key = _anonymous(k)
        if key not in first:
            first[key] = len(unique)
            unique.append(k)
        index.append(first[key])
    return unique, index


def _renamed(kernels, index: list[int], compiled: list[CompiledKernel]) -> list[CompiledKernel]:
    """One CompiledKernel per kernel: a duplicate shares its twin's code (and its argument
    buffers and lock, as calls of one kernel do) under its own name."""
    import copy
    import dataclasses

    out = []
    for k, i in zip(kernels, index):
        c = compiled[i]
        if c.name != k.name:
            c = copy.copy(c)
            c.kernel = dataclasses.replace(c.kernel, name=k.name)
            c.name = k.name
        out.append(c)
    return out
