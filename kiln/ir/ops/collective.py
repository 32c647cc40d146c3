"""Collectives: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, and
their split forms `<op>_start` + `collective_wait` made by the scheduling pass.

Every collective names its group by a string (`group="world"`, or a sub-group's name
such as "world.s0") and carries the group's size as the static attribute
`world_size`, because the type of all_gather / reduce_scatter / all_to_all depends on
it. The runtime runs these nodes through the live `ProcessGroup` of that name. The
reduction is the attribute `reduce_op` (not `op`: `Emitter.call(op, ...)` and
`dispatch.apply(op, ...)` already take the op name by that keyword).

Reference semantics (the numpy reference, used by eager mode without a process group,
by the interpreter and as the oracle of tests): the result on rank 0 of a world of
`world_size` ranks that all hold this same operand ("replicated"). With
`world_size=1`, a single process, every collective is the identity:

    all_reduce     reduce_op over world_size copies (sum: x*n, avg/min/max: x, prod: x**n)
    all_gather     world_size copies of x concatenated along `axis`
    reduce_scatter chunk 0 (of world_size, along `axis`) of all_reduce(x)
    broadcast      x
    all_to_all     chunk 0 of x along `split_axis`, world_size copies concatenated
                   along `concat_axis`

`<op>_start(x)` has the type and reference of `<op>` (its result is the collective's
value, not yet available: only `collective_wait` may read it, as XLA's
all-reduce-start / all-reduce-done); `collective_wait(h)` is the identity.

Each op's `sharding` rule maps the `Sharding` of its operand to the result's (for
sharding propagation): e.g. all_gather along `a` over group g turns a tensor sharded
on dim a over g into one replicated on dim a.

vjp rules treat the loss as the sum of every rank's loss (torch.distributed and DDP's
convention): all_reduce(sum) -> all_reduce(sum), all_gather <-> reduce_scatter(sum),
broadcast -> the summed cotangent on rank src only, all_to_all -> all_to_all with the
axes swapped. max/min split the cotangent equally over the ranks holding the extreme
(as reduce_max); prod is exact at zeros. Each rule's collectives run over the same group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.linalg import conj
from kiln.ir.ops.reduction import product_of_others
from kiln.ir.ops.rules import LOW_PRECISION, contiguous
from kiln.ir.ops.shape import full_like, zeros
from kiln.ir.registry import COLLECTIVE, OpDef, defop, register
from kiln.ir.shapes import normalize_axis

REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
GROUP_ATTRS = {"group": "world", "world_size": 1}


@dataclass(frozen=True)
class Sharding:
    """How one tensor lies across process groups.

    `dims[i]` names the group dim i is split over (None: every rank holds all of it);
    `partial` is (reduce op, group) while every rank of that group holds a partial
    value whose reduction is the tensor (the state after a local matmul of shards).

        >>> Sharding((None, "world"))          # columns split over the world group
    """

    dims: tuple
    partial: tuple | None = None


# -- attribute checks: every error names the op, the operand type and the rule -----------
def _group(op: str, x, group, world_size) -> int:
    if not isinstance(group, str) or not group:
        raise KilnArgumentError(f"{op} of {x}: attribute group must be a group name such "
                                f"as \"world\", got {group!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise KilnArgumentError(f"{op} of {x}: attribute world_size must be a positive int "
                                f"(the static size of group {group!r}), got {world_size!r}")
    return world_size


def _reduce_op(op: str, x, reduce_op) -> None:
    if reduce_op not in REDUCE_OPS:
        raise KilnArgumentError(f"{op}: op={reduce_op!r} is not a reduce op; use one of "
                                f"{', '.join(REDUCE_OPS)}")
    if reduce_op == "avg" and not x.dtype.is_inexact:
        raise KilnDTypeError(f"{op}: op='avg' needs a floating or complex operand, got {x}; "
                             "use op='sum' and divide, or convert to float32 first")
    if reduce_op in ("min", "max") and x.dtype.is_complex:
        raise KilnDTypeError(f"{op}: op={reduce_op!r} is undefined for {x} (complex numbers "
                             "have no order)")


def _divisible(op: str, x, axis: int, n: int, what: str):
    """Dim `axis` of x divided by n, refused when a static size does not divide."""
    d = x.shape[axis]
    if isinstance(d, int):
        if d % n:
            raise KilnShapeError(f"{op}: {what} dim {axis} of {x} has size {d}, which the "
                                 f"group size {n} does not divide; every rank gets an equal part")
        return d // n
    return sympy.simplify(d / n)


def _axis(op: str, x, axis, name: str = "axis") -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise KilnArgumentError(f"{op}: attribute {name} must be an int, got {axis!r}")
    return normalize_axis(op, axis, x.rank, name)


def _scaled(x, axis: int, factor):
    return x.with_shape(x.shape[:axis] + (x.shape[axis] * factor,) + x.shape[axis + 1:])


# -- numpy: op over n copies, in float32 for low-precision floats (as the runtime) --------
def _combine(x: np.ndarray, reduce_op: str, n: int) -> np.ndarray:
    data = x.astype(np.float32) if x.dtype in LOW_PRECISION else x
    if x.dtype == np.bool_:
        out = data.copy()  # or / and of equal values is the value
    elif reduce_op == "sum":
        out = np.zeros_like(data)
        for _ in range(n):
            out = out + data
    elif reduce_op == "prod":
        out = np.ones_like(data)
        for _ in range(n):
            out = out * data
    else:  # min, max and the mean of equal values
        out = data.copy()
    with np.errstate(all="ignore"):
        return contiguous(np.asarray(out).astype(x.dtype))


def _chunk(x: np.ndarray, axis: int, n: int, k: int) -> np.ndarray:
    size = x.shape[axis] // n
    return np.take(x, np.arange(k * size, (k + 1) * size), axis=axis)




def _rank_at_least_1(op: str, x) -> None:
    if x.rank < 1:
        raise KilnShapeError(f"{op}: operand {x} is a scalar; it needs a dim to split or join "
                             "(reshape it to [1] first)")


# -- sharding rules: each names the op and the layout it cannot map -----------------------
def _sharded_over(op: str, s: Sharding, group: str, what: str) -> None:
    for i, g in enumerate(s.dims):
        if g == group:
            raise KilnArgumentError(f"{op}: dim {i} of the operand is sharded over group "
                                    f"{group!r}; {what}")


def _clear_partial(op: str, s: Sharding, reduce_op: str, group: str) -> tuple | None:
    """The partial state after reducing with reduce_op over group."""
    if s.partial is None or s.partial[1] != group:
        return s.partial  # replicated, or partial over another group: unchanged
    if s.partial[0] != reduce_op:
        raise KilnArgumentError(f"{op}: the operand holds partial {s.partial[0]} values over "
                                f"group {group!r}; reducing them with {reduce_op!r} is wrong")
    return None


def _with_dim(s: Sharding, axis: int, group) -> tuple:
    return s.dims[:axis] + (group,) + s.dims[axis + 1:]


# -- vjp pieces ---------------------------------------------------------------------------
def _reduced_ct(b, total, x, y, reduce_op, group, world_size):
    """The cotangent of this rank's x in y = reduce_op of x over the group, from `total`,
    the sum over ranks of y's cotangents (y: the full reduced value, max/min only)."""
    t, g = b.type_of(x), dict(group=group, world_size=world_size)
    if reduce_op == "sum":
        return total
    if reduce_op == "avg":
        return b.div(total, full_like(b, t, world_size))
    if reduce_op in ("max", "min"):
        hit = b.eq(x, y)
        count = b.all_reduce(b.convert(hit, t.dtype), reduce_op="sum", **g)
        return b.select(hit, b.div(total, count), zeros(b, t))
    # prod: times the product over the other ranks (conjugated for complex)
    others = product_of_others(b, conj(b, x), lambda v, op: b.all_reduce(v, reduce_op=op, **g))
    return b.mul(total, others)


