"""Initial weights: PyTorch's default schemes, drawn from kiln's counter-based RNG.

Each function without a trailing underscore *makes* a tensor; the torch names with
one (`normal_`, `zeros_`, `kaiming_uniform_`, ...) write into an existing tensor in place,
as torch.nn.init does, so tied weights stay tied. A `seed` makes the result reproducible; without one the key comes from
kiln's global stream, which `kn.manual_seed` resets, so a model built after
`kn.manual_seed(0)` is the same every run.

    >>> w = nn.init.kaiming_uniform((8, 4), seed=0)      # torch.nn.Linear's weight init
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt


def _key_tensor(seed, key):
    from kiln.frontend.factories import _key, tensor

    if key is not None:
        from kiln.nn.random import _check_key

        return _check_key(key)
    return tensor(_key(seed))


def uniform(shape, low: float = 0.0, high: float = 1.0, *, seed: int | None = None, key=None,
            dtype=dt.float32):
    """Samples uniform in [low, high) of `shape` (from `key`, a u32[2] tensor, or `seed`)."""
    from kiln.frontend.dispatch import apply

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not low < high:
        if low == high:
            from kiln.frontend.factories import full

            return full(shape, float(low), dtype)
        raise KilnArgumentError(f"uniform: needs low < high, got {low}, {high}")
    return apply("uniform", _key_tensor(seed, key), shape=shape, dtype=dt.dtype(dtype),
                 low=float(low), high=float(high))


def normal(shape, mean: float = 0.0, std: float = 1.0, *, seed: int | None = None, key=None,
           dtype=dt.float32):
    """Normal samples with `mean` and `std` (Box-Muller on Threefry bits)."""
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import to

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    z = apply("normal", _key_tensor(seed, key), shape=shape, dtype=dt.float32)
    if std != 1.0:
        z = z * float(std)
    if mean != 0.0:
        z = z + float(mean)
    return to(z, dtype)


def fans(shape) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of `shape` as torch computes them: [out, in, *kernel]."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise KilnArgumentError(f"fan in and fan out need a weight of rank >= 2, got {list(shape)}")
    receptive = int(np.prod(shape[2:])) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def kaiming_uniform(shape, a: float = math.sqrt(5), *, seed: int | None = None, key=None,
                    dtype=dt.float32):
    """He-uniform with leaky-relu slope `a` over fan_in; the default `a=sqrt(5)` is
    torch.nn.Linear's, giving bound 1/sqrt(fan_in)."""
    fan_in, _ = fans(shape)
    gain = math.sqrt(2.0 / (1 + a * a))
    bound = gain * math.sqrt(3.0 / fan_in) if fan_in else 0.0
    return uniform(shape, -bound, bound, seed=seed, key=key, dtype=dtype)


def xavier_uniform(shape, gain: float = 1.0, *, seed: int | None = None, key=None,
                   dtype=dt.float32):
    """Glorot-uniform: bound gain * sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = fans(shape)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform(shape, -bound, bound, seed=seed, key=key, dtype=dtype)


def layer_keys(seed: int | None, count: int) -> list:
    """`count` keys for the tensors of one layer: fold_in(key(seed), i), or fresh keys
    from the global stream when `seed` is None."""
    from kiln.frontend.factories import _key, tensor
    from kiln.nn.random import fold_in, key

    if seed is None:
        return [tensor(_key(None)) for _ in range(count)]
    base = key(seed)
    return [fold_in(base, i) for i in range(count)]


# -- in place, as torch.nn.init: each rebinds the tensor handle (kiln/frontend/mutation.py) --


def _fill(tensor, new):
    """Write `new` into `tensor` without recording a tape; ties stay tied because every
    module attribute that holds this tensor object sees the new value."""
    from kiln.frontend.mutation import rebind
    from kiln.frontend.tape import no_grad
    from kiln.frontend.tensor import Tensor

    if not isinstance(tensor, Tensor):
        raise KilnArgumentError(f"nn.init: expected a kn.Tensor, got {type(tensor).__name__}")
    with no_grad():
        return rebind(tensor, new, "nn.init")


def _float_dtype(tensor):
    return tensor.dtype if tensor.dtype.is_floating else dt.float32


def uniform_(tensor, a: float = 0.0, b: float = 1.0, generator=None):
    """Fill `tensor` with samples uniform in [a, b) (torch.nn.init.uniform_)."""
    return _fill(tensor, uniform(tuple(tensor.shape), a, b, dtype=_float_dtype(tensor)))


def normal_(tensor, mean: float = 0.0, std: float = 1.0, generator=None):
    """Fill `tensor` with normal samples (torch.nn.init.normal_).

    >>> nn.init.normal_(module.weight, mean=0.0, std=0.02)
    """
    return _fill(tensor, normal(tuple(tensor.shape), mean, std, dtype=_float_dtype(tensor)))


def trunc_normal_(tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator=None):
    """Normal samples truncated to [a, b], by inverse-CDF sampling (torch's method)."""
    from kiln.frontend.functional import clamp

    lo = 0.5 * (1 + math.erf((a - mean) / (std * math.sqrt(2))))
    hi = 0.5 * (1 + math.erf((b - mean) / (std * math.sqrt(2))))
    u = uniform(tuple(tensor.shape), 2 * lo - 1, 2 * hi - 1, dtype=dt.float64)
    z = _erfinv(u) * (std * math.sqrt(2.0)) + mean
    return _fill(tensor, clamp(z, a, b))


def _erfinv(y):
    """erf^-1 by Giles' single-precision polynomial, then two Newton steps in float64."""
    from kiln.frontend.functional import erf, exp, log, sqrt, where

    w = -log((1.0 - y) * (1.0 + y))
    small = w < 5.0
    ws, wl = w - 2.5, sqrt(where(small, 5.0, w)) - 3.0
    p1 = [2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
          -0.00125372503, -0.00417768164, 0.246640727, 1.50140941]
    p2 = [-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
          -0.0076224613, 0.00943887047, 1.00167406, 2.83297682]
    a, b = p1[0], p2[0]
    for c1, c2 in zip(p1[1:], p2[1:]):
        a = a * ws + c1
        b = b * wl + c2
    x = where(small, a, b) * y
    for _ in range(2):
        x = x - (erf(x) - y) / (2.0 / math.sqrt(math.pi) * exp(-x * x))
    return x


def constant_(tensor, val: float):
    from kiln.frontend.factories import full_like

    return _fill(tensor, full_like(tensor, val))


def zeros_(tensor):
    return constant_(tensor, 0.0)


def ones_(tensor):
    return constant_(tensor, 1.0)


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """torch.nn.init.calculate_gain."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "sigmoid", "identity"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise KilnArgumentError(f"calculate_gain: unknown nonlinearity {nonlinearity!r}")


def _fan(tensor, mode: str) -> int:
    fan_in, fan_out = fans(tensor.shape)
    if mode not in ("fan_in", "fan_out"):
        raise KilnArgumentError(f"kaiming init: mode must be 'fan_in' or 'fan_out', got {mode!r}")
    return fan_in if mode == "fan_in" else fan_out


def kaiming_uniform_(tensor, a: float = 0.0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu", generator=None):
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / _fan(tensor, mode))
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor, a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu", generator=None):
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode)))


def xavier_uniform_(tensor, gain: float = 1.0, generator=None):
    fan_in, fan_out = fans(tensor.shape)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor, gain: float = 1.0, generator=None):
    fan_in, fan_out = fans(tensor.shape)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))
