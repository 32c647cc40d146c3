"""Scalar expressions of Kernel IR over a tile, as Triton source text.

`Tile` binds every Op to a temporary, memoized per scope, and knows which tile dims a
value varies along; `index_text` prints a sympy index expression; `Names` hands out
identifiers that never shadow one another. Shared by the loop (emit.py) and GEMM
(emit_gemm.py) emitters.
"""

from __future__ import annotations

import keyword
import re

import numpy as np
import sympy

from kiln.codegen.kernel_ir import Acc, Const, IndexValue, Load, Op, ReduceRef
from kiln.codegen.triton import scalar
from kiln.codegen.triton.scalar import ScalarOps, literal, tl_dtype
from kiln.errors import KilnArgumentError
from kiln.ir.emitter import EAGER

# -- names and index expressions -------------------------------------------------------------

class Names:
    """Unique Python identifiers: requested names when free, else with a suffix."""

    def __init__(self):
        self.taken = set(keyword.kwlist) | {"tl", "triton", "libdevice", "range", "float"}
        self.taken |= set(scalar.COMBINE_HELPERS)
        self.counter = 0

    def get(self, want: str) -> str:
        base = re.sub(r"\W", "_", want) or "v"
        if base[0].isdigit():
            base = "v" + base
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def temp(self) -> str:
        while f"t{self.counter}" in self.taken:
            self.counter += 1
        return self.get(f"t{self.counter}")


