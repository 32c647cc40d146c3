"""Guards on symbolic sizes: Python decisions on a dynamic dim that its range leaves open.

User code branches on sizes (`if x.shape[1] % 2:`, `x.shape[0] > 4`, `range(x.shape[0])`).
A SymSize decides such a question without a guard when the ShapeVars' declared ranges
(or `multiple_of`) prove the answer (kiln/frontend/symsize.py). When they cannot, and
the trace belongs to `kn.compile`, the question is answered for the sizes of the call
being compiled, as torch's guards do, and recorded here as a `ShapeGuard`; the
specialization then serves only the calls whose sizes give the same answers, and a call
that breaks one compiles a new specialization under the same cache key (the recompile
reason names the guard and the line it came from). A size used as a Python int
(`range(n)`, `int(n)`) of a declared dynamic dim is guarded `n == value`: one
specialization per value, as torch specializes a SymInt used as an int; under automatic
dynamic that dim becomes static instead (CompiledFunction._trace retraces).

`kn.compile(..., strict=True)` refuses to guard (K141 names the dim and its range), and
`kn.trace` / `kn.export` never guard (an exported program cannot recompile): K141.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import sympy

_local = threading.local()
_MEMO = 4096  # answers kept per guard


@dataclass(frozen=True)
class ShapeGuard:
    """`op(diff, 0) is verdict`, over the trace's ShapeVars; `where` is the user's line."""

    diff: sympy.Expr
    op: object
    verdict: bool
    text: str
    where: str | None = None
    # the answers for the sizes seen so far (a call's check is then a dict lookup)
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    _symbols: tuple = field(default=(), compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_symbols", tuple(sorted(self.diff.free_symbols, key=lambda s: s.name)))

    def holds(self, sizes: dict) -> bool:
        symbols = self._symbols
        try:
            key = tuple([sizes[s.name] for s in symbols])
        except KeyError:
            return False
        known = self._memo.get(key)
        if known is None:
            value = self.diff.xreplace({s: sympy.Integer(n) for s, n in zip(symbols, key)})
            known = value.is_Number and bool(self.op(value, 0)) == self.verdict
            if len(self._memo) >= _MEMO:
                self._memo.clear()
            self._memo[key] = known
        return known

    def describe(self) -> str:
        text = f"`{self.text}` is {self.verdict}"
        return text + (f" (from {self.where})" if self.where else "")


class ShapeGuards:
    """What one kn.compile trace decided about its symbolic sizes."""

    def __init__(self, shapes: list, strict: bool = False, ints: bool = True) -> None:
        self.shapes = shapes  # the concrete shapes of the tensor arguments, in input order
        self.strict = strict
        # whether a size used as a Python int is guarded `== value`; automatic dynamic
        # instead retraces with that dim static (CompiledFunction._trace)
        self.ints = ints
        self.graph = None  # set when the trace's builder is made
        self.guards: list[ShapeGuard] = []
        self._sizes: dict | None = None

    def sizes(self) -> dict:
        """ShapeVar name -> its size in the call being compiled."""
        if self._sizes is None:
            sizes = {}
            if self.graph is not None:
                for value, shape in zip(self.graph.inputs, self.shapes):
                    for d, n in zip(value.type.shape, shape):
                        if isinstance(d, sympy.Symbol):
                            sizes.setdefault(d.name, int(n))
            self._sizes = sizes
        return self._sizes

    def value(self, expr):
        """expr at this call's sizes (an int, or an exact Rational), None if unbound."""
        sizes = self.sizes()
        if not all(s.name in sizes for s in expr.free_symbols):
            return None
        value = sympy.sympify(expr).xreplace({s: sympy.Integer(sizes[s.name])
                                              for s in expr.free_symbols})
        if not value.is_Number:
            return None
        return int(value) if value.is_Integer else value

    def decide(self, diff, op, text: str, where: str | None):
        """`op(diff, 0)` at this call's sizes, guarded; None when the sizes are unbound."""
        value = self.value(diff)
        if value is None:
            return None
        verdict = bool(op(value, 0))
        guard = ShapeGuard(sympy.sympify(diff), op, verdict, text, where)
        if guard not in self.guards:
            self.guards.append(guard)
        return verdict


def active_guards() -> ShapeGuards | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def collecting(guards: ShapeGuards):
    """Record the size decisions of a kn.compile trace into `guards`."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(guards)
    try:
        yield guards
    finally:
        stack.pop()


def first_failure(guards: tuple, sizes: dict) -> ShapeGuard | None:
    for guard in guards:
        if not guard.holds(sizes):
            return guard
    return None
