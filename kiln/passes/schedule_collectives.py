"""Schedule collectives: split each into start and wait, issue early, wait late.

A collective `%y = all_reduce(%x)` becomes

    %h = all_reduce_start(%x) {...}      issued as soon as %x exists
    ...                                  compute that does not need %y
    %y = collective_wait(%h)             right before the first node that reads %y

so the communication runs on the process group's progress thread while the kernels
between start and wait run on this one (XLA's async collectives, the latency-hiding
scheduler in spirit; here a list schedule without a cost model). The rules:

- a start moves up to just after the producers of its operand, but never above an
  earlier start, so every rank still issues its collectives in program order;
- a wait moves down to just before the first node that uses its result (or to the end
  of the region when only the region's results use it); waits that end up side by
  side keep their program order;
- all other nodes keep their order. Nested regions (cond branches, loop bodies) are
  scheduled on their own; nothing moves across a region boundary.

    %0 = all_reduce(%g) : f32[8]                 %0 = all_reduce_start(%g) : f32[8]
    %1 = exp(%x) : f32[8]             ==>        %1 = exp(%x) : f32[8]
    %2 = add(%0, %1) : f32[8]                    %2 = collective_wait(%0) : f32[8]
                                                 %3 = add(%2, %1) : f32[8]

Every rank runs the same schedule (the pass is deterministic), so the order of
collectives on each group is the same everywhere, as the ProcessGroup contract needs.
"""

from __future__ import annotations

from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.ops.collective import START_OPS
from kiln.passes.rewrite import copy_graph

WAIT = "collective_wait"


def schedule_collectives(graph: Graph) -> Graph:
    """`graph` with every collective split into `<op>_start` / `collective_wait`,
    starts hoisted and waits sunk; `graph` itself when it has no collective.

    >>> schedule_collectives(optimized)   # all_reduce -> all_reduce_start ... collective_wait
    """
    if not any(node.op in START_OPS for node in graph.walk()):
        return graph
    new = copy_graph(graph)  # a fresh copy: its regions are ours to rearrange
    _schedule(new.body)
    return new


def _schedule(region: Region) -> None:
    for node in region.nodes:
        for inner in node.regions:
            _schedule(inner)
    if any(node.op in START_OPS for node in region.nodes):
        split_collectives(region)
        region.nodes = overlap_order(region.nodes, region.results)


def split_collectives(region: Region) -> None:
    """Replace each collective node of `region` (not of nested regions) by a start and a
    wait, in place: every use of the old result reads the wait's result."""
    replaced: dict[Value, Value] = {}
    nodes: list[Node] = []
    for node in region.nodes:
        if node.op not in START_OPS:
            nodes.append(node)
            continue
        types = [r.type for r in node.results]
        start = Node(START_OPS[node.op], node.operands, node.attrs, types)
        wait = Node(WAIT, [start.result], {}, types)
        replaced[node.result] = wait.result
        nodes.extend((start, wait))
    region.nodes = nodes
    _replace_uses(region, replaced)


def _replace_uses(region: Region, replaced: dict[Value, Value]) -> None:
    for node in region.nodes:
        node.operands = [replaced.get(v, v) for v in node.operands]
        for inner in node.regions:  # a nested region may read an outer value
            _replace_uses(inner, replaced)
    region.results = [replaced.get(v, v) for v in region.results]


def _reads(node: Node) -> set[Value]:
    """Values `node` reads: its operands and the outer values its regions use."""
    values = set(node.operands)
    for inner in node.regions:
        for n in inner.walk():
            values.update(n.operands)
        values.update(inner.results)
    return values


def overlap_order(nodes: list[Node], results: list[Value]) -> list[Node]:
    """`nodes` reordered: each start as early, each wait as late as dependencies allow.

    `nodes` is a valid program order; the result is one too, in which non-collective
    nodes and the starts each keep their relative order.
    """
    order = list(nodes)
    last_start = -1
    for start in [n for n in nodes if n.op.endswith("_start")]:
        order.remove(start)
        needs = set(start.operands)
        lo = last_start + 1
        for i, node in enumerate(order):
            if any(r in needs for r in node.results):
                lo = max(lo, i + 1)
        order.insert(lo, start)
        last_start = lo
    placed: set[Node] = set()
    for wait in reversed([n for n in nodes if n.op == WAIT]):
        order.remove(wait)
        value = wait.result
        at = next((i for i, node in enumerate(order) if value in _reads(node)), len(order))
        while at > 0 and order[at - 1] in placed:  # waits that meet keep program order
            at -= 1
        order.insert(at, wait)
        placed.add(wait)
    return order
