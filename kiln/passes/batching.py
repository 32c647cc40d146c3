"""Batching: small independent kernels of any shapes share one launch.

After fusion every `fused` node is one kernel launch. A launch has a fixed cost on top
of its work (on the CPU, a few microseconds of Python and ctypes per kernel), so a
program of many tiny kernels spends its time launching them. This pass groups small
`fused` nodes (loop and reduction kernels) that do not depend on each other into
*batches*: each member keeps its own iteration space, shape, strides and body, and the
backend emits one kernel over the concatenation of the members' index spaces (a switch
over sub-problems by offsets, kiln/codegen/cpu/batch_emit.py), so a batch is one
launch however many shapes it mixes. Horizontal fusion (fusion.py, step 4) already
merges independent loops of ONE iteration space into a single loop; batching is for
what remains: different shapes, and reductions.

Rules (TorchInductor's combo kernels and XLA's horizontal loop fusion, simplified):

1. *Cost model*: a kernel is small when its estimated work (elements computed, loaded
   and reduced over its region, at the largest size its ShapeVars allow) is at most
   `SMALL_KERNEL_WORK`, about a launch's cost on the CPU. A symbolic dim with no upper
   bound is never provably small, so its kernels stay unbatched.
2. *Dependence*: members of a batch are mutually independent. Each node gets a *level*,
   the longest chain of launch-like nodes (kernels, library calls, control flow; views
   and constants are free) that leads to it, counting values that control-flow regions
   read from outside as inputs. A kernel that depends on another has a higher level, so
   kernels of one level are independent, and contracting each level's batch cannot
   make a cycle (every edge between batches goes to a higher level). The same holds for
   the longest chain that FOLLOWS a node (as late as possible: a kernel that only feeds
   an output batches with the last kernels); the pass takes whichever of the two
   groupings leaves fewer launches.
3. *Schedule*: the region is re-listed in a topological order in which each batch's
   members are adjacent, at the place of its first member (Kahn's algorithm, ties by
   original position), and every member is tagged `batch=N`. Regions of `cond` and
   `while_loop` are batched on their own (a branch's kernels batch with each other).

The pass runs after `fuse` for backends that emit batches (`Backend.batches_kernels`,
the CPU's); `kiln dump --stage batch` shows the tags and `--stage kernels` the batched
kernels with their members.

    >>> batch_kernels(fuse(graph))   # 16 small ops of different shapes: one batch
"""

from __future__ import annotations

import heapq

import sympy

from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.shapes import ShapeVar
from kiln.passes.rewrite import copy_graph

# estimated element-operations at or below which a kernel's launch cost dominates its
# work (CPU: ~3 us per launch vs ~1-4 element-ops per ns in a vectorized loop)
SMALL_KERNEL_WORK = 1 << 15
# members per batch: bounds the batched kernel's code size and its compile time
MAX_MEMBERS = 32
# the benchmark flips this off to measure what batching saves (bench_horizontal.py)
ENABLED = True

_FREE = frozenset({"reshape", "constant"})  # views and baked-in data: no launch
_BATCHABLE_KINDS = ("loop", "reduction")
_CONTROL = ("cond", "while_loop")


def batch_kernels(graph: Graph) -> Graph:
    """A copy of the fused `graph` with small independent kernels batched (module doc).

    >>> str(batch_kernels(fused)).count("batch=0")   # members of the first batch
    """
    new = copy_graph(graph)
    if not ENABLED:
        return new
    counter = [0]
    _batch_region(new.body, new.shape_vars, counter)
    return new


def kernel_work(node: Node, shape_vars: dict[str, ShapeVar]) -> float:
    """Estimated element-operations of one `fused` node at its largest allowed sizes:
    every value its region computes, plus the elements each reduction reads (inf when a
    size has no upper bound)."""
    (region,) = node.regions
    work = 0.0
    for inner in region.nodes:
        for r in inner.results:
            work += _bound(r.type.shape, shape_vars)
        if inner.op.startswith("reduce_") and inner.operands:
            work += _bound(inner.operands[0].type.shape, shape_vars)
    return work + sum(_bound(p.type.shape, shape_vars) for p in region.params)


def _bound(shape: tuple, shape_vars: dict[str, ShapeVar]) -> float:
    """numel(shape) with each size at its ShapeVar's max (inf when it has none)."""
    total = 1.0
    for d in shape:
        if isinstance(d, int):
            total *= d
            continue
        expr = sympy.sympify(d)
        subs = {}
        for s in expr.free_symbols:
            var = shape_vars.get(s.name)
            if var is None or var.max is None:
                return float("inf")
            subs[s] = var.max
        total *= float(expr.subs(subs))
    return total


