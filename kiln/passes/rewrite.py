"""Graph copying and rewriting: the two tools every pass is built from.

- `copy_graph` deep-copies a graph (nested regions too), filling a value map from old
  values to new ones, and can leave nodes out (what dead-code elimination needs).
- `rebuild` re-emits every node, in program order, through a `RewriteBuilder`; a
  *rule* sees each node (operands already mapped into the new graph, regions already
  rebuilt) and either keeps it (returns None) or returns the values that replace its
  results, built with the builder. Nodes a rule emits go through the rule again, so
  rewrites compose until nothing matches (tinygrad's `graph_rewrite`, TVM's
  `ExprMutator`): a composite decomposes into composites that decompose in turn, a
  transpose of a transpose becomes one transpose that may be the identity.

Passes never mutate their input: both tools build a new graph. Constant arrays are
shared between the old and the new graph; kiln treats them as immutable.

    >>> def drop_neg_neg(b, node):
    ...     x = node.operands[0]
    ...     if node.op == "neg" and x.producer is not None and x.producer.op == "neg":
    ...         return [x.producer.operands[0]]
    ...     return None
    >>> new = rebuild(graph, drop_neg_neg)   # `graph` itself when nothing matched
"""

from __future__ import annotations

from typing import Callable, Sequence

from kiln.errors import KilnError
from kiln.ir import registry
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.regions import copy_region_into, lookup

Rule = Callable[["RewriteBuilder", Node], "Sequence[Value] | Value | None"]

# A rule whose output keeps matching itself never settles; these bounds turn that pass
# bug into an error naming the op instead of a hang: nesting of rewrites inside one
# node's rewrite, and rewrites per node of the input graph overall.
MAX_REWRITE_DEPTH = 64
MAX_REWRITES_PER_NODE = 64


def new_graph_like(graph: Graph) -> Graph:
    """An empty graph with `graph`'s name, shape variables and constants (dicts copied)."""
    return Graph(graph.name, Region(), dict(graph.shape_vars), dict(graph.constants))


def copy_graph(graph: Graph, value_map: dict[Value, Value] | None = None,
               keep: Callable[[Node], bool] | None = None) -> Graph:
    """A deep copy of `graph`: new values, nodes and regions, same text.

    `value_map`, when given, is filled with old value -> new value for every input,
    region parameter and node result copied. `keep(node)` False leaves a node out (its
    results must then be unused by the nodes kept).

    >>> g2 = copy_graph(g); str(g2) == str(g) and g2 is not g   # True
    """
    vmap: dict[Value, Value] = {} if value_map is None else value_map
    new = new_graph_like(graph)
    for value in graph.inputs:
        vmap[value] = Value(value.type, value.name)
        new.body.params.append(vmap[value])
    copy_region_into(graph.body, new.body, vmap, keep)
    return new


class RewriteBuilder(GraphBuilder):
    """A GraphBuilder whose every new node first goes through a rewrite rule.

    `apply` (and so every `b.add(...)`, `b.binary(...)`, decomposition...) builds the
    node, then `emit` offers it to the rule: the rule returns None to keep it, or the
    values that replace its results. `changed` records whether any rule fired.
    """

    def __init__(self, graph: Graph, rule: Rule | None = None, budget: int | None = None):
        super().__init__(graph)
        self.rule = rule
        self.changed = False
        self.budget = budget  # rewrites allowed in all (None: unbounded)
        self._depth = 0

    def make_node(self, op: str, operands: Sequence[Value], attrs: dict,
                  regions: list[Region] | None = None) -> Node:
        """A typed node (attributes normalized, type rule run), not yet in any region."""
        opdef = registry.get(op)
        attrs = opdef.normalize_attrs(attrs)
        for x in operands:
            if not isinstance(x, Value):
                raise KilnError(f"internal: {op} operand is a {type(x).__name__}, not a value")
        if opdef.num_regions is None or opdef.num_regions:
            types = opdef.infer([x.type for x in operands], dict(attrs, regions=regions or []))
        else:
            types = opdef.infer([x.type for x in operands], attrs)
        return Node(op, list(operands), attrs, types, regions)

    def apply(self, op: str, operands: Sequence[Value], attrs: dict,
              regions: list[Region] | None = None) -> list[Value]:
        return self.emit(self.make_node(op, operands, attrs, regions))

    def emit(self, node: Node) -> list[Value]:
        """Offer `node` to the rule; append it to the current region unless replaced."""
        if self.rule is not None:
            if self._depth >= MAX_REWRITE_DEPTH:
                raise _unsettled(node, f"{MAX_REWRITE_DEPTH} nested rewrites")
            self._depth += 1
            try:
                replacement = self.rule(self, node)
            finally:
                self._depth -= 1
            if replacement is not None:
                values = [replacement] if isinstance(replacement, Value) else list(replacement)
                _check_replacement(node, values)
                self.changed = True
                if self.budget is not None:
                    self.budget -= 1
                    if self.budget < 0:
                        raise _unsettled(node, "too many rewrites for the graph's size")
                return values
        self.region.nodes.append(node)
        return node.results


