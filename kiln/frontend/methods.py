"""Operators and methods of `Tensor`, bound to the frontend functions.

Kept apart from tensor.py so the class stays small and the method table reads as
one list: every method is exactly its function with the tensor first."""

from __future__ import annotations

from kiln.ir import dtypes as dt
from kiln.frontend import functional as F
from kiln.frontend import reductions as R
from kiln.frontend import shape_ops as S
from kiln.frontend import selection as SEL
from kiln.frontend.eager_path import eager_binary
from kiln.frontend.indexing import getitem
from kiln.frontend.mutation import bind as bind_inplace
from kiln.frontend.tensor import Tensor


def _swap(fn):
    return lambda self, other: fn(other, self)


def _operator(name: str, op: str, fn, swapped: bool = False):
    """`fn` (the function of binary primitive `op`) as an operator that tries the lean
    eager path itself (kiln/frontend/eager_path.py): one Python call less per eager op.
    The first four (add, sub, mul, div) are `eager_binary`'s own callers; the others are
    `binary(op, x, y)` with no more policy than the op."""
    from_eager = op in ("add", "sub", "mul", "div")
    if swapped:
        def method(self, other):
            result = eager_binary(op, other, self, from_eager)
            return result if result is not None else fn(other, self)
    else:
        def method(self, other):
            result = eager_binary(op, self, other, from_eager)
            return result if result is not None else fn(self, other)
    method.__name__ = name
    # errors that name the op by the outermost kiln frame (K380) say `add`, not `method`
    method.__code__ = method.__code__.replace(co_name=fn.__name__)
    return method


_OPERATORS = {"__matmul__": F.matmul, "__rmatmul__": _swap(F.matmul),
              "__neg__": F.neg, "__abs__": F.abs, "__invert__": F.bitwise_not,
              "__getitem__": getitem}
for _name, _op, _fn in (("add", "add", F.add), ("sub", "sub", F.sub), ("mul", "mul", F.mul),
                        ("truediv", "div", F.div), ("floordiv", "floor_divide", F.floor_divide),
                        ("mod", "remainder", F.remainder), ("pow", "pow", F.pow),
                        ("and", "and", F.bitwise_and), ("or", "or", F.bitwise_or),
                        ("xor", "xor", F.bitwise_xor)):
    _OPERATORS[f"__{_name}__"] = _operator(f"__{_name}__", _op, _fn)
    _OPERATORS[f"__r{_name}__"] = _operator(f"__r{_name}__", _op, _fn, swapped=True)
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    _OPERATORS[f"__{_op}__"] = _operator(f"__{_op}__", _op, getattr(F, _op))

_METHODS = {name: getattr(R if name in R.__all__ else F, name) for name in (
    "exp", "expm1", "log", "log1p", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh",
    "tanh", "sqrt", "rsqrt", "erf", "erfc", "sigmoid", "relu", "abs", "neg", "sign", "floor", "ceil",
    "round", "trunc", "isnan", "isinf", "isfinite", "logical_not", "bitwise_not",
    "add", "sub", "mul", "div", "floor_divide", "remainder", "fmod", "pow", "maximum", "minimum",
    "atan2", "logical_and", "logical_or", "logical_xor", "eq", "ne", "lt", "le", "gt", "ge",
    "clamp", "clip", "sum", "prod", "mean", "var", "std", "logsumexp", "all", "any", "max", "min",
    "amax", "amin", "argmax", "argmin", "cumsum", "cumprod", "sort", "argsort", "softmax",
    "log_softmax", "matmul", "to")}
_METHODS.update({name: getattr(S, name) for name in (
    "reshape", "view", "flatten", "permute", "transpose", "movedim", "expand", "squeeze",
    "unsqueeze", "narrow", "split", "chunk", "gather", "scatter_add", "scatter", "index_select",
    "flip")})
_METHODS.update({name: getattr(SEL, name) for name in (
    "tril", "triu", "masked_fill", "topk", "clone", "contiguous", "multinomial")})
