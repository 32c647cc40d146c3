"""In-place writes inside `kn.cond` / `kn.switch` / `kn.while_loop` branches, functionalized.

A branch that runs `x.add_(1)` on a tensor from outside the branch rebinds the handle
`x` to a value defined inside the branch's region; after the region closes, that value
is out of scope. The writes are turned into data flow, as torch's functionalization of
`torch.cond` does:

- `cond`/`switch`: while a branch is traced, a journal records every handle rebound in
  it and its value before the branch. Afterwards each handle whose old value lives
  outside the region is put back, and its new value becomes an extra result of the
  branch; a branch that leaves it alone yields the old value. The node's extra results
  are then bound to the handles, so code after the `cond` reads the branch's write.
- `while_loop`: a body that writes outside handles is traced again with them as extra
  carried values (the handle holds the region's parameter inside the cond
  and the body, the body yields its new value), and the loop's extra results are bound
  to them afterwards.

Handles created inside a branch are the branch's own business; eager tensors (a
closed-over constant) are put back as they were: writing one from a traced branch is
outside state, which kn.compile lifts (functionalize.py).
"""

from __future__ import annotations

import contextlib
import threading

from kiln.errors import KilnTraceError, user_location
from kiln.ir.graph import Region
from kiln.frontend.tensor import Tensor

_local = threading.local()


class KilnBranchWriteError(KilnTraceError):
    code = "K452"
    title = "a while_loop condition writes a tensor in place"


class Journal:
    """The handles rebound while a region is traced, with their state before."""

    def __init__(self) -> None:
        self.saved: dict = {}  # id -> (tensor, (_x, _builder, _node, _version))

    def note(self, t) -> None:
        if id(t) not in self.saved:
            self.saved[id(t)] = (t, (t._x, t._builder, t._node, t._version))


def note_write(t) -> None:
    """Called by `rebind` before it moves the handle `t` (a no-op outside a branch)."""
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].note(t)


@contextlib.contextmanager
def journaling():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    journal = Journal()
    stack.append(journal)
    try:
        yield journal
    finally:
        stack.pop()


def _defined(region: Region) -> set:
    ids = {id(p) for p in region.params}
    for node in region.nodes:
        ids.update(id(v) for v in node.results)
        for sub in node.regions:
            ids |= _defined(sub)
    return ids


def settle(journal: Journal, region: Region) -> dict:
    """Put every journaled handle back; return id -> (tensor, old state, new value) for the
    handles whose old value is a traced value from outside `region`."""
    inside = _defined(region)
    writes = {}
    for key, (t, state) in journal.saved.items():
        new = t._x
        old_x, old_builder = state[0], state[1]
        t._x, t._builder, t._node, t._version = state
        if old_builder is not None and id(old_x) not in inside and new is not old_x:
            writes[key] = (t, state, new)
    return writes


def bind(t, value, builder) -> None:
    """Point the handle `t` at `value` (a result of the control-flow node), as a write."""
    note_write(t)  # an enclosing branch sees it as its own write
    t._x, t._builder, t._node = value, builder, None
    t._version += 1


def resync_views(tensors) -> None:
    """Views among `tensors` agree with their bases again (both were bound together)."""
    for t in tensors:
        if t._view is not None:
            t._view.synced = t._view.base._version


class OperandWrites:
    """Writes to a cond/switch operand through the branch's parameter that stands for it
    (`kn.cond(p, lambda v: v.add_(1), lambda v: None, x)` changes x, as eagerly)."""

    def __init__(self, builder, leaves: list, values: list) -> None:
        self.builder = builder
        self.operands = [leaf for leaf in leaves if isinstance(leaf, Tensor) or hasattr(leaf, "dtype")]
        self.values = values
        self.params: list = []
        self.after: list = []
        self.written: set = set()

    def call_args(self, call_args):
        def remember(params):
            self.params = list(params)
            return call_args(params)

        return remember

    def branch(self, fn):
        def traced(*args):
            out = fn(*args)
            self.after = [p._x for p in self.params]  # before the region's journal settles
            return out

        traced.__name__ = getattr(fn, "__name__", "branch")
        return traced

    def collect(self, region: Region, writes: dict) -> None:
        """Add this branch's operand writes to `writes` (settle's form)."""
        for operand, value, param, after in zip(self.operands, self.values, region.params,
                                                self.after):
            if after is not param and isinstance(operand, Tensor) and \
                    operand._builder is self.builder:
                writes.setdefault(id(operand), (operand, (value,), after))
                self.written.add(id(operand))

    def bind(self, t, value) -> None:
        """After the node: an operand is rebound as an in-place write (so a view writes
        through to its base); a journaled handle just takes its result."""
        if id(t) in self.written:
            from kiln.frontend.mutation import rebind

            rebind(t, Tensor._make(value, self.builder), "cond")
        else:
            bind(t, value, self.builder)


def merge_branch_writes(regions: list[Region], writes: list[dict]) -> list:
    """Append the written handles' values to every branch's results (old value where a
    branch leaves a handle alone); returns the handles, in result order."""
    order: dict = {}
    for w in writes:
        for key, (t, state, _) in w.items():
            order.setdefault(key, (t, state))
    for region, w in zip(regions, writes):
        region.results = region.results + [w[key][2] if key in w else state[0]
                                           for key, (t, state) in order.items()]
    return [t for t, _ in order.values()]


def carried_loop(cond_fn, body_fn, handles: list, n: int) -> tuple:
    """(cond, body) of the loop with `handles` carried after the first `n` values: inside
    each region a handle holds its parameter; the body yields the handles' new values."""
    def enter(params) -> tuple:
        for t, p in zip(handles, params[n:]):
            t._x, t._builder, t._node = p._x, p._builder, None
        return params[:n]

    def cond(*params):
        return cond_fn(*enter(params))

    def body(*params):
        out = body_fn(*enter(params))
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return out + tuple(Tensor._make(t._x, t._builder) for t in handles)

    cond.__name__ = getattr(cond_fn, "__name__", "cond_fn")
    body.__name__ = getattr(body_fn, "__name__", "body_fn")
    return cond, body


def unsupported_write(who: str, written: dict) -> KilnBranchWriteError:
    shapes = ", ".join(f"{t.dtype.short}{list(t.shape)}" for t, _, _ in written.values())
    return KilnBranchWriteError(
        f"{who} changes a tensor from outside it in place ({shapes}); a while_loop's cond_fn "
        "must only read", where=user_location(),
        hint="move the in-place update into body_fn (its writes are carried through the loop)")
