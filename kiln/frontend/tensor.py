"""The user-facing `Tensor`: numpy-backed in eager mode, a graph value while tracing.

One class serves both modes, so user code runs unchanged under `kn.trace`,
`kn.export` and `kn.compile`. Operators and methods delegate to the functions of
`kiln.frontend.functional` and `kiln.frontend.shape_ops`; reading a traced tensor's
value from Python (`bool(t)`, `t.item()`, `t.numpy()`) raises a numbered error that
points at the user's line and names the control-flow op that replaces it.
"""

from __future__ import annotations

import numpy as np

from kiln.errors import KilnConcretizationError, user_location
from kiln.ir import dtypes as dt
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Value

_KILN_DTYPES = {np.dtype(d.np_dtype): d for d in dt.ALL_DTYPES}  # an eager array's dtype
_FIX = ("use kn.cond(pred, true_fn, false_fn, *operands) or kn.switch(index, branches, "
        "*operands) for branches, and kn.while_loop(cond_fn, body_fn, carried) for loops")


# devices live in the runtime (kiln/runtime/device.py); these names stay importable here
from kiln.runtime.device import CPU, KNOWN_KINDS as _DEVICE_KINDS, Device  # noqa: E402,F401
from kiln.runtime.device import as_device as _resolve_device  # noqa: E402


def as_device(device, op: str = "tensor") -> Device:
    """`device=` of a factory or `.to()`: None, "cpu", "cuda:1", a kiln Device, or an
    object with a torch-style `.type` (torch.device("cpu")), resolved to a device that is
    here (a kind whose hardware is missing is K381, an unknown one K105)."""
    return _resolve_device(device, op)


