"""Gradient clipping on pytrees, pure (it traces into a compiled training step)."""

from __future__ import annotations

from kiln.errors import KilnArgumentError
from kiln.ir import dtypes as dt
from kiln.frontend import pytree
from kiln.optim.optimizer import leaves_of


def global_norm(grads):
    """The 2-norm of all the tensors of a pytree together (a float32 scalar tensor)."""
    from kiln.frontend.functional import sqrt, to

    leaves, _ = leaves_of(grads)
    if not leaves:
        raise KilnArgumentError("global_norm: the pytree holds no tensors")
    total = None
    for g in leaves:
        g = to(g, dt.float32)
        s = (g * g).sum()
        total = s if total is None else total + s
    return sqrt(total)


def clip_grad_norm(grads, max_norm: float):
    """(clipped grads, total norm): scale every gradient by min(1, max_norm / (norm +
    1e-6)), torch.nn.utils.clip_grad_norm_'s rule, without a Python branch on the norm.

    >>> grads, norm = optim.clip_grad_norm(grads, 1.0)
    """
    from kiln.frontend.functional import minimum, to

    if max_norm <= 0:
        raise KilnArgumentError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    leaves, spec = leaves_of(grads)
    norm = global_norm(grads)
    coef = minimum(float(max_norm) / (norm + 1e-6), 1.0)
    return pytree.unflatten(spec, [g * to(coef, g.dtype) for g in leaves]), norm
