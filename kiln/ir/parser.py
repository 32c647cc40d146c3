"""Parse kiln's text IR back into a `Graph` (the inverse of `printer`).

A hand-written tokenizer and recursive-descent parser: file contents are never
evaluated (symbolic sizes are built from tokens with sympy's constructors, not
`sympify`), and any malformed input raises `KilnParseError` with the line.
"""

from __future__ import annotations

import json
import re

import numpy as np
import sympy

from kiln.errors import KilnError, KilnParseError
from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir.graph import Graph, Node, Region, Value
from kiln.ir.shapes import ShapeVar, dim, symbol
from kiln.ir.types import TensorType

_TOKEN = re.compile(r"""
  (?P<ws>[ \t]+)
 |(?P<str>"(?:[^"\\]|\\.)*")
 |(?P<val>%[A-Za-z0-9_]+)
 |(?P<glob>@[A-Za-z0-9_]+)
 |(?P<num>\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+)
 |(?P<name>[A-Za-z_][A-Za-z0-9_]*)
 |(?P<op>->|\*\*|//|[()\[\]{},:=+\-*/])
""", re.VERBOSE)

MAX_TEXT = 64 * 1024 * 1024
MAX_NESTING = 64
# Bounds on one size expression, so that a hostile text cannot make the type checks
# (which expand sizes with sympy) or shape evaluation take unbounded time or memory.
MAX_SIZE_BITS = 128  # magnitude of any integer in a size
MAX_SIZE_DEGREE = 64  # largest exponent, after sympy combines (B**8)**8 into B**64
MAX_SIZE_TERMS = 4096  # bound on the terms a size expands into
MAX_FUNC_ARGS = 8
_FUNCS = {"floor": sympy.floor, "ceiling": sympy.ceiling, "Mod": sympy.Mod,
          "Max": sympy.Max, "Min": sympy.Min}


class _SizeTooLarge(Exception):
    pass


def _check_int(value: int) -> None:
    if abs(value).bit_length() > MAX_SIZE_BITS:
        raise _SizeTooLarge(f"an integer of {abs(value).bit_length()} bits")


def _size_terms(value) -> int:
    """An upper bound on the number of terms `value` expands into (raises if too large)."""
    if isinstance(value, (int, float)):
        if isinstance(value, int):
            _check_int(value)
        return 1
    if not isinstance(value, sympy.Basic):
        return 1
    if value.is_Rational:
        _check_int(int(value.p))
        _check_int(int(value.q))
        return 1
    if value.is_Atom:
        return 1
    if value.is_Pow:
        exponent = value.exp
        if not exponent.is_Integer or abs(int(exponent)) > MAX_SIZE_DEGREE:
            raise _SizeTooLarge(f"an exponent of {exponent}")
        base = _size_terms(value.base)
        k = abs(int(exponent))
        if base > 1 and k * (base.bit_length() - 1) >= MAX_SIZE_TERMS.bit_length():
            raise _SizeTooLarge(f"{value} expands into too many terms")
        total = base ** k
    elif value.is_Mul:
        total = 1
        for arg in value.args:
            total *= _size_terms(arg)
            if total > MAX_SIZE_TERMS:
                break
    else:  # Add, and floor/ceiling/Mod/Max/Min whose arguments expand separately
        total = sum(_size_terms(arg) for arg in value.args) + (0 if value.is_Add else 1)
    if total > MAX_SIZE_TERMS:
        raise _SizeTooLarge(f"{value} expands into more than {MAX_SIZE_TERMS} terms")
    return total


def _tokenize(line: str, lineno: int) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(line):
        m = _TOKEN.match(line, pos)
        if not m:
            raise KilnParseError(f"line {lineno}: unexpected character {line[pos]!r}")
        pos = m.end()
        if m.lastgroup != "ws":
            tokens.append((m.lastgroup, m.group()))
    return tokens


