"""The free-threaded guard: compiled code needs the GIL.

kiln's compiler and runtime share process-wide state without locks of their own: the
specialization cache of a compiled function, the trace builder, the kernel and
autotuning caches, the runtime's buffer arena (a `Program` hands its buffers to one
caller at a time), and numpy's BLAS thread settings. Under the GIL each Python call into
them is atomic; on a free-threaded build (PEP 703, `python3.13t`) with the GIL off,
two threads calling one compiled function would race on them. PyTorch 2.14 refuses
`torch.compile` there with a clear error instead of falling back; kiln does the same at
the call of `kn.compile`, `kn.export` and `kn.load` (which returns a compiled
program), and eager mode, which holds no such state, keeps working.

A free-threaded build run with the GIL turned back on (`PYTHON_GIL=1` or
`python -X gil=1`) is safe and allowed: the check is the build flag *and* the GIL's
state now, as `sys._is_gil_enabled()` reports it.
"""

from __future__ import annotations

import sys
import sysconfig

from kiln.errors import KilnError


class KilnFreeThreadedError(KilnError, RuntimeError):
    code = "K320"
    title = "compiled code on a free-threaded Python with the GIL off"


def gil_disabled_build() -> bool:
    """Was this Python built without the GIL (`Py_GIL_DISABLED`, PEP 703)?"""
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def gil_enabled_now() -> bool:
    """Is the GIL on in this process (always, on a default build)?"""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


def require_gil(what: str) -> None:
    """Raise K320 when `what` (`kn.compile`, `kn.export`, `kn.load`) is called on a
    free-threaded build with the GIL off.

    >>> require_gil("kn.compile")   # returns at once on a default build
    """
    if gil_disabled_build() and not gil_enabled_now():
        raise KilnFreeThreadedError(
            f"{what}: this Python ({sys.version.split()[0]}, free-threaded build) runs without "
            "the GIL, and kiln's compiled programs share caches and buffers that need it; "
            "kiln refuses to compile rather than race",
            hint="run with the GIL on (PYTHON_GIL=1 or python -X gil=1), or use a default "
                 "(GIL) build; eager mode (no kn.compile/export/load) works as it is")