def _rank(b, group, world_size):
    """This rank's index in the group as i64[1]: rank r keeps chunk r of an iota."""
    return b.reduce_scatter(b.iota(dtype=dt.int64, shape=(world_size,)), reduce_op="max",
                            axis=0, group=group, world_size=world_size)


# -- the collectives ------------------------------------------------------------------
@defop("all_reduce", family="collective", kind=COLLECTIVE, num_operands=1,
       attrs={"reduce_op": "sum", **GROUP_ATTRS})
class all_reduce:
    """Reduce x elementwise over the ranks of `group` with `reduce_op`; every rank gets
    the result. Reference: reduce_op over world_size copies of x."""

    def type(op, x, *, reduce_op, group, world_size):
        _group(op, x, group, world_size)
        _reduce_op(op, x, reduce_op)
        return x

    def reference(x, *, reduce_op, group, world_size):
        return _combine(x, reduce_op, world_size)

    def vjp(b, cts, xs, ys, *, reduce_op, group, world_size):
        total = b.all_reduce(cts[0], reduce_op="sum", group=group, world_size=world_size)
        return [_reduced_ct(b, total, xs[0], ys[0], reduce_op, group, world_size)]

    def sharding(op, s, *, reduce_op, group, world_size):
        _sharded_over(op, s, group, "reducing across the group would combine different "
                      "shards; all_gather it first")
        return Sharding(s.dims, _clear_partial(op, s, reduce_op, group))


