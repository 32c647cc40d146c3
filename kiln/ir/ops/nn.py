"""Neural-network composites: activations, statistics (mean, var, logsumexp, softmax)
and Python-style division. The norms and attention live in layers.py, random sampling
in sampling.py, matmul and conv2d beside their primitives in linalg.py.

Each op carries a type rule, a numpy reference and a decomposition into primitives
(a backend may still match the whole op into a template: flash attention, GEMM +
epilogue). Low-precision floats compute in float32 and round once at the end, in the
reference and the decomposition alike.

Autodiff differentiates a composite through its decomposition unless it has a vjp
rule: the activations, softmax and logsumexp have one, shorter than the
decomposition's derivative and finite where it is not (softmax rows with -inf entries).
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.elementwise import elementwise_sharding, erf
from kiln.ir.ops.linalg import upcast
from kiln.ir.ops.rules import FLOATING, check_axes, check_dtype, check_same, normalize_axis, via_f32
from kiln.ir.registry import COMPOSITE, defop
from kiln.ir.shapes import numel
from kiln.ir.sharding import (
    Partial, Shard, Strategy, all_but, kept_dim, partial_through, reduced_axes, shard_dims,
    sharding_rule,
)

NUMBER = (int, float)  # the Python numbers a float attribute may be


# -- shared pieces of rules and decompositions -------------------------------------------

def _float_type(op, x, **_):
    check_dtype(op, x, FLOATING)
    return x


def _axes(op, x, axes):
    return tuple(range(x.rank)) if axes is None else check_axes(op, axes, x.rank)


def _np_axes(x, axes):
    return tuple(range(x.ndim)) if axes is None else tuple(a % max(x.ndim, 1) for a in axes)


def _reduced(op, x, *, axes, **_):
    """The type of a floating reduction over `axes` (dropped)."""
    check_dtype(op, x, FLOATING)
    axes = _axes(op, x, axes)
    return x.with_shape(tuple(d for i, d in enumerate(x.shape) if i not in axes))


def expand_reduced(b, r, shape, axes):
    """A reduced value broadcast back over the reduced axes."""
    if not axes:  # nothing was reduced (also keeps rank-0 values away from broadcast_in_dim)
        return r
    kept = tuple(i for i in range(len(shape)) if i not in axes)
    return b.broadcast_in_dim(r, shape=tuple(shape), broadcast_dimensions=kept)


def _count(b, shape, axes, dtype):
    """How many elements the axes hold: a Python float when static, else a scalar
    tensor (a sum of int64 ones, which folds once the symbols are bound)."""
    dims = [shape[a] for a in axes]
    n = numel(dims)
    if isinstance(n, int):
        return float(n)
    return b.convert(b.reduce_sum(b.full(1, dt.int64, dims), axes=tuple(range(len(dims)))), dtype)


def mean_over(b, x, axes):
    """The mean of x over `axes` (dropped)."""
    t = b.type_of(x)
    return b.binary("div", b.reduce_sum(x, axes=axes), _count(b, t.shape, axes, t.dtype))


def _softmax_parts(b, x, axis):
    """(shifted, exp(shifted), sum) along one axis (no axis for a scalar)."""
    shape, axes = b.type_of(x).shape, ((axis,) if b.type_of(x).rank else ())
    shifted = b.sub(x, expand_reduced(b, b.reduce_max(x, axes=axes), shape, axes))
    e = b.exp(shifted)
    return shifted, e, expand_reduced(b, b.reduce_sum(e, axes=axes), shape, axes)


def _sigmoid(b, x):
    return b.binary("div", 1.0, b.binary("add", b.exp(b.neg(x)), 1.0))


def sum_over(b, x, axes):
    """The sum of x over `axes` (dropped); x itself when there are none."""
    return b.reduce_sum(x, axes=axes) if axes else x


def _dim_axes(op, t, dim):
    """The axis of a softmax along `dim`, as a tuple (none for a scalar)."""
    return (normalize_axis(op, dim, t.rank),) if t.rank else ()


def _activation_vjp(grad):
    """A vjp rule for an activation from `grad(b, x) -> dy/dx` (computed in float32 for
    low-precision floats, rounded back once)."""

    def vjp(b, cts, xs, ys, **attrs):
        (x, d), (ct, _) = upcast(b, xs[0]), upcast(b, cts[0])
        return [b.convert(b.mul(ct, grad(b, x, **attrs)), d)]

    return vjp


# -- activations ---------------------------------------------------------------------------

@defop("sigmoid", family="nn", kind=COMPOSITE, num_operands=1)
class sigmoid:
    """1 / (1 + exp(-x)), elementwise."""

    type = _float_type
    reference = via_f32(lambda x: 1.0 / (np.exp(-x) + 1.0))

    def decompose(b, x):
        x, d = upcast(b, x)
        return b.convert(_sigmoid(b, x), d)

    def vjp(b, cts, xs, ys):
        (y, d), (ct, _) = upcast(b, ys[0]), upcast(b, cts[0])
        return [b.convert(b.mul(ct, b.mul(y, b.binary("sub", 1.0, y))), d)]


_f32_relu = via_f32(lambda x: np.maximum(x, 0))


@defop("relu", family="nn", kind=COMPOSITE, num_operands=1)
class relu:
    """max(x, 0), elementwise (NaN stays NaN); real numeric dtypes. The gradient at 0 is
    0, as PyTorch."""

    def type(op, x):
        if x.dtype.is_bool or x.dtype.is_complex:
            raise KilnDTypeError(f"relu: operand of type {x} is not supported; relu needs an "
                                 "integer or floating dtype")
        return x

    def reference(x):
        return np.maximum(x, 0).astype(x.dtype) if x.dtype.kind in "iu" else _f32_relu(x)

    reference.float_fn = _f32_relu.float_fn  # what float32/64 run (rules.float_fn)

    def decompose(b, x):
        return b.binary("max", x, 0)

    def vjp(b, cts, xs, ys):
        zero = b.full(0, b.type_of(cts[0]).dtype, b.type_of(cts[0]).shape)
        return [b.select(b.binary("gt", xs[0], 0), cts[0], zero)]


_GELU_TANH = math.sqrt(2.0 / math.pi)


def _gelu_reference(x, *, approximate):
    if approximate == "tanh":
        return (x * 0.5) * (np.tanh((x + x * x * x * 0.044715) * _GELU_TANH) + 1.0)
    return (x * 0.5) * (erf.reference(x * math.sqrt(0.5)) + 1.0)


@defop("gelu", family="nn", kind=COMPOSITE, num_operands=1, attrs={"approximate": "none"})
class gelu:
    """x * Phi(x) with the erf form ("none") or torch's tanh approximation ("tanh")."""

    def type(op, x, *, approximate):
        if approximate not in ("none", "tanh"):
            raise KilnArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return _float_type(op, x)

    reference = via_f32(_gelu_reference)

    def decompose(b, x, *, approximate):
        x, d = upcast(b, x)
        half = b.binary("mul", x, 0.5)
        if approximate == "tanh":
            cube = b.binary("mul", b.mul(b.mul(x, x), x), 0.044715)
            inner = b.tanh(b.binary("mul", b.add(x, cube), _GELU_TANH))
        else:
            inner = b.erf(b.binary("mul", x, math.sqrt(0.5)))
        return b.convert(b.mul(half, b.binary("add", inner, 1.0)), d)

    def _grad(b, x, *, approximate):
        if approximate == "tanh":  # d/dx x (1 + t) / 2, t = tanh(c (x + k x^3))
            x2 = b.mul(x, x)
            t = b.tanh(b.binary("mul", b.add(x, b.binary("mul", b.mul(x2, x), 0.044715)),
                                _GELU_TANH))
            du = b.binary("mul", b.binary("add", b.binary("mul", x2, 3 * 0.044715), 1.0),
                          _GELU_TANH)
            dt_dx = b.mul(b.binary("sub", 1.0, b.mul(t, t)), du)
            return b.binary("mul", b.add(b.binary("add", t, 1.0), b.mul(x, dt_dx)), 0.5)
        # Phi(x) + x phi(x)
        cdf = b.binary("mul", b.binary("add", b.erf(b.binary("mul", x, math.sqrt(0.5))), 1.0), 0.5)
        pdf = b.binary("mul", b.exp(b.binary("mul", b.mul(x, x), -0.5)), 1 / math.sqrt(2 * math.pi))
        return b.add(cdf, b.mul(x, pdf))

    vjp = _activation_vjp(_grad)


