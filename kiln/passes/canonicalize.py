"""Canonicalize: algebraic simplification by a table of patterns, keyed by op.

tinygrad's PatternMatcher idea with plain Python functions: `PATTERNS[op]` lists
functions `(builder, node) -> replacement or None`; the first that returns values
wins, and whatever it emits is canonicalized again (see `kiln.passes.rewrite`), so
`transpose(transpose(x))` becomes one transpose and then, if that is the identity, `x`.

Every pattern preserves results bit for bit (IEEE included), which decides the float
cases: `x * 1` and `x / 1` always fold; `x - 0` folds for +0.0 and `x + 0` only for
-0.0, because -0.0 + +0.0 is +0.0 (LLVM folds the same way without `nsz`); `x * 0`
folds only for integers, since NaN * 0 and inf * 0 are NaN. Constants (`full`, `iota`,
`constant`) move to the right operand of commutative ops, so later passes (CSE, the
patterns here) meet one form; float `max`/`min` stay as written, since which of +0.0
and -0.0 they return depends on the order. NaN payloads are not tracked (IEEE leaves
them unspecified); NaN stays NaN. Shapes compare with `dims_equal`, so symbolic shapes
simplify too.

    %1 = transpose(%x) {permutation=(1, 0)}          %0 = neg(%x)
    %2 = transpose(%1) {permutation=(1, 0)}   ==>    return %0
    %3 = neg(%2)
    return %3
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.ir import dtypes as dt
from kiln.ir.emitter import EAGER
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.ops.shape import pad_zeros
from kiln.ir.shapes import dims_equal, shapes_equal
from kiln.passes.rewrite import RewriteBuilder, producer_op, rebuild

Pattern = Callable[[RewriteBuilder, Node], "Value | list[Value] | None"]

LEAVES = frozenset({"full", "iota", "constant"})
COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})


def canonicalize(graph: Graph) -> Graph:
    """`graph` simplified by `PATTERNS` (inside regions too); `graph` itself if no
    pattern matched.

    >>> canonicalize(parse_graph(text))   # x * 1 -> x, reshape(reshape(x)) -> reshape(x), ...
    """
    return rebuild(graph, canonicalize_node)


def canonicalize_node(b: RewriteBuilder, node: Node):
    """The first replacement any pattern of `node.op` gives, or None."""
    for pattern in PATTERNS.get(node.op, ()):
        result = pattern(b, node)
        if result is not None:
            return result
    return None


# -- what a value is -----------------------------------------------------------------------

def splat(value: Value) -> np.ndarray | None:
    """The scalar (as a 0-d array of the value's dtype) a `full` value holds, else None."""
    if producer_op(value) != "full":
        return None
    attrs = value.producer.attrs
    return EAGER.apply("full", [], {"value": attrs["value"], "dtype": attrs["dtype"],
                                    "shape": ()})[0]


def is_leaf(value: Value) -> bool:
    """Whether `value` is a constant: a `full`, `iota` or `constant` node."""
    return producer_op(value) in LEAVES


def _is_zero(value: Value, *, sign: int | None = None) -> bool:
    """A splat of zero; for floats `sign` -1 / +1 asks for -0.0 / +0.0 exactly."""
    s = splat(value)
    if s is None or s != 0:
        return False
    if sign is None or not value.dtype.is_floating:
        return True
    return bool(np.signbit(s.astype(np.float32))) == (sign < 0)


def _is_one(value: Value) -> bool:
    s = splat(value)
    return s is not None and bool(s == 1)


def _full_like(b: RewriteBuilder, source: Value, node: Node) -> Value:
    """A `full` of `node`'s result type holding what the `full` `source` holds."""
    attrs = source.producer.attrs
    out = node.results[0]
    return b.call("full", value=attrs["value"], dtype=attrs["dtype"], shape=tuple(out.shape))


# -- patterns --------------------------------------------------------------------------

def commute_constant(b, node):
    """op(c, x) -> op(x, c) for commutative ops: constants on the right (not float
    max/min, whose result for +0.0 vs -0.0 depends on the operand order)."""
    x, y = node.operands
    if node.op in ("max", "min") and x.dtype.is_floating:
        return None
    if is_leaf(x) and not is_leaf(y):
        return b.call(node.op, y, x)
    return None


def add_zero(b, node):
    """x + 0 -> x (integers; floats only for -0.0, since -0.0 + 0.0 is +0.0)."""
    x, y = node.operands
    return x if _is_zero(y, sign=-1) else None


def sub_zero(b, node):
    """x - 0 -> x (integers; floats only for +0.0)."""
    x, y = node.operands
    return x if _is_zero(y, sign=+1) else None


def mul_one(b, node):
    """x * 1 -> x."""
    x, y = node.operands
    return x if _is_one(y) else None


def mul_zero(b, node):
    """x * 0 -> 0, integers only (NaN * 0 and inf * 0 are NaN)."""
    x, y = node.operands
    if x.dtype.is_integer and _is_zero(y):
        return b.full(0, x.dtype, x.shape)
    return None


def div_one(b, node):
    """x / 1 -> x."""
    x, y = node.operands
    return x if _is_one(y) else None


def pow_one(b, node):
    """x ** 1 -> x, floats: pow(x, 1) is x exactly, NaN and infinities included (the
    gradient of x ** 2 is 2 * x ** 1, otherwise a pow call per element for x itself)."""
    x, y = node.operands
    return x if x.dtype.is_floating and _is_one(y) else None


def idempotent(b, node):
    """max(x, x), min(x, x), and(x, x), or(x, x) -> x."""
    x, y = node.operands
    return x if x is y else None


def neg_neg(b, node):
    """neg(neg(x)) -> x (also for wrapping integers)."""
    (x,) = node.operands
    return x.producer.operands[0] if producer_op(x) == "neg" else None


def convert_same(b, node):
    """convert(x, dtype of x) -> x."""
    (x,) = node.operands
    return x if x.dtype == node.results[0].dtype else None


def convert_convert(b, node):
    """convert(convert(x, m), t) -> convert(x, t) when m holds every value of x exactly."""
    (y,) = node.operands
    if producer_op(y) != "convert":
        return None
    x = y.producer.operands[0]
    if not holds_exactly(x.dtype, y.dtype):
        return None
    return b.convert(x, node.results[0].dtype)


def holds_exactly(src: dt.DType, mid: dt.DType) -> bool:
    """Whether converting `src` to `mid` is exact for every value (so a conversion
    after it sees the original value)."""
    if src == mid or src.is_bool:
        return True  # 0 and 1 are exact in every dtype
    if mid.is_bool or src.is_complex:
        return False
    if mid.is_complex:  # complex64 holds what float32 holds (imaginary part 0)
        return holds_exactly(src, dt.float32)
    if src.is_integer:
        lo, hi = int(dt.iinfo(src).min), int(dt.iinfo(src).max)
        if mid.is_integer:
            info = dt.iinfo(mid)
            return int(info.min) <= lo and hi <= int(info.max)
        if mid.is_floating:  # |n| <= 2**(nmant + 1) is exact in the float
            return max(-lo, hi) <= 2 ** (int(dt.finfo(mid).nmant) + 1)
        return False
    if src.is_floating and mid.is_floating:
        s, m = dt.finfo(src), dt.finfo(mid)
        return (int(m.nmant) >= int(s.nmant) and int(m.maxexp) >= int(s.maxexp)
                and int(m.minexp) - int(m.nmant) <= int(s.minexp) - int(s.nmant))
    return False


def reshape_same(b, node):
    """reshape(x) to x's own shape -> x."""
    (x,) = node.operands
    return x if shapes_equal(x.shape, node.results[0].shape) else None


def reshape_reshape(b, node):
    """reshape(reshape(x)) -> reshape(x)."""
    (y,) = node.operands
    if producer_op(y) != "reshape":
        return None
    return b.reshape(y.producer.operands[0], shape=tuple(node.results[0].shape))


def transpose_identity(b, node):
    """transpose(x, (0, 1, ..., n-1)) -> x."""
    (x,) = node.operands
    perm = tuple(node.attrs["permutation"])
    return x if perm == tuple(range(len(perm))) else None


def transpose_transpose(b, node):
    """transpose(transpose(x, p), q) -> transpose(x, p[q[i]])."""
    (y,) = node.operands
    if producer_op(y) != "transpose":
        return None
    inner = tuple(y.producer.attrs["permutation"])
    outer = tuple(node.attrs["permutation"])
    return b.transpose(y.producer.operands[0], permutation=tuple(inner[i] for i in outer))


def broadcast_same(b, node):
    """broadcast_in_dim(x) to x's own shape -> x."""
    (x,) = node.operands
    return x if shapes_equal(x.shape, node.results[0].shape) else None


def broadcast_broadcast(b, node):
    """broadcast_in_dim(broadcast_in_dim(x, d1), d2) -> broadcast_in_dim(x, d2[d1[i]])."""
    (y,) = node.operands
    if producer_op(y) != "broadcast_in_dim":
        return None
    inner = tuple(y.producer.attrs["broadcast_dimensions"])
    outer = tuple(node.attrs["broadcast_dimensions"])
    return b.broadcast_in_dim(y.producer.operands[0], shape=tuple(node.results[0].shape),
                              broadcast_dimensions=tuple(outer[i] for i in inner))


def full_reshaped(b, node):
    """A broadcast, reshape, transpose, slice or reverse of a `full` -> a `full` of
    the result shape."""
    (x,) = node.operands
    return _full_like(b, x, node) if producer_op(x) == "full" else None


def select_same(b, node):
    """select(p, x, x) -> x."""
    _, on_true, on_false = node.operands
    return on_true if on_true is on_false else None


def select_constant(b, node):
    """select(full(true), x, y) -> x and select(full(false), x, y) -> y."""
    pred, on_true, on_false = node.operands
    s = splat(pred)
    if s is None:
        return None
    return on_true if bool(s) else on_false


def slice_whole(b, node):
    """slice(x) from 0 to the end with stride 1 on every dim -> x."""
    (x,) = node.operands
    stride = node.attrs.get("stride") or (1,) * x.type.rank
    for d, start, limit, step in zip(x.shape, node.attrs["start"], node.attrs["limit"], stride):
        if not (dims_equal(start, 0) and dims_equal(limit, d) and step == 1):
            return None
    return x


def reverse_reverse(b, node):
    """reverse(x, ()) -> x; reverse(reverse(x, a), b) -> reverse(x, a xor b)."""
    (y,) = node.operands
    dims = {int(d) % max(y.type.rank, 1) for d in node.attrs["dims"]}
    if not dims:
        return y
    if producer_op(y) != "reverse":
        return None
    inner = {int(d) % max(y.type.rank, 1) for d in y.producer.attrs["dims"]}
    x = y.producer.operands[0]
    both = tuple(sorted(dims ^ inner))
    return b.reverse(x, dims=both) if both else x



def _ramp_along(value: Value, axis: int) -> bool:
    """Whether `value` holds its own position along `axis` (v[..., i, ...] = i): an
    integer `iota` over that dim, or a 1-D one broadcast along it."""
    op = producer_op(value)
    if op == "broadcast_in_dim":
        inner = value.producer.operands[0]
        return tuple(value.producer.attrs["broadcast_dimensions"]) == (axis,) \
            and inner.type.rank == 1 and _ramp_along(inner, 0)
    if op != "iota" or not value.dtype.is_integer:
        return False
    dim = int(value.producer.attrs.get("dimension") or 0)
    n = value.shape[dim]  # its last value must fit the dtype (a uint8 iota of 300 wraps)
    return dim == axis and isinstance(n, int) and n - 1 <= np.iinfo(value.dtype.np_dtype).max


def _static_within(inner, outer) -> bool:
    return all(isinstance(i, int) and isinstance(o, int) and i <= o for i, o in zip(inner, outer))


def take_ramp(b, node):
    """take(x, iota(n), axis) -> slice(x, 0..n along axis), n static and at most x's dim
    (a position embedding, `wpe(arange(t))`): a copy instead of a gather, whose
    gradient is a pad instead of a scatter. Indices in range, so no K104 is lost."""
    x, idx = node.operands
    if idx.type.rank != 1 or not _ramp_along(idx, 0):
        return None
    axis = int(node.attrs["axis"]) % x.type.rank
    if not _static_within((idx.shape[0],), (x.shape[axis],)):
        return None
    limit = tuple(idx.shape[0] if d == axis else n for d, n in enumerate(x.shape))
    return b.slice(x, start=(0,) * x.type.rank, limit=limit)


def scatter_ramp(b, node):
    """scatter_along(zeros, ramp along axis, u, mode="add") -> zeros + u (its first
    indices.shape entries, padded with zeros to x's shape): each position gets at most
    one update, at its own place (take_ramp's gradient when autodiff ran first). x must
    be +0.0 (or an integer/complex zero): +0.0 + u is what the scatter writes, -0.0
    updates included, and the positions no update reaches hold +0.0 either way."""
    x, idx, u = node.operands
    axis = int(node.attrs["axis"]) % x.type.rank
    if node.attrs.get("mode", "add") != "add" or x.dtype.is_bool or \
            not _is_zero(x, sign=1) or not _ramp_along(idx, axis):
        return None
    if not (_static_within(idx.shape, x.shape) and _static_within(idx.shape, u.shape)):
        return None
    part = u if tuple(u.shape) == tuple(idx.shape) else \
        b.slice(u, start=(0,) * u.type.rank, limit=tuple(idx.shape))
    if tuple(idx.shape) != tuple(x.shape):
        part = pad_zeros(b, part, [0] * x.type.rank, [o - i for i, o in zip(idx.shape, x.shape)])
    return b.add(x, part)


PATTERNS: dict[str, tuple[Pattern, ...]] = {
    "add": (commute_constant, add_zero),
    "sub": (sub_zero,),
    "mul": (commute_constant, mul_one, mul_zero),
    "div": (div_one,),
    "pow": (pow_one,),
    "max": (commute_constant, idempotent),
    "min": (commute_constant, idempotent),
    "and": (commute_constant, idempotent),
    "or": (commute_constant, idempotent),
    "xor": (commute_constant,),
    "eq": (commute_constant,),
    "ne": (commute_constant,),
    "neg": (neg_neg,),
    "convert": (convert_same, convert_convert),
    "reshape": (reshape_same, full_reshaped, reshape_reshape),
    "transpose": (transpose_identity, full_reshaped, transpose_transpose),
    "broadcast_in_dim": (broadcast_same, full_reshaped, broadcast_broadcast),
    "select": (select_same, select_constant),
    "slice": (slice_whole, full_reshaped),
    "reverse": (reverse_reverse, full_reshaped),
    "take": (take_ramp,),
    "scatter_along": (scatter_ramp,),
}