def _unsettled(node: Node, why: str) -> KilnError:
    return KilnError(f"internal: rewriting did not settle ({why}, last at {node.op}); a "
                     "rule keeps matching its own output")


def _check_replacement(node: Node, values: list[Value]) -> None:
    # a rule that changes a type would break every user of the value: fail loudly here
    old = [r.type for r in node.results]
    new = [v.type for v in values]
    if old != new:
        raise KilnError(f"internal: a rewrite of {node.op} gives {', '.join(map(str, new))} "
                        f"where the node gives {', '.join(map(str, old))}")


def rebuild(graph: Graph, rule: Rule, *, builder: RewriteBuilder | None = None) -> Graph:
    """Re-emit every node of `graph` into a new graph, letting `rule` replace nodes.

    Nodes are visited in program order; a node with regions is seen after its regions
    are rebuilt. Returns `graph` itself when the rule never fired, else the new graph
    (unused nodes a rewrite leaves behind are for `dce` to remove).

    >>> g2 = rebuild(g, lambda b, node: None)   # g2 is g
    """
    if builder is None:
        size = sum(1 for _ in graph.walk()) + 1
        builder = RewriteBuilder(new_graph_like(graph), rule, budget=MAX_REWRITES_PER_NODE * size)
    b = builder
    b.rule = rule
    vmap: dict[Value, Value] = {}
    for value in graph.inputs:
        vmap[value] = b.add_input(value.type, value.name)
    b.graph.body.results = _rebuild_nodes(b, graph.body, vmap)
    return b.graph if b.changed else graph


def _rebuild_nodes(b: RewriteBuilder, region: Region, vmap: dict[Value, Value]) -> list[Value]:
    for node in region.nodes:
        regions = [_rebuild_region(b, r, vmap) for r in node.regions]
        clone = Node(node.op, [lookup(vmap, v, node.op) for v in node.operands], node.attrs,
                     [r.type for r in node.results], regions)
        for old, new in zip(node.results, b.emit(clone)):
            vmap[old] = new
    return [lookup(vmap, v, "yield") for v in region.results]


def _rebuild_region(b: RewriteBuilder, region: Region, vmap: dict[Value, Value]) -> Region:
    new = Region([Value(p.type, p.name) for p in region.params])
    for old, param in zip(region.params, new.params):
        vmap[old] = param
    with b.entering(new):
        new.results = _rebuild_nodes(b, region, vmap)
    return new


def producer_op(value: Value) -> str | None:
    """The op that defines `value`, or None for inputs and region parameters."""
    return value.producer.op if value.producer is not None else None


def uses(graph: Graph) -> dict[Value, int]:
    """How many times each value is used (operands and yields, in every region)."""
    counts: dict[Value, int] = {}

    def visit(region: Region) -> None:
        for node in region.nodes:
            for v in node.operands:
                counts[v] = counts.get(v, 0) + 1
            for sub in node.regions:
                visit(sub)
        for v in region.results:
            counts[v] = counts.get(v, 0) + 1

    visit(graph.body)
    return counts
