"""Symbolic shapes: named `ShapeVar`s with constraints, and dims as ints or sympy exprs.

A dim is a Python `int` or a sympy expression over the integer symbols of ShapeVars
(`B`, `2*T`, `B + 1`). `dim()` normalizes (sympy integers become ints), and
`dims_equal()` decides equality exactly by expansion, so relations such as `T*H`
stay exact through every type rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Union

import sympy

from kiln.errors import KilnArgumentError, KilnShapeError

Dim = Union[int, sympy.Expr]

RESERVED_NAMES = frozenset({"true", "false", "none", "inf", "nan", "floor", "ceiling", "Mod",
                            "Max", "Min", "graph", "where", "return", "yield", "region", "end"})


@lru_cache(maxsize=None)
def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol of a shape variable (one object per name, integer, >= 0)."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


@dataclass(frozen=True)
class ShapeVar:
    """A named dynamic dimension with constraints.

    >>> B = ShapeVar("B", min=1, max=8192)
    >>> T = ShapeVar("T", multiple_of=8)
    """

    name: str
    min: int = 0
    max: int | None = None
    multiple_of: int = 1

    def __post_init__(self):
        if not self.name.isidentifier() or self.name in RESERVED_NAMES or self.name.startswith("_"):
            raise KilnArgumentError(
                f"ShapeVar: name {self.name!r} must be an identifier, not start with '_', "
                f"and not be one of {sorted(RESERVED_NAMES)}")
        from kiln.ir.dtypes import _BY_SHORT

        if self.name in _BY_SHORT:
            raise KilnArgumentError(f"ShapeVar: name {self.name!r} is a dtype name in kiln's IR")
        if not isinstance(self.min, int) or self.min < 0:
            raise KilnArgumentError(f"ShapeVar {self.name}: min must be an int >= 0, got {self.min!r}")
        if self.max is not None and (not isinstance(self.max, int) or self.max < self.min):
            raise KilnArgumentError(
                f"ShapeVar {self.name}: max must be an int >= min ({self.min}), got {self.max!r}")
        if not isinstance(self.multiple_of, int) or self.multiple_of < 1:
            raise KilnArgumentError(
                f"ShapeVar {self.name}: multiple_of must be an int >= 1, got {self.multiple_of!r}")

    @property
    def symbol(self) -> sympy.Symbol:
        return symbol(self.name)

    def _sympy_(self):  # lets sympy (and dim()) accept a ShapeVar directly
        return self.symbol

    def __add__(self, other):
        return self.symbol + _sym(other)

    __radd__ = __add__

    def __mul__(self, other):
        return self.symbol * _sym(other)

    __rmul__ = __mul__

    def __sub__(self, other):
        return self.symbol - _sym(other)

    def __rsub__(self, other):
        return _sym(other) - self.symbol

    def __floordiv__(self, other):
        return sympy.floor(self.symbol / _sym(other))

    def check(self, value: int) -> str | None:
        """None if `value` satisfies the constraints, else the rule it breaks."""
        if value < self.min:
            return f"{self.name} >= {self.min}"
        if self.max is not None and value > self.max:
            return f"{self.name} <= {self.max}"
        if value % self.multiple_of:
            return f"{self.name} % {self.multiple_of} == 0"
        return None

    def describe(self) -> str:
        hi = "inf)" if self.max is None else f"{self.max}]"
        text = f"{self.name} in [{self.min}, {hi}"
        if self.multiple_of != 1:
            text += f" multiple_of {self.multiple_of}"
        return text


def _sym(x):
    return x.symbol if isinstance(x, ShapeVar) else x


def dim(value) -> Dim:
    """Normalize one dim: ints stay ints, integer sympy values become ints."""
    if type(value) is int:  # the common case first (a bool's type is bool, not int)
        return value
    if isinstance(value, bool):
        raise KilnArgumentError(f"a dimension must be an int or a symbolic size, got bool {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, ShapeVar):
        return value.symbol
    if hasattr(value, "_sympy_") and not isinstance(value, sympy.Basic):  # a frontend SymSize
        return dim(value._sympy_())
    if hasattr(value, "__index__") and not isinstance(value, sympy.Basic):
        return int(value.__index__())
    if isinstance(value, sympy.Basic):
        if value.is_Integer:
            return int(value)
        if value.free_symbols:
            return value
    raise KilnArgumentError(f"a dimension must be an int or a symbolic size, got {value!r}")


def shape(values: Iterable) -> tuple[Dim, ...]:
    return tuple(map(dim, values))


def is_static(d: Dim) -> bool:
    return isinstance(d, int)


def dims_equal(a: Dim, b: Dim) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def shapes_equal(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    if a == b:  # element-wise ==: equal ints, or structurally equal symbolic dims
        return True
    return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def numel(dims: Iterable[Dim]) -> Dim:
    total: Dim = 1
    for d in dims:
        total = total * d
    return dim(sympy.expand(total)) if not isinstance(total, int) else total


def evaluate(d: Dim, bindings: dict[str, int]) -> int:
    """The concrete value of a dim once its symbols are bound."""
    if isinstance(d, int):
        return d
    subs = {symbol(n): v for n, v in bindings.items()}
    value = sympy.sympify(d).subs(subs)
    if not value.is_Integer:
        missing = sorted(str(s) for s in value.free_symbols)
        raise KilnShapeError(f"size {d} is not determined: no value for {', '.join(missing)}")
    return int(value)


def dim_function(d: Dim) -> Callable[[dict], int]:
    """A closure computing `d` from shape-variable values: what the runtime calls on every
    run (sympy's `subs` costs ~100 us a dim, the closure about 1 us).

    >>> dim_function(2 * symbol("B") + 1)({"B": 3})
    7
    """
    if isinstance(d, int):
        return lambda sizes: d
    e = sympy.sympify(d)
    if e.is_Integer:
        value = int(e)
        return lambda sizes: value
    if e.is_Symbol:
        name = e.name
        return lambda sizes: sizes[name]
    if isinstance(e, (sympy.floor, sympy.ceiling)):  # floor((B + 1)/2): integer division
        num, den = sympy.fraction(sympy.together(e.args[0]))
        top, bottom = dim_function(sympy.expand(num)), dim_function(den)
        if isinstance(e, sympy.floor):
            return lambda sizes: top(sizes) // bottom(sizes)
        return lambda sizes: -(-top(sizes) // bottom(sizes))
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
        base, n = dim_function(e.base), int(e.exp)
        return lambda sizes: base(sizes) ** n
    if any(a.is_Rational and not a.is_Integer for a in e.args):
        return lambda sizes: evaluate(e, sizes)
    parts = [dim_function(a) for a in e.args]
    if isinstance(e, sympy.Add):
        return lambda sizes: sum(p(sizes) for p in parts)
    if isinstance(e, sympy.Mul):
        return lambda sizes: math.prod(p(sizes) for p in parts)
    if isinstance(e, sympy.Mod):
        a, b = parts
        return lambda sizes: a(sizes) % b(sizes)
    if isinstance(e, (sympy.Min, sympy.Max)):
        pick = min if isinstance(e, sympy.Min) else max
        return lambda sizes: pick(p(sizes) for p in parts)
    return lambda sizes: evaluate(e, sizes)  # anything rarer: exact, if slower


def free_symbol_names(d: Dim) -> set[str]:
    return set() if isinstance(d, int) else {s.name for s in d.free_symbols}


def format_dim(d: Dim) -> str:
    return str(d)


def format_shape(dims: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(map(format_dim, dims)) + "]"


def broadcast_shapes(op: str, *shapes_: tuple[Dim, ...], describe=None) -> tuple[Dim, ...]:
    """numpy broadcasting over static or symbolic dims; a mismatch names the op and dim.

    Symbolic dims broadcast only against an equal dim or a static 1: kiln never
    guesses that a symbol is 1.
    """
    rank = max((len(s) for s in shapes_), default=0)
    out: list[Dim] = []
    for axis in range(-rank, 0):
        result: Dim = 1
        for s in shapes_:
            if -axis > len(s):
                continue
            d = s[axis]
            if isinstance(d, int) and d == 1:
                continue
            if isinstance(result, int) and result == 1:
                result = d
            elif not dims_equal(result, d):
                what = describe() if describe else " with ".join(format_shape(s) for s in shapes_)
                raise KilnShapeError(
                    f"{op}: cannot broadcast {what}: dim {axis} is {result} in one operand and "
                    f"{d} in another; broadcast dims must be equal or 1")
        out.append(result)
    return tuple(out)


def normalize_axis(op: str, axis: int, rank: int, what: str = "dim") -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise KilnArgumentError(f"{op}: {what} must be an int, got {axis!r}")
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise KilnArgumentError(
            f"{op}: {what} {axis} is out of range for a tensor of rank {rank} "
            f"(expected in [{-max(rank, 1)}, {max(rank, 1) - 1}])")
    return axis % max(rank, 1) if rank else 0


def prod_static(dims: Iterable[int]) -> int:
    return math.prod(dims)