class Tensor:
    """A multi-dimensional array of one kiln dtype.

    >>> x = kn.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> (x * 2 + 1).sum(dim=-1).numpy()
    array([ 7., 15.], dtype=float32)
    """

    # _node: the tape reference of a result computed from a tensor that requires grad
    # (kiln/frontend/tape.py); _requires_grad/_grad: a leaf's flag and accumulated grad
    # _view: (base, writer) of a view (x[idx], x.view(...), x.transpose(...)): an in-place
    # op on the view writes through to its base (kiln/frontend/mutation.py)
    # _version counts in-place writes, so views of this tensor know when to re-read it
    # _device: None on the CPU, else the Device whose memory _x's array lives in
    __slots__ = ("_x", "_builder", "_node", "_requires_grad", "_grad", "_view", "_version",
                 "_device", "__weakref__")
    __array_priority__ = 1000  # numpy defers `ndarray op Tensor` to us

    def __init__(self, data, dtype=None, *, device=None, requires_grad: bool = False):
        from kiln.frontend.dispatch import to_array

        from kiln.runtime.placement import host_copy, place

        dev = as_device(device)
        array = host_copy(to_array(data), dtype is None and dev is CPU)
        if dtype is not None:
            array = _convert_array(array, dt.dtype(dtype))
        self._x = place(array, dev)
        self._device = None if dev is CPU else dev
        self._builder = None
        self._node = self._grad = self._view = None
        self._requires_grad = False
        self._version = 0
        if requires_grad:
            self.requires_grad = True

    @classmethod
    def _make(cls, x, builder: GraphBuilder | None = None, device=None) -> "Tensor":
        t = object.__new__(cls)
        t._x = x
        t._builder = builder
        t._device = device
        t._node = t._grad = t._view = None
        t._requires_grad = False
        t._version = 0
        return t

    # -- tape autograd (kiln/frontend/tape.py) -------------------------------------------

    @property
    def requires_grad(self) -> bool:
        """Whether gradients flow to this tensor: a leaf marked so, or a result computed
        from one while grad mode was on."""
        return self._requires_grad or self._node is not None

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        if self._node is not None:
            if flag:
                return
            from kiln.errors import KilnBackwardError

            raise KilnBackwardError("requires_grad: only a leaf's flag can be cleared; use "
                                    "t.detach() for a tensor computed from others")
        if flag and not self.dtype.is_floating:
            from kiln.errors import KilnBackwardError

            raise KilnBackwardError(f"requires_grad: only float tensors can require grad, this "
                                    f"one is {self.dtype}")
        self._requires_grad = bool(flag)

    def requires_grad_(self, requires_grad: bool = True) -> "Tensor":
        self.requires_grad = requires_grad
        return self

    @property
    def grad(self):
        """The gradient `backward()` accumulated into this leaf (None before)."""
        return self._grad

    @grad.setter
    def grad(self, value) -> None:
        if self._builder is None:
            from kiln.frontend.functionalize import active_tracker

            tracker = active_tracker()  # a compiled step setting .grad (functionalize.py)
            if tracker is not None:
                tracker.record_grad(self)
        self._grad = value

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    @property
    def grad_fn(self):
        from kiln.frontend.tape import NodeRef

        return self._node.node if isinstance(self._node, NodeRef) else None

    def _grad_ref(self):
        """The tape reference gradients flow back through, or None."""
        if self._node is not None:
            return self._node
        if self._requires_grad:
            from kiln.frontend.tape import LeafRef, is_grad_enabled

            return LeafRef(self, self._x) if is_grad_enabled() else None
        return None

    def backward(self, gradient=None, retain_graph=None, create_graph: bool = False,
                 inputs=None) -> None:
        """Accumulate this tensor's gradient into `.grad` of every leaf it came from.

        >>> w = kn.ones(3, requires_grad=True)
        >>> (w * w).sum().backward(); w.grad     # 2 w
        """
        from kiln.frontend.tape import backward

        backward(self, gradient, inputs)

    def detach(self) -> "Tensor":
        """The same values, cut from the tape (no gradient flows back through it)."""
        return Tensor._make(self._x, self._builder, self._device)

    def detach_(self) -> "Tensor":
        self._node = None
        self._requires_grad = False
        return self

    def retain_grad(self) -> None:
        """Accepted for torch compatibility; non-leaf gradients are not kept."""

    # -- metadata ----------------------------------------------------------------

    @property
    def is_traced(self) -> bool:
        return self._builder is not None

    @property
    def shape(self) -> tuple:
        """The sizes; while tracing under a dynamic spec a symbolic dim is a SymSize for
        user code (its comparisons, arithmetic and int() go through the ranges and size
        guards, kiln/frontend/symsize.py) and a sympy expression inside kiln."""
        if self._builder is None:
            return self._x.shape  # an ndarray's shape: a tuple already
        dims = self._x.type.shape
        if all(d.__class__ is int for d in dims):
            return dims
        import sys

        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "kiln" or caller.startswith("kiln."):
            return dims
        from kiln.frontend.symsize import wrap_dims

        return wrap_dims(dims)

    @property
    def dtype(self) -> dt.DType:
        if self._builder is not None:
            return self._x.type.dtype
        kind = _KILN_DTYPES.get(self._x.dtype)  # from_numpy without its np.dtype() call
        return kind if kind is not None else dt.from_numpy(self._x.dtype)

    @property
    def ndim(self) -> int:
        return self._x.ndim if self._builder is None else len(self._x.type.shape)

    @property
    def device(self) -> Device:
        """Where the tensor's memory is (`kn.device`): "cpu", "cuda:0", ..."""
        return self._device or CPU

    @property
    def is_cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def cpu(self) -> "Tensor":
        """This tensor on the CPU (itself when it is there already)."""
        return self if self._device is None else self.to(CPU)

    def cuda(self, device=None) -> "Tensor":
        return self.to(as_device("cuda" if device is None else f"cuda:{device}"
                                 if isinstance(device, int) else device, "Tensor.cuda"))

    def element_size(self) -> int:
        return self.dtype.bits // 8 if self.dtype.bits >= 8 else 1

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None):
        """torch's `x.size()` / `x.size(dim)`; a symbolic dim is a SymSize, whose Python
        comparisons the dynamic spec's ranges decide (kiln/frontend/symsize.py)."""
        from kiln.frontend.symsize import wrap_dims

        dims = wrap_dims(self.shape)
        return dims if dim is None else dims[dim]

    def numel(self):
        from kiln.ir.shapes import numel

        return numel(self.shape)

    @property
    def value(self) -> Value:
        """The graph value of a traced tensor."""
        return self._x

    # -- leaving kiln --------------------------------------------------------------

    def _concrete(self, what: str) -> np.ndarray:
        if self._view is not None:
            self._view.refresh(self)
        if self._builder is not None:
            raise KilnConcretizationError(
                f"{what} needs the value of a traced tensor ({self._x.type}), which is not known "
                "while kiln traces the function", where=user_location(), hint=_FIX)
        return self._x

    def numpy(self) -> np.ndarray:
        """The data as a numpy array (shared, not copied)."""
        return self._shared(self._concrete("Tensor.numpy()"))

    def _shared(self, array: np.ndarray) -> np.ndarray:
        """`array` (this tensor's memory) as it leaves kiln, where it may be written in
        place: while an async checkpoint save holds it (read-only, copy-on-write) the
        tensor first takes a copy of its own, so the save keeps the values of its call."""
        flags = getattr(array, "flags", None)  # a device tensor's memory may be no ndarray
        if flags is None or flags.writeable:
            return array
        import sys

        staging = sys.modules.get("kiln.distributed.checkpoint.staging")
        own = staging.cow_copy(array) if staging is not None else None
        if own is None:
            return array
        self._x = own
        return own

    def __array__(self, dtype=None, copy=None):
        array = self._concrete("converting a tensor to a numpy array")
        if dtype is None and not copy:
            return self._shared(array)
        if dtype is not None:
            array = array.astype(dtype)
        return array.copy() if copy else array

    def item(self):
        array = self._concrete("Tensor.item()")
        if array.size != 1:
            from kiln.errors import KilnShapeError

            raise KilnShapeError(f"item: only a tensor with one element has an item, got shape "
                                 f"{list(array.shape)}")
        return _python_values(array.reshape(()), self.dtype)

    def tolist(self):
        return _python_values(self._concrete("Tensor.tolist()"), self.dtype)

    def __bool__(self) -> bool:
        return bool(self._single("bool(tensor) (an `if` or `while` on a tensor)"))

    def __float__(self) -> float:
        return float(self._single("float(tensor)"))

    def __int__(self) -> int:
        return int(self._single("int(tensor)"))

    def __index__(self) -> int:
        if not (self.dtype.is_integer or self.dtype.is_bool):
            raise TypeError(f"only integer tensors can be used as an index, not {self.dtype}")
        return int(self._single("using a tensor as a Python index"))

    def _single(self, what: str):
        array = self._concrete(what)
        if array.size != 1:
            from kiln.errors import KilnShapeError

            raise KilnShapeError(f"{what}: the truth or value of a tensor with {array.size} "
                                 "elements is ambiguous; reduce it first (.any(), .all(), .sum())")
        value = array.reshape(())
        return value.astype(np.float32) if self.dtype.is_floating and self.dtype.bits < 32 else value

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        first = self.shape[0]
        if not isinstance(first, int):
            raise KilnConcretizationError(f"len() of a tensor whose first dim is symbolic ({first})",
                                          where=user_location(), hint="use x.shape[0]")
        return first

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __dlpack__(self, *args, **kwargs):
        """Export without copying (kiln/runtime/dlpack.py says what is shared)."""
        from kiln.runtime.dlpack import export_capsule

        return export_capsule(self._concrete("DLPack export"), self.device, *args, **kwargs)

    def __dlpack_device__(self):
        from kiln.runtime.dlpack import dlpack_device

        self._concrete("DLPack export")
        return dlpack_device(self.device)

    def __repr__(self) -> str:
        if self._builder is not None:
            return f"Tensor(traced {self._x.type})"
        data = self._x.astype(np.float32) if self.dtype.is_floating and self.dtype.bits < 32 else self._x
        body = np.array2string(data, separator=", ", prefix="tensor(")
        return f"tensor({body}, dtype={self.dtype!r})"

    def __format__(self, spec: str) -> str:
        """f"{loss:.4f}" formats a one-element tensor's value, as torch does."""
        if spec and self._builder is None and self._x.size == 1:
            return format(self.item(), spec)
        return format(repr(self), spec)

    __hash__ = object.__hash__  # == is elementwise, so hash by identity as torch does


def _python_values(array: np.ndarray, dtype: dt.DType):
    """Python scalars (or nested lists) of an array; low-precision floats (ml_dtypes
    arrays, whose .item() gives numpy scalars) go through float32 first."""
    if dtype.is_floating and dtype.bits < 32:
        array = array.astype(np.float32)
    return array.tolist()


def _convert_array(array: np.ndarray, target: dt.DType) -> np.ndarray:
    from kiln.ir.emitter import EAGER

    return EAGER.convert(array, target)

