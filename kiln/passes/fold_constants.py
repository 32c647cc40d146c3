"""Fold constants: evaluate nodes whose operands are all constants, at compile time.

A node whose every operand is a `full`, `iota` or `constant` node, with static
shapes and at most `MAX_FOLD_ELEMENTS` elements in every operand and result, is run
through its numpy reference (`EAGER.apply`, the same oracle eager mode uses, so the
folded value is bit-exact) and replaced by a `full` when every element is the same
bit pattern, else by a new entry of `graph.constants`. An elementwise op of `full`
operands is computed once on scalars and stays a `full`, at any size and for symbolic
shapes too. Nodes with regions and collectives are never folded, nor is `random_bits` unless its key
is itself a constant (its bits depend only on the key, so a constant key folds
exactly). A node whose reference raises (an out-of-range `take` index, ...) is left
for run time to report. A node with a `full` operand that does not fold goes through
canonicalize's patterns again, since folding may have made the constant they need.

    %0 = iota() {dimension=0, dtype=i32, shape=(3,)} : i32[3]
    %1 = full() {dtype=i32, shape=(3,), value=2} : i32[3]        %0 = constant() {dtype=i32, name="k0", shape=(3,)} : i32[3]
    %2 = mul(%0, %1) : i32[3]                             ==>    return %0   (k0 = [0, 2, 4])
    return %2
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.emitter import EAGER
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.registry import COLLECTIVE, CONTROL, ELEMENTWISE
from kiln.passes.canonicalize import canonicalize_node
from kiln.passes.rewrite import RewriteBuilder, producer_op, rebuild

MAX_FOLD_ELEMENTS = 2 ** 16
LEAVES = frozenset({"full", "iota", "constant"})

# a reference may fail on values the program never reaches at run time (a guarded
# division, an out-of-range index): folding then leaves the node alone
_EVAL_FAILURES = (KilnError, ArithmeticError, ValueError, TypeError, IndexError, OverflowError)


def fold_constants(graph: Graph) -> Graph:
    """`graph` with constant subexpressions evaluated; `graph` itself if none folds.

    >>> fold_constants(g)   # mul(iota, full(2)) -> constant [0, 2, 4]
    """
    return rebuild(graph, fold_node)


def fold_node(b: RewriteBuilder, node: Node):
    """The folded value of `node`'s results, or None when it cannot or should not fold."""
    if node.op in LEAVES or node.regions or not node.operands:
        return None
    if registry.get(node.op).kind in (CONTROL, COLLECTIVE):
        return None  # a collective's value depends on the other ranks' operands
    if not all(producer_op(v) in LEAVES for v in node.operands):
        # an operand folded into a constant here (2 - 1, the exponent in x ** 2's
        # gradient) may let an algebraic pattern apply that canonicalize could not see
        if any(producer_op(v) == "full" for v in node.operands):
            return canonicalize_node(b, node)
        return None
    splats = fold_splats(b, node)
    if splats is not None:
        return splats
    if not all(_small_static(v) for v in list(node.operands) + node.results):
        return None
    if any(_symbolic(value) for value in node.attrs.values()):
        return None
    arrays = [leaf_array(b.graph, v) for v in node.operands]
    try:
        with np.errstate(all="ignore"):
            results = EAGER.apply(node.op, arrays, node.attrs)
    except _EVAL_FAILURES:
        return None
    return [materialize(b, array) for array in results]


def fold_splats(b: RewriteBuilder, node: Node) -> list[Value] | None:
    """An elementwise op of `full` operands computed once, on 0-d arrays, as a `full`
    of the result shape: exact for any size, symbolic shapes included."""
    if registry.get(node.op).kind != ELEMENTWISE:
        return None
    if not all(producer_op(v) == "full" for v in node.operands):
        return None
    scalars = [EAGER.apply("full", [], dict(v.producer.attrs, shape=()))[0] for v in node.operands]
    try:
        with np.errstate(all="ignore"):
            results = EAGER.apply(node.op, scalars, node.attrs)
    except _EVAL_FAILURES:
        return None
    values = [_fill_value(r) for r in results]
    if any(v is None for v in values):
        return None
    return [b.full(v, dt.from_numpy(r.dtype), out.shape)
            for v, r, out in zip(values, results, node.results)]


def _fill_value(array: np.ndarray):
    """The `full` value that reproduces the 0-d `array` bit for bit, or None."""
    kind = dt.from_numpy(array.dtype)
    if kind.is_complex:
        return None
    item = array.reshape(-1)[0]
    value = bool(item) if kind.is_bool else int(item) if kind.is_integer else float(item)
    refill = EAGER.apply("full", [], {"value": value, "dtype": kind, "shape": array.shape})[0]
    return value if refill.tobytes() == array.tobytes() else None  # NaN payloads, -0.0


def _small_static(value: Value) -> bool:
    t = value.type
    return t.is_static and int(np.prod(t.shape, dtype=np.int64)) <= MAX_FOLD_ELEMENTS


def _symbolic(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_symbolic(v) for v in value)
    return not isinstance(value, (bool, int, float, str, dt.DType, type(None)))


def leaf_array(graph: Graph, value: Value) -> np.ndarray:
    """The data of a `full`, `iota` or `constant` value (static shape)."""
    node = value.producer
    if node.op == "constant":
        return graph.constants[node.attrs["name"]]
    return EAGER.apply(node.op, [], node.attrs)[0]


def materialize(b: RewriteBuilder, array: np.ndarray) -> Value:
    """A `full` when `array` is one repeated bit pattern that `full` reproduces
    exactly, else a new constant of the graph."""
    array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes 0-d 1-d
    if array.size and _uniform(array):
        value = _fill_value(array.reshape(-1)[:1].reshape(()))
        if value is not None:
            return b.full(value, dt.from_numpy(array.dtype), array.shape)
    return add_constant(b, array)


def add_constant(b: RewriteBuilder, array: np.ndarray, prefix: str = "k") -> Value:
    """A `constant` node for `array`, stored under a fresh name (`k0`, `k1`, ...)."""
    constants = b.graph.constants
    index = len(constants)
    while f"{prefix}{index}" in constants:
        index += 1
    name = f"{prefix}{index}"
    constants[name] = array
    return b.call("constant", name=name, dtype=dt.from_numpy(array.dtype), shape=tuple(array.shape))


def _uniform(array: np.ndarray) -> bool:
    flat = array.reshape(-1)
    if array.dtype.itemsize in (1, 2, 4, 8):
        bits = flat.view(f"u{array.dtype.itemsize}")
        return bool((bits == bits[0]).all())
    return bool((flat == flat[0]).all())
