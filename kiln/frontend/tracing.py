"""`kn.trace`: run a Python function on symbolic tensors and record a Graph.

Inputs become graph parameters (with ShapeVar dims where a dynamic spec says so);
every op the function applies lands as a typed node, including the broadcasts and
dtype conversions numpy would have done silently. Tensors the function closes over
become constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kiln.errors import KilnArgumentError, KilnTraceError, user_location
from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder, is_python_scalar
from kiln.ir.graph import Graph
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.frontend import pytree
from kiln.frontend.dispatch import raw, to_array, trace_stack
from kiln.frontend.specs import specs_by_position, symbolic_shape


def is_tensor_like(x) -> bool:
    from kiln.frontend.tensor import Tensor

    return isinstance(x, (Tensor, np.ndarray))


def _leaf(x) -> bool:
    return is_tensor_like(x) or is_python_scalar(x) or isinstance(x, str)


@dataclass
class Traced:
    graph: Graph
    in_spec: Any  # structure of the positional arguments
    out_spec: Any  # structure of the result
    static_args: list  # non-tensor leaves baked into the graph, by leaf position


def trace_function(fn: Callable, args: tuple, dynamic_shapes=None, name: str | None = None,
                   builder_cls: Callable[[Graph], GraphBuilder] = GraphBuilder,
                   verify_graph: bool = True) -> Traced:
    """`builder_cls`: a GraphBuilder subclass that also watches the trace (kn.compile's
    records where each input was first used, for its recompile explanations).
    `verify_graph=False`: the caller verifies the graph itself (kn.compile hands it to
    `compile_graph(..., verified=False)`, which skips that on a program-cache hit)."""
    from kiln.frontend.graph_compile import paused_gc

    with paused_gc():  # a trace allocates the graph's nodes at once (see paused_gc)
        return _trace_function(fn, args, dynamic_shapes, name, builder_cls, verify_graph)


def _trace_function(fn, args, dynamic_shapes, name, builder_cls, verify_graph) -> Traced:
    from kiln.frontend.tensor import Tensor

    builder = builder_cls(Graph(name or _graph_name(fn)))
    specs = specs_by_position(fn, args, dynamic_shapes)
    names = _signature_names(fn)  # once: inspect.signature costs ~15 us, a leaf is ~1 us
    traced_args = []
    static_args = []
    leaf_index = 0
    for position, (arg, spec) in enumerate(zip(args, specs)):
        leaves, structure = pytree.flatten(arg, _leaf)
        tensors = sum(1 for leaf in leaves if is_tensor_like(leaf))
        if spec is not None and tensors != 1:  # never drop a declared dim silently
            raise KilnArgumentError(
                f"dynamic_shapes: argument {position} ({_param_name(names, position, 0, 1)}) holds "
                f"{tensors} tensors, but a TensorSpec describes exactly one tensor",
                hint="pass each dynamic tensor as its own argument with its own TensorSpec")
        new_leaves = []
        for k, leaf in enumerate(leaves):
            if is_tensor_like(leaf):
                array = leaf if not isinstance(leaf, Tensor) else None
                if isinstance(leaf, Tensor) and leaf.is_traced:
                    t = leaf.value.type
                else:
                    data = to_array(leaf) if array is not None else leaf.numpy()
                    label = f"argument {position}" + (f" leaf {k}" if len(leaves) > 1 else "")
                    shape = symbolic_shape(spec if len(leaves) == 1 else None, data.shape, label,
                                           builder.graph.shape_vars)
                    t = TensorType(dt.from_numpy(data.dtype), shape)
                name_hint = _param_name(names, position, k, len(leaves))
                new_leaves.append(Tensor._make(builder.add_input(t, name_hint), builder))
            else:
                static_args.append((leaf_index, leaf))
                new_leaves.append(leaf)
            leaf_index += 1
        traced_args.append(pytree.unflatten(structure, new_leaves))
    in_leaves, in_spec = pytree.flatten(tuple(args), _leaf)
    stack = trace_stack()
    stack.append(builder)
    try:
        result = fn(*traced_args)
    finally:
        stack.pop()
    out_leaves, out_spec = pytree.flatten(result, _leaf)
    outputs = []
    for leaf in out_leaves:
        if isinstance(leaf, Tensor) and leaf.is_traced:
            if leaf._builder is not builder:
                raise KilnTraceError("the function returned a tensor from another trace",
                                     where=user_location())
            outputs.append(leaf.value)
        elif is_tensor_like(leaf) or is_python_scalar(leaf):
            outputs.append(raw(builder, leaf) if not is_python_scalar(leaf)
                           else builder.full(leaf, dt.python_scalar_dtype(leaf)))
        else:
            raise KilnTraceError(f"the function returned a {type(leaf).__name__}; traced functions "
                                 "return tensors (in tuples, lists or dicts)")
    builder.graph.body.results = outputs
    if verify_graph:
        verify(builder.graph)
    return Traced(builder.graph, in_spec, out_spec, static_args)


def trace(fn: Callable, *args, dynamic_shapes=None, name: str | None = None) -> Graph:
    """The Graph of `fn` applied to example `args` (tensors, arrays, or pytrees of them).

    >>> g = kn.trace(lambda x: kn.gelu(x * 2), kn.ones(4, 8))
    >>> print(g)
    """
    return trace_function(fn, args, dynamic_shapes, name).graph


def _graph_name(fn) -> str:
    name = getattr(fn, "__name__", "main")
    return name if name.isidentifier() else "main"


def _signature_names(fn) -> list[str]:
    import inspect

    try:
        return [p for p in inspect.signature(fn).parameters]
    except (TypeError, ValueError):
        return []


def _param_name(names: list[str], position: int, k: int, count: int) -> str:
    base = names[position] if position < len(names) and names[position].isidentifier() else f"arg{position}"
    return base if count == 1 else f"{base}_{k}"
