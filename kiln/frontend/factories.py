"""Making tensors: from data (`tensor`, `asarray`, DLPack), filled (`zeros`, `full`,
`arange`, `eye`) and random (`rand`, `randn`, `randint`).

Random tensors come from counter-based Threefry bits, so a seed gives the same
numbers eagerly, traced and compiled. Without a seed, each call takes the next key
of a global stream that `manual_seed` resets.
"""

from __future__ import annotations

import threading

import numpy as np
import sympy

from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.emitter import EAGER
from kiln.ir.ops.creation import threefry2x32
from kiln.ir.shapes import dim as as_dim
from kiln.frontend.dispatch import creation_emitter, to_array, wrap

__all__ = [
    "tensor", "asarray", "as_tensor", "from_numpy", "from_dlpack", "full", "zeros", "ones",
    "empty", "zeros_like", "ones_like", "full_like", "empty_like", "arange", "linspace", "eye",
    "manual_seed", "rand", "randn", "randint",
]


def _finish(t, op: str, device=None, requires_grad: bool = False):
    """Put the result on `device=` (made on the CPU, then copied there) and mark
    `requires_grad=`."""
    from kiln.frontend.tensor import CPU, as_device

    target = as_device(device, op)
    if target is not CPU and t._builder is None:
        t = t.to(target)
    if requires_grad:
        t.requires_grad = True
    return t


def tensor(data, dtype=None, *, device=None, requires_grad: bool = False):
    """A new tensor holding a copy of `data` (nested lists, numpy arrays, scalars).

    >>> kn.tensor([[1, 2], [3, 4]]).dtype
    kiln.int64
    """
    from kiln.frontend.tensor import Tensor

    return Tensor(data, dtype, device=device, requires_grad=requires_grad)


def asarray(data, dtype=None, *, device=None):
    """A tensor sharing `data`'s memory when it can (numpy arrays, DLPack producers)."""
    from kiln.frontend.tensor import CPU, Tensor, as_device

    target = as_device(device, "asarray")
    if isinstance(data, Tensor) and (dtype is None or data.dtype == dt.dtype(dtype)):
        return data if device is None else data.to(target)
    array = to_array(data)
    if dtype is not None and dt.from_numpy(array.dtype) != dt.dtype(dtype):
        array = EAGER.convert(array, dt.dtype(dtype))
    out = Tensor._make(array)
    return out if target is CPU else out.to(target)


as_tensor = asarray


def from_numpy(array: np.ndarray):
    return asarray(array)


def from_dlpack(obj, *, device=None, copy=None):
    """Import a DLPack producer (numpy, torch, jax, cupy; host or CUDA memory) without
    copying where kiln can share it; kiln/runtime/dlpack.py says what is shared."""
    from kiln.runtime.dlpack import from_dlpack as _from_dlpack

    return _from_dlpack(obj, device=device, copy=copy)


def _shape(op: str, size) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    dims = tuple(as_dim(s) for s in size)
    for d in dims:
        if isinstance(d, int) and d < 0:
            raise KilnArgumentError(f"{op}: negative size {d} in {list(dims)}")
    return dims


def full(size, fill_value, dtype=None, *, device=None, requires_grad: bool = False):
    if dtype is None:
        dtype = dt.python_scalar_dtype(fill_value)
    em = creation_emitter()
    out = wrap(em, em.full(fill_value, dt.dtype(dtype), _shape("full", (size,))))
    return _finish(out, "full", device, requires_grad)


def zeros(*size, dtype=dt.float32, device=None, requires_grad: bool = False):
    return full(_shape("zeros", size), 0, dtype, device=device, requires_grad=requires_grad)


def ones(*size, dtype=dt.float32, device=None, requires_grad: bool = False):
    return full(_shape("ones", size), 1, dtype, device=device, requires_grad=requires_grad)


def empty(*size, dtype=dt.float32, device=None, requires_grad: bool = False):
    """Uninitialized in PyTorch; zeros here (numpy and compiled code alike)."""
    return full(_shape("empty", size), 0, dtype, device=device, requires_grad=requires_grad)


def _like(x, dtype):
    from kiln.frontend.functional import _tensor

    x = _tensor(x)
    return x.shape, dt.dtype(dtype) if dtype is not None else x.dtype, x.device


def zeros_like(x, dtype=None, *, device=None, requires_grad: bool = False):
    """Zeros of `x`'s shape, dtype and device (unless given)."""
    shape, dtype, where = _like(x, dtype)
    return full(shape, 0, dtype, device=device or where, requires_grad=requires_grad)


def ones_like(x, dtype=None, *, device=None, requires_grad: bool = False):
    shape, dtype, where = _like(x, dtype)
    return full(shape, 1, dtype, device=device or where, requires_grad=requires_grad)


def full_like(x, fill_value, dtype=None, *, device=None, requires_grad: bool = False):
    shape, dtype, where = _like(x, dtype)
    return full(shape, fill_value, dtype, device=device or where, requires_grad=requires_grad)


def empty_like(x, dtype=None, *, device=None, requires_grad: bool = False):
    return zeros_like(x, dtype, device=device, requires_grad=requires_grad)


