"""Ops that only mean something to autodiff: `stop_gradient`."""

from __future__ import annotations

import numpy as np

from kiln.ir.registry import COMPOSITE, defop


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
