"""In-place ops and item assignment: a tensor is a mutable handle over immutable values.

kiln computes with immutable arrays (and SSA graph values when tracing), as JAX does;
PyTorch code mutates. The two meet the way PyTorch's functionalization and JAX's
`x.at[idx].set(v)` reconcile them: `x.add_(y)` computes `x + y` out of place and
*rebinds* the handle `x` to the result, so every Python reference to that tensor object
(a module attribute, a list, an optimizer's parameter list) sees the new value. While
tracing, the rebinding simply moves the handle to a new graph value: mutation becomes
pure graph ops.

`x[idx] = v` works for int, slice, None, Ellipsis, integer-tensor and boolean-mask
indices: the indexed positions are found by indexing an iota of x's flat positions with
the same `idx` (so every index form `x[idx]` reads is also one it writes), then one
scatter writes `v` (broadcast to the selection) there. A boolean mask of x's shape is
a `where`, which keeps the shape and therefore also traces.

The result of an in-place op must keep the tensor's shape and dtype: torch's rule
(`x.add_(y)` cannot broadcast `x` up, a float result cannot go into an integer tensor);
the rest is converted to x's dtype. A leaf that requires grad can only be changed in
place under `kn.no_grad()` (optimizer steps, initialization), as in torch.
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError, KilnInPlaceError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import shapes_equal
from kiln.frontend import functional as F
from kiln.frontend.tensor import Tensor


def _castable(src: dt.DType, dst: dt.DType) -> bool:
    """torch's in-place rule: a result may go into a tensor of its kind or a higher one."""
    if dst.is_bool:
        return src.is_bool
    if dst.is_integer:
        return src.is_integer or src.is_bool
    return True


def rebind(x: Tensor, new, op: str) -> Tensor:
    """Point the handle `x` at `new` (converted to x's dtype); x's shape must not change."""
    from kiln.frontend.tape import is_grad_enabled

    if not isinstance(new, Tensor):
        new = F._tensor(new)
    if not shapes_equal(tuple(new.shape), tuple(x.shape)):
        raise KilnInPlaceError(f"{op}: the result {new.dtype.short}{list(new.shape)} does not "
                               f"have the shape of the tensor it writes, {x.dtype.short}"
                               f"{list(x.shape)}; an in-place op cannot broadcast its target",
                               hint=f"compute out of place: x = x.{op.rstrip('_')}(...)")
    if new.dtype != x.dtype:
        if not _castable(new.dtype, x.dtype):
            raise KilnInPlaceError(f"{op}: the result has dtype {new.dtype}, which cannot be "
                                   f"written into a {x.dtype} tensor",
                                   hint=f"convert the operand first: .to(kn.{x.dtype.name})")
        new = F.to(new, x.dtype)
    if x._requires_grad and x._node is None and is_grad_enabled() and new._node is not None:
        raise KilnInPlaceError(f"{op}: a leaf tensor that requires grad is being changed in "
                               "place while grad mode is on",
                               hint="wrap the update in `with kn.no_grad():` (as optimizers and "
                                    "nn.init do)")
    if x._view is not None:
        x._view.refresh(x)  # the base may have changed since x was last read
    if x._builder is None and new._builder is None:
        from kiln.frontend.dispatch import current_builder

        builder = current_builder()
        if builder is not None:  # inside a trace even a value computed eagerly is traced
            new = Tensor._make(builder.constant(new._x), builder)
    if x._builder is None and new._builder is not None:
        from kiln.errors import KilnTracedStateError, user_location
        from kiln.frontend.functionalize import active_tracker

        tracker = active_tracker()  # kn.compile lifting the state (functionalize.py)
        if tracker is not None:
            tracker.record(x)
        else:
            raise KilnTracedStateError(
                f"{op}: changes a {x.dtype.short}{list(x.shape)} tensor that the traced "
                "function did not receive as an argument (a closed-over tensor, a module "
                "attribute, optimizer state); its new value would outlive the trace",
                where=user_location(),
                hint="kn.compile lifts such state (see kiln/frontend/functionalize.py); under "
                     "kn.trace/kn.export pass the tensor as an argument and return its new value")
    if x._builder is not None:  # inside a traced branch: the branch's write (region_mutation.py)
        from kiln.frontend.region_mutation import note_write

        note_write(x)
    x._x, x._builder, x._node = new._x, new._builder, new._node
    x._version += 1
    if x._view is not None:  # a view: the write goes through to its base
        x._view.write_back(x)
    return x


