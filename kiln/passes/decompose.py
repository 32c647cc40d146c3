"""Decompose: expand composite ops into primitives through their `decompose` rules.

Every composite (registry kind COMPOSITE: gelu, softmax, layer_norm, attention, ...)
carries a decomposition written against the `Emitter` interface. This pass runs it
on a `RewriteBuilder`, so the primitives it emits land in the new graph in place of
the composite, and a decomposition that emits another composite is expanded in turn.
Composites named in `keep` stay whole, for a backend that matches them into a
template (the CPU pipeline keeps `matmul`, which becomes a GEMM template call).

    graph @f(%x: f32[4]) -> f32[4]                  graph @f(%x: f32[4]) -> f32[4]
      %0 = relu(%x) : f32[4]               ==>        %0 = full() {dtype=f32, shape=(4,), value=0} : f32[4]
      return %0                                       %1 = max(%x, %0) : f32[4]
                                                      return %1
"""

from __future__ import annotations

from typing import Iterable

from kiln.errors import KilnArgumentError
from kiln.ir import registry
from kiln.ir.graph import Graph, Node
from kiln.ir.registry import COMPOSITE
from kiln.passes.rewrite import RewriteBuilder, rebuild


def composites() -> frozenset[str]:
    """The names of every composite op in the registry."""
    return frozenset(name for name, opdef in registry.all_ops().items()
                     if opdef.kind == COMPOSITE)


def decompose(graph: Graph, keep: Iterable[str] = frozenset()) -> Graph:
    """`graph` with every composite op not in `keep` expanded into primitives.

    Expansion is recursive and reaches inside control-flow regions. Returns `graph`
    itself when it holds no composite to expand.

    >>> decompose(g)                     # everything, down to primitives
    >>> decompose(g, keep={"matmul"})    # matmul stays for the GEMM template
    """
    keep = frozenset(keep)
    unknown = sorted(k for k in keep if k not in composites())
    if unknown:
        raise KilnArgumentError(f"decompose: keep names {', '.join(unknown)}, which are not "
                                "composite ops")
    if not any(_expands(node, keep) for node in graph.walk()):
        return graph

    def rule(b: RewriteBuilder, node: Node):
        if not _expands(node, keep):
            return None
        return b.decompose(node.op, node.operands, node.attrs)

    return rebuild(graph, rule)


def _expands(node: Node, keep: frozenset[str]) -> bool:
    return node.op not in keep and registry.get(node.op).kind == COMPOSITE
