"""LICM: loop-invariant code motion out of `while_loop` bodies, and closed regions.

A node of a loop body is *invariant* when every operand is: a carried value that the
body yields unchanged (the frontend passes captured values through the loop this
way), a value defined outside the loop, or the result of another invariant node. Such
a node computes the same value on every trip, so it is computed once before the loop
and its result enters the body as one more pass-through carried value:

    %0 = while_loop(%i, %x) : i32[], f32[N]          %0 = reduce_sum(%x) {axes=(0,)} : f32[]
      region(%1, %2): ...                            %1 = while_loop(%i, %x, %0) : ...
      region(%3: i32[], %4: f32[N]):       ==>         region(%2, %3, %4): ...
        %5 = reduce_sum(%4) {axes=(0,)} : f32[]        region(%5: i32[], %6: f32[N], %7: f32[]):
        %6 = add(%3, ...)                                %8 = add(%5, ...)
        yield %6, %4                                     yield %8, %6, %7

Nodes that fusion recomputes inline for free (`full`, `iota`, broadcasts, converts,
reshapes, ...) are not hoisted on their own: carrying them in would turn an inline
constant into a buffer every kernel of the body has to load (XLA's while-loop LICM
leaves constants and size-inflating ops in place for the same reason). They are
copied out of the loop when a hoisted node needs them. Inner loops are processed
first, so an invariant of an inner loop can leave the outer loop as well. Nodes with
regions stay where they are. The loop may run zero times: kiln ops are pure, so
computing a hoisted value that no trip uses is wasted work, never a wrong result.

Before hoisting, every region is *closed*: a value a region reads from an enclosing
region (CSE merges a node of a region with an equal node outside it) becomes an
explicit operand (`cond`, `fused`) or pass-through carried value (`while_loop`), so
each region is a standalone sub-graph again, as code generation needs; an operand-free
value (`full`, `iota`, `constant`) is recomputed inside the region instead.
"""

from __future__ import annotations

from kiln.errors import KilnError
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.regions import add_params, free_values, pass_through, replace_uses
from kiln.passes.rewrite import copy_graph

# values fusion computes inline at the point of use (see the module doc)
CHEAP = frozenset({"constant", "full", "iota", "broadcast_in_dim", "transpose", "slice", "reverse",
                   "convert", "reshape", "random_bits"})


def licm(graph: Graph) -> Graph:
    """`graph` with regions closed and loop-invariant nodes hoisted out of while bodies;
    `graph` itself when there is nothing to do.

    >>> licm(g)   # reduce_sum(%x) of a loop-invariant %x now runs once, before the loop
    """
    if not any(node.regions for node in graph.walk()):
        return graph
    new = copy_graph(graph)
    closed = _close(new.body)
    hoisted = _hoist_region(new.body)
    return new if closed or hoisted else graph


# -- closing regions ---------------------------------------------------------------------------


def _close(region: Region) -> bool:
    """Close every region nested in `region`, innermost first; True if anything changed."""
    changed = False
    for node in region.nodes:
        for sub in node.regions:
            changed |= _close(sub)
        captured: dict[int, Value] = {}
        for sub in node.regions:
            for v in free_values(sub):
                captured.setdefault(id(v), v)
        if not captured:
            continue
        changed = True
        values = [v for v in captured.values() if not _rematerialize(node, v)]
        if not values:
            continue
        if node.op == "while_loop":
            pass_through(node, values)
        elif node.op in ("cond", "fused"):  # parameters mirror the operands (after cond's index)
            for sub in node.regions:
                add_params(sub, values)
            node.operands = node.operands + values
        else:
            raise KilnError(f"internal: licm cannot close the regions of {node.op}")
    return changed


# -- hoisting ----------------------------------------------------------------------------------


def _rematerialize(node: Node, value: Value) -> bool:
    """Recompute an operand-free value (`full`, `iota`, `constant`) inside each region of
    `node` that reads it, rather than carrying a buffer in; True if it did."""
    producer = value.producer
    if producer is None or producer.operands or producer.regions or producer.op not in CHEAP:
        return False
    for sub in node.regions:
        if any(v is value for v in free_values(sub)):
            clone = Node(producer.op, [], producer.attrs, [r.type for r in producer.results])
            sub.nodes.insert(0, clone)
            replace_uses(sub, {id(value): clone.results[value.index]})
    return True


def _hoist_region(region: Region) -> bool:
    changed = False
    nodes: list[Node] = []
    for node in region.nodes:
        for sub in node.regions:
            changed |= _hoist_region(sub)
        if node.op == "while_loop":
            moved = _hoist_loop(node)
            nodes.extend(moved)
            changed |= bool(moved)
        nodes.append(node)
    region.nodes = nodes
    return changed


def _hoist_loop(loop: Node) -> list[Node]:
    """Move the invariant nodes of `loop`'s body out; returns their copies, in order."""
    _, body = loop.regions
    outside: dict[int, Value] = {}  # invariant body value -> the value it is outside the loop
    for k, (param, result) in enumerate(zip(body.params, body.results)):
        if result is param:
            outside[id(param)] = loop.operands[k]
    invariant: list[Node] = []
    for node in body.nodes:
        if node.regions or not all(id(v) in outside for v in node.operands):
            continue
        invariant.append(node)
        for r in node.results:
            outside[id(r)] = r  # placeholder: marks it invariant until the copy exists
    roots = {id(n) for n in invariant if n.op not in CHEAP and n.operands}
    if not roots:
        return []
    needed = _ancestors(invariant, roots)
    copies: list[Node] = []
    for node in invariant:
        if id(node) not in needed:
            continue
        clone = Node(node.op, [outside[id(v)] for v in node.operands], node.attrs,
                     [r.type for r in node.results])
        for old, new in zip(node.results, clone.results):
            outside[id(old)] = new
        copies.append(clone)
    hoisted = [n for n in invariant if id(n) in roots]
    results = [r for n in hoisted for r in n.results]
    body.nodes = [n for n in body.nodes if id(n) not in roots]
    used = {id(v) for v in free_values(body)}
    live = [r for r in results if id(r) in used]
    params = pass_through(loop, [outside[id(r)] for r in live])
    replace_uses(body, {id(r): p for r, p in zip(live, params)})
    return copies


def _ancestors(invariant: list[Node], roots: set[int]) -> set[int]:
    """The roots and every invariant node they read from (transitively)."""
    producer = {id(r): n for n in invariant for r in n.results}
    needed: set[int] = set()
    stack = [n for n in invariant if id(n) in roots]
    while stack:
        node = stack.pop()
        if id(node) in needed:
            continue
        needed.add(id(node))
        stack.extend(producer[id(v)] for v in node.operands if id(v) in producer)
    return needed
