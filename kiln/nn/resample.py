"""`F.interpolate` / `nn.Upsample` (nearest and (bi/tri)linear) and `F.glu` / `nn.GLU`.

Interpolation is separable: each spatial dim is resampled in turn with one gather
(`index_select`) per source neighbour, using torch's source-coordinate rules
(`align_corners` False: (dst + 0.5) * in/out - 0.5 clamped at 0; True: dst * (in-1)/(out-1);
nearest: floor(dst * in/out)), so bilinear matches torch and differentiates through the
gathers.

    >>> y = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.nn.module import Module

_MODES = {"nearest": None, "linear": 1, "bilinear": 2, "trilinear": 3}


def _out_sizes(x, size, scale_factor, n: int) -> tuple[list, list]:
    spatial = list(x.shape[2:])
    if not all(isinstance(d, int) for d in spatial):
        raise KilnShapeError("interpolate: needs static spatial sizes")
    if (size is None) == (scale_factor is None):
        raise KilnArgumentError("interpolate: give exactly one of size and scale_factor")
    if size is not None:
        out = [int(size)] * n if isinstance(size, int) else [int(s) for s in size]
        scales = [None] * n
    else:
        scales = [float(scale_factor)] * n if isinstance(scale_factor, (int, float)) \
            else [float(s) for s in scale_factor]
        out = [int(math.floor(d * s)) for d, s in zip(spatial, scales)]
    if len(out) != n or any(o <= 0 for o in out):
        raise KilnArgumentError(f"interpolate: output sizes {out} must be {n} positive ints")
    return out, scales


def _source(in_size: int, out_size: int, scale, align_corners: bool, nearest: bool):
    dst = np.arange(out_size, dtype=np.float64)
    if nearest:
        ratio = (1.0 / scale) if scale else in_size / out_size
        return np.minimum(np.floor(dst * ratio), in_size - 1).astype(np.int64), None
    if align_corners:
        src = dst * ((in_size - 1) / (out_size - 1)) if out_size > 1 else np.zeros_like(dst)
    else:
        ratio = (1.0 / scale) if scale else in_size / out_size
        src = np.maximum((dst + 0.5) * ratio - 0.5, 0.0)
    i0 = np.minimum(np.floor(src), in_size - 1).astype(np.int64)
    i1 = np.minimum(i0 + 1, in_size - 1)
    return (i0, i1), (src - i0).astype(np.float32)


def interpolate(input, size=None, scale_factor=None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor=None, antialias=False):
    """torch.nn.functional.interpolate for modes nearest, linear, bilinear, trilinear."""
    from kiln.frontend.factories import tensor
    from kiln.frontend.functional import _floating, to
    from kiln.frontend.shape_ops import index_select

    if mode not in _MODES:
        raise KilnArgumentError(f"interpolate: mode {mode!r} is not supported; kiln has "
                                f"{', '.join(_MODES)}")
    x = _floating(input)
    n = x.ndim - 2
    if n < 1 or (_MODES[mode] is not None and _MODES[mode] != n):
        raise KilnShapeError(f"interpolate: mode {mode!r} needs a {(_MODES[mode] or 1) + 2}-D "
                             f"input, got {list(x.shape)}")
    if mode == "nearest" and align_corners:
        raise KilnArgumentError("interpolate: align_corners applies to the linear modes only")
    out, scales = _out_sizes(x, size, scale_factor, n)
    use_scale = recompute_scale_factor is not True
    for k in range(n):
        axis = 2 + k
        index, weight = _source(x.shape[axis], out[k], scales[k] if use_scale else None,
                                bool(align_corners), mode == "nearest")
        if weight is None:
            x = index_select(x, axis, tensor(index))
            continue
        shape = [1] * x.ndim
        shape[axis] = out[k]
        w = to(tensor(weight.reshape(shape)), x.dtype)
        lo, hi = index_select(x, axis, tensor(index[0])), index_select(x, axis, tensor(index[1]))
        x = lo + (hi - lo) * w
    return x


class Upsample(Module):
    """torch.nn.Upsample(size, scale_factor, mode, align_corners)."""

    def __init__(self, size=None, scale_factor=None, mode: str = "nearest",
                 align_corners: bool | None = None) -> None:
        super().__init__()
        self.size, self.scale_factor, self.mode, self.align_corners = size, scale_factor, mode, align_corners

    def forward(self, x):
        return interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners)

    def extra_repr(self) -> str:
        return f"size={self.size}, scale_factor={self.scale_factor}, mode={self.mode!r}"


def glu(input, dim: int = -1):
    """Gated linear unit: a * sigmoid(b) where a, b are the halves of `dim`."""
    from kiln.frontend.functional import _floating, sigmoid

    x = _floating(input)
    size = x.shape[dim]
    if isinstance(size, int) and size % 2:
        raise KilnShapeError(f"glu: dim {dim} must have an even size, got {list(x.shape)}")
    a, b = x.chunk(2, dim)
    return a * sigmoid(b)


class GLU(Module):
    """torch.nn.GLU(dim=-1)."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = int(dim)

    def forward(self, x):
        return glu(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