def arange(start, end=None, step=1, dtype=None, *, device=None, requires_grad: bool = False):
    """Values from start (inclusive) to end (exclusive), as torch.arange."""
    start, end, step = (v._sympy_() if hasattr(v, "_sympy_") else v for v in (start, end, step))
    if end is None:
        start, end = 0, start
    if step == 0:
        raise KilnArgumentError("arange: step must be nonzero")
    if dtype is None:
        floating = any(isinstance(v, float) for v in (start, end, step))
        dtype = dt.float32 if floating else dt.int64
    dtype = dt.dtype(dtype)
    if any(isinstance(v, sympy.Basic) for v in (start, end, step)):  # a symbolic size (B)
        if not all(isinstance(v, (int, sympy.Basic)) for v in (start, end)) or not isinstance(step, int):
            raise KilnArgumentError("arange: with a symbolic bound, start, end and step must be "
                                    "integers and step a Python int")
        bias = step - 1 if step > 0 else step + 1  # ceil((end - start) / step) by floor division
        count = as_dim(sympy.Max(0, sympy.floor((sympy.sympify(end) - start + bias) / step)))
    else:
        count = max(0, int(np.ceil((end - start) / step)))
    em = creation_emitter()
    ramp = em.call("iota", dtype=dt.float64 if dtype.is_floating else dt.int64, shape=(count,))
    if step != 1:
        ramp = em.binary("mul", ramp, step)
    if start != 0:
        ramp = em.binary("add", ramp, start)
    return _finish(wrap(em, em.convert(ramp, dtype)), "arange", device, requires_grad)


def linspace(start: float, end: float, steps: int, dtype=dt.float32, *, device=None,
             requires_grad: bool = False):
    if steps < 0:
        raise KilnArgumentError(f"linspace: steps must be >= 0, got {steps}")
    em = creation_emitter()
    ramp = em.call("iota", dtype=dt.float64, shape=(steps,))
    delta = (end - start) / (steps - 1) if steps > 1 else 0.0
    values = em.binary("add", em.binary("mul", ramp, delta), float(start))
    return _finish(wrap(em, em.convert(values, dt.dtype(dtype))), "linspace", device,
                   requires_grad)


def eye(n: int, m: int | None = None, dtype=dt.float32, *, device=None,
        requires_grad: bool = False):
    m = n if m is None else m
    em = creation_emitter()
    rows = em.call("iota", dtype=dt.int64, shape=(n, m), dimension=0)
    cols = em.call("iota", dtype=dt.int64, shape=(n, m), dimension=1)
    return _finish(wrap(em, em.convert(em.call("eq", rows, cols), dt.dtype(dtype))), "eye",
                   device, requires_grad)


# -- randomness ------------------------------------------------------------------------

_rng = threading.local()
_MASK = 0xFFFFFFFF


def manual_seed(seed: int) -> None:
    """Reset the global random stream used when no `seed=` is given."""
    _rng.seed = int(seed)
    _rng.counter = 0


def _key(seed: int | None) -> np.ndarray:
    if seed is None:
        base = getattr(_rng, "seed", 0)
        counter = getattr(_rng, "counter", 0)
        _rng.counter = counter + 1
        k0, k1 = threefry2x32(base & _MASK, (base >> 32) & _MASK,
                              np.array([counter & _MASK], np.uint32),
                              np.array([(counter >> 32) & _MASK], np.uint32))
        return np.array([k0[0], k1[0]], dtype=np.uint32)
    seed = int(seed)
    return np.array([seed & _MASK, (seed >> 32) & _MASK], dtype=np.uint32)


def _random(op: str, size, seed, dtype, **attrs):
    dtype = dt.dtype(dtype)
    if not dtype.is_floating:
        raise KilnDTypeError(f"{op}: dtype must be floating, got {dtype}")
    em = creation_emitter()
    key = em.constant(_key(seed))
    return wrap(em, em.call(op, key, shape=_shape(op, size), dtype=dtype, **attrs))


def rand(*size, seed: int | None = None, dtype=dt.float32, device=None, requires_grad=False,
         generator=None):
    """Uniform samples in [0, 1)."""
    _no_generator("rand", generator)
    return _finish(_random("uniform", size, seed, dtype), "rand", device, requires_grad)


def randn(*size, seed: int | None = None, dtype=dt.float32, device=None, requires_grad=False,
          generator=None):
    """Standard normal samples."""
    _no_generator("randn", generator)
    return _finish(_random("normal", size, seed, dtype), "randn", device, requires_grad)


def _no_generator(op: str, generator) -> None:
    if generator is not None:
        raise KilnArgumentError(f"{op}: generator= is not supported; seed kiln's stream with "
                                "kn.manual_seed(n) or pass seed=n")


def randint(low: int, high: int | None = None, size=(), seed: int | None = None, dtype=dt.int64,
            *, device=None, generator=None):
    """Integers uniform in [low, high)."""
    from kiln.frontend.tensor import as_device

    target = as_device(device, "randint")
    _no_generator("randint", generator)
    if isinstance(high, (tuple, list)) and size == ():  # torch's randint(high, size)
        high, size = None, tuple(high)
    if high is None:
        low, high = 0, low
    if high <= low:
        raise KilnArgumentError(f"randint: high ({high}) must be greater than low ({low})")
    from kiln.frontend.functional import add, floor, mul, to

    # float32 uniforms carry 24 random bits: ranges beyond 2**24 are not uniform
    u = rand(*((size,) if isinstance(size, int) else tuple(size)), seed=seed)
    values = floor(add(mul(to(u, dt.float64), float(high - low)), float(low)))
    return _finish(to(values, dtype), "randint", target)
