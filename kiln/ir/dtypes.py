"""kiln's element types.

A `DType` is a frozen value naming one element type: its short IR name (`f32`), its
numpy dtype (low-precision floats through ml_dtypes) and its category. Promotion
follows PyTorch: categories order bool < integer < floating < complex, and within a
category the wider type wins; mixing float16 with bfloat16, or the two float8
formats, goes to float32 because neither holds the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kiln.errors import KilnDTypeError

BOOL, INT, UINT, FLOAT, COMPLEX = "bool", "int", "uint", "float", "complex"


@dataclass(frozen=True, eq=True)
class DType:
    name: str  # the public name: kn.float32
    short: str  # the IR name: f32
    np_dtype: np.dtype
    category: str
    bits: int

    def __repr__(self) -> str:
        return f"kiln.{self.name}"

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self.short)

    def __eq__(self, other) -> bool:
        return isinstance(other, DType) and other.short == self.short

    @property
    def itemsize(self) -> int:
        return max(1, self.bits // 8)

    @property
    def is_floating(self) -> bool:
        return self.category == FLOAT

    @property
    def is_complex(self) -> bool:
        return self.category == COMPLEX

    @property
    def is_integer(self) -> bool:
        return self.category in (INT, UINT)

    @property
    def is_bool(self) -> bool:
        return self.category == BOOL

    @property
    def is_inexact(self) -> bool:
        return self.category in (FLOAT, COMPLEX)


def _d(name, short, np_type, category, bits) -> DType:
    return DType(name, short, np.dtype(np_type), category, bits)


bool_ = _d("bool", "i1", np.bool_, BOOL, 1)
uint8 = _d("uint8", "u8", np.uint8, UINT, 8)
uint32 = _d("uint32", "u32", np.uint32, UINT, 32)  # random bits
int8 = _d("int8", "i8", np.int8, INT, 8)
int16 = _d("int16", "i16", np.int16, INT, 16)
int32 = _d("int32", "i32", np.int32, INT, 32)
int64 = _d("int64", "i64", np.int64, INT, 64)
float8_e4m3fn = _d("float8_e4m3fn", "f8e4m3fn", ml_dtypes.float8_e4m3fn, FLOAT, 8)
float8_e5m2 = _d("float8_e5m2", "f8e5m2", ml_dtypes.float8_e5m2, FLOAT, 8)
bfloat16 = _d("bfloat16", "bf16", ml_dtypes.bfloat16, FLOAT, 16)
float16 = _d("float16", "f16", np.float16, FLOAT, 16)
float32 = _d("float32", "f32", np.float32, FLOAT, 32)
float64 = _d("float64", "f64", np.float64, FLOAT, 64)
complex64 = _d("complex64", "c64", np.complex64, COMPLEX, 64)

ALL_DTYPES: tuple[DType, ...] = (
    bool_, uint8, uint32, int8, int16, int32, int64,
    float8_e4m3fn, float8_e5m2, bfloat16, float16, float32, float64, complex64,
)
FLOAT_DTYPES = tuple(d for d in ALL_DTYPES if d.is_floating)
INT_DTYPES = tuple(d for d in ALL_DTYPES if d.is_integer)

_BY_SHORT = {d.short: d for d in ALL_DTYPES}
_BY_NAME = {d.name: d for d in ALL_DTYPES}
_BY_NAME.update({"bool_": bool_, "float": float32, "double": float64, "half": float16,
                 "int": int32, "long": int64})
_BY_NP = {d.np_dtype: d for d in ALL_DTYPES}
# numpy types kiln has no exact match for are converted on the way in
_BY_NP[np.dtype(np.uint16)] = int32
_BY_NP[np.dtype(np.uint64)] = int64
_BY_NP[np.dtype(np.complex128)] = complex64


def from_short(short: str) -> DType:
    try:
        return _BY_SHORT[short]
    except KeyError:
        raise KilnDTypeError(f"unknown dtype '{short}' in IR; known: {', '.join(_BY_SHORT)}") from None


def dtype(value) -> DType:
    """Normalize anything dtype-like (kiln DType, name, numpy dtype or type) to a DType."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        if value in _BY_NAME:
            return _BY_NAME[value]
        if value in _BY_SHORT:
            return _BY_SHORT[value]
    elif value is bool:
        return bool_
    elif value is int:
        return int64
    elif value is float:
        return float32
    elif value is complex:
        return complex64
    else:
        try:
            npd = np.dtype(value)
        except TypeError:
            npd = None
        if npd is not None and npd in _BY_NP:
            return _BY_NP[npd]
    raise KilnDTypeError(
        f"dtype: {value!r} is not a kiln dtype; kiln has "
        + ", ".join(d.name for d in ALL_DTYPES)
    )


