"""Where an op runs: eagerly on numpy arrays, or into the graph being traced.

Every frontend function funnels through `apply`: it looks for a traced operand (or
an active trace), turns the rest into that representation (numpy data becomes a
graph constant, Python scalars stay weak) and calls the emitter. This is the only
place that knows the two modes apart.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import sympy

from kiln.errors import KilnDTypeError, KilnTraceError, user_location
from kiln.ir import dtypes as dt
from kiln.ir.emitter import EAGER, Emitter, GraphBuilder, is_python_scalar
from kiln.frontend.eager_path import (_state as eager_path_state, eager_apply, eager_binary,
                                      lean_binary)
from kiln.frontend.tape import Dual, TapeEmitter, builder_of, taping
from kiln.frontend.tensor import Tensor
from kiln.runtime.device import CPU, KilnDeviceMismatchError
from kiln.runtime.placement import charge

_state = eager_path_state  # thread-local: `stack` (active traces), `device` (wrap's)
_KILN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trace_stack() -> list[GraphBuilder]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def current_builder() -> GraphBuilder | None:
    stack = trace_stack()
    return stack[-1] if stack else None


def emitter_for(*args) -> Emitter:
    """The builder of the traced operands, else the active trace's, else eager."""
    found = device = None
    for a in args:
        if isinstance(a, Tensor):
            if a._builder is not None:
                if found is not None and a._builder is not found:
                    raise KilnTraceError("an operation mixes tensors from two different traces",
                                         hint="a traced tensor escaped its function (a global or "
                                              "a closure kept it); pass it as an argument instead")
                found = a._builder
            elif a._device is not None and a._device is not device:
                device = a._device if device is None or a._device == device else \
                    _mismatch(device, a._device)
    if found is not None:
        if found not in trace_stack():
            raise KilnTraceError("a traced tensor was used after its trace ended",
                                 hint="return it from the traced function instead of storing it")
        return found
    if device is not None:  # a CPU operand with this device: only a 0-d one, as in PyTorch
        for a in args:
            if isinstance(a, Tensor) and a._device is None and a._builder is None and a._x.ndim:
                _mismatch(CPU, device)
    _state.device = device  # the device of the results `wrap` makes
    return EAGER


def _mismatch(first, second):
    """K380 naming the op (the outermost kiln function: what the user called) and both
    devices."""
    frame, op = sys._getframe(1), "op"
    while frame is not None:
        if frame.f_code.co_filename.startswith(_KILN_DIR):
            op = frame.f_code.co_name.strip("_")
        elif op != "op":
            break
        frame = frame.f_back
    raise KilnDeviceMismatchError(
        f"{op}: operands are on different devices: {first} and {second}",
        where=user_location(), hint=f"move one of them, e.g. x.to({str(second)!r})")


def op_emitter(*args) -> Emitter:
    """`emitter_for(*args)`, recording a tape when an operand requires grad."""
    return taping(emitter_for(*args), args)


def to_array(value) -> np.ndarray:
    """numpy data of anything array-like kiln accepts as a tensor."""
    if isinstance(value, Tensor):
        return value.numpy()
    if hasattr(value, "_sympy_") and not isinstance(value, Tensor):  # Tensor.size()'s SymSize
        value = value._sympy_()
    if isinstance(value, sympy.Basic):  # a symbolic size such as x.shape[0] under a dynamic spec
        raise KilnTraceError(f"the symbolic size {value} was used as a tensor value; its value is "
                             "only known when the compiled function runs", where=user_location(),
                             hint="count with tensors instead: kn.ones(x.shape[0]).sum(), or "
                                  "x.mean(dim) rather than x.sum(dim) / x.shape[dim]")
    if isinstance(value, np.ndarray):
        array = value
    elif hasattr(value, "__dlpack__") and not isinstance(value, (list, tuple)):
        array = np.from_dlpack(value)
    else:
        array = np.asarray(value)
        if array.dtype == np.float64 and not isinstance(value, np.generic) and _all_python_floats(value):
            array = array.astype(np.float32)  # Python float lists default to float32, as torch
    if array.dtype.kind in "OUSMm" or (array.dtype.kind == "V" and array.dtype.names):
        raise KilnDTypeError(f"cannot make a tensor from numpy dtype {array.dtype}")
    target = dt.from_numpy(array.dtype).np_dtype  # raises with the list of kiln dtypes
    return array if array.dtype == target else array.astype(target)


def _all_python_floats(value) -> bool:
    return isinstance(value, (list, tuple, float))


def raw(em: Emitter, value) -> Any:
    """`value` in `em`'s representation: a numpy array or a graph Value; scalars stay."""
    if type(value) is not Tensor and is_python_scalar(value) and not isinstance(value, np.ndarray):
        return value.item() if isinstance(value, np.generic) else value
    if isinstance(value, Tensor):
        if value._view is not None:  # a view re-reads its base after a write to the base
            value._view.refresh(value)
        if value._builder is not None:
            primal = value._x
        else:
            primal = em.constant(value._x) if em is not EAGER else value._x
        if isinstance(em, TapeEmitter):  # tape autograd (kiln/frontend/tape.py)
            ref = value._grad_ref()
            return Dual(primal, ref) if ref is not None else primal
        return primal
    if hasattr(value, "_sympy_") and em is not EAGER:  # a symbolic size as a value (symsize.py)
        from kiln.frontend.symsize import size_value

        computed = size_value(builder_of(em), value)
        if computed is not None:
            return computed
    array = to_array(value)
    return em.constant(array) if em is not EAGER else array


def wrap(em: Emitter, result):
    builder = builder_of(em)
    if isinstance(result, tuple):
        return tuple(_tensor_of(r, builder) for r in result)
    return _tensor_of(result, builder)


def _tensor_of(result, builder):
    device = None
    if builder is None:  # an eager result: on the device of its operands, counted there
        device = getattr(_state, "device", None)
        charge(result.primal if isinstance(result, Dual) else result, device)
    if isinstance(result, Dual):
        t = Tensor._make(result.primal, builder, device)
        t._node = result.ref
        return t
    return Tensor._make(result, builder, device)


def apply(op: str, *args, **attrs):
    """Run registered op `op` on tensors/arrays/scalars in the right mode."""
    result = eager_apply(op, args, attrs)  # plain eager CPU tensors (eager_path.py)
    if result is not None:
        return result
    em = op_emitter(*args)
    return wrap(em, em.call(op, *(raw(em, a) for a in args), **attrs))


def binary(op: str, x, y, dtype: dt.DType | None = None):
    """A binary primitive with numpy promotion, weak scalars and explicit broadcasting."""
    if dtype is None:
        result = eager_binary(op, x, y, False)  # plain eager CPU tensors (eager_path.py)
    else:
        result = lean_binary(op, x, y, dtype)
    if result is not None:
        return result
    em = op_emitter(x, y)
    return wrap(em, em.binary(op, raw(em, x), raw(em, y), dtype=dtype))


def creation_emitter() -> Emitter:
    """Factories build into the active trace (so sizes may be symbolic), else eagerly
    (on the CPU: a factory's `device=` moves the result)."""
    _state.device = None
    return current_builder() or EAGER
