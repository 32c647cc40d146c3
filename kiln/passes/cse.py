"""CSE: common subexpression elimination over kiln's pure ops.

Two nodes are the same computation when they have the same op, the same operand
values, equal attributes (compared by their printed form, so `1` and `1.0`, or
`B*T` and `T*B`, are told apart exactly as the text IR tells them apart) and the
same result types; the later one is replaced by the earlier one's results. For
commutative ops the operand order does not count (`add(x, y)` is `add(y, x)`). Two
`constant` nodes are the same when their data is (dtype, shape and bytes), whatever
their names. Nodes with regions are never merged. `random_bits` is a function of its
key (counter-based), so two draws with the same key are the same bits and merge,
and draws with different keys differ in their operands and never do.

Scoping follows dominance: a node inside a region may be replaced by an equal node of
an enclosing region, never the other way round, and sibling regions (the branches of
a `cond`) do not share entries.

    %0 = exp(%x) : f32[4]                  %0 = exp(%x) : f32[4]
    %1 = exp(%x) : f32[4]         ==>      %1 = add(%0, %0) : f32[4]
    %2 = add(%0, %1) : f32[4]              return %1
    return %2
"""

from __future__ import annotations

import hashlib

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.printer import format_attrs
from kiln.passes.rewrite import RewriteBuilder, rebuild

# operand order does not matter to these (float max/min excepted: which of +0.0 and
# -0.0 they return depends on it), so add(x, y) and add(y, x) merge
COMMUTATIVE = frozenset({"add", "mul", "and", "or", "xor", "eq", "ne"})


def cse(graph: Graph) -> Graph:
    """`graph` with repeated computations merged (inside regions too); `graph`
    itself when nothing repeats.

    >>> cse(g)   # a second exp(%x) reuses the first
    """
    tables: dict[int, dict[tuple, list[Value]]] = {}

    def rule(b: RewriteBuilder, node: Node):
        if node.regions:
            return None
        key = node_key(b.graph, node)
        for region in reversed(b.regions):  # innermost first; every enclosing region
            found = tables.get(id(region), {}).get(key)
            if found is not None:
                return found
        tables.setdefault(id(b.region), {})[key] = node.results
        return None

    return rebuild(graph, rule)


def node_key(graph: Graph, node: Node) -> tuple:
    """What makes two region-free nodes compute the same values."""
    types = tuple(str(r.type) for r in node.results)
    if node.op == "constant":
        data = graph.constants[node.attrs["name"]]
        digest = hashlib.sha256(data.tobytes()).hexdigest()
        return ("constant", data.dtype.str, tuple(data.shape), digest, types)
    operands = tuple(id(v) for v in node.operands)
    if node.op in COMMUTATIVE or (node.op in ("max", "min") and not node.results[0].dtype.is_floating):
        operands = tuple(sorted(operands))
    return (node.op, operands, format_attrs(node.attrs), types)
