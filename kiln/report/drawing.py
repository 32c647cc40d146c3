"""Graphs as SVG pictures for `kiln report`: Graphviz `dot` when it is installed, else a
built-in layered (Sugiyama-style) drawing.

The built-in drawing puts each node on the layer of its longest path from an input,
orders each layer by the barycenter of its neighbours (a few down and up sweeps, which
removes most crossings in dataflow graphs), sizes boxes to their labels and draws edges
as curves with arrowheads. Labels are escaped; the SVG has no script.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess

import networkx as nx

_CHAR_W, _LINE_H, _PAD, _GAP_X, _GAP_Y = 7.2, 15, 8, 24, 46
_KIND_FILL = {"input": "#e3f2fd", "output": "#e8f5e9", "constant": "#fff8e1", "param": "#f3e5f5",
              "yield": "#eceff1", "op": "#ffffff", "undefined": "#ffebee"}
DOT_TIMEOUT_S = 60


def dot_available() -> bool:
    return shutil.which("dot") is not None


def graph_svg(dot_text: str, layout: dict, use_dot: bool | None = None) -> tuple[str, str]:
    """(svg, engine): the picture of one graph and which engine drew it ('graphviz' or
    'kiln'). `use_dot=None` uses Graphviz when `dot` is on PATH."""
    if use_dot is None:
        use_dot = dot_available()
    if use_dot:
        svg = _graphviz(dot_text)
        if svg is not None:
            return svg, "graphviz"
    return layered_svg(layout), "kiln"


def _graphviz(dot_text: str) -> str | None:
    try:
        done = subprocess.run(["dot", "-Tsvg"], input=dot_text.encode(), capture_output=True,
                              timeout=DOT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    svg = done.stdout.decode("utf-8", "replace")
    start = svg.find("<svg")  # drop the XML prolog and DOCTYPE: the SVG is inlined in HTML
    return svg[start:] if start >= 0 else None


def _layers(g: nx.DiGraph) -> dict[str, int]:
    dag = g
    if not nx.is_directed_acyclic_graph(g):  # never expected; break cycles rather than fail
        dag = nx.DiGraph(g)
        dag.remove_edges_from(list(nx.find_cycle(dag)))
        while not nx.is_directed_acyclic_graph(dag):
            dag.remove_edges_from(list(nx.find_cycle(dag))[:1])
    layer: dict[str, int] = {}
    for node in nx.topological_sort(dag):
        preds = list(dag.predecessors(node))
        layer[node] = 1 + max((layer[p] for p in preds), default=-1)
    # a node with no inputs (a region's parameters, a constant) sits just above its first
    # user rather than on the top row, which keeps edges short
    for node in reversed(list(nx.topological_sort(dag))):
        succs = list(dag.successors(node))
        if succs and not any(True for _ in dag.predecessors(node)):
            layer[node] = max(min(layer[s] for s in succs) - 1, 0)
    return layer


def _order(g: nx.DiGraph, layer: dict[str, int]) -> list[list[str]]:
    depth = max(layer.values(), default=-1) + 1
    rows: list[list[str]] = [[] for _ in range(depth)]
    for node in g.nodes:  # insertion order: program order, a good start
        rows[layer[node]].append(node)
    for sweep in range(4):
        down = sweep % 2 == 0
        indices = range(1, depth) if down else range(depth - 2, -1, -1)
        for i in indices:
            ref = {n: k for k, n in enumerate(rows[i - 1 if down else i + 1])}
            neighbours = g.predecessors if down else g.successors

            def centre(n, _ref=ref, _nb=neighbours, _row=rows[i]):
                linked = [_ref[m] for m in _nb(n) if m in _ref]
                return sum(linked) / len(linked) if linked else _row.index(n)

            rows[i] = sorted(rows[i], key=centre)
    return rows


def layered_svg(layout: dict) -> str:
    """The built-in drawing of a graph given as {"nodes": [{id, label, kind}], "edges":
    [{source, target, label}]}."""
    g = nx.DiGraph()
    for n in layout.get("nodes", []):
        g.add_node(n["id"], label=str(n.get("label", n["id"])), kind=n.get("kind", "op"))
    for e in layout.get("edges", []):
        if e["source"] in g and e["target"] in g:
            g.add_edge(e["source"], e["target"], label=str(e.get("label", "")))
    if not g.nodes:
        return '<svg xmlns="http://www.w3.org/2000/svg" class="kiln-graph" width="120" height="30">' \
               '<text x="8" y="20">(empty graph)</text></svg>'
    rows = _order(g, _layers(g))
    size = {}
    for node, data in g.nodes(data=True):
        lines = data["label"].split("\n")
        size[node] = (max(len(s) for s in lines) * _CHAR_W + 2 * _PAD, len(lines) * _LINE_H + _PAD)
    row_h = [max(size[n][1] for n in row) for row in rows]
    row_w = [sum(size[n][0] for n in row) + _GAP_X * (len(row) - 1) for row in rows]
    width = max(row_w) + 2 * _GAP_X
    pos: dict[str, tuple[float, float]] = {}
    y = _GAP_X / 2
    for row, h, w in zip(rows, row_h, row_w):
        x = (width - w) / 2
        for node in row:
            pos[node] = (x, y)
            x += size[node][0] + _GAP_X
        y += h + _GAP_Y
    height = y - _GAP_Y + _GAP_X / 2
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="kiln-graph" width="{width:.0f}" '
             f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" '
             'font-size="12">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
             'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>']
    for source, target, data in g.edges(data=True):
        (sx, sy), (tx, ty) = pos[source], pos[target]
        x1, y1 = sx + size[source][0] / 2, sy + size[source][1]
        x2, y2 = tx + size[target][0] / 2, ty
        bend = (y2 - y1) / 2 if y2 > y1 else 40
        parts.append(f'<g class="edge"><title>{_esc(data["label"])}</title><path d="M{x1:.1f},{y1:.1f} '
                     f'C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} {x2:.1f},{y2:.1f}" '
                     'fill="none" stroke="#555" marker-end="url(#arrow)"/></g>')
    for node, data in g.nodes(data=True):
        x, y = pos[node]
        w, h = size[node]
        fill = _KIND_FILL.get(data["kind"], "#ffffff")
        parts.append(f'<g class="node" data-kind="{_esc(data["kind"])}"><title>{_esc(node)}</title>'
                     f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" '
                     f'fill="{fill}" stroke="#333"/>')
        for k, line in enumerate(data["label"].split("\n")):
            weight = ' font-weight="bold"' if k == 0 else ""
            parts.append(f'<text x="{x + _PAD:.1f}" y="{y + _PAD / 2 + (k + 0.8) * _LINE_H:.1f}"'
                         f'{weight}>{_esc(line)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts)


def _esc(text: str) -> str:
    return html.escape(re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", "", text), quote=True)
