"""`SymSize`: what `Tensor.size()` returns for a dim that is symbolic while tracing.

PyTorch code does arithmetic and Python comparisons on sizes (`b, t = idx.size()`,
`assert t <= block_size`, `x.view(B, T, C)`, `bias[:, :, :T, :T]`). Under a dynamic spec
`t` is a sympy expression over a `ShapeVar`, and comparing one in Python leaked sympy's
"cannot determine truth value of Relational" TypeError. A SymSize wraps the expression:
arithmetic stays symbolic, and a comparison is decided from the declared ranges of the
ShapeVars in the trace (`T in [1, 64]` proves `T <= 64` and refutes `T > 64`), with no
guard; one the ranges cannot decide is a numbered error (K141) naming the dim, its range
and the fix. Everything that takes a size (`view`, `arange`, slicing, factories) accepts
a SymSize (it converts back with `_sympy_`). `Tensor.shape` keeps the plain sympy dims.
"""

from __future__ import annotations

import operator

import sympy

from kiln.errors import KilnConcretizationError, user_location


def _expr(x):
    return x.expr if isinstance(x, SymSize) else sympy.sympify(x)


def _operand(x):
    """x as a sympy expression, or None when x is not a number (a tensor, a string): the
    operator then returns NotImplemented, so the other operand's reflected method runs."""
    if isinstance(x, SymSize):
        return x.expr
    if isinstance(x, bool):
        return sympy.Integer(int(x))
    if isinstance(x, (int, float, sympy.Basic)) or type(x).__module__ == "numpy" and \
            hasattr(x, "dtype") and getattr(x, "ndim", 1) == 0:
        return sympy.sympify(x)
    return None


def _arith(fn):
    """A binary operator on sizes: symbolic result, NotImplemented for non-numbers."""
    def method(self, other):
        o = _operand(other)
        if o is None:
            return NotImplemented
        return self._wrap(fn(self.expr, o))

    return method


def _ranges() -> dict:
    """name -> (min, max or None) of the ShapeVars of the innermost trace."""
    from kiln.frontend.dispatch import current_builder

    builder = current_builder()
    if builder is None:
        return {}
    return {name: (v.min, v.max) for name, v in builder.graph.shape_vars.items()}


def _interval(expr, ranges: dict):
    """(lo, hi) of `expr` over the boxes of its symbols (hi None: unbounded), when expr is
    a polynomial with nonnegative coefficients (monotone in every symbol; sizes are);
    None otherwise."""
    expr = sympy.expand(expr)
    symbols = sorted(expr.free_symbols, key=lambda s: s.name)
    if any(s.name not in ranges for s in symbols):
        return None
    try:
        poly = sympy.Poly(expr, *symbols) if symbols else None
    except sympy.PolynomialError:
        return None
    if poly is not None and any(c < 0 for c in poly.coeffs() if c != poly.coeff_monomial(1)):
        return None
    lo = expr.subs({s: ranges[s.name][0] for s in symbols})
    if any(ranges[s.name][1] is None for s in symbols):
        return lo, None
    return lo, expr.subs({s: ranges[s.name][1] for s in symbols})


def _bounds(diff, ranges: dict) -> tuple:
    """(lo, hi) of diff as numbers, -inf/inf where the ranges do not bound it."""
    inf = float("inf")
    box = _interval(diff, ranges)
    if box is not None:
        return float(box[0]), (inf if box[1] is None else float(box[1]))
    box = _interval(-diff, ranges)
    if box is not None:
        return (-inf if box[1] is None else -float(box[1])), -float(box[0])
    return -inf, inf


def _eq(lo, hi):
    if lo == hi == 0:
        return True
    return False if lo > 0 or hi < 0 else None


# op -> its verdict on diff in [lo, hi] (None: the range does not decide)
_TESTS = {
    operator.le: lambda lo, hi: True if hi <= 0 else False if lo > 0 else None,
    operator.lt: lambda lo, hi: True if hi < 0 else False if lo >= 0 else None,
    operator.ge: lambda lo, hi: True if lo >= 0 else False if hi < 0 else None,
    operator.gt: lambda lo, hi: True if lo > 0 else False if hi <= 0 else None,
    operator.eq: _eq,
    operator.ne: lambda lo, hi: None if _eq(lo, hi) is None else not _eq(lo, hi),
}


