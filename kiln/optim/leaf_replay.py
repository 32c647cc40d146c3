"""The per-parameter body of an optimizer's update, traced once per leaf signature.

An optimizer's `update` runs the same few lines for every parameter (Adam's moments,
bias correction and step). Inside a trace each parameter's lines go through the whole
tensor layer (dispatch, promotion, weak scalars, broadcasting) to emit the same ~25
nodes again; a GPT's 28 parameters share ~8 (dtype, shape) signatures. `map_leaves`
runs the body through the tensor layer once per signature, records the nodes it
emitted, and for every other parameter of that signature emits the same nodes again
with its own operands (through the builder's `apply`, so types are still inferred and
the builder still watches every node). The graph is node for node the one the plain
loop would emit; eager mode, and any body the record cannot stand for, runs the plain
loop.

A recording stands for a signature only when it is a straight run of nodes in the
builder's current region that created no graph constant (the builder hands out one
value per constant, so a replay would duplicate it), holds no nested region, and
recorded nothing on the autograd tape (its results carry no tape node).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kiln.frontend.tensor import Tensor
from kiln.ir.graph import Node, Value


def map_leaves(body: Callable[..., tuple], columns: Sequence[tuple]) -> list[tuple]:
    """`[body(*column) for column in columns]`; in a trace, a column whose signature
    (each entry's tensor dtype and shape, or the entry itself when not a tensor) was
    already traced has the recorded nodes emitted again instead of running `body`.
    `body` must depend only on its column and on values that are the same for every
    column (an optimizer's step size, its hyperparameters): a tensor it reaches some other
    way would be shared by the replays.

    >>> map_leaves(lambda p, g: (p - 0.1 * g,), [(p1, g1), (p2, g2)])  # doctest: +SKIP
    """
    builder = _builder_of(columns)
    if builder is None:
        return [tuple(body(*column)) for column in columns]
    recorded: dict[tuple, _Recording | None] = {}
    out = []
    for column in columns:
        key = _signature(column, builder)
        recording = recorded.get(key)
        if recording is not None:
            out.append(recording.replay(builder, column))
            continue
        region, start, constants = builder.region, len(builder.region.nodes), len(builder.graph.constants)
        results = tuple(body(*column))
        if key is not None and key not in recorded:
            recorded[key] = _Recording.of(builder, region, start, constants, column, results)
        out.append(results)
    return out


def _builder_of(columns: Sequence[tuple]):
    """The one trace every tensor of `columns` belongs to; None in eager mode, for a mix
    of traces, or when a tensor is on the autograd tape (the replay records no tape)."""
    builder = None
    for column in columns:
        for x in column:
            if not isinstance(x, Tensor):
                continue
            if not x.is_traced or x._node is not None or x._requires_grad:
                return None
            if builder is None:
                builder = x._builder
            elif x._builder is not builder:
                return None
    return builder


def _signature(column: tuple, builder) -> tuple | None:
    """Per entry (type, dtype, shape, first entry of the same value) for a tensor,
    (type, entry) for None, bool, int,
    float or str; None (never replayed) for anything else."""
    key, first = [], {}
    for i, x in enumerate(column):
        if isinstance(x, Tensor):
            if x._builder is not builder:
                return None
            t = x._x.type  # and which entry first held this value (aliasing is structure)
            key.append((type(x), t.dtype, t.shape, first.setdefault(id(x._x), i)))
        elif x is None or type(x) in (bool, int, float, str):
            key.append((type(x), x))
        else:
            return None
    return tuple(key)


class _Recording:
    """The nodes one column's body emitted, and where its results came from."""

    __slots__ = ("nodes", "inputs", "results")

    def __init__(self, nodes: list[Node], inputs: list[Value | None], results: list):
        self.nodes = nodes
        self.inputs = inputs  # per column entry: its graph value (None: not a tensor)
        # per result: ("input", column index) or ("value", recorded Value)
        self.results = results

    @classmethod
    def of(cls, builder, region, start: int, constants: int, column: tuple,
           results: tuple) -> "_Recording | None":
        if builder.region is not region or len(builder.graph.constants) != constants:
            return None
        nodes = region.nodes[start:]
        if any(node.regions for node in nodes):
            return None
        inputs = [x._x if isinstance(x, Tensor) else None for x in column]
        produced = {id(v) for node in nodes for v in node.results}
        where = []
        for r in results:
            index = next((i for i, x in enumerate(column) if x is r), None)
            if index is not None:  # an entry handed back as it came (or None for None)
                where.append(("input", index))
            elif not isinstance(r, Tensor) or r._builder is not builder or r._node is not None:
                return None
            elif id(r._x) in produced and type(r) is Tensor:
                where.append(("value", r._x))
            else:  # a tensor from outside the body: not this column's own result
                return None
        return cls(list(nodes), inputs, where)

    def replay(self, builder, column: tuple) -> tuple:
        """The recorded nodes emitted again with `column`'s values for the recorded ones;
        values from outside the body (shared scalars such as a step size) stay shared."""
        vmap: dict[int, Value] = {id(old): x._x for old, x in zip(self.inputs, column)
                                  if old is not None}
        for node in self.nodes:
            operands = [vmap.get(id(v), v) for v in node.operands]
            new = builder.apply(node.op, operands, node.attrs)
            for old, value in zip(node.results, new):
                vmap[id(old)] = value
        out = []
        for kind, what in self.results:
            out.append(column[what] if kind == "input" else Tensor._make(vmap[id(what)], builder))
        return tuple(out)