@defop("all_gather", family="collective", kind=COLLECTIVE, num_operands=1,
       attrs={"axis": 0, **GROUP_ATTRS})
class all_gather:
    """Every rank's x, in rank order, concatenated along `axis` (dim `axis` grows by
    world_size). Reference: world_size copies of x."""

    def type(op, x, *, axis, group, world_size):
        n = _group(op, x, group, world_size)
        _rank_at_least_1(op, x)
        return _scaled(x, _axis(op, x, axis), n)

    def reference(x, *, axis, group, world_size):
        return contiguous(np.concatenate([x] * world_size, axis=axis % x.ndim))

    def vjp(b, cts, xs, ys, *, axis, group, world_size):
        """Rank r's chunk of every rank's cotangent, summed."""
        return [b.reduce_scatter(cts[0], reduce_op="sum", axis=axis, group=group,
                                 world_size=world_size)]

    def sharding(op, s, *, axis, group, world_size):
        a = axis % len(s.dims)
        if s.dims[a] not in (None, group):
            raise KilnArgumentError(f"{op}: dim {a} is sharded over group {s.dims[a]!r}, "
                                    f"not over {group!r}; gather over that group instead")
        return Sharding(_with_dim(s, a, None), s.partial)


@defop("reduce_scatter", family="collective", kind=COLLECTIVE, num_operands=1,
       attrs={"reduce_op": "sum", "axis": 0, **GROUP_ATTRS})
class reduce_scatter:
    """Reduce x over the group with `reduce_op`, then rank r keeps chunk r of world_size
    equal chunks along `axis`. Reference: chunk 0 of all_reduce(x)."""

    def type(op, x, *, reduce_op, axis, group, world_size):
        n = _group(op, x, group, world_size)
        _reduce_op(op, x, reduce_op)
        _rank_at_least_1(op, x)
        a = _axis(op, x, axis)
        part = _divisible(op, x, a, n, "the scattered")
        return x.with_shape(x.shape[:a] + (part,) + x.shape[a + 1:])

    def reference(x, *, reduce_op, axis, group, world_size):
        return contiguous(_chunk(_combine(x, reduce_op, world_size), axis % x.ndim,
                                 world_size, 0))

    def vjp(b, cts, xs, ys, *, reduce_op, axis, group, world_size):
        """all_reduce's rule, with every rank's chunk cotangent gathered into the total."""
        g = dict(group=group, world_size=world_size)
        total = b.all_gather(cts[0], axis=axis, **g)
        y = b.all_gather(ys[0], axis=axis, **g) if reduce_op in ("max", "min") else None
        return [_reduced_ct(b, total, xs[0], y, reduce_op, group, world_size)]

    def sharding(op, s, *, reduce_op, axis, group, world_size):
        a = axis % len(s.dims)
        if s.dims[a] is not None:
            raise KilnArgumentError(f"{op}: dim {a} is already sharded over group "
                                    f"{s.dims[a]!r}; scatter along a whole dim")
        _sharded_over(op, s, group, "reducing across the group would combine different "
                      "shards")
        return Sharding(_with_dim(s, a, group), _clear_partial(op, s, reduce_op, group))


@defop("broadcast", family="collective", kind=COLLECTIVE, num_operands=1,
       attrs={"src": 0, **GROUP_ATTRS})
