"""The composites a transformer layer is built of: layer_norm, rms_norm and
scaled_dot_product_attention (torch semantics; the activations and statistics they use
live in nn.py).

Each op carries a type rule, a numpy reference and a decomposition into primitives (a
backend may still match the whole op into a template: flash attention). Low-precision
floats compute in float32 and round once at the end, in the reference and the
decomposition alike. The norms have vjp rules, shorter than their decomposition's
derivative; attention is differentiated through its decomposition.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.linalg import upcast
from kiln.ir.ops.nn import NUMBER, expand_reduced, mean_over, sum_over
from kiln.ir.ops.rules import FLOATING, check_dtype, via_f32
from kiln.ir.registry import COMPOSITE, REQUIRED, defop
from kiln.ir.shapes import broadcast_shapes, dims_equal, shapes_equal
from kiln.ir.sharding import R, Shard, Strategy, shard_dims, sharding_rule


def _norm_type(op, x, params, n, flags):
    """A floating x normalized over its last n dims, and the optional operands (weight,
    bias) present as the flags say, each shaped like those dims."""
    check_dtype(op, x, FLOATING)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= x.rank:
        raise KilnArgumentError(f"{op}: normalized_ndim must be an int in [1, {x.rank}] for "
                                f"{x}, got {n!r}")
    names = [name for name, on in flags if on]
    if len(params) != len(names):
        raise KilnArgumentError(f"{op}: with {', '.join(f'has_{k}={v}' for k, v in flags)} it takes "
                                f"{1 + len(names)} operand(s) ({', '.join(['x'] + names)}), "
                                f"got {1 + len(params)}")
    want = x.with_shape(x.shape[x.rank - n:])
    for name, p in zip(names, params):
        if p != want:
            raise KilnShapeError(f"{op}: {name} {p} must be {want}, the last {n} dims of x {x}")
    return x


# -- normalization -----------------------------------------------------------------------------

def _layer_norm_reference(x, *params, normalized_ndim, eps, has_weight, has_bias):
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    dev = x - np.mean(x, axis=axes, keepdims=True)
    y = dev / np.sqrt(np.mean(dev * dev, axis=axes, keepdims=True) + eps)
    params = list(params)
    y = y * params.pop(0) if has_weight else y
    return y + params.pop(0) if has_bias else y


def _layer_normalized(b, x, normalized_ndim, eps):
    """((x - mean) * inv, inv) with inv = 1 / sqrt(biased var + eps), broadcast to x."""
    shape = b.type_of(x).shape
    axes = tuple(range(len(shape) - normalized_ndim, len(shape)))
    dev = b.sub(x, expand_reduced(b, mean_over(b, x, axes), shape, axes))
    inv = b.rsqrt(b.binary("add", mean_over(b, b.mul(dev, dev), axes), float(eps)))
    inv = expand_reduced(b, inv, shape, axes)
    return b.mul(dev, inv), inv


@defop("layer_norm", family="nn", kind=COMPOSITE,
       attrs={"normalized_ndim": REQUIRED, "eps": 1e-5, "has_weight": False, "has_bias": False})
class layer_norm:
    """(x - mean) / sqrt(biased var + eps) over the last normalized_ndim dims, times
    weight, plus bias (operands x, [weight], [bias])."""

    def type(op, x, *params, normalized_ndim, eps, has_weight, has_bias):
        return _norm_type(op, x, params, normalized_ndim,
                          (("weight", has_weight), ("bias", has_bias)))

    reference = via_f32(_layer_norm_reference)

    def decompose(b, x, *params, normalized_ndim, eps, has_weight, has_bias):
        x, d = upcast(b, x)
        shape = b.type_of(x).shape
        y, _ = _layer_normalized(b, x, normalized_ndim, eps)
        params = [b.broadcast_to(upcast(b, p)[0], shape) for p in params]  # over leading dims
        y = b.mul(y, params.pop(0)) if has_weight else y
        return b.convert(b.add(y, params.pop(0)) if has_bias else y, d)

    def vjp(b, cts, xs, ys, *, normalized_ndim, eps, has_weight, has_bias):
        """x: inv (g - mean(g) - xhat mean(g xhat)) with g = ct * weight; weight:
        ct * xhat summed over the leading dims; bias: ct summed over them."""
        (x, d), (ct, _) = upcast(b, xs[0]), upcast(b, cts[0])
        xhat, inv = _layer_normalized(b, x, normalized_ndim, eps)
        shape = b.type_of(x).shape
        axes = tuple(range(len(shape) - normalized_ndim, len(shape)))
        g = b.mul(ct, b.broadcast_to(upcast(b, xs[1])[0], shape)) if has_weight else ct
        mean_g = expand_reduced(b, mean_over(b, g, axes), shape, axes)
        mean_gx = expand_reduced(b, mean_over(b, b.mul(g, xhat), axes), shape, axes)
        grads = [b.mul(inv, b.sub(b.sub(g, mean_g), b.mul(xhat, mean_gx)))]
        lead = tuple(range(len(shape) - normalized_ndim))
        if has_weight:
            grads.append(sum_over(b, b.mul(ct, xhat), lead))
        if has_bias:
            grads.append(sum_over(b, ct, lead))
        return [b.convert(c, d) for c in grads]


def _rms_eps(dtype, eps):
    # torch takes finfo of the compute dtype: float32 for the low-precision floats
    return float(np.finfo(dtype).eps) if eps is None else float(eps)


def _rms_norm_reference(x, *params, normalized_ndim, eps, has_weight):
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    y = x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + _rms_eps(x.dtype, eps))
    return y * params[0] if has_weight else y


def _rms_normalized(b, x, normalized_ndim, eps):
    """(x * inv, inv) with inv = 1 / sqrt(mean(x^2) + eps), broadcast to x."""
    t = b.type_of(x)
    axes = tuple(range(t.rank - normalized_ndim, t.rank))
    ms = b.binary("add", mean_over(b, b.mul(x, x), axes), _rms_eps(t.dtype.np_dtype, eps))
    inv = expand_reduced(b, b.rsqrt(ms), t.shape, axes)
    return b.mul(x, inv), inv


@defop("rms_norm", family="nn", kind=COMPOSITE,
       attrs={"normalized_ndim": REQUIRED, "eps": None, "has_weight": False})
class rms_norm:
    """x / sqrt(mean(x^2) + eps) over the last normalized_ndim dims, times weight;
    eps None is finfo(compute dtype).eps, as torch."""

    def type(op, x, *params, normalized_ndim, eps, has_weight):
        if eps is not None and not isinstance(eps, NUMBER):
            raise KilnArgumentError(f"rms_norm: eps must be a number or None, got {eps!r}")
        return _norm_type(op, x, params, normalized_ndim, (("weight", has_weight),))

    reference = via_f32(_rms_norm_reference)

    def decompose(b, x, *params, normalized_ndim, eps, has_weight):
        x, d = upcast(b, x)
        y, _ = _rms_normalized(b, x, normalized_ndim, eps)
        if has_weight:
            y = b.mul(y, b.broadcast_to(upcast(b, params[0])[0], b.type_of(x).shape))
        return b.convert(y, d)

    def vjp(b, cts, xs, ys, *, normalized_ndim, eps, has_weight):
        """x: inv (g - xhat mean(g xhat)) with g = ct * weight; weight: ct * xhat summed
        over the leading dims."""
        (x, d), (ct, _) = upcast(b, xs[0]), upcast(b, cts[0])
        xhat, inv = _rms_normalized(b, x, normalized_ndim, eps)
        t = b.type_of(x)
        axes = tuple(range(t.rank - normalized_ndim, t.rank))
        g = b.mul(ct, b.broadcast_to(upcast(b, xs[1])[0], t.shape)) if has_weight else ct
        mean_gx = expand_reduced(b, mean_over(b, b.mul(g, xhat), axes), t.shape, axes)
        grads = [b.mul(inv, b.sub(g, b.mul(xhat, mean_gx)))]
        if has_weight:
            grads.append(sum_over(b, b.mul(ct, xhat), tuple(range(t.rank - normalized_ndim))))
        return [b.convert(c, d) for c in grads]


@sharding_rule("layer_norm", "rms_norm")
def _norm_sharding(spec):
    """x and the result shard the leading dims; weight and bias stay replicated."""
    return shard_dims(spec, range(spec.ndim - spec.attrs["normalized_ndim"]), operands=(0,))


# -- attention --------------------------------------------------------------------------

def _sdpa_type(op, q, k, v, *mask, is_causal, scale, has_mask):
    for name, t in (("query", q), ("key", k), ("value", v)):
        check_dtype(op, t, FLOATING, name)
        if t.rank < 2:
            raise KilnShapeError(f"{op}: {name} {t} must have rank >= 2 ([..., seq, features])")
    if not q.dtype == k.dtype == v.dtype:
        raise KilnDTypeError(f"{op}: query {q}, key {k} and value {v} must have one dtype")
    if len(mask) != bool(has_mask) or (is_causal and has_mask):
        raise KilnArgumentError(f"{op}: has_mask={has_mask} with {len(mask)} mask operand(s), "
                                f"is_causal={is_causal}; give a mask only with has_mask, and "
                                "not together with is_causal")
    if scale is not None and not isinstance(scale, NUMBER):
        raise KilnArgumentError(f"{op}: scale must be a number or None, got {scale!r}")
    if not dims_equal(q.shape[-1], k.shape[-1]):
        raise KilnShapeError(f"{op}: query {q} and key {k} differ in features "
                             f"({q.shape[-1]} vs {k.shape[-1]})")
    if not dims_equal(k.shape[-2], v.shape[-2]):
        raise KilnShapeError(f"{op}: key {k} and value {v} differ in sequence length "
                             f"({k.shape[-2]} vs {v.shape[-2]})")
    batch = broadcast_shapes(op, q.shape[:-2], k.shape[:-2], v.shape[:-2],
                             describe=lambda: f"query {q}, key {k} and value {v}")
    scores = batch + (q.shape[-2], k.shape[-2])
    for m in mask:
        if m.dtype not in (dt.bool_, q.dtype):
            raise KilnDTypeError(f"{op}: mask {m} must be bool or {q.dtype.short} like query {q}")
        if m.rank > len(scores) or not shapes_equal(broadcast_shapes(
                op, m.shape, scores, describe=lambda: f"mask {m} with scores"), scores):
            raise KilnShapeError(f"{op}: mask {m} does not broadcast to the scores {scores}")
    return q.with_shape(batch + (q.shape[-2], v.shape[-1]))


def _sdpa_reference(q, k, v, *mask, is_causal, scale, has_mask):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if is_causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    if has_mask:
        m = mask[0]
        scores = np.where(m, scores, -np.inf) if m.dtype == np.bool_ else scores + m
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)  # no keys: a zero row
    e = np.exp(scores - top)
    p = np.where(top == -np.inf, 0, e / np.sum(e, axis=-1, keepdims=True))
    return np.matmul(p, v)


@defop("scaled_dot_product_attention", family="nn", kind=COMPOSITE,
       attrs={"is_causal": False, "scale": None, "has_mask": False})
class scaled_dot_product_attention:
    """softmax(q @ k^T * scale + mask) @ v (torch semantics; q [..., L, E], k [..., S, E],
    v [..., S, Ev]; bool mask True attends; a fully masked row gives 0, as torch)."""

    type = _sdpa_type
    reference = via_f32(_sdpa_reference)

    def decompose(b, q, k, v, *mask, is_causal, scale, has_mask):
        (q, d), (k, _), (v, _) = upcast(b, q), upcast(b, k), upcast(b, v)
        qt, kt = b.type_of(q), b.type_of(k)
        out = _sdpa_type("scaled_dot_product_attention", qt, kt, b.type_of(v), is_causal=False,
                         scale=scale, has_mask=False)
        batch, L, S = out.shape[:-2], qt.shape[-2], kt.shape[-2]
        n, shape, bd = len(batch), batch + (L, S), tuple(range(len(batch)))
        q, k, v = (b.broadcast_to(t, batch + b.type_of(t).shape[-2:]) for t in (q, k, v))
        scores = b.dot_general(q, k, lhs_contracting=(n + 1,), rhs_contracting=(n + 1,),
                               lhs_batch=bd, rhs_batch=bd)
        scale = 1.0 / math.sqrt(qt.shape[-1]) if scale is None else scale
        scores = b.binary("mul", scores, float(scale))
        neg_inf = b.full(-math.inf, qt.dtype, shape)
        if is_causal:
            rows = b.iota(dtype=dt.int64, shape=(L, S), dimension=0)
            cols = b.iota(dtype=dt.int64, shape=(L, S), dimension=1)
            scores = b.select(b.broadcast_to(b.ge(rows, cols), shape), scores, neg_inf)
        if has_mask:
            m = b.broadcast_to(mask[0], shape)
            scores = (b.select(m, scores, neg_inf) if b.type_of(m).dtype == dt.bool_
                      else b.add(scores, b.convert(m, qt.dtype)))
        # softmax is shift-invariant: the max is only for range, so no gradient flows
        # through it (as jax.nn.softmax); else the backward recomputes and counts its ties
        top = expand_reduced(b, b.stop_gradient(b.reduce_max(scores, axes=(n + 1,))), shape, (n + 1,))
        e = b.exp(b.sub(scores, top))
        p = b.div(e, expand_reduced(b, b.reduce_sum(e, axes=(n + 1,)), shape, (n + 1,)))
        p = b.select(b.eq(top, neg_inf), b.full(0.0, qt.dtype, shape), p)
        out = b.dot_general(p, v, lhs_contracting=(n + 1,), rhs_contracting=(n,),
                            lhs_batch=bd, rhs_batch=bd)
        return b.convert(out, d)


@sharding_rule("scaled_dot_product_attention")
def _attention_sharding(spec):
    """Batch and head dims shard q, k, v (and the mask) alike; query positions shard
    alone when no causal mask ties them to key positions. Key length and features, which
    attention reduces over, stay whole."""
    q, k, v = spec.in_shapes[:3]
    mask = spec.in_shapes[3] if len(spec.in_shapes) > 3 else None
    nd = len(q)

    def mask_placement(d):
        if mask is None:
            return ()
        md = d - (nd - len(mask))
        if md < 0 or mask[md] == 1 and q[d] != 1:
            return (R,)
        return (Shard(md),) if mask[md] == q[d] else None

    found = []
    for d in range(nd - 2):
        m = mask_placement(d)
        if m is not None and len(k) == nd and len(v) == nd and k[d] == q[d] == v[d]:
            found.append(Strategy((Shard(d),) * 3 + m, (Shard(d),)))
    if not spec.attrs.get("is_causal"):
        m = mask_placement(nd - 2)
        if m is not None:
            found.append(Strategy((Shard(nd - 2), R, R) + m, (Shard(nd - 2),)))
    return found
