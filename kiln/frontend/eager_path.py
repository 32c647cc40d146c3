"""The lean eager path: an op on plain CPU tensors, with no trace, tape or view involved.

`dispatch.apply` and `dispatch.binary` serve every mode (traces, tapes, devices, views,
numpy promotion, Python scalars); on small tensors that generality cost ~40 us an op,
70x torch eager (issue 22). Most eager ops in a loop are the simple case, so it is
recognized first, in a few attribute reads, and run straight through the eager
emitter's plan cache (kiln/ir/emitter.py), whose checks are the general path's.

Three tiers, cheapest first:
- elementwise ops whose operands share one floating dtype and shape (a Python float or
  int beside a floating tensor counts: its 0-d fill is typed as the full-shape `full`
  the general path makes) replay a plan keyed by (op, dtype, shape, arity): once numpy's
  result has been checked, a call is the quiet error state, the ufunc, the allocator's
  count and the Tensor;
- any other binary op (promotion, broadcasting, a 0-d tensor, ints, bools, an explicit
  result dtype) replays a `_Binary`: the promotion, broadcast shape and conversions the
  general path decides, made once per signature from the same functions, with numpy
  broadcasting the operands as the op runs instead of materializing them;
- everything else on plain tensors runs `EAGER.apply` (its own per-signature plans).

A check that fails is never planned: the general path runs and raises its numbered
error, on every call. What counts as plain: exactly a `Tensor` (not a subclass), eager
(no builder), on the CPU, not a view, neither requiring grad nor on a tape; and no trace
active on this thread (an eager tensor used inside a trace becomes a graph constant).
Under `kn.no_grad()` a tensor that requires grad or is on a tape, and anywhere an
`nn.Parameter` that needs no grad, runs as a plain tensor over the same array
(`_as_plain`): the general path records nothing for them either.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from kiln import memory_limits
from kiln.errors import KilnError
from kiln.ir import dtypes as dt
from kiln.ir.emitter import EAGER, is_python_scalar
from kiln.ir.ops import erf_reference
from kiln.ir.quiet_numpy import _QUIET, _extobj_contextvar as _ERRSTATE, quiet_state
from kiln.ir.shapes import broadcast_shapes
from kiln.ir.types import TensorType
from kiln.frontend.tape import _mode as _grad_mode
from kiln.frontend.tensor import Tensor
from kiln.runtime import placement

# numpy dtypes of the real floating kiln dtypes: a Python scalar keeps their dtype
# (weak typing) and its fill converts exactly as `full` does
_FLOATING = frozenset(np.dtype(d.np_dtype) for d in dt.FLOAT_DTYPES)
_INEXACT = _FLOATING | frozenset(np.dtype(d.np_dtype) for d in dt.ALL_DTYPES if d.is_complex)

# binary primitives whose numpy references broadcast a 0-d operand like a full-shape one
_SCALAR_OK = frozenset({"add", "sub", "mul", "div", "pow", "max", "min", "rem", "atan2",
                        "eq", "ne", "lt", "le", "gt", "ge"})
_SCALARS = (bool, int, float)  # the Python scalars the lean path takes (exact types)

_new = object.__new__
_alike = EAGER._alike  # (op, dtype, shape, arity) -> plan; EAGER clears it in place


def _native_erf(x, name: str):
    """erf/erfc of a large float array by the CPU's loop over libm (the references'
    exact values), imported on the first call: kiln's import builds nothing."""
    from kiln.codegen.cpu.special_native import compute

    return compute(x, name)


erf_reference.NATIVE = _native_erf

# dispatch's thread-local state (defined here, where the hot path reads it): `stack` holds
# the active traces, `device` the device of the results dispatch.wrap makes
_state = threading.local()


def _tracing() -> bool:
    # through __dict__: getattr with a default costs ~0.3 us when the thread never traced
    # (the AttributeError it makes and swallows), more than the rest of these checks
    return bool(_state.__dict__.get("stack"))


def _plain(x) -> bool:
    return (type(x) is Tensor and x._builder is None and x._device is None and x._view is None
            and x._node is None and not x._requires_grad)


