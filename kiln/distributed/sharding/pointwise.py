"""Sharding rules decided by the op's kind: elementwise ops, pointwise composites,
reductions and scans, and ops that run whole (control flow, collectives, creation).

Elementwise (the IR is explicit: operands share one shape): every operand Shard(d) ->
Shard(d), for every d. A Partial value passes through where the math allows it:

    linear in all operands (add, sub, neg, real, imag, complex, select's branches,
    stop_gradient):                 Partial(sum|avg) -> Partial(sum|avg)
    linear in one operand (mul, div's numerator): that one Partial, the others Replicate
    max / min of Partial(max|min) values (neg swaps them)
    non-decreasing in one operand (exp, log, tanh, relu, floor, convert, clamp's x ...):
                                    Partial(max|min) -> Partial(max|min)

Reductions over `axes`: Shard(d) of a kept dim -> Shard of its position in the result;
Shard(d) of a reduced dim -> Partial(sum|prod|max|min) (max/min only when every rank's
chunk is non-empty; mean's Partial(avg) only for even chunks). Ops that need the whole
of a dim (softmax's dim, scans, sort, argmax, var, logsumexp) shard the other dims.
"""

from __future__ import annotations

from kiln.distributed.placements import Partial, Shard
from kiln.distributed.sharding.strategy import (
    KIND_RULES, OpSpec, Strategy, partial_through, rule, shard_dims,
)
from kiln.ir.registry import COLLECTIVE, CONTROL, ELEMENTWISE

LINEAR_ALL = {"add", "sub", "neg", "real", "imag", "complex", "stop_gradient"}
NONDECREASING = {"exp", "expm1", "log", "log1p", "sqrt", "tanh", "erf", "atan", "sinh",
                 "asin", "floor", "ceil", "round", "trunc", "sign", "relu", "sigmoid",
                 "softplus", "convert", "clamp"}


def elementwise(spec: OpSpec) -> list[Strategy]:
    """Same-shape operands: shard any dim alike; Partial where the op allows it."""
    found = shard_dims(spec, range(spec.ndim))
    op = spec.op
    floats = all(d.is_inexact for d in spec.in_dtypes)
    if op in LINEAR_ALL and floats:
        found += [partial_through(spec, "sum"), partial_through(spec, "avg")]
    if op == "mul" and floats:
        found += [partial_through(spec, "sum", (0,)), partial_through(spec, "sum", (1,))]
    if op == "div" and floats:
        found.append(partial_through(spec, "sum", (0,)))
    if op == "select" and spec.in_dtypes[1].is_inexact:
        found.append(partial_through(spec, "sum", (1, 2)))
    if op in ("max", "min") and not spec.in_dtypes[0].is_complex:
        found.append(partial_through(spec, op))
    real = not any(d.is_complex or d.is_bool for d in spec.in_dtypes)
    to_bool = op == "convert" and getattr(spec.attrs.get("dtype"), "is_bool", False)
    if op in NONDECREASING and real and not to_bool:
        for red in ("max", "min"):
            found.append(partial_through(spec, red, (0,)))
    if op == "neg" and real:
        found += [Strategy((Partial("max"),), (Partial("min"),)),
                  Strategy((Partial("min"),), (Partial("max"),))]
    return found


def run_whole(spec: OpSpec) -> list[Strategy]:
    """Control flow, collectives and creation run on whole (replicated) values only."""
    return []


KIND_RULES[ELEMENTWISE] = elementwise
KIND_RULES[CONTROL] = run_whole
KIND_RULES[COLLECTIVE] = run_whole

rule("gelu", "relu", "sigmoid", "silu", "softplus", "floor_divide", "remainder",
     "stop_gradient")(elementwise)
rule("constant", "full", "iota", "random_bits", "normal", "uniform")(run_whole)


# -- reductions -------------------------------------------------------------------------
def _axes(spec: OpSpec, key: str = "axes") -> tuple[int, ...]:
    axes = spec.attrs.get(key)
    nd = spec.ndim
    if axes is None:
        return tuple(range(nd))
    if isinstance(axes, int):
        axes = (axes,)
    return tuple(a % nd for a in axes) if nd else ()


def _kept(spec: OpSpec, axes: tuple, keepdims: bool = False):
    """Result position of input dim d (None for a reduced dim)."""
    def out(d):
        if d in axes:
            return None
        return d if keepdims else d - sum(1 for a in axes if a < d)
    return out


_PARTIAL_OF = {"reduce_sum": "sum", "reduce_prod": "prod", "reduce_max": "max",
               "reduce_min": "min"}


@rule("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "reduce_and", "reduce_or")
def reduction(spec: OpSpec) -> list[Strategy]:
    axes = _axes(spec)
    found = shard_dims(spec, range(spec.ndim), _kept(spec, axes))
    red = _PARTIAL_OF.get(spec.op)
    if red is not None and not spec.in_dtypes[0].is_bool:
        for d in axes:
            size = spec.in_shapes[0][d]
            if red in ("max", "min") and not spec.full_chunks(size):
                continue  # an empty chunk has no max
            found.append(Strategy((Shard(d),), (Partial(red),)))
        if red != "prod":
            found.append(partial_through(spec, red))
    return found


@rule("mean")
def mean(spec: OpSpec) -> list[Strategy]:
    axes = _axes(spec)
    found = shard_dims(spec, range(spec.ndim), _kept(spec, axes))
    if spec.in_dtypes[0].is_inexact:
        for d in axes:
            if spec.even(spec.in_shapes[0][d]):
                found.append(Strategy((Shard(d),), (Partial("avg"),)))
        found += [partial_through(spec, "sum"), partial_through(spec, "avg")]
    return found


@rule("var", "logsumexp")
def whole_axes(spec: OpSpec) -> list[Strategy]:
    axes = _axes(spec)
    return shard_dims(spec, range(spec.ndim), _kept(spec, axes))


@rule("argmax", "argmin")
def arg_reduction(spec: OpSpec) -> list[Strategy]:
    axes = _axes(spec, "axis")
    return shard_dims(spec, range(spec.ndim), _kept(spec, axes))


@rule("cumsum", "cumprod", "cummax", "cummin", "sort")
def scan(spec: OpSpec) -> list[Strategy]:
    (axis,) = _axes(spec, "axis")
    found = shard_dims(spec, [d for d in range(spec.ndim) if d != axis])
    if spec.op == "cumsum" and spec.in_dtypes[0].is_inexact:
        found.append(partial_through(spec, "sum"))
    return found


@rule("softmax", "log_softmax")
def softmax(spec: OpSpec) -> list[Strategy]:
    (axis,) = _axes(spec, "dim")
    return shard_dims(spec, [d for d in range(spec.ndim) if d != axis])


@rule("check_index")
def check_index(spec: OpSpec) -> list[Strategy]:
    return shard_dims(spec, range(spec.ndim))


__all__ = ["elementwise", "reduction", "run_whole"]
