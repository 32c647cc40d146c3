"""Schedule collectives: split each into start and wait, issue early, wait late.

A collective `%y = all_reduce(%x)` becomes

    %h = all_reduce_start(%x) {...}      issued as soon as %x exists
    ...                                  compute that does not need %y
    %y = collective_wait(%h)             right before the first node that reads %y

so the communication runs on the process group's progress thread while the kernels
between start and wait run on this one (XLA's async collectives, the latency-hiding
scheduler in spirit; here a list schedule without a cost model). The priorities:

- a start is issued as soon as its operand exists, but never before an earlier
  start, so every rank still issues its collectives in program order;
- the nodes computing a start's operand run before other compute, so communication
  begins early and the rest of the compute overlaps it;
- a wait is placed only when nothing else can run: right before the first node that
  needs its result, or at the end of the region; otherwise program order is kept.
  Nested regions (cond branches, loop bodies) are scheduled on their own; nothing
  moves across a region boundary.

    %0 = exp(%x) : f32[8]                        %0 = all_reduce_start(%g) : f32[8]
    %1 = all_reduce(%g) : f32[8]      ==>        %1 = exp(%x) : f32[8]
    %2 = add(%1, %0) : f32[8]                    %2 = collective_wait(%0) : f32[8]
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
        region.nodes = overlap_order(region.nodes)


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


def overlap_order(nodes: list[Node]) -> list[Node]:
    """`nodes` reordered by a list schedule: each start as early, each wait as late as
    dependencies allow.

    Of the nodes whose operands are ready, the next start goes first (starts keep their
    program order), then the producers of a start's operand (so communication begins
    before compute that can overlap it), then other nodes in program order; a wait goes
    only when nothing else is ready, i.e. right before the first node that needs it.
    """
    position = {node: i for i, node in enumerate(nodes)}
    producer = {r: node for node in nodes for r in node.results}
    needs = {node: {producer[v] for v in _reads(node) if v in producer} for node in nodes}
    starts = [n for n in nodes if n.op.endswith("_start")]
    feeds: dict[Node, int] = {}  # node -> index of the first start whose operand it computes
    for k, start in enumerate(starts):
        todo = list(needs[start])
        while todo:
            node = todo.pop()
            if node not in feeds and node.op != WAIT:
                feeds[node] = k
                todo.extend(needs[node])

    def rank(node: Node) -> tuple:
        if node.op.endswith("_start"):
            return (0, position[node])
        if node.op == WAIT:
            return (3, position[node])
        if node in feeds:
            return (1, feeds[node], position[node])
        return (2, position[node])

    done: set[Node] = set()
    order: list[Node] = []
    issued = 0
    while len(order) < len(nodes):
        ready = [n for n in nodes if n not in done and needs[n] <= done
                 and (not n.op.endswith("_start") or n is starts[issued])]
        node = min(ready, key=rank)
        order.append(node)
        done.add(node)
        issued += node.op.endswith("_start")
    return order