@defop("silu", family="nn", kind=COMPOSITE, num_operands=1)
class silu:
    """x * sigmoid(x), elementwise (swish)."""

    type = _float_type
    reference = via_f32(lambda x: x * (1.0 / (np.exp(-x) + 1.0)))

    def decompose(b, x):
        x, d = upcast(b, x)
        return b.convert(b.mul(x, _sigmoid(b, x)), d)

    def _grad(b, x):  # s (1 + x (1 - s))
        s = _sigmoid(b, x)
        return b.mul(s, b.binary("add", b.mul(x, b.binary("sub", 1.0, s)), 1.0))

    vjp = _activation_vjp(_grad)


@defop("softplus", family="nn", kind=COMPOSITE, num_operands=1,
       attrs={"beta": 1.0, "threshold": 20.0})
class softplus:
    """log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold (torch)."""

    def type(op, x, *, beta, threshold):
        if not isinstance(beta, NUMBER) or not isinstance(threshold, NUMBER) or beta == 0:
            raise KilnArgumentError(f"softplus: beta (non-zero) and threshold must be numbers, "
                                    f"got {beta!r}, {threshold!r}")
        return _float_type(op, x)

    reference = via_f32(lambda x, *, beta, threshold: np.where(
        x * beta > threshold, x, np.log1p(np.exp(x * beta)) / beta))

    def decompose(b, x, *, beta, threshold):
        x, d = upcast(b, x)
        bx = b.binary("mul", x, float(beta))
        soft = b.binary("div", b.log1p(b.exp(bx)), float(beta))
        return b.convert(b.select(b.binary("gt", bx, float(threshold)), x, soft), d)

    def _grad(b, x, *, beta, threshold):  # sigmoid(beta x), and 1 where x is passed through
        bx = b.binary("mul", x, float(beta))
        one = b.full(1.0, b.type_of(x).dtype, b.type_of(x).shape)
        return b.select(b.binary("gt", bx, float(threshold)), one, _sigmoid(b, bx))

    vjp = _activation_vjp(_grad)


