"""The graph IR: SSA `Value`s produced by `Node`s inside `Region`s of a `Graph`.

A Region is a block with parameters, an ordered list of nodes and the values it
yields. A Graph's body is its top-level region (parameters are the graph inputs,
yielded values its outputs). Control-flow nodes own nested regions (`cond` one per
branch, `while_loop` a condition and a body); a nested region may use values of the
regions around it, which the tracer turns into explicit operands.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from kiln.ir.shapes import ShapeVar
from kiln.ir.types import TensorType


class Value:
    """An SSA value: the result of a node or a region parameter."""

    __slots__ = ("type", "name", "producer", "index", "__weakref__")

    def __init__(self, type: TensorType, name: str | None = None,
                 producer: "Node | None" = None, index: int = 0):
        self.type = type
        self.name = name  # a hint for printing; graph inputs keep theirs
        self.producer = producer
        self.index = index

    @property
    def dtype(self):
        return self.type.dtype

    @property
    def shape(self):
        return self.type.shape

    def __repr__(self) -> str:
        return f"Value({self.name or hex(id(self))}: {self.type})"


class Node:
    """One op application: `%r0, %r1 = op(%a, %b) {attrs} : types` plus regions."""

    __slots__ = ("op", "operands", "attrs", "regions", "results")

    def __init__(self, op: str, operands: list[Value], attrs: dict[str, Any],
                 result_types: list[TensorType], regions: list["Region"] | None = None):
        self.op = op
        self.operands = list(operands)
        self.attrs = dict(attrs)
        self.regions = list(regions) if regions else []
        if type(result_types) is list and len(result_types) == 1:  # most nodes: one Value
            self.results = [Value(result_types[0], None, self, 0)]
        else:
            self.results = [Value(t, None, self, i) for i, t in enumerate(result_types)]

    @property
    def result(self) -> Value:
        (value,) = self.results
        return value

    def __repr__(self) -> str:
        return f"Node({self.op}, {len(self.operands)} operands, {len(self.results)} results)"


class Region:
    """A block: parameters, nodes in order, and the values it yields."""

    __slots__ = ("params", "nodes", "results")

    def __init__(self, params: list[Value] | None = None, nodes: list[Node] | None = None,
                 results: list[Value] | None = None):
        self.params = list(params or [])
        self.nodes = list(nodes or [])
        self.results = list(results or [])

    @property
    def param_types(self) -> list[TensorType]:
        return [p.type for p in self.params]

    @property
    def result_types(self) -> list[TensorType]:
        return [r.type for r in self.results]

    def walk(self) -> Iterator[Node]:
        """Every node of this region and its nested regions, in program order."""
        for node in self.nodes:
            yield node
            for region in node.regions:
                yield from region.walk()


class Graph:
    """A typed, SSA function: inputs, nodes, outputs, shape variables and constants."""

    def __init__(self, name: str = "main", body: Region | None = None,
                 shape_vars: dict[str, ShapeVar] | None = None,
                 constants: dict[str, np.ndarray] | None = None):
        self.name = name
        self.body = body if body is not None else Region()
        self.shape_vars: dict[str, ShapeVar] = dict(shape_vars or {})
        self.constants: dict[str, np.ndarray] = dict(constants or {})

    @property
    def inputs(self) -> list[Value]:
        return self.body.params

    @property
    def outputs(self) -> list[Value]:
        return self.body.results

    @property
    def nodes(self) -> list[Node]:
        return self.body.nodes

    def walk(self) -> Iterator[Node]:
        return self.body.walk()

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.walk():
            counts[node.op] = counts.get(node.op, 0) + 1
        return counts

    def __str__(self) -> str:
        from kiln.ir.printer import print_graph

        return print_graph(self)

    def __repr__(self) -> str:
        return (f"Graph(@{self.name}: {len(self.inputs)} inputs, {len(self.outputs)} outputs, "
                f"{sum(1 for _ in self.walk())} nodes)")

    def structurally_equal(self, other: "Graph") -> bool:
        """Same ops, operands, attrs, types, regions, shape vars and constant data.

        The printer is canonical (values are named by position, attrs sorted), so equal
        text means equal structure; constants are compared bit for bit.
        """
        if str(self) != str(other) or self.constants.keys() != other.constants.keys():
            return False
        for key, value in self.constants.items():
            theirs = other.constants[key]
            if value.dtype != theirs.dtype or value.shape != theirs.shape:
                return False
            if value.tobytes() != theirs.tobytes():
                return False
        return True
