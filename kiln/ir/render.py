"""Machine-readable and visual renderings of a graph: JSON and Graphviz DOT.

Both name values exactly as the text printer does (`%x`, `%3`), so the three forms
of one graph can be read side by side. Output is deterministic: the same graph
always renders to the same bytes. DOT text is written here from a `networkx`
DiGraph (no pydot or pygraphviz needed); `kiln dump --format json|dot` uses these.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from kiln.errors import KilnError
from kiln.ir import dtypes as dt
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.printer import format_attr, value_names

_MAX_LABEL_LINE = 80

# -- JSON ------------------------------------------------------------------------------


def graph_to_json(graph: Graph) -> dict[str, Any]:
    """The graph as a JSON-ready dict; attributes are in the text IR's syntax.

    >>> doc = graph_to_json(graph); doc["nodes"][0]["op"]   # 'broadcast_in_dim'
    >>> json.dumps(doc)                                        # always serializable
    """
    names = value_names(graph)
    ref = _Refs(names)
    return {
        "name": graph.name,
        "inputs": [ref.typed(v) for v in graph.inputs],
        "shape_vars": [
            {"name": name, "min": var.min, "max": var.max, "multiple_of": var.multiple_of,
             "constraint": var.describe()}
            for name, var in sorted(graph.shape_vars.items())],
        "nodes": [_node_json(n, ref) for n in graph.body.nodes],
        "outputs": [ref.typed(v) for v in graph.outputs],
        "constants": {name: _constant_json(graph.constants[name])
                      for name in sorted(graph.constants, key=str)},
    }


class _Refs:
    def __init__(self, names: dict[int, str]):
        self.names = names

    def __call__(self, value: Value) -> str:
        name = self.names.get(id(value))
        return f"%{name}" if name is not None else "%<undefined>"

    def typed(self, value: Value) -> dict[str, Any]:
        return {"name": self(value), "type": str(value.type), "dtype": value.type.dtype.name,
                "shape": [d if isinstance(d, int) else str(d) for d in value.type.shape]}


def _node_json(node: Node, ref: _Refs) -> dict[str, Any]:
    return {
        "op": node.op,
        "operands": [ref(v) for v in node.operands],
        "results": [ref.typed(v) for v in node.results],
        "attrs": {k: _attr_text(node.attrs[k]) for k in sorted(node.attrs)},
        "regions": [_region_json(r, ref) for r in node.regions],
    }


def _region_json(region: Region, ref: _Refs) -> dict[str, Any]:
    return {"params": [ref.typed(p) for p in region.params],
            "nodes": [_node_json(n, ref) for n in region.nodes],
            "results": [ref(v) for v in region.results]}


def _attr_text(value) -> str:
    try:
        return format_attr(value)
    except TypeError:  # an attribute the text IR cannot spell: still render something
        return repr(value)


def _constant_json(array) -> dict[str, Any]:
    try:
        dtype = dt.from_numpy(array.dtype).name
    except KilnError:
        dtype = str(array.dtype)
    return {"dtype": dtype, "shape": [int(d) for d in array.shape]}


# -- DOT -------------------------------------------------------------------------------


def dataflow_graph(graph: Graph) -> nx.DiGraph:
    """The dataflow as a networkx DiGraph (what `graph_to_dot` serializes).

    Node attributes: `label`, `shape`, `kind` (input, op, constant, param, yield,
    output) and `cluster` (the tuple of region clusters it sits in); edges carry the
    value names they move. `G.graph["clusters"]` maps a cluster id to its label.

    >>> G = dataflow_graph(graph); nx.is_directed_acyclic_graph(G)   # True
    """
    builder = _DataflowBuilder(graph)
    return builder.build()


class _DataflowBuilder:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.ref = _Refs(value_names(graph))
        self.g = nx.DiGraph(name=graph.name, clusters={})
        self.producer: dict[int, str] = {}
        self.count = 0

    def build(self) -> nx.DiGraph:
        for i, value in enumerate(self.graph.inputs):
            node_id = f"in{i}"
            self.g.add_node(node_id, label=f"{self.ref(value)}\n{value.type}", shape="invhouse",
                            kind="input", cluster=())
            self.producer[id(value)] = node_id
        self.region(self.graph.body, ())
        for i, value in enumerate(self.graph.outputs):
            node_id = f"out{i}"
            self.g.add_node(node_id, label=f"return {i}\n{value.type}", shape="house",
                            kind="output", cluster=())
            self.edge(value, node_id)
        return self.g

    def edge(self, value: Value, target: str, **attrs) -> None:
        source = self.producer.get(id(value))
        if source is None:  # a malformed graph: show the dangling use instead of failing
            source = f"undef{self.count}"
            self.count += 1
            self.g.add_node(source, label=f"undefined\n{value.type}", shape="octagon",
                            kind="undefined", cluster=())
        name = self.ref(value)
        if self.g.has_edge(source, target):
            names = self.g.edges[source, target]["label"].split(", ")
            if name not in names:
                self.g.edges[source, target]["label"] += f", {name}"
        else:
            self.g.add_edge(source, target, label=name, **attrs)

    def region(self, region: Region, cluster: tuple[str, ...]) -> None:
        for node in region.nodes:
            node_id = f"n{self.count}"
            self.count += 1
            self.g.add_node(node_id, label=_node_label(node),
                            shape="cylinder" if node.op == "constant" else "box",
                            kind="constant" if node.op == "constant" else "op", cluster=cluster)
            for operand in node.operands:
                self.edge(operand, node_id)
            for result in node.results:
                self.producer[id(result)] = node_id
            for k, sub in enumerate(node.regions):
                self.subregion(node, node_id, k, sub, cluster)

    def subregion(self, node: Node, node_id: str, k: int, sub: Region,
                  cluster: tuple[str, ...]) -> None:
        cluster_id = f"{node_id}_r{k}"
        inner = cluster + (cluster_id,)
        self.g.graph["clusters"][cluster_id] = f"{node.op} region {k}"
        for i, param in enumerate(sub.params):
            param_id = f"{cluster_id}_p{i}"
            self.g.add_node(param_id, label=f"{self.ref(param)}\n{param.type}", shape="ellipse",
                            kind="param", cluster=inner)
            self.producer[id(param)] = param_id
        self.region(sub, inner)
        yield_id = f"{cluster_id}_yield"
        self.g.add_node(yield_id, label="yield", shape="house", kind="yield", cluster=inner)
        for value in sub.results:
            self.edge(value, yield_id)
        # the region's results flow back into the node that owns it
        self.g.add_edge(yield_id, node_id, label="", style="dashed")


def _node_label(node: Node) -> str:
    lines = [node.op]
    if node.attrs:
        attrs = ", ".join(f"{k}={_attr_text(node.attrs[k])}" for k in sorted(node.attrs))
        lines.append(_clip(attrs))
    lines.append(_clip(", ".join(str(r.type) for r in node.results) or "()"))
    return "\n".join(lines)


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_LABEL_LINE else text[:_MAX_LABEL_LINE - 3] + "..."


def graph_to_dot(graph: Graph) -> str:
    """Graphviz DOT text of the dataflow; regions become `subgraph cluster_*` blocks.

    >>> open("g.dot", "w").write(graph_to_dot(graph))   # then: dot -Tsvg g.dot
    """
    return dot_text(dataflow_graph(graph))


def dot_text(g: nx.DiGraph) -> str:
    """Serialize a `dataflow_graph` to DOT, nesting nodes into their clusters."""
    lines = [f"digraph {quote(str(g.graph.get('name', 'graph')))} {{",
             '  node [fontname="monospace"];', '  edge [fontname="monospace"];']
    children: dict[tuple[str, ...], list[str]] = {(): []}
    members: dict[tuple[str, ...], list[str]] = {(): []}
    for node_id, data in g.nodes(data=True):
        cluster = tuple(data.get("cluster", ()))
        for depth in range(1, len(cluster) + 1):  # register every enclosing cluster
            path = cluster[:depth]
            if path not in members:
                members[path] = []
                children[path] = []
                children[path[:-1]].append(path)
        members[cluster].append(node_id)
    labels = g.graph.get("clusters", {})

    def emit(path: tuple[str, ...], indent: str) -> None:
        for node_id in members[path]:
            lines.append(f"{indent}{quote(node_id)}{_attr_list(g.nodes[node_id])};")
        for child in children[path]:
            cluster_id = child[-1]
            lines.append(f"{indent}subgraph {quote('cluster_' + cluster_id)} {{")
            lines.append(f"{indent}  label={quote(labels.get(cluster_id, cluster_id))};")
            lines.append(f"{indent}  style=rounded;")
            emit(child, indent + "  ")
            lines.append(f"{indent}}}")

    emit((), "  ")
    for source, target, data in g.edges(data=True):
        lines.append(f"  {quote(source)} -> {quote(target)}{_attr_list(data)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _attr_list(data: dict) -> str:
    items = [f"{key}={quote(str(value))}" for key, value in data.items()
             if key not in ("cluster", "kind")]
    return f" [{', '.join(items)}]" if items else ""


def quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, newlines as `\\n`.

    >>> print(quote('say "hi"'))   # "say \\"hi\\""
    """
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif not c.isprintable():
            out.append(repr(c)[1:-1].replace("\\", "\\\\"))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'
