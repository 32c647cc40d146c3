"""Choosing sharding strategies, and running ops on DTensors.

    from kiln.distributed.sharding import OpSpec, choose, strategies
    spec = OpSpec("matmul", ((8, 4), (4, 6)), (f32, f32), ((8, 6),), {}, n=4)
    strategies(spec)      # [Shard(0), R] -> Shard(0); [R, Shard(1)] -> Shard(1); ...
    choose(spec, (Shard(1), Shard(0)))   # ([Shard(1), Shard(0)] -> Partial('sum'), 0.0)

Every op's rule lives beside the op, in kiln/ir/ops/*.py (STYLE.md §1), registered in
the tables of kiln/ir/sharding.py with the placements and the OpSpec/Strategy records.
`strategy.py` ranks a rule's strategies by the bytes they move; `dispatch.py` runs an
op on DTensors with them.
"""

from __future__ import annotations

from kiln.distributed.sharding.strategy import (
    KIND_RULES, LOCAL_ATTRS, RULES, OpSpec, Strategy, choose, rule_for, strategies,
)


def load_rules() -> None:
    """Make sure every op family is registered (each registers its ops' sharding rules)."""
    import kiln.ir.ops  # noqa: F401


__all__ = ["KIND_RULES", "LOCAL_ATTRS", "OpSpec", "RULES", "Strategy", "choose",
           "load_rules", "rule_for", "strategies"]
