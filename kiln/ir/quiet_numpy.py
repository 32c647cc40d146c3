"""numpy's floating-point warnings off, cheaply: what every eager float reference runs
under (overflow to inf and NaN are results in kiln, as in torch, not warnings).

`np.errstate(all="ignore")` costs ~1.2 us to enter and leave, more than a ufunc on a
32x32 array (issue 22, eager per-op overhead). numpy keeps the state in a context
variable; setting that variable to a quiet state made once is the same thing for a
tenth of the cost.
"""

from __future__ import annotations

import numpy as np

try:  # numpy's floating-point error state is a context variable holding an "extobj"
    from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj
except ImportError:  # another numpy layout: np.errstate, at its usual cost
    _extobj_contextvar = _make_extobj = None

_QUIET: dict = {}


def quietly(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` under `np.errstate(all="ignore")`, in a tenth of its cost."""
    quiet = quiet_state()
    if quiet is None:
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    token = _extobj_contextvar.set(quiet)
    try:
        return fn(*args, **kwargs)
    finally:
        _extobj_contextvar.reset(token)


_DIRECT = frozenset(np.dtype(t) for t in (np.float32, np.float64))


def float_fn(reference, dtypes):
    """The numpy function a `via_f32` (or float-accepting) reference runs for operands of
    `dtypes`, when it runs exactly that, quietly, and returns its result unchanged: the
    eager plan cache calls it under `quiet_state()` and skips the wrapper's dispatch on
    dtype. None when the operands need the wrapper (low precision, ints, bools)."""
    fn = getattr(reference, "float_fn", None)
    if fn is None or not all(d in _DIRECT for d in dtypes):
        return None
    return fn


def quiet_state():
    """The error state `quietly` sets, for callers that set it themselves (None when
    numpy keeps it elsewhere: use `quietly`). Made once per current state, so
    np.setbufsize and a user's error callback are kept."""
    if _extobj_contextvar is None:
        return None
    current = _extobj_contextvar.get()
    quiet = _QUIET.get(current)
    if quiet is None:
        if len(_QUIET) > 64:
            _QUIET.clear()
        quiet = _QUIET[current] = _make_extobj(all="ignore")
    return quiet
