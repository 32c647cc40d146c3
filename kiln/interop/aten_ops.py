"""The ATen op table of `kn.from_torch`: each core ATen op, by its packet name, as kiln ops.

One entry per op, written with kiln's public functions (so it runs eagerly, traces,
compiles and differentiates like user code). Arguments arrive as ATen's schema gives them
(`aten.addmm(bias, a, b, beta=1, alpha=1)`). Pooling, which kiln has no primitive for, is a
decomposition into strided slices and elementwise max / sum (exact, differentiable).
An op missing here, or an argument value an entry cannot express (`Unsupported`), is
refused by the importer with K346 naming the op and the module's source line.
"""

from __future__ import annotations

import math
from typing import Callable

from kiln.frontend import factories, reductions, shape_ops
from kiln.frontend import functional as ops
from kiln.frontend.tensor import Tensor
from kiln.ir import dtypes as dt
from kiln.nn import functional as nnf

ATEN: dict[str, Callable] = {}
_INT64_MAX = 2 ** 63 - 1


def op(*names: str):
    """Register one function for the ATen packets `names`."""
    def register(fn):
        for name in names:
            ATEN[name] = fn
        return fn
    return register


class Unsupported(Exception):
    """An op variant (an argument value) the table cannot express; the importer turns it
    into K346 with the op's name and source line."""


def _unary(name: str, fn: Callable) -> None:
    ATEN[name] = lambda x, *a, **k: fn(x)


for _name in ("abs", "neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tan",
              "tanh", "sinh", "cosh", "asin", "acos", "atan", "sigmoid", "relu", "erf", "floor",
              "ceil", "trunc", "sign", "logical_not", "bitwise_not", "isnan", "isinf", "silu"):
    _unary(_name, getattr(ops, _name))
for _name, _fn in [("clone", lambda x: x), ("alias", lambda x: x), ("detach", lambda x: x),
                   ("lift_fresh_copy", lambda x: x), ("contiguous", lambda x: x),
                   ("reciprocal", lambda x: 1.0 / x)]:
    _unary(_name, _fn)

for _name in ("mul", "maximum", "minimum", "remainder", "fmod", "atan2", "eq", "ne", "lt", "le",
              "gt", "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
              "bitwise_xor", "pow"):
    ATEN[_name] = (lambda f: lambda a, b: f(a, b))(getattr(ops, _name))


@op("add")
def _add(a, b, alpha=1):
    return a + (b if alpha == 1 else b * alpha)


@op("sub")
def _sub(a, b, alpha=1):
    return a - (b if alpha == 1 else b * alpha)


@op("rsub")
def _rsub(a, b, alpha=1):
    return b - (a if alpha == 1 else a * alpha)


@op("div")
def _div(a, b, rounding_mode=None):
    if rounding_mode is None:
        return ops.true_divide(a, b)
    if rounding_mode == "floor":
        return ops.floor_divide(a, b)
    return ops.trunc(ops.true_divide(a, b)) if _is_float(a) or _is_float(b) else _trunc_div(a, b)


def _trunc_div(a, b):
    q = ops.floor_divide(a, b)
    r = a - q * b
    return ops.where(ops.logical_and(r != 0, (r < 0) != (b < 0)), q + 1, q)


def _is_float(v) -> bool:
    return isinstance(v, float) or (isinstance(v, Tensor) and v.dtype.is_floating)


@op("where")
def _where(cond, a, b):
    return ops.where(cond, a, b)


@op("clamp")
def _clamp(x, min=None, max=None):  # noqa: A002
    return ops.clamp(x, min, max)


ATEN["clamp_min"] = lambda x, m: ops.clamp(x, m, None)
ATEN["clamp_max"] = lambda x, m: ops.clamp(x, None, m)
ATEN["hardtanh"] = lambda x, lo=-1.0, hi=1.0: ops.clamp(x, lo, hi)
ATEN["leaky_relu"] = lambda x, slope=0.01: ops.where(x > 0, x, x * slope)
ATEN["log2"] = lambda x: ops.log(x) * (1.0 / math.log(2.0))
ATEN["log10"] = lambda x: ops.log(x) * (1.0 / math.log(10.0))
ATEN["exp2"] = lambda x: ops.exp(x * math.log(2.0))
ATEN["isfinite"] = lambda x: ops.isfinite(x)


@op("elu")
def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return ops.where(x > 0, x * scale, (ops.expm1(x * input_scale) * alpha) * scale)


# -- reductions -----------------------------------------------------------------------------


