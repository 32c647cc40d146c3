"""Memory planning: which intermediate buffers can share storage.

Liveness comes from one scan over the steps (a view keeps its source alive); two
intermediates interfere when their lifetimes overlap. Buffers of one dtype and one
(symbolic) size share storages by a linear scan over their lifetime intervals (the
register allocator's algorithm, optimal for interval graphs), so each storage is
reused by several buffers in turn.
"""

from __future__ import annotations

from collections import defaultdict

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
        # lifetimes are intervals, so the greedy scan by start time is an optimal coloring
        free: list[int] = []
        active: list[tuple[int, int]] = []  # (last use, storage id)
        for slot in sorted(members, key=lambda s: first[s]):
            for entry in [a for a in active if a[0] < first[slot]]:
                active.remove(entry)
                free.append(entry[1])
            if free:
                sid = free.pop()
            else:
                sid, next_id = next_id, next_id + 1
            storage[slot] = sid
            active.append((last[slot], sid))
    release = defaultdict(list)
    for s in owners:
        release[last[s]].append(s)
    program.storage = storage
    program.release_after = dict(release)
    return program