class SymSize:
    """A symbolic size with Python comparisons decided by the declared ranges."""

    __slots__ = ("expr",)

    def __init__(self, expr) -> None:
        self.expr = expr

    def _sympy_(self):
        return self.expr

    def __repr__(self) -> str:
        return str(self.expr)

    __str__ = __repr__

    def __hash__(self) -> int:
        return hash(self.expr)

    # -- arithmetic stays symbolic --------------------------------------------------------

    def _wrap(self, value):
        value = sympy.sympify(value)
        return int(value) if value.is_Integer else SymSize(value)

    __add__ = _arith(lambda a, b: a + b)
    __radd__ = _arith(lambda a, b: b + a)
    __sub__ = _arith(lambda a, b: a - b)
    __rsub__ = _arith(lambda a, b: b - a)
    __mul__ = _arith(lambda a, b: a * b)
    __rmul__ = _arith(lambda a, b: b * a)
    __floordiv__ = _arith(lambda a, b: sympy.floor(a / b))
    __rfloordiv__ = _arith(lambda a, b: sympy.floor(b / a))
    __truediv__ = _arith(lambda a, b: a / b)  # exact (a Rational expression), as SymFloat
    __rtruediv__ = _arith(lambda a, b: b / a)
    __mod__ = _arith(lambda a, b: sympy.Mod(a, b))
    __rmod__ = _arith(lambda a, b: sympy.Mod(b, a))
    __pow__ = _arith(lambda a, b: a ** b)
    __rpow__ = _arith(lambda a, b: b ** a)

    def __divmod__(self, other):
        if _operand(other) is None:
            return NotImplemented
        return self // other, self % other

    def __rdivmod__(self, other):
        if _operand(other) is None:
            return NotImplemented
        return other // self, other % self

    def __neg__(self):
        return self._wrap(-self.expr)

    def __pos__(self):
        return self

    def __abs__(self):
        return self._wrap(sympy.Abs(self.expr))

    def __floor__(self):
        return self._wrap(sympy.floor(self.expr))

    def __ceil__(self):
        return self._wrap(sympy.ceiling(self.expr))

    def __trunc__(self):
        return self._wrap(sympy.sign(self.expr) * sympy.floor(sympy.Abs(self.expr)))

    def __round__(self, ndigits=None):
        if ndigits is None and self.expr.is_integer:
            return self
        return round(self._value(float, "round()"), ndigits)

    # -- comparisons decided by the ranges ---------------------------------------------------

    def _decide(self, other, op, text: str) -> bool:
        diff = sympy.expand(self.expr - _expr(other))  # the question: op(diff, 0)
        if diff.is_Number:
            return bool(op(diff, 0))
        ranges = _ranges()
        lo, hi = _bounds(diff, ranges)
        verdict = _TESTS[op](lo, hi)
        if verdict is None:
            verdict = _by_divisibility(diff, op)
        if verdict is not None:
            return verdict
        from kiln.frontend.shape_guards import active_guards

        guards = active_guards()  # kn.compile: decide for this call's sizes, guard the rest
        if guards is not None and not guards.strict:
            verdict = guards.decide(diff, op, f"{self.expr} {text} {_expr(other)}", user_location())
            if verdict is not None:
                return verdict
        names = ", ".join(sorted(s.name for s in self.expr.free_symbols)) or str(self.expr)
        declared = "; ".join(f"{n} in [{lo}, {hi if hi is not None else 'inf'}]"
                             for n, (lo, hi) in sorted(ranges.items())
                             if n in {s.name for s in self.expr.free_symbols})
        raise KilnConcretizationError(
            f"the comparison `{self.expr} {text} {_expr(other)}` on the symbolic size {names} is "
            "true for some sizes the dynamic spec allows and false for others"
            + (f" ({declared})" if declared else ""), where=user_location(),
            hint="narrow the ShapeVar's min/max so the range decides it, or branch with kn.cond"
                 + ("; kn.compile without strict=True guards it and recompiles when it changes"
                    if _strict() else ""))

    def __le__(self, o):
        return self._decide(o, operator.le, "<=")

    def __lt__(self, o):
        return self._decide(o, operator.lt, "<")

    def __ge__(self, o):
        return self._decide(o, operator.ge, ">=")

    def __gt__(self, o):
        return self._decide(o, operator.gt, ">")

    def __eq__(self, o):
        if not isinstance(o, (int, SymSize, sympy.Basic)):
            return NotImplemented
        return self._decide(o, operator.eq, "==")

    def __ne__(self, o):
        result = self.__eq__(o)
        return result if result is NotImplemented else not result

    def __bool__(self) -> bool:
        return self._decide(0, operator.ne, "!=")

    def _value(self, kind, what: str):
        """The size as a Python number: known when the ranges pin it, else (kn.compile)
        this call's value with a guard `expr == value` (one specialization per value, as
        torch specializes a SymInt used as an int), else K141."""
        expr = sympy.expand(self.expr)
        if expr.is_Number:
            return kind(expr)
        lo, hi = _bounds(expr, _ranges())
        if lo == hi:
            return kind(lo)
        from kiln.frontend.shape_guards import active_guards

        guards = active_guards()
        if guards is not None and not guards.strict and guards.ints:
            value = guards.value(expr)
            if value is not None:
                guards.decide(expr - value, operator.eq, f"{self.expr} == {value}", user_location())
                return kind(value)
        raise KilnConcretizationError(
            f"the symbolic size {self.expr} was used as a Python {kind.__name__} ({what}: "
            "range(), a list index, int(), float()); its value is only known when the compiled "
            "function runs",
            where=user_location(),
            hint="keep sizes symbolic (view, arange, slicing accept them) or declare the dim "
                 "static" + ("; kn.compile without strict=True specializes on the value"
                             if _strict() else ""))

    def __index__(self) -> int:
        return self._value(int, "an int")

    def __int__(self) -> int:
        return self._value(int, "int()")

    def __float__(self) -> float:
        return self._value(float, "float()")

    def __format__(self, spec: str) -> str:
        return format(str(self.expr), spec)


