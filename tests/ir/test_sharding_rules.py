"""Sharding rules live beside their ops (STYLE.md §1): the vocabulary and the tables are
kiln/ir/sharding.py's, every op's explicit rule is defined in the module that defines
the op, and kiln.distributed uses these very tables and placements."""

from __future__ import annotations

import pytest

from kiln.ir import dtypes as dt
from kiln.ir import registry
from kiln.ir import sharding as sh

# rules one module defines for ops of several: the elementwise ops' (also the pointwise
# composites'), and "run whole" (creation, sampling; control flow and collectives by kind)
SHARED = {("kiln.ir.ops.elementwise", "elementwise_sharding"), ("kiln.ir.sharding", "run_whole")}


def test_every_op_has_a_rule_in_the_ir_tables():
    missing = [name for name, op in registry.all_ops().items()
               if name not in sh.RULES and op.kind not in sh.KIND_RULES]
    assert missing == []


@pytest.mark.parametrize("name", sorted(sh.RULES))
def test_an_explicit_rule_is_defined_beside_its_op(name):
    rule, op = sh.RULES[name], registry.get(name)
    where = (rule.__module__, getattr(rule, "__name__", ""))
    assert rule.__module__ == op.type_rule.__module__ or where in SHARED, (name, where)


def test_kiln_distributed_uses_the_ir_vocabulary():
    from kiln import distributed
    from kiln.distributed import errors, placements
    from kiln.distributed.sharding import strategy

    assert strategy.RULES is sh.RULES and strategy.KIND_RULES is sh.KIND_RULES
    assert strategy.LOCAL_ATTRS is sh.LOCAL_ATTRS
    assert (distributed.Shard, distributed.Partial, distributed.Replicate) == (
        sh.Shard, sh.Partial, sh.Replicate)
    assert placements.Placement is sh.Placement and errors.PlacementError is sh.PlacementError


def test_placements_are_checked_values():
    assert sh.Shard(1) == sh.Shard(1) and sh.Shard(1) != sh.Shard(0)
    assert sh.Shard(0).is_shard(0) and not sh.Shard(0).is_shard(1)
    assert sh.Partial().reduce_op == "sum" and sh.Partial("max").is_partial()
    assert sh.R.is_replicate() and repr(sh.Partial("avg")) == "Partial('avg')"
    with pytest.raises(sh.PlacementError, match=r"K241.*Partial\('mean'\)"):
        sh.Partial("mean")
    with pytest.raises(sh.PlacementError, match="dim must be an int"):
        sh.Shard(True)


def test_a_rule_reads_its_spec():
    """dot_general's rule, called directly: batch, free and contracted dims of x @ w."""
    f = dt.float32
    spec = sh.OpSpec("dot_general", ((2, 8, 4), (2, 4, 6)), (f, f), ((2, 8, 6),),
                     {"lhs_contracting": (2,), "rhs_contracting": (1,), "lhs_batch": (0,),
                      "rhs_batch": (0,)}, 4)
    found = sh.RULES["dot_general"](spec)
    S, P = sh.Shard, sh.Partial("sum")
    assert sh.Strategy((S(0), S(0)), (S(0),)) in found  # batch
    assert sh.Strategy((S(1), sh.R), (S(1),)) in found  # rows of x
    assert sh.Strategy((sh.R, S(2)), (S(2),)) in found  # columns of w
    assert sh.Strategy((S(2), S(1)), (P,)) in found  # the contraction: a Partial sum
    assert sh.Strategy((P, sh.R), (P,)) in found  # linear in x
    # every strategy gives one placement per operand and per result
    assert all(len(s.inputs) == 2 and len(s.outputs) == 1 for s in found)
