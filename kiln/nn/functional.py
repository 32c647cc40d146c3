"""`kiln.nn.functional` (import as F): torch.nn.functional's names on kiln tensors.

The activations, normalizations and attention are kiln's own functions, re-exported;
the losses and `dropout`/`embedding` are written here with kiln ops, so everything
differentiates with `kn.grad` and compiles with `kn.compile`.

    >>> from kiln.nn import functional as F
    >>> F.cross_entropy(logits, target, label_smoothing=0.1)
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.frontend.functional import (  # noqa: F401 - re-exported
    conv2d, gelu, layer_norm, linear, log_softmax, relu, rms_norm, sigmoid, silu, softmax,
    softplus, tanh,
)
from kiln.frontend.functional import scaled_dot_product_attention as _attention
from kiln.frontend.shape_ops import pad  # noqa: F401 - re-exported
from kiln.frontend.selection import one_hot  # noqa: F401 - re-exported
from kiln.nn.conv import (  # noqa: F401 - re-exported
    adaptive_avg_pool1d, adaptive_avg_pool2d, adaptive_avg_pool3d, adaptive_max_pool1d,
    adaptive_max_pool2d, adaptive_max_pool3d, avg_pool1d, avg_pool2d, avg_pool3d, conv1d, conv3d,
    max_pool1d, max_pool2d, max_pool3d,
)
from kiln.nn.norm import batch_norm, group_norm, instance_norm  # noqa: F401 - re-exported
from kiln.nn.resample import glu, interpolate  # noqa: F401 - re-exported

__all__ = [
    "binary_cross_entropy_with_logits", "conv2d", "cross_entropy", "dropout", "embedding", "gelu",
    "l1_loss", "layer_norm", "linear", "log_softmax", "mse_loss", "nll_loss", "pad", "relu",
    "rms_norm", "scaled_dot_product_attention", "sigmoid", "silu", "softmax", "softplus", "tanh",
    "one_hot", "conv1d", "conv3d", "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d",
    "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "batch_norm", "group_norm", "instance_norm", "glu", "interpolate",
]

_REDUCTIONS = ("none", "mean", "sum")


def _tensor(x):
    """`x` as a tensor; inside a trace an eager tensor becomes a graph constant right away,
    so what the loss derives from it (masks, gathered weights) is computed in the graph
    rather than baked in as one constant per intermediate."""
    from kiln.frontend.dispatch import current_builder
    from kiln.frontend.functional import _tensor as as_tensor
    from kiln.frontend.tensor import Tensor

    t = as_tensor(x)
    builder = current_builder()
    if builder is not None and not t.is_traced and not t.requires_grad:  # a taped one keeps its tape
        return Tensor._make(builder.constant(t.numpy()), builder)
    return t


def _reduce(op: str, loss, reduction: str):
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise KilnArgumentError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _check_same_shape(op: str, input, target):
    if tuple(input.shape) != tuple(target.shape):
        raise KilnShapeError(f"{op}: input {input.dtype.short}{list(input.shape)} and target "
                             f"{target.dtype.short}{list(target.shape)} must have the same shape")


def dropout(x, p: float = 0.5, training: bool = True, *, key=None, seed: int | None = None):
    """Inverted dropout: zero each element with probability `p`, scale the rest by
    1 / (1 - p); the identity when `training` is False.

    The mask comes from `key` (a u32[2] tensor: a compiled function takes it as an
    input), else from `seed`, else from the active `kn.nn.rng(key)` block, else from
    kiln's global stream (eager only).
    """
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import _floating, ge, mul, to
    from kiln.nn import random

    if not 0.0 <= p <= 1.0:
        raise KilnArgumentError(f"dropout: p must be in [0, 1], got {p}")
    x = _floating(x)
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return mul(x, 0.0)
    if key is None:
        key = random.key(seed) if seed is not None else random.next_key()
    u = apply("uniform", random._check_key(key), shape=tuple(x.shape), dtype=dt.float32)
    return mul(x, mul(to(ge(u, float(p)), x.dtype), 1.0 / (1.0 - p)))


def embedding(input, weight, padding_idx: int | None = None):
    """Rows of `weight` [num_embeddings, dim] at the integer `input` indices: the result
    is input.shape + [dim]. The row at `padding_idx` gets no gradient (torch's rule)."""
    from kiln.frontend.functional import eq, where
    from kiln.frontend.shape_ops import index_select, reshape, unsqueeze

    idx = _tensor(input)
    weight = _tensor(weight)
    if not idx.dtype.is_integer:
        raise KilnDTypeError(f"embedding: indices must be an integer tensor, got {idx.dtype}")
    if weight.ndim != 2:
        raise KilnShapeError(f"embedding: weight must be 2-D [num_embeddings, dim], got "
                             f"{weight.dtype.short}{list(weight.shape)}")
    rows = index_select(weight, 0, reshape(idx, (-1,)))
    out = reshape(rows, tuple(idx.shape) + (weight.shape[1],))
    if padding_idx is not None:
        from kiln.frontend.autodiff import stop_gradient

        pad = unsqueeze(eq(idx, padding_idx % weight.shape[0]), -1)
        out = where(pad, stop_gradient(out), out)
    return out


def mse_loss(input, target, reduction: str = "mean"):
    """Mean squared error: ((input - target) ** 2), reduced."""
    input, target = _tensor(input), _tensor(target)
    _check_same_shape("mse_loss", input, target)
    diff = input - target
    return _reduce("mse_loss", diff * diff, reduction)


def l1_loss(input, target, reduction: str = "mean"):
    """Mean absolute error: |input - target|, reduced."""
    input, target = _tensor(input), _tensor(target)
    _check_same_shape("l1_loss", input, target)
    return _reduce("l1_loss", (input - target).abs(), reduction)


def _class_dim(op: str, input) -> int:
    if input.ndim == 0:
        raise KilnShapeError(f"{op}: input must have a class dim, got a scalar")
    return 0 if input.ndim == 1 else 1


def _pick(logp, target, class_dim: int):
    """logp[n, target[n], d...] along the class dim, as a masked sum over a one-hot
    compare: its gradient is a `select`, which fuses into the softmax's kernel (a
    gather's would be a scatter); the sum adds exact zeros, so the value is exact."""
    from kiln.frontend.factories import arange
    from kiln.frontend.functional import eq, to, where
    from kiln.frontend.shape_ops import reshape, unsqueeze

    classes = logp.shape[class_dim]
    index = dt.int32 if isinstance(classes, int) and classes < 2 ** 31 else dt.int64
    # int32 where the classes fit (a target past them is check_index's error first):
    # the compare runs on twice the lanes of int64 (a (4096, 1000) loss: 1.36 -> 1.29 ms)
    iota = reshape(arange(classes, dtype=index),
                   tuple(classes if i == class_dim else 1 for i in range(logp.ndim)))
    hit = eq(unsqueeze(to(target, index), class_dim), iota)
    return where(hit, logp, 0.0).sum(dim=class_dim)


def _class_weight_shape(ndim: int, class_dim: int, classes) -> tuple:
    return tuple(classes if i == class_dim else 1 for i in range(ndim))


def nll_loss(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean"):
    """Negative log likelihood of class indices `target` under log-probabilities `input`
    ([N, C] or [N, C, d...], or [C] with a scalar target), as torch."""
    return _indexed_loss("nll_loss", _tensor(input), target, weight, ignore_index, reduction, 0.0)


def cross_entropy(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0):
    """Cross entropy of logits `input` ([N, C], [N, C, d...] or [C]) against class indices
    (an integer `target` of shape [N] / [N, d...] / []) or class probabilities (a float
    `target` shaped like `input`), with torch's `weight`, `ignore_index`, `reduction` and
    `label_smoothing`.

    >>> F.cross_entropy(kn.randn(4, 10, seed=0), kn.tensor([1, 0, 9, 3]))
    """
    from kiln.frontend.functional import log_softmax as log_softmax_fn

    input, target = _tensor(input), _tensor(target)
    if not 0.0 <= label_smoothing <= 1.0:
        raise KilnArgumentError(f"cross_entropy: label_smoothing must be in [0, 1], got "
                                f"{label_smoothing}")
    class_dim = _class_dim("cross_entropy", input)
    if not target.dtype.is_floating and not label_smoothing and input.dtype in (dt.float32, dt.float64):
        # class indices: log_softmax's entry at the target, without log_softmax itself
        return _indexed_loss("cross_entropy", input, target, weight, ignore_index, reduction, 0.0,
                             pick=_pick_logits)
    logp = log_softmax_fn(input, dim=class_dim)
    if target.dtype.is_floating:
        return _soft_loss(logp, target, weight, reduction, label_smoothing, class_dim)
    return _indexed_loss("cross_entropy", logp, target, weight, ignore_index, reduction,
                         label_smoothing)


def _pick_logits(x, target, class_dim: int):
    """log_softmax(x)[n, target[n], d...] along the class dim with log_softmax's own
    arithmetic, (x[t] - max) - log(sum(exp(x - max))), but no [N, C] value made: x[t] is
    `_pick`'s masked sum (exact), and each of the three reductions reads x alone, so each
    fuses with what it computes (a (4096, 1000) loss: 5 passes over the logits and 3
    written intermediates before, 3 reads now). The max is a constant to the gradient
    (the gradient of log_softmax does not depend on it): where(hit, g, 0) - softmax * g."""
    from kiln.frontend.autodiff import stop_gradient
    from kiln.frontend.functional import exp, log
    from kiln.frontend.reductions import amax

    top = stop_gradient(amax(x, dim=class_dim, keepdim=True))
    total = exp(x - top).sum(dim=class_dim)
    return (_pick(x, target, class_dim) - top.squeeze(class_dim)) - log(total)


def _soft_loss(logp, target, weight, reduction, smoothing, class_dim):
    from kiln.frontend.shape_ops import reshape

    _check_same_shape("cross_entropy", logp, target)
    classes = logp.shape[class_dim]
    if smoothing:
        target = target * (1.0 - smoothing) + smoothing / classes
    terms = logp * target
    if weight is not None:
        terms = terms * reshape(_tensor(weight), _class_weight_shape(logp.ndim, class_dim, classes))
    loss = -terms.sum(dim=class_dim)
    if reduction == "mean":  # torch divides by the number of samples, weighted or not
        return loss.mean() if loss.ndim else loss
    return _reduce("cross_entropy", loss, reduction)


def _indexed_loss(op, logp, target, weight, ignore_index, reduction, smoothing, pick=None):
    from kiln.frontend.dispatch import apply as _apply
    from kiln.frontend.functional import ne, to, where
    from kiln.frontend.shape_ops import index_select, reshape

    target = _tensor(target)
    if not target.dtype.is_integer:
        raise KilnDTypeError(f"{op}: class-index targets must be an integer tensor, got "
                             f"{target.dtype} (float targets are class probabilities, shaped "
                             "like the input)")
    class_dim = _class_dim(op, logp)
    expected = tuple(d for i, d in enumerate(logp.shape) if i != class_dim)
    if tuple(target.shape) != expected:
        raise KilnShapeError(f"{op}: target {target.dtype.short}{list(target.shape)} must have "
                             f"shape {list(expected)} for input {logp.dtype.short}"
                             f"{list(logp.shape)} (classes along dim {class_dim})")
    if reduction not in _REDUCTIONS:
        raise KilnArgumentError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    classes = logp.shape[class_dim]
    # the one-hot pick below selects nothing for a class out of range: check first, as torch
    target = _apply("check_index", target, size=classes, caller=op, what="target",
                   negative=False, ignore=int(ignore_index))
    valid = ne(target, ignore_index)
    safe = where(valid, target, 0)  # an ignored target still needs an in-range index
    keep = to(valid, logp.dtype)
    picked = -(pick or _pick)(logp, safe, class_dim)  # (pick: from the logits themselves)
    if weight is not None:
        weight = to(_tensor(weight), logp.dtype)
        w_t = reshape(index_select(weight, 0, reshape(safe, (-1,))), tuple(safe.shape)) * keep
    else:
        w_t = keep
    loss = picked * w_t
    if smoothing:
        terms = logp if weight is None else logp * reshape(
            weight, _class_weight_shape(logp.ndim, class_dim, classes))
        smooth = -terms.sum(dim=class_dim) * keep
        loss = loss * (1.0 - smoothing) + smooth * (smoothing / classes)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w_t.sum()  # torch: divided by the total weight of the kept targets


def binary_cross_entropy_with_logits(input, target, weight=None, reduction: str = "mean",
                                     pos_weight=None):
    """Sigmoid + binary cross entropy in one numerically stable expression (torch's):
    (1 - t) x + (1 + (pos_weight - 1) t) log(1 + exp(-x)), times `weight`."""
    from kiln.frontend.functional import exp, log1p, relu, to

    input = _tensor(input)
    target = to(_tensor(target), input.dtype)
    _check_same_shape("binary_cross_entropy_with_logits", input, target)
    softplus_neg = log1p(exp(-input.abs())) + relu(-input)  # log(1 + exp(-x)), stably
    if pos_weight is not None:
        log_weight = (to(_tensor(pos_weight), input.dtype) - 1.0) * target + 1.0
        loss = (1.0 - target) * input + log_weight * softplus_neg
    else:
        loss = (1.0 - target) * input + softplus_neg
    if weight is not None:
        loss = loss * to(_tensor(weight), input.dtype)
    return _reduce("binary_cross_entropy_with_logits", loss, reduction)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None):
    """torch.nn.functional.scaled_dot_product_attention, also `kn.scaled_dot_product_attention`:
    one attention op (a fused kernel when compiled); with `dropout_p` > 0, the weights are
    dropped with keys from the active `kn.nn.rng` block, a compiled module's key or kiln's
    global stream (see attention_with_dropout).

    >>> out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    if dropout_p:
        return attention_with_dropout(query, key, value, attn_mask, float(dropout_p),
                                      bool(is_causal), scale)
    return _attention(query, key, value, attn_mask, is_causal=is_causal, scale=scale)


def attention_with_dropout(query, key, value, attn_mask, p: float, is_causal: bool, scale):
    """SDPA with dropout on the attention weights, as torch: softmax(q k^T * scale + mask),
    dropped with probability p (inverted), times v. The mask's key comes from the active
    `kn.nn.rng` block, a compiled module's key, or kiln's global stream (eager)."""
    import math

    from kiln.frontend.functional import (
        _floating, _tensor, add, matmul, mul, softmax, to, where,
    )
    from kiln.frontend.selection import tril
    from kiln.frontend.shape_ops import transpose

    if not 0.0 <= p <= 1.0:
        raise KilnArgumentError(f"scaled_dot_product_attention: dropout_p must be in [0, 1], "
                                f"got {p}")
    q = _floating(query)
    k, v = to(key, q.dtype), to(value, q.dtype)
    s = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = mul(matmul(q, transpose(k, -2, -1)), s)
    if is_causal:
        from kiln.frontend.factories import ones

        keep = tril(ones(q.shape[-2], k.shape[-2], dtype=dt.bool_))
        scores = where(keep, scores, float("-inf"))
    if attn_mask is not None:
        mask = _tensor(attn_mask)
        scores = where(mask, scores, float("-inf")) if mask.dtype.is_bool \
            else add(scores, to(mask, q.dtype))
    return matmul(dropout(softmax(scores, -1), p), v)
