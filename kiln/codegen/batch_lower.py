"""Lowering a batch: adjacent `fused` nodes tagged `batch=N` become one `BatchKernel`.

The batching pass (kiln/passes/batching.py) tags small independent kernels and lists
each batch's members next to each other; `build_program` asks `batch_launch` at every
node whether a batch starts there. Each member is lowered as it would be alone (same
Kernel IR, same name stem), then the members' buffers are merged by program slot: an
input two members read is one buffer of the batch. A member that does not lower to a
plain loop nest (a large reduction split in two launches) is left out and launched on
its own; a batch of fewer than two kernels is no batch.

A tagged graph written by hand is checked: members must be adjacent and must not read
each other's results (K455), since a batch runs its members in any order and in
parallel.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kiln.codegen.kernel_ir import BatchKernel, BufferParam, Kernel
from kiln.errors import KilnBatchError
from kiln.ir.graph import Node, Value


def batch_run(nodes: Sequence[Node], index: int) -> list[int]:
    """Positions of the batch that starts at `nodes[index]` ([] when none starts there)."""
    tag = nodes[index].attrs.get("batch") if nodes[index].op == "fused" else None
    if tag is None or (index > 0 and nodes[index - 1].op == "fused"
                       and nodes[index - 1].attrs.get("batch") == tag):
        return []
    run = [index]
    while run[-1] + 1 < len(nodes) and nodes[run[-1] + 1].op == "fused" \
            and nodes[run[-1] + 1].attrs.get("batch") == tag:
        run.append(run[-1] + 1)
    later = [k for k in range(run[-1] + 1, len(nodes))
             if nodes[k].op == "fused" and nodes[k].attrs.get("batch") == tag]
    if later:
        raise KilnBatchError(f"batch {tag}: its members must be adjacent, but node {later[0]} "
                             f"is separated from the run at nodes {run[0]}-{run[-1]}",
                             hint="let the batching pass tag the graph (kiln dump --stage batch)")
    made = {id(r): k for k in run for r in nodes[k].results}
    for k in run:
        for v in nodes[k].operands:
            if id(v) in made:
                raise KilnBatchError(
                    f"batch {tag}: member at node {k} reads a result of the member at node "
                    f"{made[id(v)]}; members of one batch must be independent (they run in one "
                    "launch, in any order)", hint="give the dependent kernel its own launch")
    return run


def batch_launch(nodes: Sequence[Node], index: int, stem: str, slot: Callable[[Value], int],
                 lower: Callable) -> tuple[BatchKernel, tuple[int, ...], list[int]] | None:
    """(batched kernel, its launch's slots, positions it covers) for the batch starting
    at `nodes[index]`, or None. `lower(node, name)` is the single-kernel lowering."""
    run = batch_run(nodes, index)
    if len(run) < 2:
        return None
    name = f"{stem}_batch_{nodes[index].attrs['batch']}"
    members: list[Kernel] = []
    covered: list[int] = []
    member_slots: list[tuple[int, ...]] = []
    for k in run:
        node = nodes[k]
        lowered = lower(node, f"{name}_m{len(members)}")
        if type(lowered) is not Kernel:  # a split reduction or a template: alone
            continue
        members.append(lowered)
        covered.append(k)
        member_slots.append(tuple(slot(v) for v in node.operands) + tuple(slot(v) for v in node.results))
    if len(members) < 2:
        return None
    position: dict[int, int] = {}
    buffers: list[BufferParam] = []
    args: list[tuple[int, ...]] = []
    for kernel, slots in zip(members, member_slots):
        mine = []
        for param, s in zip(kernel.buffers, slots):
            if s not in position:
                position[s] = len(buffers)
                buffers.append(BufferParam(f"a{len(buffers)}", param.dtype, param.shape, param.role))
            mine.append(position[s])
        args.append(tuple(mine))
    sizes: list[str] = []
    for kernel in members:
        sizes += [n for n in kernel.sizes if n not in sizes]
    batch = BatchKernel(name, tuple(buffers), tuple(sizes), tuple(members), tuple(args))
    return batch, tuple(position), covered