def _dims(dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    return tuple(dim) if isinstance(dim, (list, tuple)) else dim


def _reduction(name, fn):
    def reduce(x, dim=None, keepdim=False, dtype=None):
        if dtype is not None:
            x = x.to(dtype)
        return fn(x, _dims(dim), keepdim)
    ATEN[name] = reduce


for _name in ("sum", "mean", "amax", "amin", "any", "all", "logsumexp"):
    _reduction(_name, getattr(reductions, _name))


@op("prod")
def _prod(x, dim=None, keepdim=False, dtype=None):
    return reductions.prod(x if dtype is None else x.to(dtype), dim, keepdim)


def _max_or_min(fn):
    def run(x, dim=None, keepdim=False):
        if isinstance(dim, Tensor):  # max.other: elementwise
            return (ops.maximum if fn is reductions.max else ops.minimum)(x, dim)
        return fn(x) if dim is None else tuple(fn(x, dim, keepdim))
    return run


ATEN["max"] = _max_or_min(reductions.max)
ATEN["min"] = _max_or_min(reductions.min)
ATEN["argmax"] = lambda x, dim=None, keepdim=False: reductions.argmax(x, dim, keepdim)
ATEN["argmin"] = lambda x, dim=None, keepdim=False: reductions.argmin(x, dim, keepdim)
ATEN["cumsum"] = lambda x, dim, dtype=None: reductions.cumsum(x if dtype is None else x.to(dtype),
                                                              dim)
ATEN["cumprod"] = lambda x, dim, dtype=None: reductions.cumprod(x if dtype is None else x.to(dtype),
                                                                dim)


@op("sort")
def _sort(x, dim=-1, descending=False, *, stable=None):
    if isinstance(dim, bool):  # sort.stable(x, stable, dim, descending) given positionally
        dim, descending = -1, descending
    return tuple(reductions.sort(x, dim, descending))


ATEN["argsort"] = lambda x, dim=-1, descending=False, *, stable=None: \
    reductions.argsort(x, dim, descending)


def _moment(fn):
    def run(x, dim=None, *args, correction=None, keepdim=False):
        unbiased = None
        if args:  # var.dim(x, dim, unbiased, keepdim)
            unbiased = args[0]
            keepdim = args[1] if len(args) > 1 else keepdim
        if correction is None:
            correction = 1 if unbiased in (None, True) else 0
        return fn(x, _dims(dim), keepdim, correction=correction)
    return run


ATEN["var"] = _moment(reductions.var)
ATEN["std"] = _moment(reductions.std)


# -- neural-network ops ---------------------------------------------------------------------

ATEN["_softmax"] = lambda x, dim, half_to_float=False: ops.softmax(x, dim)
ATEN["_log_softmax"] = lambda x, dim, half_to_float=False: ops.log_softmax(x, dim)
ATEN["softmax"] = lambda x, dim, dtype=None: ops.softmax(x, dim, dtype)
ATEN["log_softmax"] = lambda x, dim, dtype=None: ops.log_softmax(x, dim, dtype)
ATEN["gelu"] = lambda x, approximate="none": ops.gelu(x, approximate=approximate)
ATEN["softplus"] = lambda x, beta=1.0, threshold=20.0: ops.softplus(x, beta, threshold)


@op("native_layer_norm")
def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    dims = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = reductions.mean(x, dims, keepdim=True)
    rstd = ops.rsqrt(reductions.var(x, dims, keepdim=True, correction=0) + eps)
    out = ops.layer_norm(x, tuple(normalized_shape), weight, bias, eps)
    return out, mean, rstd


def layer_norm_output_only(x, normalized_shape, weight, bias, eps):
    """native_layer_norm where the graph reads only the normalized output (inference)."""
    return ops.layer_norm(x, tuple(normalized_shape), weight, bias, eps), None, None


@op("native_group_norm")
def _group_norm(x, weight, bias, n, c, hw, group, eps):
    shape = tuple(x.shape)
    grouped = x.reshape(shape[0], group, -1)
    mean = reductions.mean(grouped, -1, keepdim=True)
    rstd = ops.rsqrt(reductions.var(grouped, -1, keepdim=True, correction=0) + eps)
    out = ((grouped - mean) * rstd).reshape(*shape)
    channel = (1, -1) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(*channel)
    if bias is not None:
        out = out + bias.reshape(*channel)
    return out, mean.reshape(shape[0], group), rstd.reshape(shape[0], group)


@op("_native_batch_norm_legit_no_training")
def _batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    scale = ops.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    out = (x - running_mean.reshape(*shape)) * scale.reshape(*shape)
    if bias is not None:
        out = out + bias.reshape(*shape)
    return out, None, None


@op("convolution")
def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise Unsupported("transposed convolution (ConvTranspose) has no kiln op")
    if x.ndim != 4:
        raise Unsupported(f"a {x.ndim - 2}-d convolution: kiln has conv2d only")
    return ops.conv2d(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


@op("embedding")
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return nnf.embedding(indices, weight, None if padding_idx < 0 else padding_idx)


def _pair(v):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _windows(x, kernel, stride, padding, dilation, fill):
    """Each of the kh*kw strided views a 2-d pooling window reads, over padded x."""
    (kh, kw), (ph, pw), (dh, dw) = _pair(kernel), _pair(padding), _pair(dilation)
    sh, sw = _pair(stride) if stride else (kh, kw)
    h, w = x.shape[-2], x.shape[-1]
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if ph or pw:
        x = shape_ops.pad(x, (pw, pw, ph, ph), value=fill)
    lead = (slice(None),) * (x.ndim - 2)
    for i in range(kh):
        for j in range(kw):
            yield x[lead + (slice(i * dh, i * dh + sh * (ho - 1) + 1, sh),
                            slice(j * dw, j * dw + sw * (wo - 1) + 1, sw))]


@op("max_pool2d_with_indices", "max_pool2d")
def _max_pool2d(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    if ceil_mode:
        raise Unsupported("max_pool2d with ceil_mode=True")
    out = None
    for window in _windows(x, kernel_size, stride, padding, dilation, -math.inf):
        out = window if out is None else ops.maximum(out, window)
    return out, None  # the indices: an importer error if the graph reads them


@op("avg_pool2d")
def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if ceil_mode:
        raise Unsupported("avg_pool2d with ceil_mode=True")
    total = None
    for window in _windows(x, kernel_size, stride, padding, 1, 0.0):
        total = window if total is None else total + window
    if divisor_override:
        return total / divisor_override
    if count_include_pad or not any(_pair(padding)):
        kh, kw = _pair(kernel_size)
        return total / float(kh * kw)
    count = None
    ones = factories.ones(*x.shape[-2:], dtype=x.dtype)
    for window in _windows(ones, kernel_size, stride, padding, 1, 0.0):
        count = window if count is None else count + window
    return total / count


@op("_adaptive_avg_pool2d", "adaptive_avg_pool2d")
def _adaptive_avg_pool2d(x, output_size):
    (oh, ow), (h, w) = _pair(output_size), x.shape[-2:]
    if h % oh or w % ow:
        raise Unsupported(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow} (sizes that do not divide)")
    lead = tuple(x.shape[:-2])
    x = x.reshape(*lead, oh, h // oh, ow, w // ow)
    return reductions.mean(x, (-3, -1))


# -- linear algebra -------------------------------------------------------------------------

ATEN["mm"] = ATEN["bmm"] = ATEN["matmul"] = lambda a, b: ops.matmul(a, b)


@op("addmm", "baddbmm")
def _addmm(bias, a, b, beta=1, alpha=1):
    product = ops.matmul(a, b)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (bias if beta == 1 else bias * beta)


# -- shapes ---------------------------------------------------------------------------------

ATEN["view"] = ATEN["_unsafe_view"] = ATEN["reshape"] = \
    lambda x, shape: shape_ops.reshape(x, tuple(shape))
ATEN["permute"] = lambda x, dims: shape_ops.permute(x, *dims)
ATEN["transpose"] = lambda x, d0, d1: shape_ops.transpose(x, d0, d1)
ATEN["t"] = lambda x: x if x.ndim < 2 else shape_ops.transpose(x, 0, 1)
ATEN["unsqueeze"] = lambda x, dim: shape_ops.unsqueeze(x, dim)
ATEN["flip"] = lambda x, dims: shape_ops.flip(x, tuple(dims))
ATEN["cat"] = lambda tensors, dim=0: shape_ops.cat(list(tensors), dim)
ATEN["stack"] = lambda tensors, dim=0: shape_ops.stack(list(tensors), dim)
ATEN["index_select"] = lambda x, dim, index: shape_ops.index_select(x, dim, index)
ATEN["gather"] = lambda x, dim, index, sparse_grad=False: shape_ops.gather(x, dim, index)
ATEN["scatter_add"] = lambda x, dim, index, src: shape_ops.scatter_add(x, dim, index, src)


@op("scatter")
def _scatter(x, dim, index, src, reduce=None):
    if reduce is not None:
        raise Unsupported(f"scatter with reduce={reduce!r}")
    if not isinstance(src, Tensor):  # scatter.value: a scalar written at every index
        src = factories.full_like(index, src, dtype=x.dtype)
    return shape_ops.scatter(x, dim, index, src)


def _triangle(x, diagonal, lower):
    rows, cols = x.shape[-2], x.shape[-1]
    offset = factories.arange(rows).reshape(rows, 1) - factories.arange(cols).reshape(1, cols)
    keep = offset >= -diagonal if lower else offset <= -diagonal
    return ops.where(keep, x, factories.zeros_like(x))


ATEN["tril"] = lambda x, diagonal=0: _triangle(x, diagonal, True)
ATEN["triu"] = lambda x, diagonal=0: _triangle(x, diagonal, False)
ATEN["constant_pad_nd"] = lambda x, pad, value=0.0: shape_ops.pad(x, tuple(pad), value=value)


@op("squeeze")
def _squeeze(x, dim=None):
    if dim is None:
        return shape_ops.squeeze(x)
    dims = [d % x.ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    dims = [d for d in dims if x.shape[d] == 1]  # torch ignores dims that are not 1
    if not dims:
        return x
    return shape_ops.reshape(x, tuple(n for i, n in enumerate(x.shape) if i not in dims))


@op("expand")
def _expand(x, size, implicit=False):
    lead = len(size) - x.ndim
    full = tuple(x.shape[i - lead] if (n == -1 and i >= lead) else n for i, n in enumerate(size))
    return shape_ops.expand(x, *full)


@op("select")
def _select(x, dim, index):
    dim %= x.ndim
    return x[(slice(None),) * dim + (index,)]


@op("slice")
def _slice(x, dim=0, start=None, end=None, step=1):
    dim %= x.ndim
    # start/end may be symbolic sizes (a dynamic dim): only plain ints are compared
    start = None if isinstance(start, int) and start == 0 else start
    end = None if isinstance(end, int) and end >= _INT64_MAX else end
    return x[(slice(None),) * dim + (slice(start, end, step),)]


@op("split_with_sizes")
def _split_with_sizes(x, sizes, dim=0):
    return shape_ops.split(x, list(sizes), dim)


@op("split")
def _split(x, size, dim=0):
    return shape_ops.split(x, size if isinstance(size, int) else list(size), dim)


@op("unbind")
def _unbind(x, dim=0):
    return [_select(x, dim, i) for i in range(x.shape[dim])]


@op("_to_copy", "to")
def _to_copy(x, dtype=None, **ignored):
    return x if dtype is None else x.to(dtype)


@op("index")
def _index(x, indices):
    axes = [i for i, ix in enumerate(indices) if ix is not None]
    if len(axes) != 1:
        raise Unsupported("advanced indexing with more than one index tensor")
    axis, index = axes[0], indices[axes[0]]
    if index.dtype == dt.bool_:
        raise Unsupported("boolean-mask indexing (its result's shape depends on the data)")
    picked = shape_ops.index_select(x, axis, index.reshape(-1))
    shape = tuple(x.shape[:axis]) + tuple(index.shape) + tuple(x.shape[axis + 1:])
    return picked.reshape(*shape)


# -- creation -------------------------------------------------------------------------------


def _dtype(dtype, default=None):
    return default if dtype is None else dtype


ATEN["full"] = lambda size, value, dtype=None, **k: factories.full(tuple(size), value, dtype=dtype)
ATEN["zeros"] = lambda size, dtype=None, **k: factories.full(tuple(size), 0,
                                                             dtype=_dtype(dtype, dt.float32))
ATEN["ones"] = lambda size, dtype=None, **k: factories.full(tuple(size), 1,
                                                            dtype=_dtype(dtype, dt.float32))
ATEN["full_like"] = lambda x, value, dtype=None, **k: factories.full_like(x, value, dtype=dtype)
ATEN["zeros_like"] = lambda x, dtype=None, **k: factories.full_like(x, 0, dtype=dtype)
ATEN["ones_like"] = lambda x, dtype=None, **k: factories.full_like(x, 1, dtype=dtype)
ATEN["scalar_tensor"] = lambda v, dtype=None, **k: factories.full(
    (), v, dtype=_dtype(dtype, dt.float32))


@op("arange")
def _arange(*args, dtype=None, **ignored):
    return factories.arange(*args, dtype=dtype)