def _strict() -> bool:
    from kiln.frontend.shape_guards import active_guards

    guards = active_guards()
    return guards is not None and guards.strict


def _by_divisibility(diff, op):
    """Questions on `T % k` (`if x.shape[1] % 2:`) that the ShapeVars' `multiple_of`
    decides; None when it does not."""
    const, rest = diff.as_coeff_Add()
    if not isinstance(rest, sympy.Mod):
        return None
    remainder = _mod_value(rest)
    return None if remainder is None else bool(op(remainder + const, 0))


def _mod_value(mod):
    """The value of `value % k` when every term of `value` but the constant is a multiple
    of k for every size the ShapeVars' `multiple_of` allows; None otherwise."""
    from kiln.frontend.dispatch import current_builder

    builder = current_builder()
    value, k = mod.args
    if builder is None or not k.is_Integer or int(k) <= 0:
        return None
    steps = {name: v.multiple_of for name, v in builder.graph.shape_vars.items()}
    if not all(s.name in steps for s in value.free_symbols):
        return None
    try:
        poly = sympy.Poly(value, *sorted(value.free_symbols, key=lambda s: s.name))
    except sympy.PolynomialError:
        return None
    for monomial, coeff in poly.terms():
        if not coeff.is_Integer:
            return None
        if any(monomial):
            step = int(coeff)
            for sym, power in zip(poly.gens, monomial):
                step *= steps[sym.name] ** power
            if step % int(k):
                return None
    return int(poly.coeff_monomial(1)) % int(k)


def wrap_dims(dims: tuple) -> tuple:
    """`dims` with every symbolic entry as a SymSize."""
    return tuple(d if isinstance(d, int) else SymSize(d) for d in dims)


