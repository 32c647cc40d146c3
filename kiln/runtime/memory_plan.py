"""Memory planning: which intermediate buffers can share storage.

Liveness comes from one scan over the steps (a view keeps its source alive); two
intermediates interfere when their lifetimes overlap. Buffers of one dtype and one
(symbolic) size are colored on their interference graph with networkx, so each
color is one storage that several buffers reuse in turn.
"""

from __future__ import annotations

from collections import defaultdict

import networkx as nx

from kiln.runtime.program import Constant, Control, Extern, Launch, Program, View
from kiln.ir.shapes import numel


def _reads_writes(step):
    if isinstance(step, Launch):
        return step.args, step.args
    if isinstance(step, Extern):
        return step.inputs, step.outputs
    if isinstance(step, View):
        return (step.source,), (step.target,)
    if isinstance(step, Constant):
        return (), (step.target,)
    if isinstance(step, Control):
        return step.inputs, step.outputs
    raise TypeError(step)


def plan_memory(program: Program) -> Program:
    """Fill `program.storage` and `program.release_after` in place; returns it."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    base: dict[int, int] = {}
    for i, step in enumerate(program.steps):
        reads, writes = _reads_writes(step)
        for s in writes:
            first.setdefault(s, i)
            last[s] = max(last.get(s, i), i)
        for s in reads:
            last[s] = i
        if isinstance(step, View):
            base[step.target] = base.get(step.source, step.source)
    for view, root in base.items():  # a view keeps the memory it shows alive
        last[root] = max(last.get(root, 0), last.get(view, 0))
    pinned = set(program.inputs) | set(program.outputs)
    for view, root in base.items():
        if view in pinned or root in pinned:
            pinned |= {view, root}
    constant_slots = {s.target for s in program.steps if isinstance(s, Constant)}
    owners = [s for s in first if s not in pinned and s not in base and s not in constant_slots]

    classes = defaultdict(list)
    for s in owners:
        spec = program.buffers[s]
        classes[(spec.dtype.short, str(numel(spec.shape)))].append(s)
    storage, next_id = {}, 0
    for members in classes.values():
        graph = nx.Graph()
        graph.add_nodes_from(members)
        for a_i, a in enumerate(members):
            for b in members[a_i + 1:]:
                if not (last[a] < first[b] or last[b] < first[a]):
                    graph.add_edge(a, b)
        coloring = nx.greedy_color(graph, strategy="largest_first")
        for slot, color in coloring.items():
            storage[slot] = next_id + color
        next_id += (max(coloring.values()) + 1) if coloring else 0
    release = defaultdict(list)
    for s in owners:
        release[last[s]].append(s)
    program.storage = storage
    program.release_after = dict(release)
    return program