def is_small(node: Node, shape_vars: dict[str, ShapeVar]) -> bool:
    """Is `node` a kernel whose launch cost dominates its work (a batching candidate)?"""
    return (node.op == "fused" and node.attrs.get("kind") in _BATCHABLE_KINDS
            and node.attrs.get("batch") is None
            and kernel_work(node, shape_vars) <= SMALL_KERNEL_WORK)


def _inputs(node: Node) -> list[Value]:
    """Operands plus the outer values a control-flow region reads directly."""
    values = list(node.operands)
    if node.regions and node.op != "fused":
        from kiln.ir.regions import captured_values

        values += [v for v in captured_values(node.regions) if all(v is not o for o in node.operands)]
    return values


def _batch_region(region: Region, shape_vars: dict, counter: list) -> None:
    """Tag and re-order `region` (a copy this pass owns) in place; recurse into control flow."""
    nodes = region.nodes
    for node in nodes:
        if node.op in _CONTROL:
            for inner in node.regions:
                _batch_region(inner, shape_vars, counter)
    producer = {id(r): k for k, n in enumerate(nodes) for r in n.results}
    preds = [{producer[id(v)] for v in _inputs(node) if id(v) in producer} for node in nodes]
    weight = [0 if node.op in _FREE else 1 for node in nodes]
    small = [k for k, node in enumerate(nodes) if is_small(node, shape_vars)]
    # kernels of one level are independent by either count: the launches before a node
    # (as soon as possible) or after it (as late as possible); the one that leaves fewer
    # launches wins (a small kernel that only feeds an output batches with the last ones)
    early: list[int] = []
    for k in range(len(nodes)):
        early.append(max((early[j] for j in preds[k]), default=0) + weight[k])
    late = [0] * len(nodes)
    for k in reversed(range(len(nodes))):
        for j in preds[k]:
            late[j] = max(late[j], late[k] + weight[k])
    best = min((_chunks(small, early), _chunks(small, late)),
               key=lambda chunks: len(chunks) - sum(len(c) for c in chunks))
    group_of: dict[int, int] = {}
    for chunk in best:
        for k in chunk:
            group_of[k] = counter[0]
            nodes[k].attrs["batch"] = counter[0]
        counter[0] += 1
    if group_of:
        region.nodes = _schedule(nodes, preds, group_of)


def _chunks(small: list[int], level: list[int]) -> list[list[int]]:
    """The batches (two members or more, at most MAX_MEMBERS) of the small kernels of
    each level, in program order."""
    by_level: dict[int, list[int]] = {}
    for k in small:
        by_level.setdefault(level[k], []).append(k)
    out = []
    for members in by_level.values():
        for start in range(0, len(members), MAX_MEMBERS):
            if len(members[start:start + MAX_MEMBERS]) >= 2:
                out.append(members[start:start + MAX_MEMBERS])
    return sorted(out, key=lambda chunk: chunk[0])


def _schedule(nodes: list[Node], preds: list[set[int]], group_of: dict[int, int]) -> list[Node]:
    """`nodes` in a topological order where each batch's members are adjacent, placed
    where the batch's first member was (Kahn's algorithm on the contracted graph)."""
    unit = {k: ("b", group_of[k]) if k in group_of else ("n", k) for k in range(len(nodes))}
    members: dict[tuple, list[int]] = {}
    for k in range(len(nodes)):
        members.setdefault(unit[k], []).append(k)
    waiting: dict[tuple, set] = {u: set() for u in members}
    users: dict[tuple, set] = {u: set() for u in members}
    for k, p in enumerate(preds):
        for j in p:
            if unit[j] != unit[k]:
                waiting[unit[k]].add(unit[j])
                users[unit[j]].add(unit[k])
    ready = [(min(ks), u) for u, ks in members.items() if not waiting[u]]
    heapq.heapify(ready)
    out: list[Node] = []
    while ready:
        _, u = heapq.heappop(ready)
        out.extend(nodes[k] for k in members[u])
        for v in users[u]:
            waiting[v].discard(u)
            if not waiting[v]:
                heapq.heappush(ready, (min(members[v]), v))
    if len(out) != len(nodes):  # levels make the contracted graph acyclic: a pass bug
        from kiln.errors import KilnError

        raise KilnError("internal: batching made the kernel dependence graph cyclic")
    return out
