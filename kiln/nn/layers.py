"""The standard layers: Linear, LayerNorm, RMSNorm, Embedding, Dropout and the
activation modules. Constructor arguments, parameter names, shapes and default
initializations are torch.nn's, so weights load across with `load_state_dict`.

Every layer that makes random weights takes `seed=`: with it the weights are the same
on every run; without it they come from kiln's global stream (`kn.manual_seed`).
"""

from __future__ import annotations

import math

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.frontend import functional as KF
from kiln.nn import functional as F
from kiln.nn import init
from kiln.nn.module import Module


def _shape_tuple(normalized_shape) -> tuple:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise KilnArgumentError(f"normalized_shape must be a positive int or a non-empty tuple "
                                f"of them, got {normalized_shape!r}")
    return shape


class Linear(Module):
    """y = x @ weight.T + bias, with weight [out_features, in_features] (torch's layout
    and init: kaiming-uniform weight and bias uniform in +-1/sqrt(in_features)).

    >>> fc = nn.Linear(4, 8, seed=0)
    >>> fc(kn.ones(2, 4)).shape
    (2, 8)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype=dt.float32, seed: int | None = None) -> None:
        super().__init__()
        if in_features < 0 or out_features < 0:
            raise KilnArgumentError(f"Linear: feature counts must be >= 0, got "
                                    f"({in_features}, {out_features})")
        self.in_features, self.out_features = int(in_features), int(out_features)
        k_weight, k_bias = init.layer_keys(seed, 2)
        self.weight = init.kaiming_uniform((out_features, in_features), key=k_weight, dtype=dtype)
        if bias:
            bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
            self.bias = init.uniform((out_features,), -bound, bound, key=k_bias, dtype=dtype)
        else:
            self.bias = None

    def forward(self, x):
        return KF.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class LayerNorm(Module):
    """Normalize over the last dims `normalized_shape`, then scale and shift (weight
    ones, bias zeros), as torch.nn.LayerNorm."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, dtype=dt.float32) -> None:
        super().__init__()
        self.normalized_shape = _shape_tuple(normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        from kiln.frontend.factories import ones, zeros

        self.weight = ones(*self.normalized_shape, dtype=dtype) if elementwise_affine else None
        self.bias = zeros(*self.normalized_shape, dtype=dtype) if elementwise_affine and bias else None

    def forward(self, x):
        return KF.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class RMSNorm(Module):
    """x / sqrt(mean(x**2) + eps) * weight over the last dims; `eps=None` uses the
    input dtype's machine epsilon, as torch.nn.RMSNorm."""

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, dtype=dt.float32) -> None:
        super().__init__()
        self.normalized_shape = _shape_tuple(normalized_shape)
        self.eps = None if eps is None else float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        from kiln.frontend.factories import ones

        self.weight = ones(*self.normalized_shape, dtype=dtype) if elementwise_affine else None

    def forward(self, x):
        return KF.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class Embedding(Module):
    """A lookup table: `Embedding(n, d)(idx)` is `weight[idx]`, shape idx.shape + [d].
    The weight is standard normal (torch's init); the `padding_idx` row starts at zero
    and gets no gradient."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 dtype=dt.float32, seed: int | None = None) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise KilnArgumentError(f"Embedding: padding_idx {padding_idx} is out of range "
                                        f"for {num_embeddings} embeddings")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.padding_idx = padding_idx
        (k,) = init.layer_keys(seed, 1)
        weight = init.normal((num_embeddings, embedding_dim), key=k, dtype=dtype)
        if padding_idx is not None:
            from kiln.frontend.factories import arange

            keep = KF.ne(arange(num_embeddings), padding_idx).reshape(num_embeddings, 1)
            weight = KF.where(keep, weight, 0.0)
        self.weight = weight

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class Dropout(Module):
    """Zero each element with probability `p` in training mode and scale the rest by
    1 / (1 - p); the identity in evaluation mode (after `.eval()`).

    Where the mask's key comes from, first match wins:

    1. an active `with nn.rng(key):` block: the n-th random draw inside it uses
       `nn.random.fold_in(key, n)`. This is the way to train compiled: pass `key` into the
       compiled step as an argument, a new one per step, and the masks change every step
       without recompiling; eager and compiled runs with the same key draw the same masks.
    2. the layer's own `seed`: call i uses `fold_in(key(seed), i)` (eager only);
    3. kiln's global stream (`kn.manual_seed`), eager only.

    Inside a traced or compiled function without an `nn.rng` block a Dropout in training
    mode raises (its key would be baked in, the same mask every step); `kn.compile(model)`
    supplies a fresh key on each call by itself.
    """

    def __init__(self, p: float = 0.5, seed: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise KilnArgumentError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = float(p)
        self.seed = seed
        from kiln.nn import random

        self._stream = None if seed is None else random._Stream(random.key(seed))

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        from kiln.nn import random

        return F.dropout(x, self.p, key=random.next_key(self._stream) if self.p < 1.0 else None)

    def _needs_rng(self) -> bool:
        return self.training and 0.0 < self.p < 1.0

    def extra_repr(self) -> str:
        return f"p={self.p}"


# -- activations --------------------------------------------------------------------------


class Identity(Module):
    """Returns its input."""

    def forward(self, x):
        return x


class ReLU(Module):
    def forward(self, x):
        return KF.relu(x)


class GELU(Module):
    """gelu(x, approximate="none" | "tanh")."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise KilnArgumentError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return KF.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Module):
    def forward(self, x):
        return KF.silu(x)


class Tanh(Module):
    def forward(self, x):
        return KF.tanh(x)


class Sigmoid(Module):
    def forward(self, x):
        return KF.sigmoid(x)


class Softmax(Module):
    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return KF.softmax(x, dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
