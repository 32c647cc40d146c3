"""The text form of a graph: stable, readable, and parsed back exactly by `parser`.

    graph @mlp(%x: f32[B, 1024], %w: f32[1024, 64]) -> f32[B, 64]
      where B in [1, 8192]
      %0 = dot_general(%x, %w) {lhs_batch=(), lhs_contracting=(1,), ...} : f32[B, 64]
      %1 = gelu(%0) {approximate="tanh"} : f32[B, 64]
      return %1

Graph inputs keep their (sanitized, unique) names; every other value is numbered in
program order, attributes are sorted, so equal graphs print equal text. A node with
regions is followed by one `region(...)` block per region, closed by `end`.
"""

from __future__ import annotations

import json
import math
import re

import sympy

from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.shapes import format_dim

_IDENT = re.compile(r"[^A-Za-z0-9_]")


def format_attr(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest repr that round-trips
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, DType):
        return value.short
    if isinstance(value, sympy.Basic):
        return format_dim(value)
    if isinstance(value, (tuple, list)):
        inner = ", ".join(format_attr(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise TypeError(f"attribute value {value!r} of type {type(value).__name__} has no text form")


def format_attrs(attrs: dict) -> str:
    if not attrs:
        return ""
    return " {" + ", ".join(f"{k}={format_attr(attrs[k])}" for k in sorted(attrs)) + "}"


def _shown_attrs(node: Node) -> dict:
    """Attributes left at a default of None (an unset option: no stride, no trip bound)
    are not printed; the parser fills them back in, so the text still round-trips."""
    attrs = node.attrs
    if None not in attrs.values():  # most nodes: nothing to leave out
        return attrs
    defaults = _defaults(node.op)
    return {k: v for k, v in attrs.items() if not (v is None and k in defaults
                                                   and defaults[k] is None)}


def _defaults(op: str) -> dict:
    from kiln.ir import registry

    return registry.get(op).attrs


class _Namer:
    def __init__(self):
        self.names: dict[int, str] = {}
        self.used: set[str] = set()
        self.counter = 0

    def named(self, value: Value, hint: str | None) -> str:
        base = _IDENT.sub("_", hint or "") if hint else ""
        if not base or not (base[0].isalpha() or base[0] == "_"):
            base = f"v_{base}" if base else ""
        if base:
            name, k = base, 1
            while name in self.used:
                name, k = f"{base}_{k}", k + 1
        else:
            name = self.fresh()
        self.used.add(name)
        self.names[id(value)] = name
        return name

    def fresh(self) -> str:
        name = str(self.counter)
        self.counter += 1
        return name

    def number(self, value: Value) -> str:
        name = self.fresh()
        self.names[id(value)] = name
        return name

    def __getitem__(self, value: Value) -> str:
        try:
            return self.names[id(value)]
        except KeyError:
            return f"<undefined {value!r}>"


def _types(values, texts: dict) -> str:
    """The values' types as text; `texts` memoizes the text of each (dtype, shape)
    within one rendering (a graph repeats a few types across thousands of values)."""
    out = []
    for v in values:
        t = v.type
        key = (t.dtype.short, t.shape)
        text = texts.get(key)
        if text is None:
            text = texts[key] = str(t)
        out.append(text)
    return ", ".join(out)


def print_graph(graph: Graph) -> str:
    """The canonical text of `graph` (what `str(graph)` gives).

    >>> print(print_graph(graph))   # graph @main(%x: f32[4]) -> f32[4] ...
    """
    return _render(graph)[0]


def value_names(graph: Graph) -> dict[int, str]:
    """`id(value) -> name` (without `%`) exactly as `print_graph` names every value.

    Renderings (JSON, DOT) use it so their names match the text IR.

    >>> names = value_names(graph); names[id(graph.inputs[0])]   # 'x'
    """
    return dict(_render(graph)[1].names)


def _render(graph: Graph) -> tuple[str, "_Namer"]:
    namer = _Namer()
    params = ", ".join(f"%{namer.named(v, v.name or f'arg{i}')}: {v.type}"
                       for i, v in enumerate(graph.inputs))
    outs = [v.type for v in graph.outputs]
    out_text = str(outs[0]) if len(outs) == 1 else "(" + ", ".join(map(str, outs)) + ")"
    lines = [f"graph @{graph.name}({params}) -> {out_text}"]
    for name in sorted(graph.shape_vars):
        lines.append(f"  where {graph.shape_vars[name].describe()}")
    _print_nodes(graph.body.nodes, namer, lines, "  ", {})
    lines.append("  return" + _value_list(graph.outputs, namer))
    return "\n".join(lines) + "\n", namer


def _print_nodes(nodes: list[Node], namer: _Namer, lines: list[str], indent: str,
                 texts: dict) -> None:
    names, number = namer.names, namer.number
    for node in nodes:
        operands = ", ".join(["%" + (names.get(id(v)) or namer[v]) for v in node.operands])
        if node.results:
            results = ", ".join(["%" + number(v) for v in node.results])
            lhs, types = results + " = ", _types(node.results, texts)
        else:
            lhs, types = "", "()"
        lines.append(f"{indent}{lhs}{node.op}({operands}){format_attrs(_shown_attrs(node))} : {types}")
        if node.regions:
            for region in node.regions:
                _print_region(region, namer, lines, indent + "  ", texts)
            lines.append(f"{indent}  end")


def _print_region(region: Region, namer: _Namer, lines: list[str], indent: str,
                  texts: dict) -> None:
    params = ", ".join(f"%{namer.number(p)}: {p.type}" for p in region.params)
    lines.append(f"{indent}region({params}):")
    _print_nodes(region.nodes, namer, lines, indent + "  ", texts)
    lines.append(f"{indent}  yield" + _value_list(region.results, namer))


def _value_list(values, namer: _Namer) -> str:
    return "".join([" ", ", ".join(f"%{namer[v]}" for v in values)]) if values else ""
