"""Math and neural-network functions: `kn.exp`, `kn.add`, `kn.softmax`, ... (the
reductions, `kn.sum`, `kn.max`, ..., are in reductions.py).

Each function states its PyTorch-compatible dtype policy (ints to float32 for
transcendental functions, bool/int sums to int64, true division to float) and then
applies one registered op; the op's type rule does the checking.
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import normalize_axis
from kiln.frontend.dispatch import apply, binary, op_emitter as emitter_for, raw, wrap
from kiln.frontend.eager_path import eager_apply, eager_binary, eager_unary_float
from kiln.frontend.tensor import Tensor

# the public functions (the `kn` face star-imports these); `to`, `_tensor`, `_floating` and
# the dispatch helpers are for kiln's own modules, which import them from here
__all__ = [
    "exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh",
    "tanh", "sqrt", "rsqrt", "erf", "erfc", "sigmoid", "silu", "floor", "ceil", "round",
    "trunc", "neg", "abs", "sign", "relu", "gelu", "softplus", "isnan", "isinf", "isfinite",
    "logical_not", "bitwise_not", "add", "sub", "mul", "div", "true_divide", "floor_divide",
    "remainder", "fmod", "pow", "maximum", "minimum", "atan2", "bitwise_and", "bitwise_or",
    "bitwise_xor", "logical_and", "logical_or", "logical_xor", "eq", "ne", "lt", "le", "gt",
    "ge", "where", "clamp", "clip", "softmax", "log_softmax", "layer_norm", "rms_norm",
    "matmul", "linear", "conv2d", "dropout",
]


def _dtype_of(x) -> dt.DType:
    from kiln.frontend.tensor import Tensor

    if isinstance(x, Tensor):
        return x.dtype
    from kiln.frontend.factories import as_tensor

    return as_tensor(x).dtype


def _tensor(x):
    if type(x) is Tensor:  # the common case without the two imports (1.3 us an op, issue 22)
        return x
    from kiln.frontend.factories import as_tensor

    return x if isinstance(x, Tensor) else as_tensor(x)


def _floating(x):
    """Integer and bool inputs of transcendental functions compute in float32."""
    x = _tensor(x)
    return x if x.dtype.is_inexact else to(x, dt.float32)


def to(x, dtype):
    """`x` converted to `dtype` (a copy-free no-op when it already is)."""
    x = _tensor(x)
    target = dt.dtype(dtype)
    if x.dtype == target:
        return x
    return apply("convert", x, dtype=target)


def _unary_float(op):
    def fn(x):
        result = eager_unary_float(op, x)  # a plain eager float tensor (eager_path.py)
        return result if result is not None else apply(op, _floating(x))

    fn.__name__ = op
    fn.__doc__ = f"Elementwise {op}; integer inputs compute in float32."
    return fn


exp = _unary_float("exp")
expm1 = _unary_float("expm1")
log = _unary_float("log")
log1p = _unary_float("log1p")
sin = _unary_float("sin")
cos = _unary_float("cos")
tan = _unary_float("tan")
asin = _unary_float("asin")
acos = _unary_float("acos")
atan = _unary_float("atan")
sinh = _unary_float("sinh")
cosh = _unary_float("cosh")
tanh = _unary_float("tanh")
sqrt = _unary_float("sqrt")
rsqrt = _unary_float("rsqrt")
erf = _unary_float("erf")
erfc = _unary_float("erfc")
sigmoid = _unary_float("sigmoid")
silu = _unary_float("silu")


def _same_unless_int(op):
    def fn(x):
        x = _tensor(x)
        return x if (x.dtype.is_integer or x.dtype.is_bool) else apply(op, x)

    fn.__name__ = op
    fn.__doc__ = f"Elementwise {op}; integers are returned unchanged."
    return fn


floor = _same_unless_int("floor")
ceil = _same_unless_int("ceil")
round = _same_unless_int("round")
trunc = _same_unless_int("trunc")


def neg(x):
    return apply("neg", _tensor(x))


def abs(x):  # noqa: A001 - the PyTorch name
    x = _tensor(x)
    return x if x.dtype.is_bool else apply("abs", x)


def sign(x):
    return apply("sign", _tensor(x))


def relu(x):
    return apply("relu", _tensor(x))


def gelu(x, approximate: str = "none"):
    if approximate not in ("none", "tanh"):
        raise KilnArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return apply("gelu", _floating(x), approximate=approximate)


def softplus(x, beta: float = 1.0, threshold: float = 20.0):
    return apply("softplus", _floating(x), beta=float(beta), threshold=float(threshold))


def isnan(x):
    x = _tensor(x)
    return apply("isnan", x) if x.dtype.is_floating else ne(x, x)


def isinf(x):
    x = _tensor(x)
    return apply("isinf", x) if x.dtype.is_floating else ne(x, x)


def isfinite(x):
    x = _tensor(x)
    return apply("isfinite", x) if x.dtype.is_floating else eq(x, x)


def logical_not(x):
    return apply("not", to(x, dt.bool_))


def bitwise_not(x):
    return apply("not", _tensor(x))


# -- binary --------------------------------------------------------------------------


def _both_bool(x, y) -> bool:
    em = emitter_for(x, y)
    return em.result_dtype(raw(em, x), raw(em, y)).is_bool


def add(x, y, alpha=1):
    """x + alpha * y; bool + bool is logical or, as torch."""
    y = y if alpha == 1 else mul(y, alpha)
    result = eager_binary("add", x, y)  # plain eager float tensors (eager_path.py)
    return result if result is not None else binary("or" if _both_bool(x, y) else "add", x, y)


def sub(x, y, alpha=1):
    if alpha == 1:
        result = eager_binary("sub", x, y)  # plain eager float tensors (eager_path.py)
        if result is not None:
            return result
    return binary("sub", x, y if alpha == 1 else mul(y, alpha))


def mul(x, y):
    """x * y; bool * bool is logical and, as torch."""
    result = eager_binary("mul", x, y)  # plain eager float tensors (eager_path.py)
    return result if result is not None else binary("and" if _both_bool(x, y) else "mul", x, y)


def div(x, y, rounding_mode: str | None = None):
    """True division (ints give float32), or rounding_mode "trunc" / "floor" as torch."""
    if rounding_mode is None:
        result = eager_binary("div", x, y)  # plain eager float tensors (eager_path.py)
        if result is not None:
            return result
        em = emitter_for(x, y)
        dtype = em.result_dtype(raw(em, x), raw(em, y))
        if not dtype.is_inexact:
            dtype = dt.float32
        return binary("div", x, y, dtype=dtype)
    if rounding_mode == "trunc":
        result = binary("div", x, y)
        return result if not result.dtype.is_floating else trunc(result)
    if rounding_mode == "floor":
        return floor_divide(x, y)
    raise KilnArgumentError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")


true_divide = div


def floor_divide(x, y):
    return binary("floor_divide", x, y)


def remainder(x, y):
    return binary("remainder", x, y)


def fmod(x, y):
    return binary("rem", x, y)


def pow(x, y):  # noqa: A001
    return binary("pow", x, y)


def maximum(x, y):
    return binary("max", x, y)


def minimum(x, y):
    return binary("min", x, y)


def atan2(x, y):
    em = emitter_for(x, y)
    dtype = em.result_dtype(raw(em, x), raw(em, y))
    return binary("atan2", x, y, dtype=dtype if dtype.is_floating else dt.float32)


def _bitwise(op):
    def fn(x, y):
        return binary(op, x, y)  # the primitive's rule refuses non-integer operands

    fn.__name__ = f"bitwise_{op}"
    return fn


bitwise_and = _bitwise("and")
bitwise_or = _bitwise("or")
bitwise_xor = _bitwise("xor")


def logical_and(x, y):
    return binary("and", to(x, dt.bool_), to(y, dt.bool_))


def logical_or(x, y):
    return binary("or", to(x, dt.bool_), to(y, dt.bool_))


def logical_xor(x, y):
    return binary("xor", to(x, dt.bool_), to(y, dt.bool_))


def eq(x, y):
    return binary("eq", x, y)


def ne(x, y):
    return binary("ne", x, y)


def lt(x, y):
    return binary("lt", x, y)


def le(x, y):
    return binary("le", x, y)


def gt(x, y):
    return binary("gt", x, y)


def ge(x, y):
    return binary("ge", x, y)


def where(condition, x, y):
    """Elementwise `condition ? x : y` with broadcasting and promotion."""
    em = emitter_for(condition, x, y)
    c, a, b = raw(em, condition), raw(em, x), raw(em, y)
    if em.type_of(c).dtype != dt.bool_:
        c = em.convert(c, dt.bool_)
    a, b = em.promote("where", a, b)
    c, a, b = _broadcast3(em, c, a, b)
    return wrap(em, em.call("select", c, a, b))


def _broadcast3(em, c, a, b):
    from kiln.ir.shapes import broadcast_shapes

    shape = broadcast_shapes("where", em.type_of(c).shape, em.type_of(a).shape)
    return em.broadcast_to(c, shape), em.broadcast_to(a, shape), em.broadcast_to(b, shape)


def clamp(x, min=None, max=None):  # noqa: A002 - the PyTorch names
    """Elementwise clamp into [min, max]; either bound may be None, a scalar or a tensor."""
    if min is None and max is None:
        raise KilnArgumentError("clamp: at least one of min and max must be given")
    result = _tensor(x)
    if min is not None:
        result = maximum(result, min)
    if max is not None:
        result = minimum(result, max)
    return result


clip = clamp


# -- neural-network functions (torch.nn.functional signatures) ----------------------------


def softmax(x, dim: int, dtype=None):
    x = _floating(x) if dtype is None else to(x, dtype)
    return apply("softmax", x, dim=normalize_axis("softmax", dim, x.ndim, "dim"))


def log_softmax(x, dim: int, dtype=None):
    x = _floating(x) if dtype is None else to(x, dtype)
    return apply("log_softmax", x, dim=normalize_axis("log_softmax", dim, x.ndim, "dim"))


def _normalized_ndim(op, normalized_shape) -> int:
    if isinstance(normalized_shape, int):
        return 1
    if not isinstance(normalized_shape, (tuple, list)) or not normalized_shape:
        raise KilnArgumentError(f"{op}: normalized_shape must be an int or a non-empty tuple, "
                                f"got {normalized_shape!r}")
    return len(normalized_shape)


def _check_normalized(op, x, normalized_shape):
    ndim = _normalized_ndim(op, normalized_shape)
    expected = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    from kiln.ir.shapes import shapes_equal

    if ndim > x.ndim or not shapes_equal(tuple(x.shape[-ndim:]), expected):
        from kiln.errors import KilnShapeError

        raise KilnShapeError(f"{op}: normalized_shape {list(expected)} does not match the last "
                             f"dims of input {x.dtype.short}{list(x.shape)}")
    return ndim


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    x = _floating(x)
    ndim = _check_normalized("layer_norm", x, normalized_shape)
    params = [to(p, x.dtype) for p in (weight, bias) if p is not None]
    return apply("layer_norm", x, *params, normalized_ndim=ndim, eps=float(eps),
                 has_weight=weight is not None, has_bias=bias is not None)


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None):
    x = _floating(x)
    ndim = _check_normalized("rms_norm", x, normalized_shape)
    params = [to(weight, x.dtype)] if weight is not None else []
    return apply("rms_norm", x, *params, normalized_ndim=ndim,
                 eps=None if eps is None else float(eps), has_weight=weight is not None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, *, is_causal: bool = False,
                                 scale: float | None = None):
    """softmax(q k^T * scale + mask) v as one op (a fused kernel when compiled). With
    dropout, `kn.scaled_dot_product_attention` is kiln.nn.functional's, which owns the
    random keys (kn.nn.rng) and calls this one when dropout_p is 0."""
    q = _floating(query)
    k, v = to(key, q.dtype), to(value, q.dtype)
    operands = [q, k, v]
    if attn_mask is not None:
        mask = _tensor(attn_mask)
        operands.append(mask if mask.dtype.is_bool else to(mask, q.dtype))
    return apply("scaled_dot_product_attention", *operands, is_causal=bool(is_causal),
                 scale=None if scale is None else float(scale), has_mask=attn_mask is not None)


def matmul(x, y):
    """Matrix product with torch.matmul semantics (1-D operands, broadcast batch dims)."""
    result = eager_apply("matmul", (x, y), {}, same_dtype=True)  # plain eager CPU tensors
    if result is not None:
        return result
    em = emitter_for(x, y)
    a, b = _promote_dtype(em, x, y)
    return wrap(em, em.call("matmul", a, b))


def _promote_dtype(em, x, y):
    a, b = raw(em, x), raw(em, y)
    dtype = em.result_dtype(a, b)
    return em.convert(em.as_value(a, dtype), dtype), em.convert(em.as_value(b, dtype), dtype)


def linear(x, weight, bias=None):
    """x @ weight.T + bias, as torch.nn.functional.linear."""
    from kiln.frontend.shape_ops import transpose

    out = matmul(x, transpose(weight, -1, -2))
    return out if bias is None else add(out, bias)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    def pair(v, name):
        v = (v, v) if isinstance(v, int) else tuple(v)
        if len(v) != 2:
            raise KilnArgumentError(f"conv2d: {name} must be an int or a pair, got {v!r}")
        return v

    x = _floating(x)
    operands = [x, to(weight, x.dtype)] + ([to(bias, x.dtype)] if bias is not None else [])
    return apply("conv2d", *operands, stride=pair(stride, "stride"), padding=pair(padding, "padding"),
                 dilation=pair(dilation, "dilation"), groups=int(groups), has_bias=bias is not None)


def dropout(x, p: float = 0.5, training: bool = True, seed: int | None = None):
    """Inverted dropout with counter-based random bits (deterministic under a seed)."""
    if not 0.0 <= p < 1.0:
        raise KilnArgumentError(f"dropout: p must be in [0, 1), got {p}")
    x = _floating(x)
    if not training or p == 0.0:
        return x
    from kiln.frontend.factories import rand

    keep = ge(rand(*x.shape, seed=seed, dtype=dt.float32), p)
    return where(keep, div(x, 1.0 - p), 0.0)

