"""Ops that only mean something to autodiff: `stop_gradient`."""

from __future__ import annotations

import numpy as np

from kiln.ir.registry import COMPOSITE, defop
from kiln.ir.sharding import partial_through, shard_dims, sharding_rule


@defop("stop_gradient", family="autodiff", kind=COMPOSITE, num_operands=1, differentiable=False)
class stop_gradient:
    """The operand unchanged; gradients do not flow through it (decomposes away once
    autodiff has run)."""

    def type(op, x):
        return x

    def reference(x):
        return np.array(x, copy=True)

    def decompose(b, x):
        return x


@sharding_rule("stop_gradient")
def _stop_gradient_sharding(spec):
    """The identity: any dim stays sharded; Partial sums and means pass through."""
    found = shard_dims(spec, range(spec.ndim))
    if spec.in_dtypes[0].is_inexact:
        found += [partial_through(spec, "sum"), partial_through(spec, "avg")]
    return found