class _Line:
    """A cursor over one line's tokens."""

    def __init__(self, text: str, lineno: int, parser: "_Parser"):
        self.text, self.lineno, self.parser = text, lineno, parser
        self.tokens = _tokenize(text, lineno)
        self.pos = 0
        self.depth = 0

    def error(self, message: str) -> KilnParseError:
        return KilnParseError(f"line {self.lineno}: {message}: {self.text.strip()[:200]}")

    def peek(self, offset: int = 0):
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else (None, None)

    def next(self):
        tok = self.peek()
        if tok[0] is None:
            raise self.error("unexpected end of line")
        self.pos += 1
        return tok

    def accept(self, text: str) -> bool:
        if self.peek()[1] == text and self.peek()[0] in ("op", "name"):
            self.pos += 1
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.accept(text):
            raise self.error(f"expected '{text}', found {self.peek()[1] or 'end of line'!r}")

    def expect_kind(self, kind: str) -> str:
        k, v = self.next()
        if k != kind:
            raise self.error(f"expected a {kind} token, found {v!r}")
        return v

    def done(self) -> None:
        if self.pos != len(self.tokens):
            raise self.error(f"unexpected {self.peek()[1]!r}")

    def nest(self):
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error("expression nested too deeply")

    def bounded(self, value):
        """`value`, checked after each operation so no size grows past the limits."""
        try:
            _size_terms(value)
        except _SizeTooLarge as exc:
            raise self.error(f"size expression out of range ({exc})") from None
        return value

    # -- sizes -----------------------------------------------------------------

    def expr(self, first=None):
        left = self.term(first)
        while self.peek()[1] in ("+", "-"):
            op = self.next()[1]
            right = self.term()
            left = self.bounded(left + right if op == "+" else left - right)
        return left

    def term(self, first=None):
        left = self.unary(first)
        while self.peek()[1] in ("*", "/", "//"):
            op = self.next()[1]
            right = self.unary()
            if op == "*":
                left = left * right
            elif op == "/":
                if right == 0:
                    raise self.error("division by zero in a size")
                left = sympy.Rational(left) / right if isinstance(left, int) else left / right
            else:
                if right == 0:
                    raise self.error("division by zero in a size")
                left = sympy.floor(sympy.sympify(left) / right)
            left = self.bounded(left)
        return left

    def unary(self, first=None):
        if first is None and self.peek()[1] == "-":
            self.next()
            self.nest()
            value = -self.unary()
            self.depth -= 1
            return value
        base = first if first is not None else self.atom()
        if self.peek()[1] == "**":
            self.next()
            exponent = self.unary()
            if not isinstance(exponent, (int, sympy.Integer)) or not 0 <= int(exponent) <= 64:
                raise self.error("a size exponent must be an integer in [0, 64]")
            if isinstance(base, (int, sympy.Integer)) and \
                    abs(int(base)).bit_length() * int(exponent) > 2 * MAX_SIZE_BITS:
                raise self.error("size expression out of range (an integer too large)")
            return self.bounded(sympy.sympify(base) ** int(exponent))
        return base

    def atom(self):
        kind, text = self.next()
        if kind == "num":
            if not text.isdigit():
                raise self.error(f"a size must be an integer, found {text}")
            return int(text)
        if kind == "name":
            if text in _FUNCS:
                self.expect("(")
                self.nest()
                args = [self.expr()]
                while self.accept(","):
                    args.append(self.expr())
                    if len(args) > MAX_FUNC_ARGS:
                        raise self.error(f"{text} takes at most {MAX_FUNC_ARGS} arguments here")
                self.expect(")")
                self.depth -= 1
                try:
                    return self.bounded(_FUNCS[text](*[sympy.sympify(a) for a in args]))
                except (TypeError, ValueError, ArithmeticError) as exc:
                    raise self.error(f"bad arguments to {text}: {exc}") from None
            return self.parser.symbol(text, self)
        if text == "(":
            self.nest()
            value = self.expr()
            self.expect(")")
            self.depth -= 1
            return value
        raise self.error(f"expected a size, found {text!r}")

    def size(self):
        value = self.bounded(self.expr())
        try:
            value = dim(value)
        except KilnError:
            raise self.error(f"{value} is not a valid size") from None
        if (value < 0) if isinstance(value, int) else value.is_negative:
            raise self.error(f"a size cannot be negative, found {value}")
        return value

    # -- types and attributes ------------------------------------------------------

    def type(self) -> TensorType:
        name = self.expect_kind("name")
        try:
            dtype = dt.from_short(name)
        except KilnError:
            raise self.error(f"unknown dtype '{name}'") from None
        self.expect("[")
        dims = []
        if not self.accept("]"):
            dims.append(self.size())
            while self.accept(","):
                dims.append(self.size())
            self.expect("]")
        return TensorType(dtype, tuple(dims))

    def attr(self):
        kind, text = self.peek()
        if kind == "str":
            self.next()
            try:
                value = json.loads(text)
            except ValueError:
                raise self.error("bad string literal") from None
            return value
        if kind == "name" and text in ("none", "true", "false", "nan", "inf"):
            self.next()
            return {"none": None, "true": True, "false": False,
                    "nan": float("nan"), "inf": float("inf")}[text]
        if kind == "name" and text in dt._BY_SHORT:
            self.next()
            return dt.from_short(text)
        if text == "-":
            k2, t2 = self.peek(1)
            if t2 == "inf" or (k2 == "num" and not t2.isdigit()):
                self.next()
                return -self.attr()
        if kind == "num" and not text.isdigit():
            self.next()
            return float(text)
        if text == "(":
            self.next()
            self.nest()
            items, trailing = [], False
            while not self.accept(")"):
                items.append(self.attr())
                trailing = self.accept(",")
                if not trailing and self.peek()[1] != ")":
                    raise self.error(f"expected ',' or ')' in a tuple, found {self.peek()[1]!r}")
            self.depth -= 1
            if len(items) == 1 and not trailing and not isinstance(items[0], (tuple, str)):
                return dim(self.expr(first=items[0]))  # a parenthesized size, not a tuple
            return tuple(items)
        value = self.expr()
        return dim(value) if not isinstance(value, float) else value