class broadcast:
    """Rank `src`'s x on every rank of the group. Reference: x."""

    def type(op, x, *, src, group, world_size):
        n = _group(op, x, group, world_size)
        if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < n:
            raise KilnArgumentError(f"{op}: src={src!r} is not a rank of group {group!r} "
                                    f"of {n} ranks (0..{n - 1}); operand {x}")
        return x

    def reference(x, *, src, group, world_size):
        return x.copy()

    def vjp(b, cts, xs, ys, *, src, group, world_size):
        """Every rank's cotangent, summed, on rank src; zero on the others."""
        t, g = b.type_of(xs[0]), dict(group=group, world_size=world_size)
        total = b.all_reduce(cts[0], reduce_op="sum", **g)
        is_src = b.reshape(b.eq(_rank(b, **g), b.full(src, dt.int64, (1,))), shape=())
        if t.rank:
            is_src = b.broadcast_in_dim(is_src, shape=t.shape, broadcast_dimensions=())
        return [b.select(is_src, total, zeros(b, t))]

    def sharding(op, s, *, src, group, world_size):
        _sharded_over(op, s, group, "every rank would get rank src's shard only")
        if s.partial is not None and s.partial[1] == group:
            raise KilnArgumentError(f"{op}: the operand holds partial values over group "
                                    f"{group!r}; all_reduce it instead of broadcasting one")
        return s


@defop("all_to_all", family="collective", kind=COLLECTIVE, num_operands=1,
       attrs={"split_axis": 0, "concat_axis": 0, **GROUP_ATTRS})
class all_to_all:
    """Split x into world_size equal chunks along `split_axis`, send chunk j to rank j,
    and concatenate the chunks received, in rank order, along `concat_axis`.
    Reference: world_size copies of chunk 0."""

    def type(op, x, *, split_axis, concat_axis, group, world_size):
        n = _group(op, x, group, world_size)
        _rank_at_least_1(op, x)
        s = _axis(op, x, split_axis, "split_axis")
        c = _axis(op, x, concat_axis, "concat_axis")
        part = _divisible(op, x, s, n, "the split")
        out = x.with_shape(x.shape[:s] + (part,) + x.shape[s + 1:])
        return _scaled(out, c, n)

    def reference(x, *, split_axis, concat_axis, group, world_size):
        first = _chunk(x, split_axis % x.ndim, world_size, 0)
        return contiguous(np.concatenate([first] * world_size, axis=concat_axis % x.ndim))

    def vjp(b, cts, xs, ys, *, split_axis, concat_axis, group, world_size):
        """Chunk j of the cotangent along concat_axis goes back to rank j, in its place
        along split_axis."""
        return [b.all_to_all(cts[0], split_axis=concat_axis, concat_axis=split_axis,
                             group=group, world_size=world_size)]

    def sharding(op, s, *, split_axis, concat_axis, group, world_size):
        a, c = split_axis % len(s.dims), concat_axis % len(s.dims)
        if a == c:
            return s
        if s.dims[c] != group or s.dims[a] is not None:
            raise KilnArgumentError(
                f"{op}: moves the sharding over {group!r} from dim {c} to dim {a}; the operand "
                f"is sharded {s.dims} (dim {c} must be over {group!r}, dim {a} whole)")
        return Sharding(_with_dim(Sharding(_with_dim(s, c, None)), a, group), s.partial)


# -- the split forms: start (issue, nonblocking) and wait ------------------------------
def _start_form(base: OpDef) -> OpDef:
    """`<base>_start`: base's attributes, type, reference and sharding; the scheduling
    pass makes it, so it is not differentiated (autodiff runs before scheduling)."""
    return register(OpDef(
        name=base.name + "_start", family="collective", kind=COLLECTIVE,
        type_rule=base.type_rule, reference=base.reference, attrs=dict(base.attrs),
        num_operands=1, differentiable=False, sharding=base.sharding,
        doc=f"Issue {base.name} without waiting; its result may be read only by "
            "collective_wait, which yields the value."))


START_OPS = {base.name: _start_form(base).name
             for base in (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all)}


@defop("collective_wait", family="collective", kind=COLLECTIVE, num_operands=1,
       differentiable=False)
class collective_wait:
    """Wait for the collective started by the `<op>_start` that made h; yields its value."""

    def type(op, h):
        return h

    def reference(h):
        return h

    def sharding(op, s):
        return s
