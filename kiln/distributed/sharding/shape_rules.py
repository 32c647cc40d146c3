"""Sharding rules of the shape ops, gather and scatter, and how their attributes change
when they run on a local block.

A dim may stay sharded through a shape op when the op leaves it whole: a transpose
moves it, broadcast_in_dim and concatenate keep it when its size is unchanged, slice,
pad, reverse and dynamic_slice when they do not touch it, reshape when the dim maps to
one result dim whose chunks are the same elements (even chunks only). Gathers keep the
non-indexed dims of the source (and the dims of the indices, for `take`); scatters the
dims that are not scattered along. Partial values pass through the ops that only move
elements (any reduce op), and through scatter-add (sum).

`LOCAL_ATTRS` entries rewrite attributes that name sizes (a reshape's shape, a slice's
limit) for the local block: fn(attrs, in_global, in_local, out_global, out_local).
"""

from __future__ import annotations

from kiln.distributed.placements import PARTIAL_OPS, Partial, Shard
from kiln.distributed.sharding.strategy import (
    R, OpSpec, Strategy, partial_through, rule, shard_dims,
)


def _movers(spec: OpSpec, operands: tuple = (0,)) -> list[Strategy]:
    """Partial(op) through an op that only moves or copies elements."""
    if spec.in_dtypes[0].is_bool:
        return []
    return [partial_through(spec, op, operands) for op in PARTIAL_OPS if op != "prod"]


def _out_shape_attr(attrs, in_global, in_local, out_global, out_local):
    return {**attrs, "shape": tuple(out_local[0])}


@rule("transpose")
def transpose(spec: OpSpec) -> list[Strategy]:
    perm = spec.attrs["permutation"]
    return [Strategy((Shard(perm[j]),), (Shard(j),)) for j in range(len(perm))] + _movers(spec)


@rule("broadcast_in_dim", local_attrs=_out_shape_attr)
def broadcast_in_dim(spec: OpSpec) -> list[Strategy]:
    dims, (x,), (out,) = spec.attrs["broadcast_dimensions"], spec.in_shapes, spec.out_shapes
    found = [Strategy((Shard(i),), (Shard(dims[i]),)) for i in range(len(x))
             if x[i] == out[dims[i]]]
    return found + _movers(spec)


def _prod(shape) -> int:
    size = 1
    for s in shape:
        size *= int(s)
    return size


@rule("reshape", local_attrs=_out_shape_attr)
def reshape(spec: OpSpec) -> list[Strategy]:
    """Shard(d) -> Shard(j) when chunk c of dim d and chunk c of result dim j are the
    same elements: equal sizes before them and of their blocks, both cut evenly."""
    (x,), (out,) = spec.in_shapes, spec.out_shapes
    found = []
    for d in range(len(x)):
        for j in range(len(out)):
            if (_prod(x[:d]) == _prod(out[:j]) and _prod(x[d:]) == _prod(out[j:])
                    and spec.even(x[d]) and spec.even(out[j]) and x[d] > 0 and out[j] > 0):
                found.append(Strategy((Shard(d),), (Shard(j),)))
                break
    return found + _movers(spec)


def _untouched_slice(spec: OpSpec) -> list[int]:
    (x,) = spec.in_shapes[:1]
    a = spec.attrs
    stride = a.get("stride") or (1,) * len(x)
    return [d for d in range(len(x)) if a["start"][d] == 0 and a["limit"][d] == x[d]
            and stride[d] == 1]


def _slice_attrs(attrs, in_global, in_local, out_global, out_local):
    limit = tuple(in_local[0][d] if attrs["limit"][d] == in_global[0][d] and attrs["start"][d] == 0
                  else attrs["limit"][d] for d in range(len(in_global[0])))
    return {**attrs, "limit": limit}


@rule("slice", local_attrs=_slice_attrs)
def slice_(spec: OpSpec) -> list[Strategy]:
    return shard_dims(spec, _untouched_slice(spec)) + _movers(spec)


@rule("pad")
def pad(spec: OpSpec) -> list[Strategy]:
    a, x = spec.attrs, spec.in_shapes[0]
    interior = a.get("interior") or (0,) * len(x)
    dims = [d for d in range(len(x)) if a["low"][d] == 0 and a["high"][d] == 0
            and interior[d] == 0]
    return shard_dims(spec, dims, operands=(0,))


@rule("reverse")
def reverse(spec: OpSpec) -> list[Strategy]:
    dims = {d % max(spec.ndim, 1) for d in spec.attrs["dims"]}
    return shard_dims(spec, [d for d in range(spec.ndim) if d not in dims]) + _movers(spec)


@rule("concatenate")
def concatenate(spec: OpSpec) -> list[Strategy]:
    axis = spec.attrs["dimension"] % spec.ndim
    found = shard_dims(spec, [d for d in range(spec.ndim) if d != axis])
    return found + _movers(spec, tuple(range(len(spec.in_shapes))))


def _dyn_slice_attrs(attrs, in_global, in_local, out_global, out_local):
    return {**attrs, "sizes": tuple(out_local[0])}


@rule("dynamic_slice", local_attrs=_dyn_slice_attrs)
def dynamic_slice(spec: OpSpec) -> list[Strategy]:
    x, sizes = spec.in_shapes[0], spec.attrs["sizes"]
    found = shard_dims(spec, [d for d in range(len(x)) if sizes[d] == x[d]], operands=(0,))
    return found + _movers(spec)


@rule("dynamic_update_slice")
def dynamic_update_slice(spec: OpSpec) -> list[Strategy]:
    x, upd = spec.in_shapes[0], spec.in_shapes[1]
    found = shard_dims(spec, [d for d in range(len(x)) if upd[d] == x[d]], operands=(0, 1))
    if spec.in_dtypes[0].is_inexact:
        found.append(partial_through(spec, "sum", (0, 1)))
    return found


@rule("take")
def take(spec: OpSpec) -> list[Strategy]:
    x, idx = spec.in_shapes
    axis = spec.attrs["axis"] % len(x)
    found = [Strategy((Shard(d), R), (Shard(d if d < axis else d + len(idx) - 1),))
             for d in range(len(x)) if d != axis]
    found += [Strategy((R, Shard(j)), (Shard(axis + j),)) for j in range(len(idx))]
    return found + _movers(spec)


@rule("take_along")
def take_along(spec: OpSpec) -> list[Strategy]:
    x, idx = spec.in_shapes
    axis = spec.attrs["axis"] % len(x)
    found = shard_dims(spec, [d for d in range(len(x)) if d != axis and x[d] == idx[d]])
    return found + _movers(spec)


@rule("scatter_along")
def scatter_along(spec: OpSpec) -> list[Strategy]:
    x, idx, upd = spec.in_shapes
    axis = spec.attrs["axis"] % len(x)
    found = shard_dims(spec, [d for d in range(len(x))
                              if d != axis and x[d] == idx[d] == upd[d]])
    if spec.attrs.get("mode", "add") == "add" and spec.in_dtypes[0].is_inexact:
        found.append(Strategy((Partial("sum"), R, Partial("sum")), (Partial("sum"),)))
    return found


__all__ = ["broadcast_in_dim", "reshape", "transpose"]