# pointwise: the elementwise ops' rule (relu, sigmoid and softplus are non-decreasing)
sharding_rule("sigmoid", "relu", "gelu", "silu", "softplus")(elementwise_sharding)


# -- statistics ------------------------------------------------------------------------------

@defop("mean", family="nn", kind=COMPOSITE, num_operands=1, attrs={"axes": None})
class mean:
    """Arithmetic mean over `axes` (None: all), which are dropped."""

    type = _reduced
    reference = via_f32(lambda x, *, axes: np.mean(x, axis=_np_axes(x, axes)))

    def decompose(b, x, *, axes):
        x, d = upcast(b, x)
        return b.convert(mean_over(b, x, _axes("mean", b.type_of(x), axes)), d)


@sharding_rule("mean")
def _mean_sharding(spec):
    """Kept dims stay sharded; an evenly cut reduced dim gives Partial(avg); the mean is
    linear (Partial sum and avg pass through)."""
    axes = reduced_axes(spec)
    found = shard_dims(spec, range(spec.ndim), kept_dim(axes))
    if spec.in_dtypes[0].is_inexact:
        found += [Strategy((Shard(d),), (Partial("avg"),)) for d in axes
                  if spec.even(spec.in_shapes[0][d])]
        found += [partial_through(spec, "sum"), partial_through(spec, "avg")]
    return found


def _var_reference(x, *, axes, correction):
    axes = _np_axes(x, axes)
    n = math.prod(x.shape[a] for a in axes)
    dev = x - np.mean(x, axis=axes, keepdims=True)
    return np.sum(dev * dev, axis=axes) / max(n - correction, 0)


@defop("var", family="nn", kind=COMPOSITE, num_operands=1, attrs={"axes": None, "correction": 1})
class var:
    """Variance over `axes` (None: all): sum of squared deviations / max(N - correction, 0)."""

    def type(op, x, *, axes, correction):
        if not isinstance(correction, NUMBER) or isinstance(correction, bool):
            raise KilnArgumentError(f"var: correction must be a number, got {correction!r}")
        return _reduced(op, x, axes=axes)

    reference = via_f32(_var_reference)

    def decompose(b, x, *, axes, correction):
        x, d = upcast(b, x)
        t = b.type_of(x)
        axes = _axes("var", t, axes)
        dev = b.sub(x, expand_reduced(b, mean_over(b, x, axes), t.shape, axes))
        total = b.reduce_sum(b.mul(dev, dev), axes=axes)
        n = _count(b, t.shape, axes, t.dtype)
        if isinstance(n, float):
            denom = max(n - correction, 0.0)
        else:
            denom = b.binary("max", b.binary("sub", n, float(correction)), 0.0)
        return b.convert(b.binary("div", total, denom), d)