# -- views: an in-place op on a view writes through to its base ---------------------------


class ViewOf:
    """What a view remembers: its base, how to re-read itself from the base, how to write
    itself into the base, and the base's version it last agreed with."""

    __slots__ = ("base", "read", "write", "synced")

    def __init__(self, base: Tensor, read, write) -> None:
        self.base, self.read, self.write = base, read, write
        self.synced = base._version

    def refresh(self, view: Tensor) -> None:
        base = self.base
        if base._view is not None:
            base._view.refresh(base)
        if base._version != self.synced:
            new = self.read(base)
            view._x, view._builder, view._node = new._x, new._builder, new._node
            view._version += 1  # views of this view re-read it in turn
            self.synced = base._version

    def write_back(self, view: Tensor) -> None:
        self.write(self.base, view)
        self.synced = self.base._version


def _viewing(fn, writer):
    """`fn` (a view-making method), tagging its result as a view of `self`: an in-place
    op on it writes into `self`, and a write to `self` is seen when it is next read."""
    def method(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if isinstance(out, Tensor) and out is not self:
            out._view = ViewOf(self, lambda b: fn(b, *args, **kwargs),
                               writer(self, *args, **kwargs))
        return out

    method.__name__ = getattr(fn, "__name__", "view")
    method.__doc__ = fn.__doc__
    return method


def _write_index(base, index):
    return lambda b, v: setitem(b, index, v)


def _write_narrow(base, dim, start, length):
    from kiln.ir.shapes import normalize_axis

    axis = normalize_axis("narrow", dim, base.ndim, "dim")
    index = (slice(None),) * axis + (slice(start, start + length),)
    return lambda b, v: setitem(b, index, v)


def _write_reshaped(base, *args, **kwargs):
    shape = tuple(base.shape)
    return lambda b, v: copy_(b, v.reshape(*shape))


def _write_transposed(base, dim0, dim1):
    return lambda b, v: copy_(b, v.transpose(dim0, dim1))


def _write_permuted(base, *dims):
    dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d % len(dims)] = i
    return lambda b, v: copy_(b, v.permute(*inverse))


def _data(self) -> Tensor:
    """torch's `p.data`: the values, detached, as a view (writes reach `p`, untaped)."""
    out = Tensor._make(self._x, self._builder)
    out._view = ViewOf(self, lambda b: b.detach(), _assign_data)
    return out


def _assign_data(base, value) -> None:
    from kiln.frontend.tape import no_grad

    with no_grad():
        rebind(base, F._tensor(value).detach(), "data")


def _inplace(name: str, fn):
    def method(self, *args, **kwargs):
        return rebind(self, fn(self, *args, **kwargs), name)

    method.__name__ = name
    method.__doc__ = f"In place: `x.{name}(...)` makes x `x.{name[:-1]}(...)` and returns x."
    return method


def copy_(x: Tensor, src, non_blocking: bool = False) -> Tensor:
    """Write `src` (broadcast to x's shape, converted to x's dtype) into x."""
    from kiln.frontend.shape_ops import expand

    src = F._tensor(src)
    return rebind(x, expand(F.to(src, x.dtype), *x.shape) if tuple(src.shape) != tuple(x.shape)
                  else F.to(src, x.dtype), "copy_")


def fill_(x: Tensor, value) -> Tensor:
    from kiln.frontend.factories import full_like

    if isinstance(value, Tensor):
        return copy_(x, value)
    return rebind(x, full_like(x, value), "fill_")


def zero_(x: Tensor) -> Tensor:
    return fill_(x, 0)


