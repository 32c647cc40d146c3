"""The verifier: a graph is well formed, or `KilnVerifierError` says where it is not.

Checks: every op is registered and its attributes are valid; every operand is
defined before use in its region or an enclosing one (SSA scoping); every node's
result types are exactly what its type rule gives; region counts and signatures
match; shape variables are declared; constants have data of the declared type.
"""

from __future__ import annotations

from kiln.errors import KilnError, KilnVerifierError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.types import TensorType


_RULE_FAILURES = (TypeError, ValueError, ArithmeticError, IndexError, KeyError, AttributeError,
                  RecursionError)


def verify(graph: Graph) -> Graph:
    """Raise KilnVerifierError on the first problem; return the graph if it is sound."""
    visible: set[int] = set()
    for value in graph.inputs:
        _check_type(graph, value.type, f"input %{value.name}")
        visible.add(id(value))
    _verify_region(graph, graph.body, visible, "graph", {})
    return graph


def exact_key(value):
    """`value` tagged with its type, all the way into tuples: 2, 2.0, True and
    sympy.Integer(2) are equal and hash alike in Python, but a type rule may accept one
    and reject another, so a memo key must tell them apart. Unhashable values (lists,
    arrays) raise TypeError: such a node is simply not memoized."""
    if type(value) is tuple:
        return tuple, tuple(exact_key(v) for v in value)
    hash(value)
    return type(value), value


def signature_key(op: str, operands, attrs: dict) -> tuple:
    """A region-free node's type-rule signature: its op, its operands' dtypes and
    shapes, and its attributes by `exact_key` (TypeError where one is unhashable). A type
    rule is a pure function of these, so the verifier and the graph builder remember a
    rule's result per signature."""
    return (op, tuple([(v.type.dtype, v.type.shape) for v in operands]),
            tuple([(k, exact_key(v)) for k, v in sorted(attrs.items())]))


def _check_type(graph: Graph, t: TensorType, where: str) -> None:
    for d in t.shape:
        if type(d) is not int:
            break
    else:  # a static type names no shape variable
        return
    missing = t.symbols() - set(graph.shape_vars)
    if missing:
        raise KilnVerifierError(f"{where}: type {t} uses undeclared shape variable(s) "
                                f"{', '.join(sorted(missing))}")


def _verify_region(graph: Graph, region: Region, visible: set[int], where: str, memo: dict) -> None:
    defined = set(visible)
    for param in region.params:
        defined.add(id(param))
    for index, node in enumerate(region.nodes):
        _verify_node(graph, node, defined, where, index, memo)
        for result in node.results:
            if id(result) in defined:
                raise KilnVerifierError(f"{where}: {node.op} redefines a value")
            defined.add(id(result))
    for value in region.results:
        if id(value) not in defined:
            raise KilnVerifierError(f"{where}: yields a value that is not defined in scope")


def _verify_node(graph: Graph, node: Node, defined: set[int], region_where: str, index: int,
                 memo: dict) -> None:
    where = f"{region_where}, node {index} ({node.op})"
    try:
        opdef = registry.get(node.op)
    except KilnError as exc:
        raise KilnVerifierError(f"{where}: {exc.message}") from None
    for i, operand in enumerate(node.operands):
        if not isinstance(operand, Value) or id(operand) not in defined:
            raise KilnVerifierError(f"{where}: operand {i} is not defined before its use")
    # A graph repeats few signatures (the GPT training step: 1128 nodes, 240 distinct):
    # within one verify, a region-free node whose op, operand types and exactly-typed
    # attributes were checked before has the same rule result (type rules are pure
    # functions of those), so its results are compared with the remembered types.
    key = None
    if not node.regions:
        try:
            key = signature_key(node.op, node.operands, node.attrs)
            known = memo.get(key)
        except TypeError:
            key = known = None
        if known is not None:
            _check_results(graph, node, known, where)
            return
    expected_regions = opdef.num_regions
    if expected_regions is None:
        if not node.regions:
            raise KilnVerifierError(f"{where}: {node.op} needs at least one region")
    elif len(node.regions) != expected_regions:
        raise KilnVerifierError(f"{where}: {node.op} takes {expected_regions} region(s), "
                                f"has {len(node.regions)}")
    try:
        attrs = opdef.normalize_attrs(node.attrs)
        if node.regions or opdef.num_regions is None:
            types = opdef.infer([v.type for v in node.operands], dict(attrs, regions=node.regions))
        else:
            types = opdef.infer([v.type for v in node.operands], attrs)
    except KilnError as exc:
        raise KilnVerifierError(f"{where}: {exc.message}") from None
    except _RULE_FAILURES as exc:
        # a graph parsed from an untrusted file can hand a type rule operands or
        # attributes it never expects (wrong arity, a tuple for an int): still a bad graph
        raise KilnVerifierError(f"{where}: operands or attributes {node.op} cannot take "
                                f"({type(exc).__name__}: {exc})") from None
    _check_results(graph, node, types, where)
    if key is not None:
        memo[key] = types
    for k, region in enumerate(node.regions):
        _verify_region(graph, region, defined, f"{where}, region {k}", memo)


def _check_results(graph: Graph, node: Node, types: list, where: str) -> None:
    actual = [r.type for r in node.results]
    if types != actual:
        raise KilnVerifierError(
            f"{where}: results are typed {', '.join(map(str, actual)) or '()'} but the type rule "
            f"of {node.op} gives {', '.join(map(str, types)) or '()'}")
    for t in actual:
        _check_type(graph, t, where)
    if node.op == "constant":
        _verify_constant(graph, node, where)


def _verify_constant(graph: Graph, node: Node, where: str) -> None:
    name = node.attrs["name"]
    if name not in graph.constants:
        raise KilnVerifierError(f"{where}: constant '{name}' has no data in the graph")
    data = graph.constants[name]
    t = node.results[0].type
    try:
        data_dtype = dt.from_numpy(data.dtype)
    except (KilnError, AttributeError):
        raise KilnVerifierError(f"{where}: constant '{name}' holds data of no kiln dtype") from None
    if data_dtype != t.dtype or tuple(data.shape) != tuple(t.shape):
        raise KilnVerifierError(f"{where}: constant '{name}' holds {data.dtype}{list(data.shape)} "
                                f"but is typed {t}")
