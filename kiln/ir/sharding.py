"""Sharding rules' vocabulary: placements, the strategy record, and the table of rules
that every op fills beside its definition (STYLE.md §1; JAX keeps one table per
interpreter, keyed by primitive).

A placement says how a tensor lies along one dim of a device mesh (PyTorch DTensor's):

    Shard(dim)      cut along `dim` into mesh-dim-size chunks, as `torch.chunk` cuts it
    Replicate()     every rank holds the whole tensor
    Partial(op)     every rank holds a value of the tensor's shape; the tensor is their
                    reduction with `op` ("sum", "avg", "max", "min", "prod")

A sharding rule looks at an op's operands on ONE mesh dim of size n (an `OpSpec`) and
lists what it can run, as `Strategy`s:

    Strategy(inputs=(Shard(0), Replicate()), outputs=(Shard(0),))   # rows of x @ w

Running the op on the local blocks is correct for each strategy it lists. An op's rule
is registered beside the op with `@sharding_rule("name")`; a kind's default (every
elementwise op shares one) with `@kind_rule(KIND)`. Ranking strategies by the bytes
they move, and running ops on sharded tensors, is kiln.distributed's
(`kiln.distributed.sharding`), which re-exports this vocabulary; kiln/ir imports
nothing of it.

    >>> Strategy((Shard(1), Shard(0)), (Partial("sum"),))   # x @ w, contraction cut
    [Shard(1), Shard(0)] -> [Partial('sum')]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kiln.errors import KilnError
from kiln.ir.registry import COLLECTIVE, CONTROL

PARTIAL_OPS = ("sum", "avg", "max", "min", "prod")


class PlacementError(KilnError, ValueError):
    """A placement does not fit its tensor or mesh: a Shard dim outside the tensor, an
    unknown Partial op, a placement count that is not the mesh's ndim, or operands of one
    op on different meshes."""

    code = "K241"
    title = "invalid placement"


# -- placements ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Base class of Shard, Replicate and Partial."""

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@dataclass(frozen=True)
class Shard(Placement):
    """The tensor is cut along `dim` (torch.chunk's sizes) over the mesh dim."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise PlacementError("Shard(dim): dim must be an int, got %r" % (self.dim,))

    def __repr__(self) -> str:
        return "Shard(%d)" % self.dim


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds a partial value; the tensor is their reduction by `reduce_op`."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in PARTIAL_OPS:
            raise PlacementError("Partial(%r): the reduce op must be one of %s"
                                 % (self.reduce_op, ", ".join(PARTIAL_OPS)))

    def __repr__(self) -> str:
        return "Partial(%r)" % self.reduce_op


R = Replicate()


# -- what a rule sees and what it gives ---------------------------------------------------

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
        """Every rank's chunk of a dim of `size` has the same size."""
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


# -- the tables ---------------------------------------------------------------------------

RULES: dict[str, Callable[[OpSpec], list]] = {}
KIND_RULES: dict[str, Callable[[OpSpec], list]] = {}
# attrs of the local op from the global ones: fn(attrs, in_global, in_local, out_global,
# out_local), for attributes that name sizes (a reshape's shape, a slice's limit)
LOCAL_ATTRS: dict[str, Callable] = {}


def sharding_rule(*names: str, local_attrs: Callable | None = None):
    """Register the decorated function as the sharding rule of ops `names`.

        @sharding_rule("transpose")
        def _transpose_sharding(spec): ...
    """

    def wrap(fn):
        for name in names:
            if name in RULES:
                raise ValueError("sharding rule for %s defined twice" % name)
            RULES[name] = fn
            if local_attrs is not None:
                LOCAL_ATTRS[name] = local_attrs
        return fn

    return wrap


def kind_rule(kind: str):
    """Register the decorated function as the sharding rule of every op of `kind` that
    has no rule of its own."""

    def wrap(fn):
        if kind in KIND_RULES:
            raise ValueError("sharding rule for kind %s defined twice" % kind)
        KIND_RULES[kind] = fn
        return fn

    return wrap


# -- pieces rules share -------------------------------------------------------------------

def replicate_all(spec: OpSpec) -> Strategy:
    """Every operand and result whole on every rank (always valid)."""
    return Strategy(tuple(R for _ in spec.in_shapes), tuple(R for _ in spec.out_shapes))


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


def moved_partials(spec: OpSpec, operands: tuple = (0,)) -> list[Strategy]:
    """Partial(op) through an op that only moves or copies elements (any op but prod,
    which a copy would raise to a power)."""
    if spec.in_dtypes[0].is_bool:
        return []
    return [partial_through(spec, op, operands) for op in PARTIAL_OPS if op != "prod"]


def result_shape_attr(attrs, in_global, in_local, out_global, out_local) -> dict:
    """LOCAL_ATTRS entry of an op whose `shape` attribute is its result's shape."""
    return {**attrs, "shape": tuple(out_local[0])}


def reduced_axes(spec: OpSpec, key: str = "axes") -> tuple[int, ...]:
    """The dims attribute `key` names (None: all), made non-negative."""
    axes = spec.attrs.get(key)
    nd = spec.ndim
    if axes is None:
        return tuple(range(nd))
    if isinstance(axes, int):
        axes = (axes,)
    return tuple(a % nd for a in axes) if nd else ()


def kept_dim(axes: tuple, keepdims: bool = False) -> Callable[[int], int | None]:
    """Where input dim d lands in a reduction's result over `axes` (None: reduced)."""

    def out(d):
        if d in axes:
            return None
        return d if keepdims else d - sum(1 for a in axes if a < d)

    return out


def all_but(spec: OpSpec, *dims: int) -> list[Strategy]:
    """Shard any dim but `dims` (an op that needs those whole), on every operand alike."""
    return shard_dims(spec, [d for d in range(spec.ndim) if d not in dims])


def run_whole(spec: OpSpec) -> list[Strategy]:
    """No strategy but all-Replicate: the op runs on whole values (creation ops, and
    control flow and collectives, whose bodies and groups the rule cannot see into)."""
    return []


KIND_RULES[CONTROL] = run_whole
KIND_RULES[COLLECTIVE] = run_whole


__all__ = ["KIND_RULES", "LOCAL_ATTRS", "OpSpec", "PARTIAL_OPS", "Partial", "Placement",
           "PlacementError", "R", "RULES", "Replicate", "Shard", "Strategy", "all_but",
           "kept_dim", "kind_rule", "moved_partials", "partial_through", "reduced_axes",
           "replicate_all", "result_shape_attr", "run_whole", "same_on_all", "shard_dims",
           "sharding_rule"]