def _order(a, b):
    """-1 if a <= b is proven by the trace's ranges, 1 if a >= b, 0 if undecided."""
    diff = sympy.expand(sympy.sympify(a) - sympy.sympify(b))
    if diff.is_Number:
        return -1 if diff <= 0 else 1
    lo, hi = _bounds(diff, _ranges())
    return -1 if hi <= 0 else 1 if lo >= 0 else 0


def range_min(a, b):
    """min(a, b) of sizes, simplified where the declared ranges decide it (slice bounds)."""
    order = _order(a, b)
    return a if order < 0 else b if order > 0 else sympy.Min(a, b)


def range_max(a, b):
    order = _order(a, b)
    return b if order < 0 else a if order > 0 else sympy.Max(a, b)


# -- a size as a tensor value (`x.sum(-1) / x.shape[-1]`, `idx + x.size(1)`) ---------------


def size_value(builder, size):
    """`size` (a SymSize) as a traced scalar of `builder`: int64 for an integer
    expression, float32 otherwise (torch's promotion then keeps a float tensor's dtype,
    as for a Python number). A ShapeVar's value is counted in the graph (the sum of an
    [N] vector of ones: no extra input), then the expression is evaluated with tensor
    ops; None for an expression this does not evaluate (K140 follows)."""
    from kiln.ir import dtypes as dt

    expr = getattr(size, "expr", None)
    if builder is None or expr is None:
        return None
    value = _evaluate(builder, sympy.sympify(expr), {})
    if value is None:
        return None
    return builder.convert(value[0], dt.int64 if value[1] else dt.float32)


def _evaluate(b, expr, memo: dict):
    """(value, is_integer) of expr as a graph scalar, or None (float64 for the division
    of a rational expression, int64 otherwise)."""
    from kiln.ir import dtypes as dt

    if expr in memo:
        return memo[expr]
    out = None
    if expr.is_Integer:
        out = b.full(int(expr), dt.int64), True
    elif expr.is_Number and expr.is_real:
        out = b.full(float(expr), dt.float64), False
    elif isinstance(expr, sympy.Symbol):
        out = b.reduce_sum(b.full(1, dt.int64, (expr,)), axes=(0,)), True
    elif isinstance(expr, (sympy.Add, sympy.Mul)):
        parts = [_evaluate(b, a, memo) for a in expr.args]
        if all(p is not None for p in parts):
            exact = all(p[1] for p in parts)
            kind = dt.int64 if exact else dt.float64
            acc = b.convert(parts[0][0], kind)
            for value, _ in parts[1:]:
                acc = (b.add if isinstance(expr, sympy.Add) else b.mul)(acc, b.convert(value, kind))
            out = acc, exact
    elif isinstance(expr, sympy.Pow) and expr.exp.is_Integer:
        base = _evaluate(b, expr.base, memo)
        k = int(expr.exp)
        if base is not None and k != 0:
            acc = b.convert(base[0], dt.float64 if k < 0 or not base[1] else dt.int64)
            power = acc
            for _ in range(abs(k) - 1):
                power = b.mul(power, acc)
            out = (b.div(b.full(1.0, dt.float64), power), False) if k < 0 else (power, base[1])
    elif isinstance(expr, sympy.Pow) and expr.exp.is_Number and expr.exp.is_real:
        base = _evaluate(b, expr.base, memo)  # `C ** -0.5`: a float power
        if base is not None:
            out = b.call("pow", b.convert(base[0], dt.float64),
                         b.full(float(expr.exp), dt.float64)), False
    elif isinstance(expr, (sympy.floor, sympy.Mod)):
        args = [_evaluate(b, a, memo) for a in (expr.args if isinstance(expr, sympy.Mod)
                                               else sympy.fraction(sympy.together(expr.args[0])))]
        if all(a is not None and a[1] for a in args):
            op = "remainder" if isinstance(expr, sympy.Mod) else "floor_divide"
            out = b.call(op, args[0][0], args[1][0]), True
    memo[expr] = out
    return out
