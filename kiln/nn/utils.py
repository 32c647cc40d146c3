"""`nn.utils`: torch.nn.utils's in-place gradient clipping over `.grad`.

The arithmetic is `kiln.optim.clip_grad_norm`'s (torch's rule, no Python branch on the
norm); these functions read each parameter's `.grad` and write the clipped one back.

    >>> loss.backward()
    >>> nn.utils.clip_grad_norm_(model.parameters(), 1.0)
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError


def _with_grads(parameters) -> list:
    from kiln.frontend.tensor import Tensor

    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    return [p for p in params if p.grad is not None]


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None):
    """Scale the `.grad` of `parameters` so that their joint 2-norm is at most `max_norm`;
    returns the norm before clipping (a float32 scalar tensor), as torch."""
    from kiln.frontend.tape import no_grad
    from kiln.optim.clip import clip_grad_norm

    if float(norm_type) != 2.0:
        raise KilnArgumentError(f"clip_grad_norm_: only norm_type=2.0 is supported, got "
                                f"{norm_type}")
    params = _with_grads(parameters)
    if not params:
        from kiln.frontend.factories import zeros

        return zeros(())
    with no_grad():
        clipped, norm = clip_grad_norm([p.grad for p in params], max_norm)
    if error_if_nonfinite and not bool(norm.isfinite()):
        raise KilnArgumentError(f"clip_grad_norm_: the total gradient norm is {float(norm)}")
    for p, g in zip(params, clipped):
        p.grad = g
    return norm


def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """Clamp every `.grad` of `parameters` into [-clip_value, clip_value], in place."""
    from kiln.frontend.functional import clamp
    from kiln.frontend.tape import no_grad

    with no_grad():
        for p in _with_grads(parameters):
            p.grad = clamp(p.grad, -float(clip_value), float(clip_value))