def _as_plain(args):
    """`args` with each tensor that is plain but for its autograd state or its class (a
    leaf requiring grad, a result on a tape, an nn.Parameter) as a plain tensor over the
    same array, where the general path would do the same: grad mode off (`kn.no_grad`:
    nothing is recorded), or an operand needing no grad (a frozen Parameter). None when
    nothing changed or an operand is traced, on a device or a view."""
    grad = _grad_mode.__dict__.get("enabled", True)
    out, changed = [], False
    for a in args:
        if isinstance(a, Tensor):
            if a._builder is not None or a._device is not None or a._view is not None:
                return None
            if a._node is not None or a._requires_grad:
                if grad:
                    return None
            elif type(a) is Tensor:
                out.append(a)
                continue
            a, changed = _tensor(a._x), True  # the same array, counted already
        out.append(a)
    return out if changed else None


# -- results -------------------------------------------------------------------------------


def _bind_allocator(array) -> None:
    """The first count binds the CPU caching allocator's (placement.charge's) methods."""
    global _track, _track_new
    cpu = placement._cpu()
    _track, _track_new = cpu.track, cpu.track_new
    _track(array)


_track = _track_new = _bind_allocator


def _tensor(array) -> Tensor:
    """`Tensor._make(array)`, inlined: one call less on every eager result."""
    t = _new(Tensor)
    t._x = array
    t._builder = t._device = t._node = t._grad = t._view = None
    t._requires_grad = False
    t._version = 0
    return t


def _result(array) -> Tensor:
    """An eager CPU result, counted by the CPU allocator as `placement.charge` counts it."""
    if type(array) is np.ndarray and array.base is None:  # a view is counted with its base
        _track(array)
    return _tensor(array)


def _new_result(array, a, b=None) -> Tensor:
    """`_result` of an elementwise op's output, which is a new array (never counted
    before) unless a reference handed back its operand `a` or `b`."""
    if array is a or array is b:
        return _result(array)
    if type(array) is np.ndarray and array.base is None:
        _track_new(array)
    return _tensor(array)


def _quick(plan, operands) -> Tensor:
    """A trusted plan's ufunc on `operands`, quietly: a fresh array, counted and wrapped."""
    token = _ERRSTATE.set(_QUIET.get(_ERRSTATE.get()) or quiet_state())
    try:
        r = plan.direct(*operands)
    finally:
        _ERRSTATE.reset(token)
    _track_new(r)
    return _tensor(r)


# -- the lean paths ----------------------------------------------------------------------------


def eager_apply(op: str, args: tuple, attrs: dict, same_dtype: bool = False):
    """`op` on plain tensors, or None when any operand is not one (or a trace is on); with
    `same_dtype`, also None unless every operand has the first one's dtype (the callers
    that promote first: their promotion is then nothing)."""
    arrays = []
    for a in args:
        if type(a) is not Tensor or a._builder is not None or a._device is not None \
                or a._view is not None or a._node is not None or a._requires_grad:
            plain = _as_plain(args)  # `_plain`, inlined; no_grad and Parameters retry
            return None if plain is None else eager_apply(op, tuple(plain), attrs, same_dtype)
        arrays.append(a._x)
    if _state.__dict__.get("stack"):
        return None
    if len(arrays) == 1 and not attrs:  # a unary op: its plan keyed by the operand's type
        a = arrays[0]
        plan = _alike.get((op, a.dtype, a.shape, 1))
        if plan is not None and plan.nbytes <= memory_limits._limit:
            if plan.trusted:
                return _quick(plan, arrays)
            return _new_result(EAGER.call1(op, plan, arrays), a)
    if same_dtype:
        first = arrays[0].dtype
        for a in arrays:
            if a.dtype != first:
                return None
    results = EAGER.run(op, arrays, attrs, arrays)
    if len(results) == 1:
        return _result(results[0])
    return tuple(_result(r) for r in results)


def eager_unary_float(op: str, x):
    """A float op on one plain floating or complex tensor (ints take the general path,
    which computes them in float32), else None."""
    if type(x) is not Tensor or x._builder is not None or x._device is not None \
            or x._view is not None or x._node is not None or x._requires_grad:
        plain = _as_plain((x,))  # `_plain`, inlined; no_grad and Parameters retry
        return None if plain is None else eager_unary_float(op, plain[0])
    if _state.__dict__.get("stack"):
        return None
    a = x._x
    if a.dtype not in _INEXACT:
        return None
    plan = _alike.get((op, a.dtype, a.shape, 1))
    if plan is not None and plan.trusted and plan.nbytes <= memory_limits._limit:
        return _quick(plan, (a,))
    return _new_result(EAGER.run1(op, (a,), a, 1), a)


