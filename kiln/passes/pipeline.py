"""The graph pipeline, as a list of named stages (STYLE §2).

Each backend's `graph_passes` (kiln/codegen/backend.py) gives its own list: by default
`standard_passes(keep)`, the stages below with the composites its templates match kept
whole. `DEFAULT_PASSES` is the CPU backend's list:

    decompose       every composite to primitives, except `matmul` (CPU_KEEP), which
                    the CPU backend turns into a GEMM template call with an epilogue
    complex         complex64 arithmetic rewritten into float32 (re, im) pairs, so complex
                    programs fuse into ordinary kernels (complex_decompose.py)
    canonicalize    algebraic simplification (x * 1, transpose of transpose, ...)
    fold_constants  constant subexpressions evaluated at compile time
    cse             repeated computations merged
    licm            regions closed; loop-invariant nodes hoisted out of while_loop bodies
    unroll          while_loops of a short, compile-time trip count and a pointwise body
                    unrolled, so fusion makes the loop one kernel (unroll_loops.py)
    dce             unused nodes and constants removed

The list *is* the documentation: `kiln dump --stage NAME` prints the graph after any
stage, by these names.

Extension point: later stages (fusion, memory planning, ...) are appended by the
modules that own them, without editing this file's list:

    >>> pipeline = default_pipeline(extra=[("fuse", fuse), ("plan_memory", plan_memory)])
    >>> pipeline.names()[-2:]      # ['fuse', 'plan_memory']

`DEFAULT_PASSES` is the tuple the pipeline starts from; `default_pipeline` copies it,
so appending to one pipeline never changes another.
"""

from __future__ import annotations

from typing import Iterable

from kiln.ir.graph import Graph
from kiln.passes.canonicalize import canonicalize
from kiln.passes.complex_decompose import decompose_complex
from kiln.passes.cse import cse
from kiln.passes.dce import dce
from kiln.passes.decompose import decompose
from kiln.passes.fold_constants import fold_constants
from kiln.passes.licm import licm
from kiln.passes.manager import PassFn, Pipeline
from kiln.passes.unroll_loops import unroll_loops

# composites the CPU backend matches as a whole: matmul becomes a GEMM template call
# (with its epilogue fused in); every other composite is lowered through primitives,
# which the fusion pass then groups into loop nests
CPU_KEEP = frozenset({"matmul"})


def decompose_for_cpu(graph: Graph) -> Graph:
    """`decompose` with the CPU backend's keep set (`CPU_KEEP`: matmul stays whole)."""
    return decompose(graph, keep=CPU_KEEP)


def standard_passes(keep: Iterable[str] = CPU_KEEP) -> list[tuple[str, PassFn]]:
    """The graph pass list of a backend that keeps the composites in `keep` whole (its
    templates match them); each backend's `graph_passes` starts from this.

    >>> [name for name, _ in standard_passes(keep={"matmul"})][:2]
    ['decompose', 'canonicalize']
    """
    keep = frozenset(keep)
    head = decompose_for_cpu if keep == CPU_KEEP else _decompose_keeping(keep)
    return [("decompose", head)] + list(DEFAULT_PASSES[1:])


def _decompose_keeping(keep: frozenset) -> PassFn:
    def decompose_keeping(graph: Graph) -> Graph:
        return decompose(graph, keep=keep)

    decompose_keeping.__doc__ = f"`decompose` keeping {', '.join(sorted(keep)) or 'nothing'} whole."
    return decompose_keeping


DEFAULT_PASSES: tuple[tuple[str, PassFn], ...] = (
    ("decompose", decompose_for_cpu),
    ("complex", decompose_complex),
    ("canonicalize", canonicalize),
    ("fold_constants", fold_constants),
    ("cse", cse),
    ("licm", licm),
    ("unroll", unroll_loops),
    ("dce", dce),
)


def default_pipeline(extra: Iterable[tuple[str, PassFn]] = (), *, debug: bool = False) -> Pipeline:
    """The CPU graph pipeline (`DEFAULT_PASSES`) followed by the `extra` stages.

    >>> default_pipeline().run(graph)                       # all stages
    >>> default_pipeline(debug=True).run(graph, until="cse")  # verified, stops after cse
    """
    return Pipeline(list(DEFAULT_PASSES), debug=debug).extend(extra)


def optimize(graph: Graph, *, debug: bool = False) -> Graph:
    """`graph` through the default pipeline.

    >>> optimize(kn.trace(f, x))
    """
    return default_pipeline(debug=debug).run(graph)
