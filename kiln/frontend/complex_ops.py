"""Complex accessors and constructors, as PyTorch names them.

`z.real`, `z.imag`, `z.conj()`, `kn.view_as_real(z)`, `kn.view_as_complex(x)`,
`kn.angle(z)`, `kn.polar(abs, angle)`, `kn.complex(real, imag)`. Each is written with the
three complex primitives (`real`, `imag`, `complex`), so it traces, compiles (the
`complex` pass turns it into real arithmetic, see kiln/passes/complex_decompose.py) and
differentiates with PyTorch's convention through their vjp rules.

kiln tensors are values, not storage: `view_as_real`, `.real` and `.imag` return new
tensors rather than views that alias `z` (writing into them does not change `z`).

    >>> z = kn.polar(kn.ones(3), kn.tensor([0.0, 1.5708, 3.1416]))
    >>> kn.view_as_real(z).shape        # (3, 2)
"""

from __future__ import annotations

import math

from kiln.errors import KilnDTypeError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.frontend.dispatch import apply
from kiln.frontend.functional import _tensor, to
from kiln.frontend.tensor import Tensor


def _complex_operand(op: str, x) -> Tensor:
    x = _tensor(x)
    if not x.dtype.is_complex:
        raise KilnDTypeError(f"{op}: expects a complex tensor, got {x.dtype.short}{list(x.shape)}",
                             hint="real tensors have no imaginary part; kn.complex(x, y) makes one")
    return x


def real(x) -> Tensor:
    """The real part: float32 for complex64; a real tensor is returned as it is (torch)."""
    x = _tensor(x)
    return apply("real", x) if x.dtype.is_complex else x


def imag(x) -> Tensor:
    """The imaginary part (float32) of a complex tensor; a real tensor is an error (torch)."""
    return apply("imag", _complex_operand("imag", x))


def conj(x) -> Tensor:
    """The complex conjugate; a real tensor is returned as it is."""
    x = _tensor(x)
    if not x.dtype.is_complex:
        return x
    from kiln.frontend.functional import neg

    return complex(real(x), neg(imag(x)))


def complex(real_part, imag_part) -> Tensor:  # noqa: A001 - torch.complex
    """complex64 from float32 real and imaginary parts of one shape (torch.complex)."""
    re, im = _tensor(real_part), _tensor(imag_part)
    for name, t in (("real", re), ("imag", im)):
        if not t.dtype.is_floating:
            raise KilnDTypeError(f"complex: {name} must be a float tensor, got "
                                 f"{t.dtype.short}{list(t.shape)}")
    if tuple(re.shape) != tuple(im.shape):
        from kiln.frontend.shape_ops import expand
        from kiln.ir.shapes import broadcast_shapes

        shape = broadcast_shapes("complex", tuple(re.shape), tuple(im.shape))
        re, im = expand(re, shape), expand(im, shape)
    return apply("complex", to(re, dt.float32), to(im, dt.float32))


def view_as_real(x) -> Tensor:
    """[..., 2] float32 holding (real, imag) of each entry of a complex tensor."""
    from kiln.frontend.shape_ops import stack

    x = _complex_operand("view_as_real", x)
    return stack([apply("real", x), apply("imag", x)], dim=-1)


def view_as_complex(x) -> Tensor:
    """The inverse of `view_as_real`: a float32 [..., 2] tensor as complex64 [...]."""
    x = _tensor(x)
    if x.dtype != dt.float32 or x.ndim == 0 or x.shape[-1] != 2:
        raise KilnShapeError(f"view_as_complex: expects a float32 tensor whose last dim is 2, "
                             f"got {x.dtype.short}{list(x.shape)}")
    return apply("complex", x[..., 0], x[..., 1])


def angle(x) -> Tensor:
    """The argument atan2(imag, real) of a complex tensor; of a real one, 0 for x >= 0 and
    pi for x < 0 (NaN stays NaN), as torch.angle."""
    from kiln.frontend.functional import atan2, lt, where

    x = _tensor(x)
    if x.dtype.is_complex:
        return atan2(apply("imag", x), apply("real", x))
    xf = x if x.dtype.is_floating else to(x, dt.float32)
    return where(lt(xf, 0.0), math.pi, xf * 0.0)


def polar(abs, angle) -> Tensor:  # noqa: A002 - torch.polar's names
    """abs * (cos(angle) + i sin(angle)) (torch.polar)."""
    from kiln.frontend.functional import cos, mul, sin

    r, theta = _tensor(abs), _tensor(angle)
    return complex(mul(r, cos(theta)), mul(r, sin(theta)))


def is_complex(x) -> bool:
    return _tensor(x).dtype.is_complex


def _bind() -> None:
    """Tensor.real / .imag (properties), .conj(), .angle(), .is_complex()."""
    Tensor.real = property(real, doc="The real part (see kiln.frontend.complex_ops.real).")
    Tensor.imag = property(imag, doc="The imaginary part (complex tensors only).")
    Tensor.conj = conj
    Tensor.angle = angle
    Tensor.is_complex = is_complex


_bind()
