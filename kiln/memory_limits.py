"""How much memory kiln lets one process ask for, checked before anything is allocated.

A leaf module (it imports only `kiln.errors`), so that every layer can check a size
before it allocates: eager ops check their result type before running the numpy
reference, the runtime allocator checks before `np.empty`. A request past the limit is
a numbered K170 with the figures, never numpy's `MemoryError` or "array is too big".
"""

from __future__ import annotations

import math
import os

from kiln.errors import KilnError


class KilnMemoryError(KilnError, MemoryError):
    code = "K170"
    title = "allocation beyond the memory fraction"


_HINT = "lower the batch size or raise kiln.runtime.set_memory_fraction()"


def physical_memory() -> int:
    """Bytes of physical memory on this host (1 TiB when the OS cannot say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def limit_for(fraction: float) -> int:
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise KilnError(f"memory fraction must be in (0, 1], got {fraction!r}")
    return int(physical_memory() * fraction)


_fraction = 1.0
_limit = limit_for(_fraction)


def set_process_fraction(fraction: float) -> None:
    """The limit every eager result and the default allocator are checked against."""
    global _fraction, _limit
    _limit = limit_for(fraction)
    _fraction = fraction


def process_limit() -> int:
    return _limit


def human(nbytes: int) -> str:
    """`4.0 TiB (4398046511104 bytes)`: readable and exact."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            break
        value /= 1024
    return f"{nbytes} bytes" if unit == "B" else f"{value:.1f} {unit} ({nbytes} bytes)"


def nbytes_of(shape, itemsize: int) -> int:
    """Exact byte count of a dense array (Python ints: no overflow, however absurd)."""
    return math.prod(int(d) for d in shape) * int(itemsize)


def check_request(what: str, nbytes: int, in_use: int = 0, limit: int | None = None,
                  fraction: float | None = None) -> None:
    """Raise K170 when `nbytes` more on top of `in_use` would pass the limit."""
    limit = _limit if limit is None else limit
    fraction = _fraction if fraction is None else fraction
    total = in_use + nbytes
    if total > limit:
        held = f", with {human(in_use)} already held" if in_use else ""
        raise KilnMemoryError(
            f"{what} needs {human(nbytes)}{held}: over the limit of {human(limit)} "
            f"({fraction:.0%} of physical memory)", hint=_HINT)