_METHODS["where"] = lambda self, condition, other: F.where(condition, self, other)
_METHODS["clamp_min"] = lambda self, min: F.maximum(self, min)  # noqa: A002
_METHODS["clamp_max"] = lambda self, max: F.minimum(self, max)  # noqa: A002
_METHODS["lerp"] = lambda self, end, weight: F.add(self, F.mul(F.sub(end, self), weight))
_METHODS["addcmul"] = lambda self, t1, t2, value=1: F.add(self, F.mul(F.mul(t1, t2), value))
_METHODS["addcdiv"] = lambda self, t1, t2, value=1: F.add(self, F.mul(F.div(t1, t2), value))
_METHODS["t"] = lambda self: self if self.ndim < 2 else S.transpose(self, 0, 1)
_METHODS["new_zeros"] = lambda self, *size, dtype=None, **kw: _new(self, size, 0, dtype)
_METHODS["new_ones"] = lambda self, *size, dtype=None, **kw: _new(self, size, 1, dtype)
_METHODS["new_full"] = lambda self, size, fill_value, dtype=None, **kw: _new(self, (size,),
                                                                             fill_value, dtype)
_METHODS["new_tensor"] = lambda self, data, dtype=None, **kw: Tensor(data, dtype or self.dtype)
_METHODS["expand_as"] = lambda self, other: S.expand(self, *other.shape)
_METHODS["reshape_as"] = lambda self, other: S.reshape(self, *other.shape)
_METHODS["type_as"] = lambda self, other: F.to(self, other.dtype)

for _name, _dtype in (("float", dt.float32), ("double", dt.float64), ("half", dt.float16),
                      ("bfloat16", dt.bfloat16), ("int", dt.int32), ("long", dt.int64),
                      ("bool", dt.bool_)):
    _METHODS[_name] = (lambda d: lambda self: F.to(self, d))(_dtype)


def _new(self, size, value, dtype):
    from kiln.frontend.factories import _shape, full

    return full(_shape("new_full", size), value, self.dtype if dtype is None else dtype,
                device=self.device)


def _to(self, *args, dtype=None, device=None, copy: bool = False, non_blocking: bool = False,
        **_):
    """torch's `.to(dtype)`, `.to(device)`, `.to(device, dtype)`, `.to(other_tensor)`."""
    from kiln.frontend.tensor import as_device

    for a in args:
        if isinstance(a, Tensor):  # torch's x.to(other): other's dtype and device
            dtype = a.dtype
            if a._builder is None:
                device = a.device
        elif _is_device(a):
            device = a
        else:
            dtype = a
    target = None if device is None else as_device(device, "Tensor.to")
    out = self if dtype is None else F.to(self, dtype)
    if target is not None and target != out.device:
        from kiln.runtime.placement import move

        moved = Tensor._make(move(out._concrete("Tensor.to(device)"), out.device, target),
                             None, None if target.type == "cpu" else target)
        if out.requires_grad:  # a new leaf on the target device (the tape stays per device)
            moved.requires_grad = True
        return moved
    return SEL.clone(out) if copy and out is self else out


def _is_device(a) -> bool:
    from kiln.frontend.tensor import _DEVICE_KINDS, Device
    from kiln.runtime.device import device_kinds

    if isinstance(a, Device):
        return True
    if isinstance(a, str):
        kind = a.split(":")[0]
        return kind in _DEVICE_KINDS or kind in device_kinds()
    return not isinstance(a, (dt.DType, type)) and hasattr(a, "type") and hasattr(a, "index")


def _T(self):
    return S.permute(self, tuple(reversed(range(self.ndim))))


def _mT(self):
    return S.transpose(self, -2, -1)


_METHODS["to"] = _to
for _name, _fn in {**_OPERATORS, **_METHODS}.items():
    setattr(Tensor, _name, _fn)
bind_inplace(Tensor)
Tensor.T = property(_T)
Tensor.mT = property(_mT)
Tensor.__hash__ = object.__hash__  # __eq__ is elementwise
