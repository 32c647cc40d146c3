"""Random keys for layers that draw randomness (Dropout, attention dropout).

A key is a `u32[2]` tensor, the same key kiln's random ops take (`uniform`, `normal`,
`random_bits`: counter-based Threefry, so the bits depend only on the key). Because a
key is a tensor, a compiled training step takes it as an *input*: a new key each step
gives new dropout masks without recompiling, and eager and compiled code draw the same
masks from the same key.

    >>> key = nn.random.key(0)
    >>> with nn.rng(nn.random.fold_in(key, step)):     # one key per training step
    ...     loss = loss_fn(params, x, y)               # Dropout layers draw from it

Inside `rng(key)` the n-th draw (in call order, which Python fixes) uses
`fold_in(key, n)`, so every Dropout layer and every call of it gets its own mask.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt

_MASK = 0xFFFFFFFF
_state = threading.local()


def key(seed: int):
    """The `u32[2]` key of an integer seed (the key `kn.rand(..., seed=seed)` uses).

    >>> nn.random.key(0)
    tensor([0, 0], dtype=kiln.uint32)
    """
    from kiln.frontend.factories import tensor

    seed = int(seed)
    return tensor(np.array([seed & _MASK, (seed >> 32) & _MASK], dtype=np.uint32))


def _check_key(k, what: str = "key"):
    from kiln.frontend.functional import _tensor

    k = _tensor(k)
    if k.dtype != dt.uint32 or len(k.shape) != 1 or k.shape[0] != 2:
        raise KilnDTypeError(f"{what} must be a u32[2] key tensor (nn.random.key(seed)), got "
                             f"{k.dtype.short}{list(k.shape)}")
    return k


def fold_in(k, data):
    """A new key from `k` and an integer `data` (a Python int, or an integer scalar tensor
    such as the step count of a compiled training step): Threefry-2x32 of the counter
    `data` under key `k`, as `jax.random.fold_in`. It equals row `data` of
    `split(k, n)`, and an int and a tensor holding the same value give the same key, so
    eager and compiled code agree.
    """
    from kiln.frontend.factories import tensor

    k = _check_key(k)
    if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
        data = int(data)
        if not 0 <= data < 2 ** 64:
            raise KilnArgumentError(f"fold_in: data must be in [0, 2**64), got {data}")
        if not k.is_traced:  # a concrete key: the block computed here, in numpy
            from kiln.ir.ops.creation import threefry2x32

            with np.errstate(over="ignore"):
                y0, y1 = threefry2x32(*k.numpy(), np.array([data & _MASK], np.uint32),
                                      np.array([data >> 32], np.uint32))
            return tensor(np.concatenate([y0, y1]).astype(np.uint32))
        if data < _SMALL:  # counter block `data` of the key's random_bits stream
            from kiln.frontend.dispatch import apply
            from kiln.frontend.shape_ops import narrow

            return narrow(apply("random_bits", k, shape=(2 * data + 2,)), 0, 2 * data, 2)
        lo, hi = tensor(np.array([data & _MASK], np.uint32)), tensor(np.array([data >> 32], np.uint32))
        return _threefry(k, lo, hi)
    from kiln.frontend.dispatch import binary
    from kiln.frontend.functional import _tensor, to
    from kiln.frontend.shape_ops import reshape

    data = _tensor(data)
    if data.ndim != 0 or not data.dtype.is_integer:
        raise KilnDTypeError(f"fold_in: data must be an int or an integer scalar tensor, got "
                             f"{data.dtype.short}{list(data.shape)}")
    lo = reshape(to(data, dt.uint32), (1,))
    if data.dtype.bits > 32:
        hi = reshape(to(binary("shift_right_logical", data, 32), dt.uint32), (1,))
    else:
        from kiln.frontend.factories import zeros

        hi = zeros(1, dtype=dt.uint32)
    return _threefry(k, lo, hi)


_SMALL = 64  # up to here a traced key folds in a Python int by slicing its bit stream
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)


def _threefry(k, x0, x1):
    """Threefry-2x32, 20 rounds, of the counter (x0, x1) (u32[1] tensors) under key `k`,
    written with kiln's uint32 ops (the same function random_bits computes per block)."""
    from kiln.frontend.dispatch import binary
    from kiln.frontend.shape_ops import cat, narrow

    k0, k1 = narrow(k, 0, 0, 1), narrow(k, 0, 1, 1)
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(20):
        x0 = x0 + x1
        r = _ROTATIONS[i % 8]
        x1 = binary("shift_left", x1, r) | binary("shift_right_logical", x1, 32 - r)
        x1 = x1 ^ x0
        if i % 4 == 3:
            s = i // 4 + 1
            x0 = x0 + ks[s % 3]
            x1 = x1 + ks[(s + 1) % 3] + s
    return cat([x0, x1])


def split(k, num: int = 2):
    """`num` new independent keys from `k`, stacked as `u32[num, 2]` (jax.random.split).

    >>> k, sub = nn.random.split(k)      # thread `k` through a loop, use `sub`
    """
    from kiln.frontend.dispatch import apply

    k = _check_key(k)
    if num < 1:
        raise KilnArgumentError(f"split: num must be >= 1, got {num}")
    return apply("random_bits", k, shape=(num, 2))


# -- the active key: `with nn.rng(key):` --------------------------------------------------


class _Stream:
    """A key and a count of the draws taken from it; `start` may be a traced tensor
    (a compiled module passes the position of an eager stream in as an input)."""

    __slots__ = ("key", "start", "draws")

    def __init__(self, k, start=0):
        self.key = k
        self.start = start
        self.draws = 0

    def next_key(self):
        n = self.draws
        self.draws += 1
        return fold_in(self.key, self.start + n if n else self.start)


def _stack() -> list:
    s = getattr(_state, "stack", None)
    if s is None:
        s = _state.stack = []
    return s


@contextlib.contextmanager
def rng(k, start=0):
    """Layers that draw randomness inside this block take their keys from `k`: the n-th
    draw uses `fold_in(k, start + n)`. `k` may be a concrete or a traced key; inside a
    compiled function pass it as an argument so each call can get a different one.

    >>> with nn.rng(nn.random.key(0)):
    ...     y = model(x)           # the same masks eagerly and compiled
    """
    stream = _Stream(_check_key(k, "rng: key"), start)
    stack = _stack()
    stack.append(stream)
    try:
        yield stream
    finally:
        stack.pop()


def current_stream() -> _Stream | None:
    """The innermost active `rng(...)` stream, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def next_key(seed_stream=None):
    """The key for one random draw: from the active `rng(...)` block if there is one,
    else from `seed_stream` (a layer's own seeded stream, a `_Stream`), else from kiln's
    global stream (`kn.manual_seed`). None of the last two is allowed while tracing:
    the key would be baked into the graph and every call would draw the same mask."""
    stream = current_stream()
    if stream is not None:
        return stream.next_key()
    from kiln.frontend.dispatch import current_builder

    if current_builder() is not None:
        from kiln.errors import KilnTraceError, user_location

        raise KilnTraceError(
            "a random layer (Dropout in training mode) ran inside a traced or compiled "
            "function without a key, so every call would reuse one baked-in mask",
            where=user_location(),
            hint="pass a key tensor as an argument and run the model inside "
                 "`with kn.nn.rng(key):` (a new key per step: nn.random.fold_in(key, step)), "
                 "call model.eval(), or compile the module itself with kn.compile(model)")
    if seed_stream is not None:
        return seed_stream.next_key()
    from kiln.frontend.factories import _key, tensor

    return tensor(_key(None))
