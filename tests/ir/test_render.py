"""JSON and DOT renderings: they match the graph and the text printer's names, are
deterministic, and the DOT is well formed with every string escaped."""

from __future__ import annotations

import json
import re

import networkx as nx
import numpy as np

from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph, Region, Value
from kiln.ir.parser import parse_graph
from kiln.ir.printer import print_graph, value_names
from kiln.ir.render import dataflow_graph, graph_to_dot, graph_to_json, quote
from kiln.ir.shapes import ShapeVar
from kiln.ir.types import TensorType

GOLDEN = """\
graph @small(%x: f32[B, 4], %w: f32[4]) -> (f32[B, 4], f32[4])
  where B in [1, 64]
  %0 = broadcast_in_dim(%w) {broadcast_dimensions=(1,), shape=(B, 4)} : f32[B, 4]
  %1 = mul(%x, %0) : f32[B, 4]
  %2 = constant() {dtype=f32, name="c0", shape=(4,)} : f32[4]
  %3 = reduce_sum(%2) {axes=(0,)} : f32[]
  %4 = full() {dtype=f32, shape=(), value=0.0} : f32[]
  %5 = gt(%3, %4) : i1[]
  %6 = cond(%5, %w) : f32[4]
    region(%7: f32[4]):
      %8 = neg(%7) : f32[4]
      yield %8
    region(%9: f32[4]):
      yield %9
    end
  return %1, %6
"""


def small_graph(constant_name: str = "c0") -> Graph:
    b = GraphBuilder()
    b.graph.name = "small"
    b.graph.shape_vars["B"] = B = ShapeVar("B", min=1, max=64)
    x = b.add_input(TensorType(dt.float32, (B.symbol, 4)), "x")
    w = b.add_input(TensorType(dt.float32, (4,)), "w")
    y = b.binary("mul", x, w)
    c = b.constant(np.arange(4, dtype=np.float32))
    if constant_name != "c0":
        b.graph.constants[constant_name] = b.graph.constants.pop("c0")
        c.producer.attrs["name"] = constant_name
    pred = b.call("gt", b.call("reduce_sum", c, axes=(0,)), b.full(0.0, dt.float32))
    negate = Region([Value(w.type)])
    b.regions.append(negate)
    negate.results = [b.call("neg", negate.params[0])]
    b.regions.pop()
    keep = Region([Value(w.type)])
    keep.results = [keep.params[0]]
    (out,) = b.apply("cond", [pred, w], {}, regions=[negate, keep])
    b.graph.body.results = [y, out]
    return b.graph


def test_printer_output_is_unchanged_and_value_names_match_it():
    graph = small_graph()
    assert print_graph(graph) == GOLDEN
    names = value_names(graph)
    assert names[id(graph.inputs[0])] == "x"
    assert names[id(graph.outputs[1])] == "6"
    cond_node = graph.nodes[-1]
    assert names[id(cond_node.regions[0].params[0])] == "7"


# -- JSON -----------------------------------------------------------------------------


def _defined_names(doc_nodes, out):
    for node in doc_nodes:
        out.extend(r["name"] for r in node["results"])
        for region in node["regions"]:
            out.extend(p["name"] for p in region["params"])
            _defined_names(region["nodes"], out)
    return out


def test_json_matches_the_graph_and_the_text_names():
    graph = small_graph()
    doc = graph_to_json(graph)
    json.dumps(doc)  # JSON-native all the way down
    assert doc["name"] == "small"
    assert [i["name"] for i in doc["inputs"]] == ["%x", "%w"]
    assert doc["inputs"][0] == {"name": "%x", "type": "f32[B, 4]", "dtype": "float32",
                                "shape": ["B", 4]}
    assert doc["shape_vars"] == [{"name": "B", "min": 1, "max": 64, "multiple_of": 1,
                                  "constraint": "B in [1, 64]"}]
    assert [n["op"] for n in doc["nodes"]] == [n.op for n in graph.nodes]
    assert doc["nodes"][0]["attrs"] == {"broadcast_dimensions": "(1,)", "shape": "(B, 4)"}
    assert doc["nodes"][1]["operands"] == ["%x", "%0"]
    assert [o["name"] for o in doc["outputs"]] == ["%1", "%6"]
    assert doc["constants"] == {"c0": {"dtype": "float32", "shape": [4]}}
    cond = doc["nodes"][-1]
    assert len(cond["regions"]) == 2
    assert cond["regions"][0]["nodes"][0]["op"] == "neg"
    assert cond["regions"][0]["results"] == ["%8"] and cond["regions"][1]["results"] == ["%9"]
    # every name defined in the text is defined in the JSON, in the same order
    in_text = re.findall(r"(%\w+)(?=(?:, %\w+)* = |: )", GOLDEN.split("\n", 1)[1])
    assert _defined_names(doc["nodes"], []) == in_text


