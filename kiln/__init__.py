"""kiln: a compiler-first tensor framework."""

__version__ = "0.1.0"

from kiln.errors import KilnError  # noqa: F401
from kiln.ir.dtypes import (  # noqa: F401
    DType, bool_, uint8, uint32, int8, int16, int32, int64, float8_e4m3fn, float8_e5m2,
    bfloat16, float16, float32, float64, complex64, promote_types, finfo, iinfo,
)
