"""Buffers and reduce ops: turning user tensors into flat numpy views, and combining them.

A collective works in place on the memory of the caller's tensor: a numpy array, or
any object whose `.numpy()` / `__array__` returns a view of its memory (kiln.Tensor).
Everything is checked here, before a byte is sent: the dtype must be a kiln dtype, the
buffer C-contiguous (and writeable when it receives), sizes must agree.
"""

from __future__ import annotations

import numpy as np

from kiln.distributed.errors import CollectiveArgumentError
from kiln.errors import KilnDTypeError
from kiln.ir import dtypes as kd

REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
# wire codes: stable small integers for the data-socket header
REDUCE_CODES = {name: i + 1 for i, name in enumerate(REDUCE_OPS)}
DTYPE_CODES = {d.short: i + 1 for i, d in enumerate(kd.ALL_DTYPES)}

# ml_dtypes' low-precision floats are reduced in float32 and rounded back once per step
_UPCAST = {kd.bfloat16.short, kd.float8_e4m3fn.short, kd.float8_e5m2.short}


def describe(obj) -> str:
    """`float32[4, 3] ndarray`-style text for error messages."""
    arr = obj if isinstance(obj, np.ndarray) else None
    if arr is None:
        return type(obj).__name__
    return "%s%s %s" % (arr.dtype, list(arr.shape), type(obj).__name__)


_KILN_NP_DTYPES: set = set()  # numpy dtypes `kd.from_numpy` accepted (the fast check)


def as_array(obj, op: str, name: str, *, writeable: bool) -> np.ndarray:
    """The numpy view of a user buffer, validated; raises CollectiveArgumentError."""
    if type(obj) is np.ndarray and obj.dtype in _KILN_NP_DTYPES:  # the common case
        flags = obj.flags
        if flags.c_contiguous and (flags.writeable or not writeable):
            return obj
    arr = obj
    if not isinstance(arr, np.ndarray):
        if hasattr(obj, "numpy") and callable(obj.numpy):
            arr = obj.numpy()
        elif hasattr(obj, "__array__"):
            arr = np.asarray(obj)
        if not isinstance(arr, np.ndarray):
            raise CollectiveArgumentError(
                "%s: %s must be a numpy array or a tensor exposing .numpy()/__array__, got %s"
                % (op, name, type(obj).__name__))
    try:
        kd.from_numpy(arr.dtype)
        _KILN_NP_DTYPES.add(arr.dtype)
    except KilnDTypeError:
        raise CollectiveArgumentError(
            "%s: %s has dtype %s, which is not a kiln dtype; use one of %s"
            % (op, name, arr.dtype, ", ".join(d.name for d in kd.ALL_DTYPES))) from None
    if not arr.flags.c_contiguous:
        raise CollectiveArgumentError(
            "%s: %s (%s) is not C-contiguous; collectives work in place on contiguous memory"
            % (op, name, describe(arr)),
            hint="pass np.ascontiguousarray(x) and copy the result back")
    if writeable and not arr.flags.writeable:
        raise CollectiveArgumentError("%s: %s (%s) is read-only but receives data"
                                      % (op, name, describe(arr)))
    return arr


def flat(arr: np.ndarray) -> np.ndarray:
    """A 1-D view sharing memory (valid for contiguous arrays, including 0-d)."""
    return arr.reshape(-1)


def dtype_of(arr: np.ndarray) -> kd.DType:
    return kd.from_numpy(arr.dtype)


def check_same_dtype(op: str, arrays: list[tuple[str, np.ndarray]]) -> None:
    first_name, first = arrays[0]
    for name, arr in arrays[1:]:
        if arr.dtype != first.dtype:
            raise CollectiveArgumentError(
                "%s: %s is %s but %s is %s; every buffer of one collective has one dtype"
                % (op, first_name, describe(first), name, describe(arr)))


def check_reduce_op(op: str, reduce_op: str, dt: kd.DType) -> str:
    """Validate a reduce op name against the dtype; returns the normalized name."""
    name = str(getattr(reduce_op, "value", reduce_op)).lower()
    if name not in REDUCE_OPS:
        raise CollectiveArgumentError("%s: unknown reduce op %r; use one of %s"
                                      % (op, reduce_op, ", ".join(REDUCE_OPS)))
    if name == "avg" and not dt.is_inexact:
        raise CollectiveArgumentError(
            "%s: op='avg' needs a floating or complex buffer, got %s (the mean would be "
            "truncated)" % (op, dt.name), hint="use op='sum' and divide, or cast to float32")
    if name in ("min", "max") and dt.is_complex:
        raise CollectiveArgumentError("%s: op=%r is undefined for complex64 (no ordering)"
                                      % (op, name))
    return name


def check_rank(op: str, name: str, value, world_size: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not (
            0 <= int(value) < world_size):
        raise CollectiveArgumentError("%s: %s=%r is not a rank of this group (0..%d)"
                                      % (op, name, value, world_size - 1))
    return int(value)


class Reducer:
    """Combines buffers of one dtype with one reduce op: `combine(out, a, b)`.

    Low-precision floats are upcast into reusable float32 scratch (no per-chunk
    allocation once warm) and rounded back, as NCCL does for bf16.
    """

    def __init__(self, reduce_op: str, dt: kd.DType):
        self.op, self.dtype = reduce_op, dt
        if dt.is_bool:
            ufuncs = {"sum": np.logical_or, "max": np.logical_or,
                      "prod": np.logical_and, "min": np.logical_and}
        else:
            ufuncs = {"sum": np.add, "avg": np.add, "prod": np.multiply,
                      "min": np.minimum, "max": np.maximum}
        self.ufunc = ufuncs[reduce_op]
        self.upcast = dt.short in _UPCAST
        self._scratch = np.empty(0, np.float32)

    def _f32(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self._scratch.size < 2 * n:
            self._scratch = np.empty(2 * n, np.float32)
        return self._scratch[:n], self._scratch[n:2 * n]

    def combine(self, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """out = a (op) b, elementwise; `out` may alias `a`."""
        if not self.upcast:
            self.ufunc(a, b, out=out)
            return
        fa, fb = self._f32(a.size)
        fa[...] = a
        fb[...] = b
        self.ufunc(fa, fb, out=fa)
        out[...] = fa

    def accumulate(self, out: np.ndarray, other: np.ndarray, world_size: int) -> None:
        """The last step of a reduction over `world_size` ranks: out = out (op) other,
        then `finish`."""
        if self.upcast or self.op == "avg":
            self.combine(out, out, other)
            self.finish(out, world_size)
        else:
            self.ufunc(out, other, out=out)

    def finish(self, buf: np.ndarray, world_size: int) -> None:
        """Apply the final step of the op (divide by the group size for avg)."""
        if self.op != "avg":
            return
        if self.upcast:
            fa, _ = self._f32(buf.size)
            fa[...] = buf
            np.divide(fa, world_size, out=fa)
            buf[...] = fa
        else:
            np.divide(buf, world_size, out=buf)
