"""Shared pieces of type rules and references: dtype checks that name the op, and
numerics helpers (low-precision floats are computed in float32, then rounded)."""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnArgumentError, KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import format_shape, normalize_axis, shapes_equal
from kiln.ir.quiet_numpy import quietly
from kiln.ir.types import TensorType

FLOATING = "floating"
INEXACT = "floating or complex"
NUMERIC = "numeric (not bool)"
INTEGRAL = "integer or bool"
INTEGER = "integer"
ANY = "any"
REAL = "real (not complex)"

_ALLOWED = {
    FLOATING: lambda d: d.is_floating,
    INEXACT: lambda d: d.is_inexact,
    NUMERIC: lambda d: not d.is_bool,
    INTEGRAL: lambda d: d.is_integer or d.is_bool,
    INTEGER: lambda d: d.is_integer,
    ANY: lambda d: True,
    REAL: lambda d: not d.is_complex,
}


def check_dtype(op: str, t: TensorType, allowed: str, what: str = "operand") -> None:
    if not _ALLOWED[allowed](t.dtype):
        raise KilnDTypeError(f"{op}: {what} of type {t} is not supported; {op} needs a "
                             f"{allowed} dtype")


def check_same(op: str, *types: TensorType) -> TensorType:
    """Primitives take operands already promoted and broadcast (the IR is explicit)."""
    first = types[0]
    for t in types[1:]:
        if t.dtype != first.dtype:
            raise KilnDTypeError(
                f"{op}: operands must have one dtype, got {', '.join(map(str, types))}; "
                "insert a convert (the frontend does this for you)")
        if not shapes_equal(t.shape, first.shape):
            raise KilnShapeError(
                f"{op}: operands must have one shape, got {', '.join(map(str, types))}; "
                "insert a broadcast_in_dim (the frontend does this for you)")
    return first


def check_int_tuple(op: str, name: str, value, length: int | None = None) -> tuple:
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise KilnArgumentError(f"{op}: attribute {name} must be a tuple of ints, got {value!r}")
    if length is not None and len(value) != length:
        raise KilnArgumentError(f"{op}: attribute {name} must have {length} entries, got {len(value)}")
    return tuple(value)


def check_axes(op: str, axes, rank: int, name: str = "axes") -> tuple[int, ...]:
    axes = check_int_tuple(op, name, axes)
    normalized = tuple(normalize_axis(op, a, rank, name) for a in axes)
    if len(set(normalized)) != len(normalized):
        raise KilnArgumentError(f"{op}: {name} {axes} repeats a dim")
    return normalized


def check_rank(op: str, t: TensorType, rank: int | tuple, what: str = "operand") -> None:
    ranks = (rank,) if isinstance(rank, int) else rank
    if t.rank not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise KilnShapeError(f"{op}: {what} must have rank {want}, got {t} "
                             f"(shape {format_shape(t.shape)})")


LOW_PRECISION = {np.dtype(d.np_dtype) for d in dt.FLOAT_DTYPES if d.bits < 32}


def compute_dtype(x: np.ndarray) -> np.dtype:
    return np.dtype(np.float32) if x.dtype in LOW_PRECISION else x.dtype


def _rounded(dtype, fn, *arrays, **attrs):
    return np.asarray(fn(*arrays, **attrs)).astype(dtype)


def via_f32(fn):
    """Wrap a float reference: low-precision inputs are computed in float32 and rounded
    back once, as every backend does, so results are correctly rounded."""

    def reference(*arrays, **attrs):
        out_dtype = arrays[0].dtype
        if out_dtype in LOW_PRECISION:
            arrays = tuple(a.astype(np.float32) if a.dtype == out_dtype else a for a in arrays)
            return quietly(_rounded, out_dtype, fn, *arrays, **attrs)
        result = quietly(fn, *arrays, **attrs)
        if type(result) is np.ndarray and result.dtype is out_dtype:
            return result
        return np.asarray(result, dtype=out_dtype)

    reference.__name__ = getattr(fn, "__name__", "reference")
    reference.float_fn = fn
    return reference


def contiguous(x) -> np.ndarray:
    """A C-contiguous array with x's shape (np.ascontiguousarray makes 0-d arrays 1-d)."""
    return np.require(x, requirements="C")


# -- emitter helpers shared by vjp rules -----------------------------------------------


def full_like(b, t: TensorType, value):
    """A tensor of type t filled with value (complex from two float32 fills: full is real)."""
    if t.dtype.is_complex:
        return b.complex(b.full(value, dt.float32, t.shape), b.full(0.0, dt.float32, t.shape))
    return b.full(value, t.dtype, t.shape)


def zeros(b, t: TensorType):
    return full_like(b, t, 0)


def conj(b, x):
    """The complex conjugate (real values pass through; kiln has no conj primitive)."""
    if not b.type_of(x).dtype.is_complex:
        return x
    return b.complex(b.real(x), b.neg(b.imag(x)))
