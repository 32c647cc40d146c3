"""Complex accessors and constructors, as PyTorch names them.

`z.real`, `z.imag`, `z.conj()`, `kn.view_as_real(z)`, `kn.view_as_complex(x)`,
`kn.angle(z)`, `kn.polar(abs, angle)`, `kn.complex(real, imag)`. Each is written with the
three complex primitives (`real`, `imag`, `complex`), so it traces, compiles (the
`complex` pass turns it into real arithmetic, see kiln/passes/complex_decompose.py) and
differentiates with PyTorch's convention through their vjp rules.

`view_as_real`, `view_as_complex`, `.real` and `.imag` are views, as in PyTorch: eagerly
they share `z`'s memory (`view_as_real` is the same bytes as f32[..., 2]; `.real` and
`.imag` are stride-2 views into it), and an in-place op through one changes `z` (kiln's
view rule, kiln/frontend/mutation.py: the write is rebound into the base, and the view
then shows the base's new memory again). Compiled, the `complex` pass reads the parts
from the same interleaved memory (kiln/ir/ops/complex_view.py).

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


def _plain(x: Tensor) -> bool:
    """An eager CPU tensor outside autograd: its parts can be numpy views of its memory."""
    return x._builder is None and x._node is None and not x._requires_grad and x._device is None


def _part(x: Tensor, which: str) -> Tensor:
    if x._view is not None:
        x._view.refresh(x)
    if _plain(x):
        from kiln.frontend.dispatch import current_builder

        if current_builder() is None:  # a stride-2 float32 view of x's pairs
            return Tensor._make(getattr(x._x, which))
    return apply(which, x)


def _aliasing(base: Tensor, out: Tensor, read, to_base, op: str) -> Tensor:
    """Tag `out` as a view of `base`: `read(base)` makes it again, an in-place write to it
    is rebound into `base` as `to_base(base, view)`, after which an eager view shows the
    base's new memory again (so the two keep sharing memory, as torch's views do)."""
    from kiln.frontend.mutation import ViewOf, rebind

    def write(b: Tensor, view: Tensor) -> None:
        rebind(b, to_base(b, view), op)
        if view._builder is None and b._builder is None:
            view._x = read(b)._x

    out._view = ViewOf(base, read, write)
    return out


def real(x) -> Tensor:
    """The real part: float32 for complex64, a view of x (a write through it changes x);
    a real tensor is returned as it is (torch)."""
    x = _tensor(x)
    if not x.dtype.is_complex:
        return x
    return _aliasing(x, _part(x, "real"), lambda b: _part(b, "real"),
                     lambda b, v: apply("complex", _detached(v), _part(b, "imag")), "real")


def imag(x) -> Tensor:
    """The imaginary part (float32) of a complex tensor, a view of x; a real tensor is an
    error (torch)."""
    x = _complex_operand("imag", x)
    return _aliasing(x, _part(x, "imag"), lambda b: _part(b, "imag"),
                     lambda b, v: apply("complex", _part(b, "real"), _detached(v)), "imag")


def _detached(v: Tensor) -> Tensor:
    """The view's values as a plain tensor (not re-read from the base it is written to)."""
    out = Tensor._make(v._x, v._builder, v._device)
    out._node = v._node
    return out


def _set_real(x: Tensor, value) -> None:
    """`z.real = v` writes v into z's real part (torch)."""
    real(x).copy_(value)


def _set_imag(x: Tensor, value) -> None:
    """`z.imag = v` writes v into z's imaginary part (torch)."""
    imag(x).copy_(value)


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
    """[..., 2] float32 holding (real, imag) of each entry of a complex tensor: a view of
    x's memory (a write through it changes x), as torch.view_as_real."""
    x = _complex_operand("view_as_real", x)
    if x._view is not None:
        x._view.refresh(x)
    return _aliasing(x, apply("view_as_real", x), lambda b: apply("view_as_real", b),
                     lambda b, v: apply("view_as_complex", _detached(v)), "view_as_real")


def view_as_complex(x) -> Tensor:
    """The inverse of `view_as_real`: a float32 [..., 2] tensor as complex64 [...], a view
    of x's memory (torch.view_as_complex)."""
    x = _tensor(x)
    if x.dtype != dt.float32 or x.ndim == 0 or x.shape[-1] != 2:
        raise KilnShapeError(f"view_as_complex: expects a float32 tensor whose last dim is 2, "
                             f"got {x.dtype.short}{list(x.shape)}")
    if x._view is not None:
        x._view.refresh(x)
    return _aliasing(x, apply("view_as_complex", x), lambda b: apply("view_as_complex", b),
                     lambda b, v: apply("view_as_real", _detached(v)), "view_as_complex")


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
    Tensor.real = property(real, _set_real, doc="The real part, a view (complex_ops.real).")
    Tensor.imag = property(imag, _set_imag, doc="The imaginary part, a view (complex tensors only).")
    Tensor.conj = conj
    Tensor.angle = angle
    Tensor.is_complex = is_complex


_bind()
