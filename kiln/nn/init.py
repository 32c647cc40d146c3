"""Initial weights: PyTorch's default schemes, drawn from kiln's counter-based RNG.

Each function *makes* a tensor (kiln tensors are values, so there is no in-place
`uniform_`). A `seed` makes the result reproducible; without one the key comes from
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