class _Parser:
    def __init__(self, text: str, constants):
        self.lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines())
                      if ln.strip() and not ln.strip().startswith("#")]
        self.index = 0
        self.graph = Graph(constants=constants or {})
        self.values: dict[str, Value] = {}

    def symbol(self, name: str, line: _Line):
        if name not in self.graph.shape_vars:
            raise line.error(f"unknown name '{name}' (shape variables are declared with 'where')")
        return symbol(name)

    def next_line(self) -> _Line:
        if self.index >= len(self.lines):
            raise KilnParseError("unexpected end of text: the graph is not closed by 'return'")
        lineno, text = self.lines[self.index]
        self.index += 1
        return _Line(text, lineno, self)

    def peek_word(self) -> str | None:
        if self.index >= len(self.lines):
            return None
        return self.lines[self.index][1].strip().split("(")[0].split(" ")[0]

    def define(self, line: _Line, name: str, value: Value) -> None:
        if name in self.values:
            raise line.error(f"%{name} is defined twice")
        self.values[name] = value

    def use(self, line: _Line) -> Value:
        name = line.expect_kind("val")[1:]
        if name not in self.values:
            raise line.error(f"%{name} is used before it is defined")
        return self.values[name]

    def parse(self) -> Graph:
        header = self.next_line()
        # the header's types may use shape variables declared on the 'where' lines below it
        while self.peek_word() == "where":
            self._shape_var(self.next_line())
        header.expect("graph")
        self.graph.name = header.expect_kind("glob")[1:]
        inputs = self._params(header)
        header.expect("->")
        if header.accept("("):
            out_types = []
            while not header.accept(")"):
                out_types.append(header.type())
                if not header.accept(","):
                    header.expect(")")
                    break
        else:
            out_types = [header.type()]
        header.done()
        for name, value in inputs:
            value.name = name
            self.define(header, name, value)
            self.graph.body.params.append(value)
        results = self._block(self.graph.body, "return", 0)
        self.graph.body.results = results
        if [v.type for v in results] != out_types:
            raise KilnParseError("graph returns " + ", ".join(str(v.type) for v in results)
                                 + " but its header declares " + ", ".join(map(str, out_types)))
        if self.index != len(self.lines):
            raise KilnParseError(f"line {self.lines[self.index][0]}: text after 'return'")
        return self.graph

    def _params(self, line: _Line) -> list[tuple[str, Value]]:
        line.expect("(")
        params = []
        while not line.accept(")"):
            name = line.expect_kind("val")[1:]
            line.expect(":")
            params.append((name, Value(line.type())))
            if not line.accept(","):
                line.expect(")")
                break
        return params

    def _shape_var(self, line: _Line) -> None:
        line.expect("where")
        name = line.expect_kind("name")
        line.expect("in")
        line.expect("[")
        lo = int(line.expect_kind("num"))
        line.expect(",")
        if line.accept("inf"):
            hi = None
            line.expect(")")
        else:
            hi = int(line.expect_kind("num"))
            line.expect("]")
        multiple = 1
        if line.accept("multiple_of"):
            multiple = int(line.expect_kind("num"))
        line.done()
        if name in self.graph.shape_vars:
            raise line.error(f"shape variable {name} is declared twice")
        try:
            self.graph.shape_vars[name] = ShapeVar(name, min=lo, max=hi, multiple_of=multiple)
        except KilnError as exc:
            raise line.error(exc.message) from None

    def _block(self, region: Region, terminator: str, depth: int) -> list[Value]:
        if depth > MAX_NESTING:
            raise KilnParseError("regions nested too deeply")
        while True:
            line = self.next_line()
            if line.accept(terminator):
                results = []
                if line.peek()[0] is not None:
                    results.append(self.use(line))
                    while line.accept(","):
                        results.append(self.use(line))
                line.done()
                return results
            region.nodes.append(self._node(line, depth))

    def _node(self, line: _Line, depth: int) -> Node:
        names = []
        if line.peek()[0] == "val":
            names.append(line.expect_kind("val")[1:])
            while line.accept(","):
                names.append(line.expect_kind("val")[1:])
            line.expect("=")
        op = line.expect_kind("name")
        try:
            opdef = registry.get(op)
        except KilnError:
            raise line.error(f"unknown op '{op}'") from None
        line.expect("(")
        operands = []
        while not line.accept(")"):
            operands.append(self.use(line))
            if not line.accept(","):
                line.expect(")")
                break
        attrs = {}
        if line.accept("{"):
            while not line.accept("}"):
                key = line.expect_kind("name")
                line.expect("=")
                if key in attrs:
                    raise line.error(f"attribute {key} given twice")
                attrs[key] = line.attr()
                if not line.accept(","):
                    line.expect("}")
                    break
        try:
            attrs = opdef.normalize_attrs(attrs)
        except KilnError as exc:
            raise line.error(exc.message) from None
        line.expect(":")
        types = []
        if line.accept("("):
            line.expect(")")
        else:
            types.append(line.type())
            while line.accept(","):
                types.append(line.type())
        line.done()
        if len(types) != len(names):
            raise line.error(f"{len(names)} result names but {len(types)} result types")
        regions = []
        if self.peek_word() == "region":
            while self.peek_word() == "region":
                regions.append(self._region(self.next_line(), depth + 1))
            self.next_line().expect("end")
        node = Node(op, operands, attrs, types, regions)
        for name, value in zip(names, node.results):
            self.define(line, name, value)
        return node

    def _region(self, line: _Line, depth: int) -> Region:
        line.expect("region")
        params = self._params(line)
        line.expect(":")
        line.done()
        region = Region()
        for name, value in params:
            self.define(line, name, value)
            region.params.append(value)
        region.results = self._block(region, "yield", depth)
        return region


def parse_graph(text: str, constants: dict[str, np.ndarray] | None = None,
                verify: bool = True) -> Graph:
    """Parse text IR; `constants` supplies the data of `constant` nodes.

    >>> g = parse_graph(str(graph))   # round-trips: str(g) == str(graph)
    """
    if not isinstance(text, str):
        raise KilnParseError(f"expected IR text, got {type(text).__name__}")
    if len(text) > MAX_TEXT:
        raise KilnParseError(f"IR text of {len(text)} characters exceeds the {MAX_TEXT} limit")
    try:
        graph = _Parser(text, constants).parse()
    except KilnParseError:
        raise
    except (RecursionError, OverflowError, ValueError, TypeError, ArithmeticError) as exc:
        raise KilnParseError(f"malformed IR text: {type(exc).__name__}: {exc}") from None
    if verify:
        from kiln.ir.verifier import verify as verify_graph

        verify_graph(graph)
    return graph
