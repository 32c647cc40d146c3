"""How much arithmetic a Kernel IR kernel does: the FLOP count the profiler reports.

A loop-nest kernel counts, per point of its outer loops, each stage's arithmetic ops
(distinct nodes of its expression DAG, casts and selects excluded: they move data) times
the stage's inner trip count, plus one combine per reduced element. A GEMM template is
2·batch·m·n·k plus its epilogue per output element. Sizes may be symbolic: the result is
a function of the run's size binding.

    >>> flops_function(kernel)({"B": 8})
    24576
"""

from __future__ import annotations

from typing import Callable

import sympy

from kiln.codegen.kernel_ir import BatchKernel, GemmKernel, Kernel, Op, Reduce, walk
from kiln.ir.shapes import dim_function

# scalar ops that move or reinterpret data rather than compute
_FREE = frozenset({"convert", "bitcast", "select"})


def expression_flops(expr) -> int:
    """Arithmetic ops in one scalar expression (shared sub-expressions counted once)."""
    return sum(1 for node in walk(expr) if isinstance(node, Op) and node.op not in _FREE)


def flops_expr(kernel) -> sympy.Expr:
    """The kernel's FLOP count as a sympy expression over its size variables."""
    if isinstance(kernel, BatchKernel):  # one launch of several kernels: their sum
        return sympy.expand(sum((flops_expr(m) for m in kernel.members), sympy.Integer(0)))
    if isinstance(kernel, GemmKernel):
        outputs = sympy.sympify(kernel.batch) * kernel.m * kernel.n
        return 2 * outputs * kernel.k + outputs * expression_flops(kernel.epilogue)
    if not isinstance(kernel, Kernel):
        return sympy.Integer(0)
    per_point = sympy.Integer(0)
    for stage in kernel.stages:
        trips = sympy.Integer(1)
        for loop in stage.loops:
            trips *= sympy.sympify(loop.extent)
        work = expression_flops(stage.value) + (1 if isinstance(stage, Reduce) else 0)
        per_point += trips * work
    points = sympy.Integer(1)
    for loop in kernel.outer:
        points *= sympy.sympify(loop.extent)
    return sympy.expand(points * per_point)


def flops_function(kernel) -> Callable[[dict], int]:
    """A fast closure from a size binding to the kernel's FLOP count."""
    return dim_function(flops_expr(kernel))