def _logsumexp_reference(x, *, axes):
    axes = _np_axes(x, axes)
    m = np.max(x, axis=axes, keepdims=True, initial=-np.inf)  # no elements: -inf, as torch
    m = np.where(np.isinf(m), 0, m)  # all -inf (or an inf) row: shift by 0, not by inf
    return np.log(np.sum(np.exp(x - m), axis=axes)) + np.squeeze(m, axis=axes)


@defop("logsumexp", family="nn", kind=COMPOSITE, num_operands=1, attrs={"axes": None})
class logsumexp:
    """log(sum(exp(x))) over `axes`, max-shifted; an all -inf row gives -inf."""

    type = _reduced
    reference = via_f32(_logsumexp_reference)

    def decompose(b, x, *, axes):
        x, d = upcast(b, x)
        t = b.type_of(x)
        axes = _axes("logsumexp", t, axes)
        m = b.reduce_max(x, axes=axes)
        m = b.select(b.isinf(m), b.full(0.0, t.dtype, b.type_of(m).shape), m)
        total = b.reduce_sum(b.exp(b.sub(x, expand_reduced(b, m, t.shape, axes))), axes=axes)
        return b.convert(b.add(b.log(total), m), d)

    def vjp(b, cts, xs, ys, *, axes):
        """ct * softmax(x) over axes: exp(x - y), with y recomputed in float32 for
        low-precision floats (a rounded y is off by |y| 2^-8, and exp magnifies that)."""
        (x, d), (ct, _) = upcast(b, xs[0]), upcast(b, cts[0])
        t = b.type_of(x)
        axes = _axes("logsumexp", t, axes)
        y = ys[0] if x is xs[0] else b.logsumexp(x, axes=axes)
        p = b.exp(b.sub(x, expand_reduced(b, y, t.shape, axes)))
        return [b.convert(b.mul(expand_reduced(b, ct, t.shape, axes), p), d)]


@sharding_rule("var", "logsumexp")
def _whole_axes_sharding(spec):
    """The kept dims stay sharded; the reduced ones must be whole."""
    return shard_dims(spec, range(spec.ndim), kept_dim(reduced_axes(spec)))


def _softmax_reference(x, *, dim, log):
    axis = dim % max(x.ndim, 1) if x.ndim else ()
    shifted = x - np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # an empty dim is fine
    e = np.exp(shifted)
    total = np.sum(e, axis=axis, keepdims=True)
    return shifted - np.log(total) if log else e / total


def _dim_type(op, x, *, dim):
    check_dtype(op, x, FLOATING)
    normalize_axis(op, dim, x.rank, "dim")
    return x


@defop("softmax", family="nn", kind=COMPOSITE, num_operands=1, attrs={"dim": -1})
class softmax:
    """exp(x - max) / sum(exp(x - max)) along `dim` (an all -inf row gives NaN, as torch)."""

    type = _dim_type
    reference = via_f32(lambda x, *, dim: _softmax_reference(x, dim=dim, log=False))

    def decompose(b, x, *, dim):
        x, d = upcast(b, x)
        _, e, total = _softmax_parts(b, x, normalize_axis("softmax", dim, b.type_of(x).rank))
        return b.convert(b.div(e, total), d)

    def vjp(b, cts, xs, ys, *, dim):  # y (ct - sum(ct y))
        (y, d), (ct, _) = upcast(b, ys[0]), upcast(b, cts[0])
        t = b.type_of(y)
        axes = _dim_axes("softmax", t, dim)
        inner = expand_reduced(b, sum_over(b, b.mul(ct, y), axes), t.shape, axes)
        return [b.convert(b.mul(y, b.sub(ct, inner)), d)]


