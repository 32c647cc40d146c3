"""The reference interpreter: runs a graph node by node with each op's numpy reference.

It is the oracle that compiled code is checked against, and what an exported
program runs until a backend compiles it. Inputs are checked against the graph's
types, binding shape variables and enforcing their constraints.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import sympy

from kiln.errors import KilnDTypeError, KilnShapeError, KilnShapeSpecError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.ir.graph import Graph, Region
from kiln.ir.registry import CONTROL
from kiln.ir.shapes import evaluate


def bind_shapes(graph: Graph, arrays: Sequence[np.ndarray], name: str | None = None) -> dict[str, int]:
    """Check input arrays against the graph's input types; return shape-var values."""
    what = name or f"@{graph.name}"
    if len(arrays) != len(graph.inputs):
        raise KilnShapeError(f"{what}: expects {len(graph.inputs)} inputs, got {len(arrays)}")
    bindings: dict[str, int] = {}
    deferred = []
    for i, (value, array) in enumerate(zip(graph.inputs, arrays)):
        label = f"{what} input {i} (%{value.name})"
        t = value.type
        got = dt.from_numpy(array.dtype)
        if got != t.dtype:
            raise KilnDTypeError(f"{label}: expected dtype {t.dtype}, got {got}")
        if array.ndim != t.rank:
            raise KilnShapeError(f"{label}: expected rank {t.rank} ({t}), got shape {list(array.shape)}")
        for axis, (d, n) in enumerate(zip(t.shape, array.shape)):
            if isinstance(d, int):
                if d != n:
                    raise KilnShapeError(f"{label}: dim {axis} must be {d}, got {n} (type {t})")
            elif isinstance(d, sympy.Symbol):
                var = graph.shape_vars[d.name]
                broken = var.check(n)
                if broken is not None:
                    raise KilnShapeSpecError(
                        f"{label}: dim {axis} ({d.name}) is {n}, which breaks {var.describe()}",
                        hint=f"the spec requires {broken}")
                if bindings.setdefault(d.name, n) != n:
                    raise KilnShapeSpecError(
                        f"{label}: dim {axis} is {n} but {d.name} is {bindings[d.name]} elsewhere")
            else:
                deferred.append((label, axis, d, n))
    for label, axis, d, n in deferred:
        if evaluate(d, bindings) != n:
            raise KilnShapeSpecError(f"{label}: dim {axis} must equal {d} = "
                                     f"{evaluate(d, bindings)}, got {n}")
    return bindings


def concrete_attrs(attrs: dict, bindings: dict[str, int]) -> dict:
    if not bindings and not any(_symbolic(v) for v in attrs.values()):
        return attrs
    return {k: _concrete(v, bindings) for k, v in attrs.items()}


def _symbolic(value) -> bool:
    if isinstance(value, sympy.Basic):
        return True
    return isinstance(value, tuple) and any(_symbolic(v) for v in value)


def _concrete(value, bindings):
    if isinstance(value, sympy.Basic):
        return evaluate(value, bindings)
    if isinstance(value, tuple):
        return tuple(_concrete(v, bindings) for v in value)
    return value


def run_graph(graph: Graph, *arrays: np.ndarray) -> list[np.ndarray]:
    """Run `graph` on numpy arrays; returns its outputs as a list."""
    arrays = [np.asarray(a) for a in arrays]
    bindings = bind_shapes(graph, arrays)
    return run_region(graph, graph.body, arrays, {}, bindings)


def run_region(graph: Graph, region: Region, args: Sequence[np.ndarray], env: dict,
               bindings: dict[str, int]) -> list[np.ndarray]:
    env = dict(env)
    for param, array in zip(region.params, args):
        env[id(param)] = array
    for node in region.nodes:
        operands = [env[id(v)] for v in node.operands]
        attrs = concrete_attrs(node.attrs, bindings)
        opdef = registry.get(node.op)
        if node.op == "constant":
            results = [graph.constants[attrs["name"]]]
        elif opdef.kind == CONTROL:
            callables = [_region_callable(graph, r, env, bindings) for r in node.regions]
            out = opdef.reference(*operands, regions=callables, **attrs)
            results = list(out)
        else:
            results = EAGER.apply(node.op, operands, attrs)
        for value, array in zip(node.results, results):
            env[id(value)] = array
    return [env[id(v)] for v in region.results]


def _region_callable(graph, region, env, bindings):
    def call(*args):
        return run_region(graph, region, args, env, bindings)

    return call