def index_text(e, names: dict) -> str:
    """An index expression (sympy) as Triton source; `names` maps symbols to code names.

    Indices are non-negative wherever a result is used, so floor division is `//`
    (Triton truncates, which agrees there) and Mod is `%`."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return names[e.name]
    if e.is_Add:
        out = ""
        for t in e.as_ordered_terms():
            if t.as_coeff_Mul()[0] < 0:
                part = index_text(-t, names)
                out += f" - {paren(part, -t)}" if out else f"-{paren(part, -t)}"
            else:
                out += f" + {index_text(t, names)}" if out else index_text(t, names)
        return out
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        if not coeff.is_Integer:
            num, den = sympy.fraction(e)
            if den != 1:
                raise KilnArgumentError(f"triton backend: index expression {e} is not an integer")
        factors = sympy.Mul.make_args(rest)
        parts = [paren(index_text(f, names), f) for f in factors]
        if coeff != 1:
            parts.insert(0, str(int(coeff)))
        return "*".join(parts)
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        base = paren(index_text(e.base, names), e.base)
        return "*".join([base] * int(e.exp))
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        top, bottom = index_text(sympy.expand(num), names), index_text(den, names)
        if isinstance(e, sympy.floor):
            return f"({top}) // {paren(bottom, den)}"
        return f"({top} + {paren(bottom, den)} - 1) // {paren(bottom, den)}"
    if isinstance(e, sympy.Mod):
        a, b = e.args
        return f"({index_text(a, names)}) % {paren(index_text(b, names), b)}"
    if isinstance(e, (sympy.Min, sympy.Max)):
        fn = "tl.minimum" if isinstance(e, sympy.Min) else "tl.maximum"
        args = [index_text(a, names) for a in e.args]
        text = args[0]
        for a in args[1:]:
            text = f"{fn}({text}, {a})"
        return text
    raise KilnArgumentError(f"triton backend: index expression {e} uses {type(e).__name__}, which the "
                            "Triton code generator does not lower; use +, *, floor division, Mod, Min or Max")


def pointer(buffer: str, index: str) -> str:
    """`buffer + index`, parenthesized only where the index is not a name or number."""
    return f"{buffer} + {index}" if re.fullmatch(r"\w+", index) else f"{buffer} + ({index})"


def paren(text: str, e) -> str:
    e = sympy.sympify(e)
    return text if (e.is_Symbol or e.is_Integer or isinstance(e, (sympy.Min, sympy.Max))) else f"({text})"


def static_int(d) -> int | None:
    e = sympy.sympify(d)
    return int(e) if e.is_Integer else None


def subst_expr(e, subs: dict, memo: dict):
    """Kernel IR expression with index symbols substituted (unit loops -> 0)."""
    if not subs:
        return e
    if e in memo:
        return memo[e]
    if isinstance(e, Load):
        out = Load(e.buffer, sympy.sympify(e.index).subs(subs), e.dtype)
    elif isinstance(e, IndexValue):
        out = IndexValue(sympy.sympify(e.expr).subs(subs), e.dtype)
    elif isinstance(e, Op):
        out = Op(e.op, tuple(subst_expr(a, subs, memo) for a in e.args), e.dtype)
    else:
        out = e
    memo[e] = out
    return out


# -- expressions over one tile ------------------------------------------------------------------

class Tile:
    """Emits scalar expressions over a tile of one or two dims.

    Every value knows which dims it varies along (`deps`, a frozenset of 0/1): a load's
    pointer has exactly the shape its index implies, so masks and broadcasts follow from
    deps alone. Values independent of dim 1 (loads by row, reduction results) are
    emitted at kernel level even while a dim-1 loop is open (hoisted out of it)."""

    def __init__(self, names: Names, buffers: dict, symbols: dict, var_dim: dict, shapes: dict,
                 masks: dict, fast_math: bool, buffer_names: dict):
        self.names, self.buffers, self.symbols = names, buffers, symbols
        self.buffer_names = buffer_names  # Kernel IR buffer -> kernel parameter
        self.var_dim, self.shapes, self.masks = var_dim, shapes, masks
        self.fast_math = fast_math
        self.top: list[str] = []  # kernel-level statements
        self.inner: list[str] | None = None  # the open dim-1 loop body, if any
        self.memo_top: dict = {}
        self.memo_inner: dict = {}
        self.deps_memo: dict = {}
        self.refs: dict = {}  # ReduceRef name -> (text, dtype)
        self.acc: tuple | None = None  # GEMM accumulator (text, dtype)
        self.helpers: set[str] = set()

    def lines(self, deps) -> list[str]:
        return self.inner if (1 in deps and self.inner is not None) else self.top

    def deps_of_index(self, expr) -> frozenset:
        return frozenset(self.var_dim[s.name] for s in sympy.sympify(expr).free_symbols
                         if s.name in self.var_dim)

    def index(self, expr) -> str:
        return index_text(expr, self.symbols)

    def mask(self, deps) -> str | None:
        parts = [self.masks[d] for d in sorted(deps) if self.masks.get(d)]
        if len(parts) > 1:  # `&` binds tighter than `<`
            parts = [p if re.fullmatch(r"\w+", p) else f"({p})" for p in parts]
        return " & ".join(parts) if parts else None

    def broadcast(self, text: str, deps, target, dtype: str) -> str:
        """`text` broadcast to the shape of `target` deps (a Python literal becomes tl.full)."""
        if frozenset(deps) >= frozenset(target) or not target:
            return text
        shape = self.shapes[frozenset(target)]
        if is_python_literal(text):
            return f"tl.full({shape}, {text}, {dtype})"
        return f"tl.broadcast_to({text}, {shape})"

    def convert(self, text: str, src, dst, deps) -> str:
        """`text` converted from dtype `src` to `dst` (kiln's rules), bound to a temporary."""
        if src == dst:
            return text
        lines = self.lines(deps)
        return self.bind(ScalarOps(lines.append, self.names.temp).convert(text, src, dst), deps)

    def value(self, e) -> tuple[str, frozenset]:
        """(source text, deps) of a Kernel IR expression; Ops are bound to temporaries."""
        deps = self.deps(e)
        # values along dim 1 are per inner space (persistent) or per loop body (looped)
        memo = self.memo_inner if 1 in deps else self.memo_top
        if e not in memo:
            memo[e] = self._value(e, deps)
        return memo[e], deps

    def deps(self, e) -> frozenset:
        """The tile dims `e` varies along (memoized: expressions are DAGs)."""
        if e in self.deps_memo:
            return self.deps_memo[e]
        if isinstance(e, Load):
            out = self.deps_of_index(e.index)
        elif isinstance(e, IndexValue):
            out = self.deps_of_index(e.expr)
        elif isinstance(e, ReduceRef):
            out = frozenset({0})
        elif isinstance(e, Acc):
            out = frozenset({0, 1})
        elif isinstance(e, Op):
            out = frozenset().union(*(self.deps(a) for a in e.args))
        else:
            out = frozenset()
        self.deps_memo[e] = out
        return out

    def bind(self, text: str, deps) -> str:
        if re.fullmatch(r"\w+", text):  # already a name (a conversion that is a no-op)
            return text
        name = self.names.temp()
        self.lines(deps).append(f"{name} = {text}")
        return name

    def _value(self, e, deps) -> str:
        if isinstance(e, Const):
            return literal(e.value, e.dtype)
        if isinstance(e, Load):
            d = self.buffers[e.buffer]
            mask = self.mask(self.deps_of_index(e.index))
            # masked lanes are never used (reductions select their identity there), so
            # `other` only keeps them tidy; Triton cannot cast the literal 0 to float8
            other = "" if d.bits == 8 and d.is_floating else ", other=0"
            call = f"tl.load({pointer(self.buffer_names[e.buffer], self.index(e.index))}"
            call += f", mask={mask}{other})" if mask else ")"
            if scalar.is_low_precision(d):
                call += ".to(tl.float32)"
            return self.convert(self.bind(call, deps), d, e.dtype, deps)
        if isinstance(e, IndexValue):
            if not sympy.sympify(e.expr).free_symbols:
                return literal(int(e.expr), e.dtype)
            return self.bind(f"({self.index(e.expr)}).to({tl_dtype(e.dtype)})", deps)
        if isinstance(e, ReduceRef):
            text, d = self.refs[e.name]
            return self.convert(text, d, e.dtype, deps)
        if isinstance(e, Acc):
            if self.acc is None:
                raise KilnArgumentError("triton backend: Acc is only valid in a GEMM epilogue")
            text, d = self.acc
            return self.convert(text, d, e.dtype, deps)
        if isinstance(e, Op):
            if all(isinstance(a, Const) for a in e.args):
                folded = fold_constant(e)
                if folded is not None:
                    return literal(folded, e.dtype)
            args = [self.value(a)[0] for a in e.args]
            lines = self.lines(deps)
            ops = ScalarOps(lines.append, self.names.temp, self.fast_math)
            return self.bind(ops.op(e.op, args, [a.dtype for a in e.args], e.dtype), deps)
        raise KilnArgumentError(f"triton backend: not a Kernel IR expression: {e!r}")


def is_python_literal(text: str) -> bool:
    return text in ("True", "False") or re.fullmatch(r'-?(\d[\w.+-]*|float\("\w+"\))', text) is not None


def fold_constant(e: Op):
    """The value of an Op over constants, by the registry's reference (exact semantics)."""
    from kiln.codegen.legalize import MACHINE_OPS, evaluate
    from kiln.ir import registry

    if e.dtype.is_complex or any(a.dtype.is_complex for a in e.args):
        return None
    if e.op in MACHINE_OPS:  # legalize's unchecked ops: not registry ops
        value = np.asarray(evaluate(e, {})).astype(e.dtype.np_dtype)
        return value.item() if not e.dtype.is_floating else float(value.astype(np.float64))
    args = [np.asarray(a.value).astype(a.dtype.np_dtype) for a in e.args]
    attrs = {"dtype": e.dtype} if "dtype" in registry.get(e.op).attrs else {}
    with np.errstate(all="ignore"):
        (value,) = EAGER.apply(e.op, args, attrs)
    value = np.asarray(value).astype(e.dtype.np_dtype)
    return value.item() if not e.dtype.is_floating else float(value.astype(np.float64))
