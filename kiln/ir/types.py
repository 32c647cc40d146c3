"""`TensorType`: the type of every value in kiln's IR (dtype + shape of dims)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import dtypes as dt
from kiln.ir.shapes import Dim, format_shape, free_symbol_names, is_static, numel, shape, shapes_equal


@dataclass(frozen=True, eq=False)
class TensorType:
    """`f32[B, 1024]`: an element type and a tuple of int or symbolic dims."""

    dtype: dt.DType
    shape: tuple[Dim, ...]

    def __post_init__(self):
        object.__setattr__(self, "dtype", dt.dtype(self.dtype))
        object.__setattr__(self, "shape", shape(self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(is_static(d) for d in self.shape)

    @property
    def numel(self) -> Dim:
        return numel(self.shape)

    def symbols(self) -> set[str]:
        names: set[str] = set()
        for d in self.shape:
            names |= free_symbol_names(d)
        return names

    def with_shape(self, new_shape) -> "TensorType":
        return TensorType(self.dtype, tuple(new_shape))

    def with_dtype(self, new_dtype) -> "TensorType":
        return TensorType(new_dtype, self.shape)

    def __eq__(self, other) -> bool:
        return (isinstance(other, TensorType) and self.dtype == other.dtype
                and shapes_equal(self.shape, other.shape))

    def __hash__(self) -> int:
        return hash((self.dtype, len(self.shape)))

    def __str__(self) -> str:
        return f"{self.dtype.short}{format_shape(self.shape)}"

    __repr__ = __str__
