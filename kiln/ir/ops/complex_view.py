"""Zero-copy views between complex64 and its interleaved float32 pairs.

complex64 stores each entry as (real, imag) float32 pairs, so a c64[S] buffer IS an
f32[S, 2] buffer: `view_as_real` and `view_as_complex` reinterpret the memory without
moving a byte (numpy's `.view`, PyTorch's `torch.view_as_real`). The runtime runs them as
views (kiln/codegen/build_program.py), and the complex pass
(kiln/passes/complex_decompose.py) reads a complex input's parts through them: the real
part is element (..., 0) of the f32[S, 2] view (stride 2), the imaginary part element
(..., 1), so kernels index the interleaved buffer directly and a complex output is
written interleaved in place.

    %r = view_as_real(%z : c64[4, 3]) : f32[4, 3, 2]
    %z2 = view_as_complex(%r) : c64[4, 3]
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.ir.registry import PRIMITIVE, defop
from kiln.ir.sharding import Shard, Strategy, partial_through, sharding_rule


@defop("view_as_real", family="shape", kind=PRIMITIVE, num_operands=1)
class view_as_real:
    """c64[S] as f32[S, 2]: (real, imag) of each entry, the same memory."""

    def type(op, x):
        if x.dtype != dt.complex64:
            raise KilnDTypeError(f"view_as_real: operand of type {x} is not complex64")
        return x.with_shape(tuple(x.shape) + (2,)).with_dtype(dt.float32)

    def reference(x):
        x = np.asarray(x, np.complex64)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return x.view(np.float32).reshape(x.shape + (2,))

    def vjp(b, cts, xs, ys):
        return [b.call("view_as_complex", cts[0])]


@defop("view_as_complex", family="shape", kind=PRIMITIVE, num_operands=1)
class view_as_complex:
    """f32[S, 2] as c64[S]: pairs (real, imag) become entries, the same memory."""

    def type(op, x):
        if x.dtype != dt.float32:
            raise KilnDTypeError(f"view_as_complex: operand of type {x} is not float32")
        if x.rank == 0 or x.shape[-1] != 2:
            raise KilnShapeError(f"view_as_complex: operand {x} must have a last dim of size 2")
        return x.with_shape(tuple(x.shape)[:-1]).with_dtype(dt.complex64)

    def reference(x):
        x = np.asarray(x, np.float32)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return x.view(np.complex64).reshape(x.shape[:-1])

    def vjp(b, cts, xs, ys):
        return [b.call("view_as_real", cts[0])]


@sharding_rule("view_as_real")
def _view_as_real_sharding(spec):
    """Shard(d) stays Shard(d) (the pair dim is new and whole)."""
    (x,) = spec.in_shapes
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(len(x)) if spec.even(x[d])] \
        + _linear_partials(spec)


@sharding_rule("view_as_complex")
def _view_as_complex_sharding(spec):
    """Shard(d) stays Shard(d) for every dim but the pair dim."""
    (x,) = spec.in_shapes
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(len(x) - 1) if spec.even(x[d])] \
        + _linear_partials(spec)


def _linear_partials(spec):
    """Partial sums (and averages) pass between a complex value and its pairs, part by
    part; max/min/prod of pairs are no complex reduction (complex has no order, and a
    product of complex values is not the product of their parts)."""
    return [partial_through(spec, op) for op in ("sum", "avg")]
