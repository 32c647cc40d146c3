"""Sharding rules for every op of the registry, and running ops on DTensors.

    from kiln.distributed.sharding import OpSpec, choose, strategies
    spec = OpSpec("matmul", ((8, 4), (4, 6)), (f32, f32), ((8, 6),), {}, n=4)
    strategies(spec)      # [Shard(0), R] -> Shard(0); [R, Shard(1)] -> Shard(1); ...
    choose(spec, (Shard(1), Shard(0)))   # ([Shard(1), Shard(0)] -> Partial('sum'), 0.0)

`strategy.py` holds the machinery; `pointwise.py` the rules an op's kind decides;
`shape_rules.py`, `linalg_rules.py` and `lowp_rules.py` the explicit ones; `dispatch.py` runs an op on
DTensors with them. (ARCHITECTURE.md puts an op's rules beside it; they live here while
the op families are being edited, keyed by op name so the registry walk still checks
that every op has one.)
"""

from __future__ import annotations

from kiln.distributed.sharding.strategy import (
    KIND_RULES, LOCAL_ATTRS, RULES, OpSpec, Strategy, choose, rule_for, strategies,
)

_loaded = False


def load_rules() -> None:
    """Import the rule modules (they fill RULES and KIND_RULES)."""
    global _loaded
    if not _loaded:
        _loaded = True
        from kiln.distributed.sharding import (  # noqa: F401
            linalg_rules, lowp_rules, pointwise, shape_rules,
        )


__all__ = ["KIND_RULES", "LOCAL_ATTRS", "OpSpec", "RULES", "Strategy", "choose",
           "load_rules", "rule_for", "strategies"]