def eager_binary(op: str, x, y, from_eager: bool = True):
    """`dispatch.binary(op, x, y)` on plain tensors or a plain tensor and a Python scalar,
    as the general path computes it, or None. `from_eager` (`functional`'s add, sub, mul
    and div, which try this first): None too where they do something else than the op
    (bool operands, whose add and mul are `or` and `and`; integer division, which is true
    division in float32)."""
    if type(x) is Tensor and type(y) is Tensor:
        if x._builder is not None or x._device is not None or x._view is not None \
                or x._node is not None or x._requires_grad or y._builder is not None \
                or y._device is not None or y._view is not None or y._node is not None \
                or y._requires_grad:  # `_plain`, inlined for the commonest case
            return _retry_plain(op, x, y, None, from_eager)
        a, b = x._x, y._x
        dtype = a.dtype
        if dtype != b.dtype or a.shape != b.shape or dtype not in _FLOATING:
            return lean_binary(op, x, y, None, from_eager)
        if _state.__dict__.get("stack"):  # `_tracing()`, inlined
            return None
        plan = _alike.get((op, dtype, a.shape, 2))
        if plan is not None and plan.trusted and plan.nbytes <= memory_limits._limit:
            # `_quick` and `_tensor`, inlined: the commonest eager op, 0.15 us less
            token = _ERRSTATE.set(_QUIET.get(_ERRSTATE.get()) or quiet_state())
            try:
                r = plan.direct(a, b)
            finally:
                _ERRSTATE.reset(token)
            _track_new(r)
            t = _new(Tensor)
            t._x = r
            t._builder = t._device = t._node = t._grad = t._view = None
            t._requires_grad = False
            t._version = 0
            return t
        return _new_result(EAGER.run1(op, (a, b), a, 2), a, b)
    return _with_scalar(op, x, y, from_eager)


def _with_scalar(op: str, x, y, from_eager: bool):
    """`eager_binary` with a Python scalar operand: a floating tensor and a float or int
    take its 0-d fill (weakly typed: the tensor's dtype wins, as in torch)."""
    if type(x) is Tensor:
        tensor, scalar, first = x, y, True
    elif type(y) is Tensor:
        tensor, scalar, first = y, x, False
    else:
        return _retry_plain(op, x, y, None, from_eager)
    kind = type(scalar)
    if (kind is not float and kind is not int) or op not in _SCALAR_OK \
            or tensor._builder is not None or tensor._device is not None \
            or tensor._view is not None or tensor._node is not None or tensor._requires_grad:
        return lean_binary(op, x, y, None, from_eager)
    a = tensor._x
    if a.dtype not in _FLOATING or _state.__dict__.get("stack"):
        return lean_binary(op, x, y, None, from_eager)
    fill = _fill(scalar, a.dtype)
    if fill is None:
        return None  # `full` refuses this value: the general path says so
    operands = (a, fill) if first else (fill, a)
    plan = _alike.get((op, a.dtype, a.shape, 2))
    if plan is not None and plan.trusted and plan.nbytes <= memory_limits._limit:
        return _quick(plan, operands)
    return _new_result(EAGER.run1(op, operands, a, 2), a)


_FILLS: dict = {}  # (type, value, sign, numpy dtype) -> the 0-d fill of a Python scalar


def _fill(scalar, np_dtype):
    """The 0-d `full` of a Python scalar in `np_dtype` (read only, shared), made by the
    `full` op; None when `full` refuses the value (the general path raises its error)."""
    kind = type(scalar)
    key = (kind, scalar, math.copysign(1.0, scalar) if kind is float else 0, np_dtype)  # -0.0
    fill = _FILLS.get(key)
    if fill is None:
        try:
            fill = np.asarray(EAGER.full(scalar, dt.from_numpy(np_dtype), ()))
        except KilnError:
            return None
        if fill.dtype != np_dtype:
            return None
        if len(_FILLS) >= 256:
            _FILLS.clear()
        fill.flags.writeable = False
        _FILLS[key] = fill
    return fill


# -- binary ops with promotion and broadcasting -----------------------------------------------


class _Binary:
    """What the general path (`Emitter.promote`, then the op) decides for one signature:
    the dtype both operands convert to (`dtype`, a numpy dtype, and `kind`, kiln's), the
    broadcast result shape, each tensor operand's `convert` plan (or None), and the op's
    plan at the result type. `eager_ok`: `eager_binary`'s callers may use it (see there)."""

    __slots__ = ("op", "dtype", "kind", "shape", "convert", "plan", "composite", "nbytes",
                 "eager_ok")

    def __init__(self, op, kind, shape, convert, plan):
        self.op, self.kind, self.shape, self.convert, self.plan = op, kind, shape, convert, plan
        self.dtype = kind.np_dtype
        self.composite = plan.reference is None  # a decomposition sees full-shape operands
        self.nbytes = max([plan.nbytes] + [c.nbytes for c in convert if c is not None])
        result = plan.types[0].dtype
        self.eager_ok = not kind.is_bool and (op != "div" or result.is_inexact)