def test_json_is_deterministic_across_a_text_round_trip():
    graph = small_graph()
    again = parse_graph(str(graph), constants=graph.constants)
    assert json.dumps(graph_to_json(graph)) == json.dumps(graph_to_json(again))


def test_json_of_non_finite_attributes_stays_valid_json():
    b = GraphBuilder()
    b.graph.body.results = [b.full(float("nan"), dt.float32), b.full(float("-inf"), dt.float32)]
    doc = graph_to_json(b.graph)
    text = json.dumps(doc, allow_nan=False)
    assert '"value": "nan"' in text and '"value": "-inf"' in text


# -- DOT ------------------------------------------------------------------------------

_DOT_TOKEN = re.compile(r'\s+|"(?:[^"\\]|\\.)*"|->|[{}\[\];=,]|[A-Za-z_][A-Za-z0-9_]*')


def parse_dot(text: str):
    """A small DOT reader: (declared node ids, edges, node labels); asserts well-formedness."""
    tokens, pos = [], 0
    while pos < len(text):
        m = _DOT_TOKEN.match(text, pos)
        assert m, f"unexpected DOT text at {text[pos:pos + 40]!r}"
        if not m.group().isspace():
            tokens.append(m.group())
        pos = m.end()
    depth, nodes, edges, labels, i = 0, [], [], {}, 0
    assert tokens[:2] == ["digraph", tokens[1]] and tokens[2] == "{"
    while i < len(tokens):
        tok = tokens[i]
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            assert depth >= 0, "unbalanced braces"
        elif tok.startswith('"') and i + 1 < len(tokens) and tokens[i - 1] in ("{", ";"):
            if tokens[i + 1] == "->":
                edges.append((_unquote(tok), _unquote(tokens[i + 2])))
                i += 2
            elif tokens[i + 1] == "[":
                nodes.append(_unquote(tok))
                end = tokens.index("]", i)
                attrs = tokens[i + 2:end]
                for k in range(0, len(attrs), 4):  # key = "value" ,
                    if attrs[k] == "label":
                        labels[nodes[-1]] = _unquote(attrs[k + 2])
        i += 1
    assert depth == 0, "unbalanced braces"
    return nodes, edges, labels


def _unquote(token: str) -> str:
    assert token[0] == token[-1] == '"'
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), token[1:-1])


def test_dot_is_well_formed_and_complete():
    graph = small_graph()
    text = graph_to_dot(graph)
    nodes, edges, labels = parse_dot(text)
    assert len(nodes) == len(set(nodes))
    declared = set(nodes)
    for source, target in edges:
        assert source in declared and target in declared
    # 2 inputs, 7 ops and a neg inside a region, 2 region params, 2 yields, 2 outputs
    assert len(nodes) == 2 + 8 + 2 + 2 + 2
    assert text.count("subgraph \"cluster_") == 2
    assert labels["in0"] == "%x\nf32[B, 4]"
    assert any(label.startswith("constant\n") for label in labels.values())
    assert graph_to_dot(graph) == text  # deterministic


def test_dot_shapes_distinguish_inputs_ops_constants_and_outputs():
    g = dataflow_graph(small_graph())
    shapes = {data["kind"]: data["shape"] for _, data in g.nodes(data=True)}
    assert shapes == {"input": "invhouse", "op": "box", "constant": "cylinder",
                      "param": "ellipse", "yield": "house", "output": "house"}
    solid = nx.DiGraph([(u, v) for u, v, d in g.edges(data=True) if d.get("style") != "dashed"])
    assert nx.is_directed_acyclic_graph(solid)


def test_dot_escapes_quotes_backslashes_and_newlines():
    name = 'we"ird\\name\nwith {braces} and ;'
    graph = small_graph(constant_name=name)
    text = graph_to_dot(graph)
    nodes, edges, labels = parse_dot(text)
    expected = dict(dataflow_graph(graph).nodes(data="label"))
    assert labels == expected  # what a DOT reader recovers is exactly the label we meant
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert quote("bell\x07") == '"bell\\\\x07"'
