"""Index expressions (sympy, in loop variables and size symbols) -> i64 LLVM arithmetic.

Supported: integers, symbols, +, * (integer coefficients), integer powers, floor of a
rational combination (`floor(x/4)`, emitted as a floor division), Mod (Python's sign of
the divisor), Min and Max. The runtime computes the same expressions in Python with
`kiln.ir.shapes.dim_function` (shape checks, loop counts), without eval.
"""

from __future__ import annotations

from functools import reduce
from math import lcm

import sympy

from kiln.errors import KilnArgumentError

from kiln.codegen.cpu.ir_builder import Fn, V, const


def _unsupported(expr) -> KilnArgumentError:
    return KilnArgumentError(
        f"cpu backend: index expression {expr} uses {type(expr).__name__}, which the CPU code "
        "generator does not lower; use +, *, floor division, Mod, Min or Max")


def _common_denominator(expr) -> int:
    dens = [sympy.fraction(t)[1] for t in sympy.Add.make_args(sympy.expand(expr))]
    out = 1
    for d in dens:
        if not d.is_Integer:
            raise _unsupported(expr)
        out = lcm(out, int(d))
    return out


def floor_div(fn: Fn, a: V, b: V) -> V:
    """Python floor division of i64 values (b != 0)."""
    q = fn.bin("sdiv", a, b)
    r = fn.bin("srem", a, b)
    adjust = fn.bin("and", fn.icmp("ne", r, const("i64", 0)),
                    fn.icmp("ne", fn.icmp("slt", r, const("i64", 0)), fn.icmp("slt", b, const("i64", 0))))
    return fn.bin("sub", q, fn.cast("zext", adjust, "i64"))


def floor_mod(fn: Fn, a: V, b: V) -> V:
    """Python's a % b: the result takes the divisor's sign."""
    r = fn.bin("srem", a, b)
    adjust = fn.bin("and", fn.icmp("ne", r, const("i64", 0)),
                    fn.icmp("ne", fn.icmp("slt", r, const("i64", 0)), fn.icmp("slt", b, const("i64", 0))))
    return fn.bin("add", r, fn.select(adjust, b, const("i64", 0)))


def emit_index(fn: Fn, expr, symbols: dict[str, V], memo: dict | None = None) -> V:
    """Emit `expr` as i64 arithmetic; `symbols` maps loop variables and sizes to values."""
    memo = {} if memo is None else memo
    expr = sympy.sympify(expr)

    def go(e) -> V:
        if e in memo:
            return memo[e]
        out = _emit(e)
        memo[e] = out
        return out

    def _emit(e) -> V:
        if e.is_Integer:
            return const("i64", int(e))
        if e.is_Symbol:
            if e.name not in symbols:
                raise KilnArgumentError(f"cpu backend: index uses unknown symbol {e.name}")
            return symbols[e.name]
        if isinstance(e, sympy.Add):
            return reduce(lambda a, b: fn.bin("add", a, b), [go(t) for t in e.args])
        if isinstance(e, sympy.Mul):
            if any(f.is_Rational and not f.is_Integer for f in e.args):
                raise _unsupported(e)
            return reduce(lambda a, b: fn.bin("mul", a, b), [go(f) for f in e.args])
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
            base = go(e.base)
            return reduce(lambda a, b: fn.bin("mul", a, b), [base] * int(e.exp))
        if isinstance(e, sympy.floor):
            inner = e.args[0]
            den = _common_denominator(inner)
            num = sympy.expand(inner * den)
            return floor_div(fn, go(num), const("i64", den)) if den != 1 else go(num)
        if isinstance(e, sympy.Mod):
            return floor_mod(fn, go(e.args[0]), go(e.args[1]))
        if isinstance(e, (sympy.Min, sympy.Max)):
            pred = "slt" if isinstance(e, sympy.Min) else "sgt"
            vals = [go(a) for a in e.args]
            return reduce(lambda a, b: fn.select(fn.icmp(pred, a, b), a, b), vals)
        raise _unsupported(e)

    return go(expr)
