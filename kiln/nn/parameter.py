"""`nn.Parameter`: a tensor that is a module's trainable weight and requires grad.

kiln modules treat every floating-point tensor attribute as a parameter already;
`Parameter` is what PyTorch code writes (`self.weight = nn.Parameter(torch.ones(n))`),
so it is accepted as is: a `Tensor` subclass sharing the data it wraps, with
`requires_grad=True` by default.

    >>> w = nn.Parameter(kn.randn(4, 4))
    >>> w.requires_grad, w.is_leaf
    (True, True)
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError
from kiln.frontend.tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor registered as a module weight (torch.nn.Parameter)."""

    __slots__ = ()

    def __new__(cls, data=None, requires_grad: bool = True):
        from kiln.frontend.factories import zeros

        if data is None:
            data = zeros(0)
        if not isinstance(data, Tensor):
            data = Tensor(data)
        if data.is_traced:
            raise KilnArgumentError("nn.Parameter: wraps a concrete tensor, not a traced one")
        p = object.__new__(cls)
        p._x, p._builder, p._device = data._x, None, data._device
        p._node = p._grad = p._view = None
        p._version = 0
        p._requires_grad = False
        if requires_grad:
            p.requires_grad = True  # float tensors only: a clear K301 otherwise
        return p

    def __init__(self, data=None, requires_grad: bool = True) -> None:
        pass

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()