def from_numpy(npd: np.dtype) -> DType:
    """The kiln dtype of a numpy array's dtype; float64 numpy data stays float64."""
    try:
        return _BY_NP[np.dtype(npd)]
    except (KeyError, TypeError):
        raise KilnDTypeError(
            f"asarray: numpy dtype {npd} has no kiln equivalent; "
            "convert it to one of " + ", ".join(d.name for d in ALL_DTYPES)
        ) from None


_CATEGORY_RANK = {BOOL: 0, UINT: 1, INT: 1, FLOAT: 2, COMPLEX: 3}


def _promote_ints(a: DType, b: DType) -> DType:
    if a.category == b.category:
        return a if a.bits >= b.bits else b
    unsigned, signed = (a, b) if a.category == UINT else (b, a)
    if signed.bits > unsigned.bits:
        return signed
    # the narrowest signed type that holds every value of both
    for candidate in (int16, int32, int64):
        if candidate.bits > unsigned.bits and candidate.bits >= signed.bits:
            return candidate
    return int64


def _promote_floats(a: DType, b: DType) -> DType:
    if a.bits == b.bits:  # f16 vs bf16, e4m3 vs e5m2: neither holds the other
        return float32 if a.bits <= 16 else float64
    return a if a.bits > b.bits else b


def promote_types(a: DType, b: DType) -> DType:
    """The dtype both operands convert to before a binary op (PyTorch's rules)."""
    if a == b:
        return a
    ra, rb = _CATEGORY_RANK[a.category], _CATEGORY_RANK[b.category]
    if ra != rb:
        hi, lo = (a, b) if ra > rb else (b, a)
        if hi.is_complex and lo == float64:
            return complex64  # kiln has no complex128
        return hi
    if a.category == BOOL:
        return a
    if a.is_integer:
        return _promote_ints(a, b)
    if a.is_floating:
        return _promote_floats(a, b)
    return complex64


def weak_scalar_dtype(tensor_dtype: DType, scalar) -> DType:
    """Result dtype of `tensor op python_scalar`: the scalar is weakly typed.

    The tensor's dtype wins unless the scalar is of a higher category
    (`int_tensor * 1.5` is float32, as in PyTorch).
    """
    scalar_dtype = python_scalar_dtype(scalar)
    if _CATEGORY_RANK[scalar_dtype.category] > _CATEGORY_RANK[tensor_dtype.category]:
        if scalar_dtype.is_complex:
            return complex64
        return scalar_dtype
    return tensor_dtype


def python_scalar_dtype(scalar) -> DType:
    """The default dtype a bare Python scalar takes (bool, int64, float32, complex64)."""
    if isinstance(scalar, (bool, np.bool_)):
        return bool_
    if isinstance(scalar, (int, np.integer)):
        return int64
    if isinstance(scalar, (float, np.floating)):
        return float32
    if isinstance(scalar, (complex, np.complexfloating)):
        return complex64
    raise KilnDTypeError(f"{type(scalar).__name__} is not a Python scalar kiln understands")


def finfo(dt: DType):
    """Machine limits of a floating dtype (ml_dtypes' finfo covers the low-precision ones)."""
    dt = dtype(dt)
    if not dt.is_floating:
        raise KilnDTypeError(f"finfo: {dt} is not a floating dtype")
    return ml_dtypes.finfo(dt.np_dtype)


def iinfo(dt: DType):
    dt = dtype(dt)
    if dt.is_bool:
        raise KilnDTypeError("iinfo: bool is not an integer dtype")
    if not dt.is_integer:
        raise KilnDTypeError(f"iinfo: {dt} is not an integer dtype")
    return np.iinfo(dt.np_dtype)
