"""Sharding strategies: the table of rules, and choosing one strategy per mesh dim.

A rule looks at an op's operands on ONE mesh dim of size n and lists what it can run:

    Strategy(inputs=(Shard(0), Replicate()), outputs=(Shard(0),))   # rows of x @ w

Each strategy says which placement every operand must have on that mesh dim and what
placement every result then has; running the op on the local blocks is correct for
it. Every rule also lists the all-Replicate strategy, so any input can run. The
strategy chosen is the one whose redistributions move the fewest bytes (`cost`), ties
broken by moving fewer operands (replicated inputs give a replicated result, as in
PyTorch), then by sharding more results (less duplicated compute), then by the rule's
order.
On an n-d mesh the choice is made mesh dim by mesh dim (PyTorch's expansion of
single-dim strategies); a tensor dim is cut by at most one mesh dim inside an op.

Rules are found by op name in `RULES` (explicit rules), else derived from the op's
kind (`KIND_RULES`: every elementwise op shares one rule). `rule_for` raises K242 when
an op has neither; tests/distributed/test_sharding_rules.py walks the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kiln.distributed.errors import ShardingRuleError
from kiln.distributed.placements import Partial, Placement, Replicate, Shard
from kiln.distributed.redistribute import cost as move_cost

R = Replicate()


@dataclass(frozen=True)
class OpSpec:
    """What a rule sees: the op, its operands' and results' global shapes and dtypes,
    its attributes, and the size `n` of the mesh dim being decided."""

    op: str
    in_shapes: tuple
    in_dtypes: tuple
    out_shapes: tuple
    attrs: dict = field(hash=False)
    n: int

    @property
    def ndim(self) -> int:
        return len(self.in_shapes[0]) if self.in_shapes else 0

    def even(self, size: int) -> bool:
        return size % self.n == 0

    def full_chunks(self, size: int) -> bool:
        """Every rank's chunk of a dim of `size` is non-empty (torch.chunk sizes)."""
        step = -(-size // self.n)
        return size > 0 and step * (self.n - 1) < size


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on one mesh dim: operand placements -> result placements."""

    inputs: tuple
    outputs: tuple

    def __repr__(self) -> str:
        return "%s -> %s" % (list(self.inputs), list(self.outputs))


RULES: dict[str, Callable[[OpSpec], list]] = {}
KIND_RULES: dict[str, Callable[[OpSpec], list]] = {}
# attrs of the local op from the global ones: fn(attrs, local_in_shapes, local_out_shapes)
LOCAL_ATTRS: dict[str, Callable] = {}


def rule(*names: str, local_attrs: Callable | None = None):
    """Register the decorated function as the sharding rule of ops `names`."""

    def wrap(fn):
        for name in names:
            if name in RULES:
                raise ValueError("sharding rule for %s defined twice" % name)
            RULES[name] = fn
            if local_attrs is not None:
                LOCAL_ATTRS[name] = local_attrs
        return fn

    return wrap


def replicate_all(spec: OpSpec) -> Strategy:
    """Every operand and result whole on every rank (always valid)."""
    return Strategy(tuple(R for _ in spec.in_shapes), tuple(R for _ in spec.out_shapes))


def rule_for(op: str) -> Callable[[OpSpec], list]:
    """The sharding rule of `op`: explicit, else its kind's; K242 when there is none."""
    from kiln.distributed.sharding import load_rules
    from kiln.ir import registry

    load_rules()
    if op in RULES:
        return RULES[op]
    opdef = registry.get(op)
    fn = KIND_RULES.get(opdef.kind)
    if fn is None:
        raise ShardingRuleError("%s (kind %s) has no sharding rule" % (op, opdef.kind),
                                hint="add one to kiln/distributed/sharding/ (RULES by op name)")
    return fn


def strategies(spec: OpSpec) -> list[Strategy]:
    """Every strategy of spec's op on one mesh dim (all-Replicate included, last)."""
    found = list(rule_for(spec.op)(spec))
    full = replicate_all(spec)
    found = [s for s in found if s != full] + [full]
    for s in found:
        if len(s.inputs) != len(spec.in_shapes) or len(s.outputs) != len(spec.out_shapes):
            raise ShardingRuleError("%s: sharding rule gave %r for %d operand(s) and %d "
                                    "result(s)" % (spec.op, s, len(spec.in_shapes),
                                                   len(spec.out_shapes)))
    return found


def _nbytes(shape, dtype) -> int:
    size = 1
    for s in shape:
        size *= int(s)
    return size * (4 if dtype is None else max(1, dtype.bits // 8))


def choose(spec: OpSpec, current: tuple, forbidden: tuple = ()) -> tuple[Strategy, float]:
    """The cheapest strategy on one mesh dim given each operand's `current` placement
    there; `forbidden[k]` is the set of dims of operand/result k a strategy may not cut
    (another mesh dim cuts them, or they do not divide). Returns (strategy, bytes moved
    now); the ranking also counts what a Partial result will owe (a reduce_scatter)."""
    best, best_key = None, None
    for order, s in enumerate(strategies(spec)):
        if _cuts_forbidden(s, forbidden, len(spec.in_shapes)):
            continue
        bytes_ = sum(move_cost(_nbytes(shape, dtype), (cur,), (want,), (spec.n,))
                     for shape, dtype, cur, want in zip(spec.in_shapes, spec.in_dtypes,
                                                        current, s.inputs))
        # a Partial result owes at least a reduce_scatter later (unless a linear op
        # consumes it): counted, so that a cheap move now is not a dear one later
        owed = sum(move_cost(_nbytes(shape, spec.in_dtypes[0] if spec.in_dtypes else None),
                             (p,), (Shard(0),), (spec.n,))
                   for shape, p in zip(spec.out_shapes, s.outputs)
                   if p.is_partial() and not current_partial(current, p))
        moved = sum(1 for cur, want in zip(current, s.inputs) if cur != want)
        sharded = sum(1 for p in s.outputs if not p.is_replicate())
        key = (bytes_ + owed, moved, -sharded, order)
        if best_key is None or key < best_key:
            best, best_key, best_bytes = s, key, bytes_
    return best, (best_bytes if best is not None else 0.0)


def current_partial(current: tuple, p: Placement) -> bool:
    """An operand is already that Partial: the debt was counted where it was made."""
    return any(c == p for c in current)


def _cuts_forbidden(s: Strategy, forbidden: tuple, n_in: int) -> bool:
    if not forbidden:
        return False
    for k, p in enumerate(s.inputs + s.outputs):
        if p.is_shard() and p.dim in forbidden[k]:
            return True
    return False


# -- helpers rules share ------------------------------------------------------------------
def same_on_all(spec: OpSpec, p: Placement, n_out: int | None = None) -> Strategy:
    """Every operand and result with placement p."""
    n_out = len(spec.out_shapes) if n_out is None else n_out
    return Strategy(tuple(p for _ in spec.in_shapes), tuple(p for _ in range(n_out)))


def shard_dims(spec: OpSpec, dims, out_dim: Callable[[int], int | None] = lambda d: d,
               operands: tuple | None = None) -> list[Strategy]:
    """For each tensor dim d in `dims`: the given operands (default all) Shard(d), the
    others Replicate, every result Shard(out_dim(d)) (dropped when None)."""
    found = []
    ops = range(len(spec.in_shapes)) if operands is None else operands
    for d in dims:
        od = out_dim(d)
        if od is None:
            continue
        ins = tuple(Shard(d) if k in ops else R for k in range(len(spec.in_shapes)))
        found.append(Strategy(ins, tuple(Shard(od) for _ in spec.out_shapes)))
    return found


def partial_through(spec: OpSpec, op: str = "sum", operands: tuple | None = None) -> Strategy:
    """Partial(op) operands (default all) -> Partial(op) results: the op is linear (sum)
    or monotone (max/min) in those operands."""
    ops = range(len(spec.in_shapes)) if operands is None else operands
    ins = tuple(Partial(op) if k in ops else R for k in range(len(spec.in_shapes)))
    return Strategy(ins, tuple(Partial(op) for _ in spec.out_shapes))


__all__ = ["KIND_RULES", "LOCAL_ATTRS", "OpSpec", "RULES", "Strategy", "choose",
           "partial_through", "replicate_all", "rule", "rule_for", "same_on_all",
           "shard_dims", "strategies"]
