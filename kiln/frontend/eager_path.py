"""The lean eager path: an op on plain CPU tensors, with no trace, tape or view involved.

`dispatch.apply` and `dispatch.binary` serve every mode (traces, tapes, devices, views,
numpy promotion, Python scalars); on small tensors that generality cost ~40 us an op,
70x torch eager (issue 22). Most eager ops in a loop are the simple case, so it is
recognized first, in a few attribute reads, and run straight through the eager
emitter's plan cache (kiln/ir/emitter.py), whose checks are the general path's. Any
other case returns None and takes the general path; so does every first call of a
signature, where the checks run and raise their numbered errors on bad input.

What counts as plain: exactly a `Tensor` (not a subclass), eager (no builder), on the
CPU, not a view, neither requiring grad nor on a tape; and no trace active on this
thread (an eager tensor used inside a trace becomes a graph constant).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from kiln.ir import dtypes as dt
from kiln.ir.emitter import EAGER
from kiln.runtime import placement

_Tensor = None  # kiln.frontend.tensor.Tensor, bound on first use (it imports dispatch)

# numpy dtypes of the real floating kiln dtypes: a Python scalar keeps their dtype
# (weak typing) and its fill converts exactly as `full` does
_FLOATING = frozenset(np.dtype(d.np_dtype) for d in dt.FLOAT_DTYPES)
_INEXACT = _FLOATING | frozenset(np.dtype(d.np_dtype) for d in dt.ALL_DTYPES if d.is_complex)

# binary primitives whose numpy references broadcast a 0-d operand like a full-shape one
_SCALAR_OK = frozenset({"add", "sub", "mul", "div", "pow", "max", "min", "rem", "atan2",
                        "eq", "ne", "lt", "le", "gt", "ge"})


_FILLS: dict = {}  # (type, value, sign, dtype) -> the 0-d fill of a Python scalar


def _tensor_class():
    global _Tensor
    if _Tensor is None:
        from kiln.frontend.tensor import Tensor

        _Tensor = Tensor
    return _Tensor


# dispatch's thread-local state (defined here, where the hot path reads it): `stack` holds
# the active traces, `device` the device of the results dispatch.wrap makes
_state = threading.local()


def _tracing() -> bool:
    # through __dict__: getattr with a default costs ~0.3 us when the thread never traced
    # (the AttributeError it makes and swallows), more than the rest of these checks
    return bool(_state.__dict__.get("stack"))


def _plain(x, Tensor) -> bool:
    return (type(x) is Tensor and x._builder is None and x._device is None and x._view is None
            and x._node is None and not x._requires_grad)


_track = _track_new = None  # the CPU caching allocator's (placement.charge's), bound once


def _result(array) -> object:
    """An eager CPU result, counted by the CPU allocator as `placement.charge` counts it."""
    global _track, _track_new
    if type(array) is np.ndarray and array.base is None:  # a view is counted with its base
        if _track is None:
            _track, _track_new = placement._cpu().track, placement._cpu().track_new
        _track(array)
    return _Tensor._make(array)


def _new_result(array, a, b=None) -> object:
    """`_result` of an elementwise op's output, which is a new array (never counted
    before) unless a reference handed back its operand `a` or `b`."""
    global _track, _track_new
    if array is a or array is b:
        return _result(array)
    if type(array) is np.ndarray and array.base is None:
        if _track_new is None:
            _track, _track_new = placement._cpu().track, placement._cpu().track_new
        _track_new(array)
    return _Tensor._make(array)


def eager_apply(op: str, args: tuple, attrs: dict):
    """`op` on plain tensors, or None when any operand is not one (or a trace is on)."""
    Tensor = _Tensor or _tensor_class()
    arrays = []
    for a in args:
        if not _plain(a, Tensor):
            return None
        arrays.append(a._x)
    if _tracing():
        return None
    results = EAGER.apply(op, arrays, attrs)
    if len(results) == 1:
        return _result(results[0])
    return tuple(_result(r) for r in results)


def eager_unary_float(op: str, x):
    """A float op on one plain floating or complex tensor (ints take the general path,
    which computes them in float32), else None."""
    Tensor = _Tensor or _tensor_class()
    if type(x) is not Tensor or x._builder is not None or x._device is not None \
            or x._view is not None or x._node is not None or x._requires_grad \
            or x._x.dtype not in _INEXACT or _tracing():  # `_plain`, inlined
        return None
    return _new_result(EAGER.run1(op, (x._x,), x._x, 1), x._x)


def eager_binary(op: str, x, y):
    """A binary primitive on two plain floating tensors of one dtype and shape, or on one
    and a Python float or int (weakly typed: the tensor's dtype wins, as in torch);
    None for anything else (promotion, broadcasting, ints, bools, complex), which the
    general path handles."""
    Tensor = _Tensor or _tensor_class()
    tx, ty = type(x), type(y)
    if tx is Tensor and ty is Tensor:
        if x._builder is not None or x._device is not None or x._view is not None \
                or x._node is not None or x._requires_grad or y._builder is not None \
                or y._device is not None or y._view is not None or y._node is not None \
                or y._requires_grad:  # `_plain`, inlined for the commonest case
            return None
        a, b = x._x, y._x
        if a.dtype not in _FLOATING or a.dtype != b.dtype or a.shape != b.shape \
                or _state.__dict__.get("stack"):  # `_tracing()`, inlined
            return None
        return _new_result(EAGER.run1(op, (a, b), a, 2), a, b)
    if tx is Tensor:
        tensor, scalar, first = x, y, True
    elif ty is Tensor:
        tensor, scalar, first = y, x, False
    else:
        return None
    if (type(scalar) is not float and type(scalar) is not int) or op not in _SCALAR_OK:
        return None
    if tensor._builder is not None or tensor._device is not None or tensor._view is not None \
            or tensor._node is not None or tensor._requires_grad:  # `_plain`, inlined
        return None
    a = tensor._x
    if a.dtype not in _FLOATING or (type(scalar) is int and not -2**63 <= scalar < 2**64) \
            or _tracing():
        return None  # `full` refuses an int beyond 64 bits: the general path says so
    key = (type(scalar), scalar, math.copysign(1.0, scalar), a.dtype)  # -0.0 is not 0.0
    fill = _FILLS.get(key)
    if fill is None:  # the 0-d `full` the general path would broadcast (read only)
        if len(_FILLS) >= 256:
            _FILLS.clear()
        fill = _FILLS[key] = np.array(scalar, a.dtype)
        fill.flags.writeable = False
    operands = (a, fill) if first else (fill, a)
    return _new_result(EAGER.run1(op, operands, a, 2), a)
