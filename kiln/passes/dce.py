"""DCE: dead-code elimination. Every kiln op is pure, so a node none of whose results
is used (by a later node, a region's yield or the graph's outputs) goes, inside
regions too, and so do the entries of `graph.constants` no `constant` node names.

Control flow is trimmed as well (XLA's while-loop simplifier does the same):

- a `cond` result nobody reads is dropped from the node and from every branch's
  yield, and an operand no branch reads any more is dropped with its parameters;
- a `while_loop` carried value is dropped when its result is unused and neither the
  loop condition nor any value the loop still carries depends on it.

Liveness runs backwards from the outputs; a node is seen after every node (and
nested region) that uses it, and a loop is re-marked until its carried set settles.

    %0 = exp(%x) : f32[4]                 %0 = neg(%x) : f32[4]
    %1 = neg(%x) : f32[4]        ==>      return %0
    return %1
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.ir.graph import Graph, Node, Region, Value
from kiln.passes.rewrite import new_graph_like


@dataclass
class Liveness:
    """What survives: live values and nodes, and for `cond`/`while_loop` nodes the
    indices of the results and operands they keep."""

    values: set[Value] = field(default_factory=set)
    nodes: set[Node] = field(default_factory=set)
    kept_results: dict[Node, list[int]] = field(default_factory=dict)
    kept_operands: dict[Node, list[int]] = field(default_factory=dict)


def dce(graph: Graph) -> Graph:
    """`graph` without unused nodes, control-flow results and constants; `graph`
    itself when everything is used.

    >>> dce(g)   # drops nodes whose results nothing reads
    """
    live = liveness(graph)
    used_constants = {n.attrs["name"] for n in live.nodes if n.op == "constant"}
    trimmed = any(len(idx) < len(n.results) for n, idx in live.kept_results.items()) or any(
        len(idx) < len(n.operands) for n, idx in live.kept_operands.items())
    if (not trimmed and len(live.nodes) == sum(1 for _ in graph.walk())
            and used_constants == set(graph.constants)):
        return graph
    new = new_graph_like(graph)
    new.constants = {k: v for k, v in graph.constants.items() if k in used_constants}
    vmap: dict[Value, Value] = {}
    for value in graph.inputs:
        vmap[value] = Value(value.type, value.name)
        new.body.params.append(vmap[value])
    new.body.results = _copy_nodes(graph.body, new.body, vmap, live, None)
    return new


def liveness(graph: Graph) -> Liveness:
    """The live values and nodes of `graph` (and what its control flow keeps)."""
    live = Liveness()
    _mark_region(graph.body, live, None)
    return live


def live_nodes(graph: Graph) -> set[Node]:
    """The nodes whose results reach an output of `graph` (directly or through regions)."""
    return liveness(graph).nodes


def _mark_region(region: Region, live: Liveness, results: list[int] | None) -> None:
    live.values.update(region.results if results is None
                       else [region.results[i] for i in results])
    for node in reversed(region.nodes):
        if node.op == "cond":
            _mark_cond(node, live)
        elif node.op == "while_loop":
            _mark_while(node, live)
        elif any(r in live.values for r in node.results):
            live.nodes.add(node)
            live.values.update(node.operands)
            for sub in node.regions:
                _mark_region(sub, live, None)


def _mark_cond(node: Node, live: Liveness) -> None:
    kept = [i for i, r in enumerate(node.results) if r in live.values]
    if not kept:
        return
    live.nodes.add(node)
    live.kept_results[node] = kept
    for branch in node.regions:
        _mark_region(branch, live, kept)
    # operand 0 picks the branch; operand k + 1 is parameter k of every branch
    params = [k for k in range(len(node.operands) - 1)
              if any(branch.params[k] in live.values for branch in node.regions)]
    live.kept_operands[node] = [0] + [k + 1 for k in params]
    live.values.update(node.operands[i] for i in live.kept_operands[node])


def _mark_while(node: Node, live: Liveness) -> None:
    cond_region, body = node.regions
    needed = {i for i, r in enumerate(node.results) if r in live.values}
    if not needed:
        return
    while True:  # grows monotonically, so it settles within len(carried) rounds
        _mark_region(cond_region, live, None)
        _mark_region(body, live, sorted(needed))
        grown = needed | {i for i in range(len(node.operands))
                          if cond_region.params[i] in live.values or body.params[i] in live.values}
        if grown == needed:
            break
        needed = grown
    live.nodes.add(node)
    live.kept_results[node] = live.kept_operands[node] = sorted(needed)
    live.values.update(node.operands[i] for i in needed)


def _copy_nodes(old: Region, new: Region, vmap: dict[Value, Value], live: Liveness,
                results: list[int] | None) -> list[Value]:
    for node in old.nodes:
        if node not in live.nodes:
            continue
        kept_results = live.kept_results.get(node, list(range(len(node.results))))
        kept_operands = live.kept_operands.get(node, list(range(len(node.operands))))
        if node.op == "cond":
            params = [k - 1 for k in kept_operands[1:]]
            regions = [_copy_region(r, vmap, live, params, kept_results) for r in node.regions]
        elif node.op == "while_loop":
            cond_region, body = node.regions
            regions = [_copy_region(cond_region, vmap, live, kept_results, None),
                       _copy_region(body, vmap, live, kept_results, kept_results)]
        else:
            regions = [_copy_region(r, vmap, live, None, None) for r in node.regions]
        clone = Node(node.op, [vmap[node.operands[i]] for i in kept_operands], node.attrs,
                     [node.results[i].type for i in kept_results], regions)
        for i, value in zip(kept_results, clone.results):
            vmap[node.results[i]] = value
        new.nodes.append(clone)
    chosen = old.results if results is None else [old.results[i] for i in results]
    return [vmap[v] for v in chosen]


def _copy_region(region: Region, vmap: dict[Value, Value], live: Liveness,
                 params: list[int] | None, results: list[int] | None) -> Region:
    kept = range(len(region.params)) if params is None else params
    new = Region([Value(region.params[i].type, region.params[i].name) for i in kept])
    for i, value in zip(kept, new.params):
        vmap[region.params[i]] = value
    new.results = _copy_nodes(region, new, vmap, live, results)
    return new