@defop("log_softmax", family="nn", kind=COMPOSITE, num_operands=1, attrs={"dim": -1})
class log_softmax:
    """(x - max) - log(sum(exp(x - max))) along `dim`."""

    type = _dim_type
    reference = via_f32(lambda x, *, dim: _softmax_reference(x, dim=dim, log=True))

    def decompose(b, x, *, dim):
        x, d = upcast(b, x)
        shifted, _, total = _softmax_parts(b, x, normalize_axis("log_softmax", dim, b.type_of(x).rank))
        return b.convert(b.sub(shifted, b.log(total)), d)

    def vjp(b, cts, xs, ys, *, dim):  # ct - exp(y) sum(ct)
        (y, d), (ct, _) = upcast(b, ys[0]), upcast(b, cts[0])
        t = b.type_of(y)
        axes = _dim_axes("log_softmax", t, dim)
        total = expand_reduced(b, sum_over(b, ct, axes), t.shape, axes)
        return [b.convert(b.sub(ct, b.mul(b.exp(y), total)), d)]


sharding_rule("softmax", "log_softmax")(lambda spec: all_but(spec, *reduced_axes(spec, "dim")))


# -- Python-style division ---------------------------------------------------------------------

def _division_type(op, x, y):
    t = check_same(op, x, y)
    if not (t.dtype.is_integer or t.dtype.is_floating):
        raise KilnDTypeError(f"{op}: operands of type {x} and {y} are not supported; {op} "
                             "needs an integer or floating dtype")
    return t


def _int_floor(fn, a, b):
    with np.errstate(all="ignore"):  # x // 0 and x % 0 are 0 for integers, as kiln's div/rem
        return np.where(b == 0, 0, fn(a, np.where(b == 0, 1, b))).astype(a.dtype)


_f32_floordiv = via_f32(np.floor_divide)  # CPython's float // algorithm, as torch
_float_remainder = via_f32(lambda a, b: np.where(
    (np.fmod(a, b) != 0) & ((b < 0) != (np.fmod(a, b) < 0)), np.fmod(a, b) + b, np.fmod(a, b)))


def _wrong_sign(b, r, y):
    """r != 0 and sign(r) != sign(y): where truncation and floor differ."""
    return b.call("and", b.binary("ne", r, 0), b.ne(b.binary("lt", y, 0), b.binary("lt", r, 0)))


@defop("floor_divide", family="nn", kind=COMPOSITE, num_operands=2)
class floor_divide:
    """a // b rounded toward -inf (Python, torch); floats follow Python's float //
    (x // 0.0 is x / 0.0), integer x // 0 is 0."""

    type = _division_type

    def reference(a, b):
        return _int_floor(np.floor_divide, a, b) if a.dtype.kind in "iu" else _f32_floordiv(a, b)

    def decompose(b, x, y):
        if b.type_of(x).dtype.is_integer:
            q = b.div(x, y)
            return b.select(_wrong_sign(b, b.rem(x, y), y), b.binary("sub", q, 1), q)
        (x, d), (y, _) = upcast(b, x), upcast(b, y)
        # CPython's float_floor_div: exact (x - fmod) / y, then a floor that fixes rounding
        m = b.rem(x, y)
        q = b.div(b.sub(x, m), y)
        q = b.select(_wrong_sign(b, m, y), b.binary("sub", q, 1.0), q)
        f = b.floor(q)
        f = b.select(b.binary("gt", b.sub(q, f), 0.5), b.binary("add", f, 1.0), f)
        exact = b.div(x, y)
        f = b.select(b.binary("eq", q, 0.0), b.binary("mul", exact, 0.0), f)  # signed zero
        return b.convert(b.select(b.binary("eq", y, 0.0), exact, f), d)


@defop("remainder", family="nn", kind=COMPOSITE, num_operands=2)
class remainder:
    """a - floor(a / b) * b with the divisor's sign (Python %, torch.remainder);
    integer x % 0 is 0."""

    type = _division_type

    def reference(a, b):
        return _int_floor(np.remainder, a, b) if a.dtype.kind in "iu" else _float_remainder(a, b)

    def decompose(b, x, y):
        (x, d), (y, _) = upcast(b, x), upcast(b, y)
        r = b.rem(x, y)
        return b.convert(b.select(_wrong_sign(b, r, y), b.add(r, y), r), d)


sharding_rule("floor_divide", "remainder")(elementwise_sharding)
