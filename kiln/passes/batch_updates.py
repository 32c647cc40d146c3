"""Batch the program's final updates: every kernel that only feeds outputs, one launch.

A training step ends with the optimizer: for each parameter a kernel reads the
parameter, its gradient and its moments and writes their new values (AdamW: p, m, v),
and nothing in the step reads those results again, they are outputs. Such *sink*
kernels are mutually independent by construction, so they can all run as ONE launch:
the multi-tensor apply of PyTorch's fused/foreach optimizers and apex's
`multi_tensor_applier`, here as a `BatchKernel` (kiln/codegen/cpu/batch_emit.py) whose
members are the per-parameter update kernels, whatever their shapes, split over
threads by their concatenated index space.

The pass runs after the batching pass (`batch`): it takes the `fused` loop and
reduction nodes of the top-level region whose results are read by nothing but the
region's outputs and that read a common 0-d value computed in the program (the step's
bias corrections, a schedule's learning rate, a clipping factor: what marks the
per-tensor updates of one optimizer step), tags each such set with one new batch
number (taking them out of any small batch they were in, which stays adjacent) and
lists them at the end of the region. A member that does not lower to one loop nest (a
large full reduction split in two launches) is launched on its own by `batch_lower`.
Independent outputs that share no computed scalar (`(exp(x), tanh(y))`) are left to
the batching pass's own rules.

    >>> str(batch_updates(batch_kernels(fuse(step_graph)))).count("batch=7")  # one per parameter
"""

from __future__ import annotations

from kiln.ir.graph import Graph, Node
from kiln.passes.rewrite import copy_graph

_KINDS = ("loop", "reduction")


def batch_updates(graph: Graph) -> Graph:
    """A copy of the fused (and batched) `graph` with its sink kernels in one batch."""
    from kiln.passes import batching

    new = copy_graph(graph)
    if not batching.ENABLED:  # one switch turns every batching rule off (benchmarks, tests)
        return new
    region = new.body
    used_inside: set[int] = set()
    for node in region.nodes:
        for v in node.operands:
            used_inside.add(id(v))
        if node.regions and node.op != "fused":
            from kiln.ir.regions import captured_values

            used_inside.update(id(v) for v in captured_values(node.regions))
    produced = {id(r) for n in region.nodes for r in n.results}
    groups = _by_shared_scalar([n for n in region.nodes if _is_sink(n, used_inside)], produced)
    if not groups:
        return new
    tag = 1 + max((n.attrs["batch"] for n in _all_fused(new) if n.attrs.get("batch") is not None),
                  default=-1)
    moved = []
    for members in groups:
        for n in members:
            n.attrs["batch"] = tag
        moved += members
        tag += 1
    ids = {id(n) for n in moved}
    region.nodes = [n for n in region.nodes if id(n) not in ids] + moved
    return new


def _by_shared_scalar(sinks: list[Node], produced: set[int]) -> list[list[Node]]:
    """Sinks joined when they read a common 0-d value computed in the program (union-find),
    groups of two or more, in program order."""
    parent = list(range(len(sinks)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_reader: dict[int, int] = {}
    for i, node in enumerate(sinks):
        for v in node.operands:
            if id(v) in produced and v.type.rank == 0:
                j = first_reader.setdefault(id(v), i)
                parent[root(i)] = root(j)
    groups: dict[int, list[Node]] = {}
    for i, node in enumerate(sinks):
        groups.setdefault(root(i), []).append(node)
    return [g for g in groups.values() if len(g) >= 2]


def _is_sink(node: Node, used_inside: set[int]) -> bool:
    return (node.op == "fused" and node.attrs.get("kind") in _KINDS and bool(node.results)
            and not any(id(r) in used_inside for r in node.results))


def _all_fused(graph: Graph):
    stack = [graph.body]
    while stack:
        region = stack.pop()
        for node in region.nodes:
            if node.op == "fused":
                yield node
            elif node.regions:
                stack.extend(node.regions)