_BINARY: dict = {}  # signature -> _Binary


def lean_binary(op: str, x, y, dtype: dt.DType | None = None, from_eager: bool = False):
    """`dispatch.binary(op, x, y, dtype)` on plain tensors (one of them may be a Python
    bool, int or float), or None. `from_eager`: for `eager_binary`'s callers, None too
    where they do something else than the op (see `_Binary.eager_ok`). A signature whose
    checks fail is not planned: None, and the general path raises its error."""
    tx, ty = type(x), type(y)
    if tx is Tensor:
        if x._builder is not None or x._device is not None or x._view is not None \
                or x._node is not None or x._requires_grad:  # `_plain`, inlined
            return _retry_plain(op, x, y, dtype, from_eager)
        a = x._x
        if ty is Tensor:
            if y._builder is not None or y._device is not None or y._view is not None \
                    or y._node is not None or y._requires_grad:
                return _retry_plain(op, x, y, dtype, from_eager)
            b = y._x
            key = (op, dtype and dtype.name, a.dtype, a.shape, b.dtype, b.shape)
        elif ty in _SCALARS:
            b = y
            key = (op, dtype and dtype.name, a.dtype, a.shape, ty, True)
        else:
            return _retry_plain(op, x, y, dtype, from_eager)
    elif ty is Tensor and tx in _SCALARS:
        if not _plain(y):
            return _retry_plain(op, x, y, dtype, from_eager)
        a, b = x, y._x
        key = (op, dtype and dtype.name, b.dtype, b.shape, tx, False)
    else:
        return _retry_plain(op, x, y, dtype, from_eager)
    if _state.__dict__.get("stack"):
        return None
    plan = _BINARY.get(key)
    if plan is None:
        plan = _plan_binary(op, a, b, dtype)
        if plan is None:
            return None
        if len(_BINARY) >= 4096:
            _BINARY.clear()
        _BINARY[key] = plan
    if (from_eager and not plan.eager_ok) or plan.nbytes > memory_limits._limit:
        return None
    ca, cb = plan.convert
    if type(a) is not np.ndarray:
        a = _fill(a, plan.dtype)
        if a is None:
            return None
    elif ca is not None:
        a = EAGER.call_plan("convert", ca, (a,))
    if type(b) is not np.ndarray:
        b = _fill(b, plan.dtype)
        if b is None:
            return None
    elif cb is not None:
        b = EAGER.call_plan("convert", cb, (b,))
    if plan.composite:
        shape = plan.shape
        full = [v if v.shape == shape else np.broadcast_to(v, shape) for v in (a, b)]
        return _result(EAGER.run(op, full, {}, full)[0])
    if plan.plan.trusted:
        return _quick(plan.plan, (a, b))
    return _new_result(EAGER.call1(op, plan.plan, (a, b)), a, b)


def _retry_plain(op, x, y, dtype, from_eager):
    """A binary op whose operands `_as_plain` can make plain, on those; else None."""
    plain = _as_plain((x, y))
    if plain is None:
        return None
    if dtype is None:
        return eager_binary(op, plain[0], plain[1], from_eager)
    return lean_binary(op, plain[0], plain[1], dtype, from_eager)


def _plan_binary(op, a, b, dtype):
    """The `_Binary` of `op` on arrays or Python scalars `a`, `b`, made by the general
    path's own functions; None when one of its checks fails."""
    try:
        operands = (a, b)
        if dtype is None:
            dtype = EAGER.result_dtype(*operands)
        types = [EAGER.type_of(v) for v in operands if not is_python_scalar(v)]
        shape = broadcast_shapes(op, *(t.shape for t in types),
                                 describe=lambda: " with ".join(str(t) for t in types))
        convert = []
        for v in operands:
            if is_python_scalar(v) or EAGER.type_of(v).dtype == dtype:
                convert.append(None)
            else:
                convert.append(EAGER.plan_types("convert", [EAGER.type_of(v)], {"dtype": dtype}))
        result = TensorType(dtype, shape)
        return _Binary(op, dtype, shape, convert, EAGER.plan_types(op, [result, result], {}))
    except KilnError:
        return None
