"""How `kiln launch` keeps its workers' lives bounded by its own and by the group's.

- `die_with_parent()`: every worker is started with `prctl(PR_SET_PDEATHSIG, SIGKILL)`,
  so the kernel kills it when the launcher dies, even by SIGKILL (when nothing can be
  forwarded and nothing cleaned up): no worker runs on as an orphan.
- `GroupWatch`: what the launcher learns from the fault-tolerant group's membership in
  the store (kiln.distributed.membership): whether the first rendezvous happened (a
  replacement before it must take the dead worker's place there, not wait to join), the
  uids of replacements (from their join requests), and which uids an epoch removed (a
  worker stopped or hung from outside, shrunk away by its peers, is killed rather than
  waited for: no epoch will take it back).
- `process_state`: a worker stopped from outside (state T) while every other worker is
  done is killed after --grace seconds: nobody is left to wake it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Callable

FIRST_VIEW = "ft/view/0"  # written once the fault-tolerant world's first rendezvous is done
VIEW = "ft/view/%d"       # epoch e's membership: {"members", "removed", ...}
JOIN_PREFIX = "ft/join/"  # a replacement waiting to be admitted: {"pid": ...}
_PR_SET_PDEATHSIG = 1     # linux/prctl.h


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the kernel send the child `signum` (default SIGKILL)
    when this process dies (Linux `prctl(PR_SET_PDEATHSIG)`); None where that does not
    exist. Made in the parent: the child only calls an already resolved C function
    between fork and exec.

        >>> subprocess.Popen(cmd, preexec_fn=die_with_parent())
        >>> subprocess.Popen(["mpirun", ...], preexec_fn=die_with_parent(signal.SIGTERM))
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent, kill = os.getpid(), int(signum)

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), kill)
    return arm


def process_state(pid: int) -> str | None:
    """The state letter of a process in /proc (R, S, T stopped, t traced, Z zombie, ...);
    None when it cannot be read (gone, or not Linux)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(b")")[2].split()  # the command name may hold spaces and ')'
    return fields[0].decode() if fields else None


class GroupWatch:
    """The launcher's reader of the group's membership keys. `call(fn, default)` runs a
    store operation and returns `default` when the store cannot be reached."""

    def __init__(self, store, call: Callable, store_timeout: float):
        self.store, self.call, self.timeout = store, call, store_timeout
        self.next_view = 0                 # the first epoch not read yet
        self.removed: dict[int, int] = {}  # uid -> the epoch that removed it

    def formed(self) -> bool:
        """Whether the group's first rendezvous is done (True if the store is gone:
        then a replacement can only try to join)."""
        return bool(self.call(lambda: self.store.check([FIRST_VIEW]), True))

    def joiners(self) -> dict[int, int]:
        """pid -> uid of the replacements waiting to be admitted now."""
        def read() -> dict[int, int]:
            found = {}
            for key in self.store.list_keys(JOIN_PREFIX):
                info = json.loads(self.store.get(key, timeout=self.timeout))
                found[info.get("pid")] = int(key[len(JOIN_PREFIX):])
            return found
        try:
            return self.call(read, {})
        except (ValueError, AttributeError):  # not a join request kiln wrote
            return {}

    def update(self) -> dict[int, int]:
        """Read the epochs formed since the last look; every uid removed so far."""
        while True:
            key = VIEW % self.next_view
            raw = self.call(lambda: self.store.get(key) if self.store.check([key]) else None,
                            None)
            if raw is None:
                return self.removed
            try:
                removed = json.loads(raw).get("removed", [])
            except (ValueError, AttributeError):
                removed = []
            for uid in removed:
                self.removed.setdefault(int(uid), self.next_view)
            self.next_view += 1
