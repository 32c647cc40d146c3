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

The rules live beside their ops in kiln/ir/ops/*.py and register in the tables of
kiln/ir/sharding.py (which also holds the placements and the OpSpec/Strategy records;
this module re-exports them). Rules are found by op name in `RULES` (explicit rules),
else derived from the op's kind (`KIND_RULES`: every elementwise op shares one rule).
`rule_for` raises K242 when an op has neither; tests/distributed/test_sharding.py walks
the registry.
"""

from __future__ import annotations

from typing import Callable

from kiln.distributed.errors import ShardingRuleError
from kiln.distributed.redistribute import cost as move_cost
from kiln.ir.sharding import (  # noqa: F401  (re-exported: the rules' vocabulary)
    KIND_RULES, LOCAL_ATTRS, RULES, OpSpec, Placement, Shard, Strategy, partial_through,
    replicate_all, same_on_all, shard_dims, sharding_rule,
)


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
                                hint="add one beside the op in kiln/ir/ops/ (@sharding_rule, "
                                     "kiln/ir/sharding.py)")
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


__all__ = ["KIND_RULES", "LOCAL_ATTRS", "OpSpec", "RULES", "Strategy", "choose",
           "partial_through", "replicate_all", "rule_for", "same_on_all", "shard_dims",
           "sharding_rule", "strategies"]
