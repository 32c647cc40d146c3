"""Primitives that make values from nothing: full, iota, constant, random bits.

Random numbers are counter-based (Threefry-2x32, 20 rounds, as JAX and Random123):
bits depend only on the key and the element's index, so eager, compiled and
every backend produce the same stream, in any order and on any number of threads.
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.ops.rules import contiguous, check_rank
from kiln.ir.registry import PRIMITIVE, REQUIRED, defop
from kiln.ir.shapes import dim, normalize_axis
from kiln.ir.sharding import run_whole, sharding_rule
from kiln.ir.types import TensorType

_SCALARS = (bool, int, float)


def _check_shape_attr(op, shape):
    if not isinstance(shape, (tuple, list)):
        raise KilnArgumentError(f"{op}: attribute shape must be a tuple of sizes, got {shape!r}")
    dims = tuple(dim(d) for d in shape)
    for d in dims:
        if isinstance(d, int) and d < 0:
            raise KilnArgumentError(f"{op}: negative size {d} in shape {list(dims)}")
    return dims


@defop("full", family="creation", kind=PRIMITIVE, num_operands=0,
       attrs={"value": REQUIRED, "dtype": REQUIRED, "shape": ()}, differentiable=False)
class full:
    """A tensor of `shape` filled with the scalar `value` (an int wraps into an integer
    dtype, as a C cast and torch's weak scalars do)."""

    def type(op, *, value, dtype, shape):
        if not isinstance(value, _SCALARS):
            raise KilnArgumentError(f"full: value must be a bool, int or float, got {value!r}")
        if isinstance(value, int) and not -2**63 <= value < 2**64:
            raise KilnArgumentError(f"full: integer value {value} does not fit in 64 bits")
        dtype = dt.dtype(dtype)
        if dtype.is_complex:
            raise KilnDTypeError("full: complex fills are made from two float32 fills "
                                 "with complex(); full takes a real dtype")
        return TensorType(dtype, _check_shape_attr(op, shape))

    def reference(*, value, dtype, shape):
        np_dtype = dt.dtype(dtype).np_dtype
        if np_dtype.kind in "iu" and isinstance(value, int) and not isinstance(value, bool):
            low, high = int(np.iinfo(np_dtype).min), int(np.iinfo(np_dtype).max)
            value = (value - low) % (high - low + 1) + low  # wraps, as a C cast (and torch)
        return np.full(shape, value, dtype=np_dtype)


@defop("iota", family="creation", kind=PRIMITIVE, num_operands=0,
       attrs={"dtype": REQUIRED, "shape": REQUIRED, "dimension": 0}, differentiable=False)
class iota:
    """Indices along `dimension`, broadcast over `shape` (arange is iota of rank 1)."""

    def type(op, *, dtype, shape, dimension):
        dims = _check_shape_attr(op, shape)
        normalize_axis(op, dimension, len(dims), "dimension")
        dtype = dt.dtype(dtype)
        if dtype.is_bool or dtype.is_complex:
            raise KilnDTypeError(f"iota: dtype {dtype} is not an integer or floating dtype")
        return TensorType(dtype, dims)

    def reference(*, dtype, shape, dimension):
        rank = len(shape)
        axis = dimension % max(rank, 1)
        line = np.arange(shape[axis] if rank else 1).astype(dt.dtype(dtype).np_dtype)
        if rank == 0:
            return line.reshape(())
        view = [1] * rank
        view[axis] = shape[axis]
        return contiguous(np.broadcast_to(line.reshape(view), shape))


@defop("constant", family="creation", kind=PRIMITIVE, num_operands=0,
       attrs={"name": REQUIRED, "dtype": REQUIRED, "shape": REQUIRED}, differentiable=False)
class constant:
    """Data stored with the graph (`graph.constants[name]`; `.npy` in a .kir file).
    It has no standalone reference: interpreters read the graph's constants."""

    def type(op, *, name, dtype, shape):
        if not isinstance(name, str) or not name:
            raise KilnArgumentError(f"constant: name must be a non-empty string, got {name!r}")
        return TensorType(dt.dtype(dtype), _check_shape_attr(op, shape))


_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)


_CHUNK = 1 << 14  # elements per block: the two words and a scratch stay in L1/L2


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds over uint32 arrays (Salmon et al., SC'11).

    Computed in place on blocks of _CHUNK elements (a fused kernel's 5 numpy passes per
    round otherwise stream every temporary through memory: Dropout's 512x1024 mask in a
    compiled training step, where random_bits runs as this extern, took 15-28 ms)."""
    k0, k1 = np.uint32(k0), np.uint32(k1)
    ks = (k0, k1, np.uint32(k0 ^ k1 ^ np.uint32(0x1BD11BDA)))
    x0, x1 = np.broadcast_arrays(np.asarray(x0, np.uint32), np.asarray(x1, np.uint32))
    y0, y1 = np.empty(x0.shape, np.uint32), np.empty(x1.shape, np.uint32)
    f0, f1, out0, out1 = x0.reshape(-1), x1.reshape(-1), y0.reshape(-1), y1.reshape(-1)
    tmp = np.empty(min(_CHUNK, max(1, out0.size)), np.uint32)
    # the key words added every 4 rounds: word 1 gets the round count too (wrapping)
    inject = [(ks[s % 3], np.uint32((int(ks[(s + 1) % 3]) + s) & 0xFFFFFFFF)) for s in range(1, 6)]
    for lo in range(0, out0.size, _CHUNK):
        hi = min(lo + _CHUNK, out0.size)
        a, b, t = out0[lo:hi], out1[lo:hi], tmp[:hi - lo]
        np.add(f0[lo:hi], ks[0], out=a)
        np.add(f1[lo:hi], ks[1], out=b)
        for i in range(20):
            r = _ROTATIONS[i % 8]
            np.add(a, b, out=a)
            np.left_shift(b, np.uint32(r), out=t)
            np.right_shift(b, np.uint32(32 - r), out=b)
            np.bitwise_or(b, t, out=b)
            np.bitwise_xor(b, a, out=b)
            if i % 4 == 3:
                add0, add1 = inject[i // 4]
                np.add(a, add0, out=a)
                np.add(b, add1, out=b)
    return y0, y1


@defop("random_bits", family="creation", kind=PRIMITIVE, num_operands=1,
       attrs={"shape": REQUIRED}, differentiable=False)
class random_bits:
    """uint32 random bits of `shape` from a key u32[2]. Element j is word j % 2 of
    threefry2x32(key, counter=j // 2), so any element is computable on its own."""

    def type(op, key, *, shape):
        check_rank(op, key, 1, "key")
        if key.dtype != dt.uint32 or key.shape != (2,):
            raise KilnDTypeError(f"random_bits: key must be u32[2], got {key}")
        return TensorType(dt.uint32, _check_shape_attr(op, shape))

    def reference(key, *, shape):
        n = int(np.prod(shape, dtype=np.int64))
        m = (n + 1) // 2
        counter = np.arange(m, dtype=np.uint64)
        with np.errstate(over="ignore"):
            y0, y1 = threefry2x32(key[0], key[1], (counter & 0xFFFFFFFF).astype(np.uint32),
                                  (counter >> np.uint64(32)).astype(np.uint32))
        bits = np.empty(2 * m, dtype=np.uint32)
        bits[0::2], bits[1::2] = y0, y1
        return bits[:n].reshape(shape)


# made whole on every rank: a sharded tensor is made by distributing one
sharding_rule("constant", "full", "iota", "random_bits")(run_whole)