def uniform_(x: Tensor, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
    """Fill `x` with samples uniform in [a, b) from kiln's global stream (`kn.manual_seed`),
    as torch's Tensor.uniform_: the draws nn.init.uniform_ makes. An integer tensor gets
    float32 samples converted, as there."""
    from kiln.frontend.factories import _random, full

    dtype = x.dtype if x.dtype.is_floating else dt.float32
    if a == b:
        return _refill(x, full(tuple(x.shape), float(a), dtype), "uniform_")
    if not a < b:
        raise KilnArgumentError(f"uniform_: needs a < b, got {a}, {b}")
    return _refill(x, _random("uniform", tuple(x.shape), None, dtype, low=float(a), high=float(b)),
                   "uniform_")


def normal_(x: Tensor, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
    """Fill `x` with normal samples (Box-Muller on Threefry bits) from kiln's global stream,
    as torch's Tensor.normal_: the draws nn.init.normal_ makes."""
    from kiln.frontend.factories import _random

    z = _random("normal", tuple(x.shape), None, dt.float32)
    if std != 1.0:
        z = F.mul(z, float(std))
    if mean != 0.0:
        z = F.add(z, float(mean))
    return _refill(x, F.to(z, x.dtype if x.dtype.is_floating else dt.float32), "normal_")


def _refill(x: Tensor, new: Tensor, op: str) -> Tensor:
    """Initialization rebinds without recording a tape (a leaf that requires grad may be
    filled, as in torch)."""
    from kiln.frontend.tape import no_grad

    with no_grad():
        return rebind(x, new, op)


def setitem(x: Tensor, index, value) -> None:
    """`x[index] = value` (see the module docstring)."""
    from kiln.frontend.indexing import _bool_mask, getitem
    from kiln.frontend.shape_ops import expand, reshape
    from kiln.frontend.factories import arange

    value = F._tensor(value) if not isinstance(value, (bool, int, float)) else value
    items = index if isinstance(index, tuple) else (index,)
    if len(items) == 1 and _bool_mask(items[0]):
        mask = F._tensor(items[0])
        if tuple(mask.shape) == tuple(x.shape) and (not isinstance(value, Tensor) or value.ndim == 0):
            rebind(x, F.where(mask, value if not isinstance(value, Tensor) else F.to(value, x.dtype),
                              x), "__setitem__")
            return
    if isinstance(value, Tensor) and not _castable(value.dtype, x.dtype):
        raise KilnInPlaceError(f"__setitem__: cannot write {value.dtype} values into a {x.dtype} "
                               "tensor", hint=f"convert them first: .to(kn.{x.dtype.name})")
    positions = reshape(arange(x.numel()), *x.shape)
    selected = getitem(positions, index)
    flat_index = reshape(selected, -1)
    if isinstance(value, Tensor):
        from kiln.ir.shapes import broadcast_shapes

        try:
            broadcast_shapes("__setitem__", value.shape, selected.shape)
        except Exception:  # noqa: BLE001 - re-raised as the in-place rule it breaks
            raise KilnInPlaceError(f"__setitem__: the value {value.dtype.short}{list(value.shape)}"
                                   f" does not broadcast to the indexed region "
                                   f"{list(selected.shape)}") from None
        src = reshape(expand(F.to(value, x.dtype), *selected.shape), -1)
    else:
        from kiln.frontend.factories import full

        src = full(tuple(flat_index.shape), value, x.dtype)
    from kiln.frontend.shape_ops import scatter

    flat = scatter(reshape(x, -1), 0, flat_index, src)
    rebind(x, reshape(flat, *x.shape), "__setitem__")


_OUT_OF_PLACE = ("add", "sub", "mul", "div", "pow", "neg", "abs", "exp", "log", "sqrt", "rsqrt",
                 "sin", "cos", "tanh", "sigmoid", "relu", "floor", "ceil", "round", "trunc",
                 "clamp", "clip", "remainder", "fmod", "maximum", "minimum", "masked_fill",
                 "sign", "erf", "exp2", "floor_divide", "logical_not", "bitwise_not", "tril",
                 "triu", "lerp", "addcmul", "addcdiv", "clamp_min", "clamp_max", "t")


def bind(cls) -> None:
    """Attach the in-place methods and `__setitem__` to `cls` (Tensor)."""
    for name in _OUT_OF_PLACE:
        fn = getattr(cls, name, None)
        if fn is not None and not hasattr(cls, name + "_"):
            setattr(cls, name + "_", _inplace(name + "_", fn))
    for name, fn in (("copy_", copy_), ("fill_", fill_), ("zero_", zero_), ("uniform_", uniform_),
                     ("normal_", normal_), ("__setitem__", setitem)):
        setattr(cls, name, fn)
    for op, name in (("__iadd__", "add_"), ("__isub__", "sub_"), ("__imul__", "mul_"),
                     ("__itruediv__", "div_"), ("__ipow__", "pow_")):
        setattr(cls, op, getattr(cls, name))
    for name, writer in (("__getitem__", _write_index), ("narrow", _write_narrow),
                         ("view", _write_reshaped), ("reshape", _write_reshaped),
                         ("flatten", _write_reshaped), ("squeeze", _write_reshaped),
                         ("unsqueeze", _write_reshaped), ("transpose", _write_transposed),
                         ("permute", _write_permuted)):
        setattr(cls, name, _viewing(getattr(cls, name), writer))
    cls.data = property(_data, _assign_data)
