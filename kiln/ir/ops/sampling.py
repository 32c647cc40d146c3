"""Random sampling composites over the random_bits primitive: uniform and normal
(threefry-keyed, as jax.random; the key is a u32[2] tensor).

Their reference is the decomposition run eagerly, so every backend and the reference
give the same bits.
"""

from __future__ import annotations

import math

from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.emitter import EAGER
from kiln.ir.ops.creation import _check_shape_attr
from kiln.ir.ops.nn import NUMBER
from kiln.ir.registry import COMPOSITE, REQUIRED, defop
from kiln.ir.shapes import dims_equal
from kiln.ir.sharding import run_whole, sharding_rule
from kiln.ir.types import TensorType


# -- random sampling ------------------------------------------------------------------------

def _random_type(op, key, shape, dtype):
    if key.dtype != dt.uint32 or key.rank != 1 or not dims_equal(key.shape[0], 2):
        raise KilnDTypeError(f"{op}: key must be u32[2], got {key}")
    d = dt.dtype(dtype)
    if not d.is_floating:
        raise KilnDTypeError(f"{op}: dtype {d} is not a floating dtype")
    return TensorType(d, _check_shape_attr(op, shape))


def _unit(b, bits, dtype):
    """Uniform [0, 1) in float32 from the top mantissa bits (no more than `dtype` holds,
    so the value is exact in it): exponent of 1.0 or-ed in gives [1, 2), minus 1."""
    nmant = min(23, int(dt.finfo(dtype).nmant))
    m = b.binary("shift_right_logical", bits, 32 - nmant)
    if nmant < 23:
        m = b.binary("shift_left", m, 23 - nmant)
    one_to_two = b.bitcast_convert(b.binary("or", m, 0x3F800000), dtype=dt.float32)
    return b.binary("sub", one_to_two, 1.0)


@defop("uniform", family="nn", kind=COMPOSITE, num_operands=1, differentiable=False,
       attrs={"shape": REQUIRED, "dtype": dt.float32, "low": 0.0, "high": 1.0})
class uniform:
    """Uniform samples in [low, high) from a u32[2] key (computed in float32, then
    converted; at most 23 random mantissa bits)."""

    def type(op, key, *, shape, dtype, low, high):
        if not isinstance(low, NUMBER) or not isinstance(high, NUMBER) or not low < high:
            raise KilnArgumentError(f"uniform: needs numbers low < high, got {low!r}, {high!r}")
        return _random_type(op, key, shape, dtype)

    # the reference is the decomposition run eagerly: bit-exact by construction
    reference = lambda key, **attrs: EAGER.decompose("uniform", [key], attrs)[0]  # noqa: E731

    def decompose(b, key, *, shape, dtype, low, high):
        u = _unit(b, b.random_bits(key, shape=tuple(shape)), dtype)
        u = b.binary("add", b.binary("mul", u, float(high) - float(low)), float(low))
        return b.convert(u, dtype)


@defop("normal", family="nn", kind=COMPOSITE, num_operands=1, differentiable=False,
       attrs={"shape": REQUIRED, "dtype": dt.float32})
class normal:
    """Standard normal samples from a u32[2] key (Box-Muller on two uniform streams,
    in float32, then converted)."""

    def type(op, key, *, shape, dtype):
        return _random_type(op, key, shape, dtype)

    reference = lambda key, **attrs: EAGER.decompose("normal", [key], attrs)[0]  # noqa: E731

    def decompose(b, key, *, shape, dtype):
        dims = tuple(shape)
        bits = b.random_bits(key, shape=(2,) + dims)
        halves = [b.reshape(b.slice(bits, start=(i,) + (0,) * len(dims), limit=(i + 1,) + dims,
                                    stride=None), shape=dims) for i in (0, 1)]
        u1 = b.binary("sub", 1.0, _unit(b, halves[0], dt.float32))  # (0, 1]: log stays finite
        radius = b.sqrt(b.binary("mul", b.log(u1), -2.0))
        theta = b.binary("mul", _unit(b, halves[1], dt.float32), 2.0 * math.pi)
        return b.convert(b.mul(radius, b.cos(theta)), dtype)


sharding_rule("uniform", "normal")(run_whole)  # one key, whole samples on every rank
