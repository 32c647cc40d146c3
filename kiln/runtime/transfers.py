"""Counting host <-> device traffic: every copy kiln makes between host memory and a
device's memory, and every host-memory operand handed to a device kernel.

Compiled programs on a device copy nothing between their kernels (kiln/runtime/
device_programs.py); the copies that do happen — `x.to(device)`, `.to("cpu")`, an extern
(sort, LAPACK) that computes on the host, a `cond` index or a `while_loop` flag read by
the host, the OpenCL backend copying a host array through a buffer, the Triton backend
uploading a numpy argument — are counted here, so a test or a user can check that a
program stays on its device:

    >>> from kiln.runtime import transfers
    >>> with transfers.counting() as seen:
    ...     y = f(x)                      # x on "opencl:0"
    >>> seen["host_to_device"], seen["device_to_host"], seen["host_operands"]
    (0, 0, 0)

Counters: `host_to_device` / `device_to_host` / `device_to_device` (copies) with their
`*_bytes`, and `host_operands`: kernel arguments in host memory that a device used in
place (PoCL's CPU device can; a GPU would need a copy), which a device-resident
program never has.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_KEYS = ("host_to_device", "device_to_host", "device_to_device", "host_operands")
_counts = {k: 0 for k in _KEYS} | {f"{k}_bytes": 0 for k in _KEYS}
_lock = threading.Lock()


def record(what: str, nbytes: int = 0) -> None:
    """Count one transfer of `nbytes` ("host_to_device", "device_to_host",
    "device_to_device" or "host_operands")."""
    with _lock:
        _counts[what] += 1
        _counts[what + "_bytes"] += int(nbytes)


def transfer_stats() -> dict:
    """The process's counts and bytes so far (a copy)."""
    with _lock:
        return dict(_counts)


@contextlib.contextmanager
def counting() -> Iterator[dict]:
    """A dict that, after the block, holds what the block transferred (all threads)."""
    before = transfer_stats()
    seen: dict = {}
    try:
        yield seen
    finally:
        after = transfer_stats()
        seen.update({k: after[k] - before[k] for k in after})
