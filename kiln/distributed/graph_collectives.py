"""Running the IR's collective ops on live process groups.

A collective node names its group by a string and carries the group's static size
(`kiln/ir/ops/collective.py`). Here that name is resolved to a live `ProcessGroup`
(the world group and every sub-group `split` made from it), the op is issued as a
nonblocking call on copies of its operands, and a `Pending` hands the result over
on `wait()`. The runtime's `Collective` steps and eager `kn.collectives` calls both
come through `start`, so compiled and eager code issue identical calls.

Without a process group in this process, a group of size 1 runs the op's numpy
reference (a single process: every collective is the identity); a larger static size
is an error, because there is nobody to exchange data with.

    >>> pending = start("all_reduce", x, {"reduce_op": "sum", "group": "world",
    ...                                    "world_size": 2})
    >>> y = pending.wait()
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kiln.distributed import rendezvous
from kiln.distributed.errors import CollectiveArgumentError
from kiln.distributed.process_group import ProcessGroup


class Pending:
    """A collective in flight: `wait()` returns its result (once; later calls too)."""

    __slots__ = ("_work", "_finish", "_result")

    def __init__(self, work, finish: Callable[[], np.ndarray] | None = None,
                 result: np.ndarray | None = None):
        self._work, self._finish, self._result = work, finish, result

    def wait(self) -> np.ndarray:
        """Block until the collective is done (bounded by the group's deadline)."""
        if self._result is None:
            self._work.wait()
            self._result = self._finish()
            self._work = self._finish = None
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work.is_completed()


def live_groups() -> dict[str, ProcessGroup]:
    """Every usable group of this process by name: the world group and its splits."""
    if not rendezvous.is_initialized():
        return {}
    found: dict[str, ProcessGroup] = {}
    todo = [rendezvous.get_world()]
    while todo:
        pg = todo.pop()
        found[pg.name] = pg
        todo.extend(pg.children)
    return found


def resolve(op: str, group: str, world_size: int) -> ProcessGroup | None:
    """The live group named `group`, checked against the static `world_size`; None
    when this process has no process group and the op is over a world of one."""
    groups = live_groups()
    if not groups:
        if world_size == 1:
            return None
        raise CollectiveArgumentError(
            "%s over group %r of %d ranks: no process group is initialized in this process"
            % (op, group, world_size),
            hint="call kiln.distributed.init_process_group() (or start the script with "
            "`kiln launch --nproc %d`) before running this program" % world_size)
    pg = groups.get(group)
    if pg is None:
        raise CollectiveArgumentError(
            "%s: no live process group named %r on this rank; live groups: %s"
            % (op, group, ", ".join(sorted(groups))),
            hint="run the program on a rank that belongs to that group (split returns None "
            "on the others), or trace it with the group object you mean")
    if pg.world_size != world_size:
        raise CollectiveArgumentError(
            "%s: the program was built for group %r of %d ranks, but the live group has %d"
            % (op, group, world_size, pg.world_size),
            hint="compile (trace) the function again under the current group")
    return pg


def start(op: str, x: np.ndarray, attrs: dict, *, blocking: bool = False) -> Pending:
    """Issue collective `op` (a base name such as "all_reduce") on `x`; nonblocking.

    `x` is never written. It is copied when the call works in place (all_reduce,
    broadcast), and for a nonblocking call also otherwise, because the caller (the
    runtime's memory plan) may reuse its buffer while the call is in flight;
    `blocking=True` says the caller waits at once, so no copy is needed there.
    """
    pg = resolve(op, attrs["group"], attrs["world_size"])
    if pg is None:
        from kiln.ir import registry

        result = np.asarray(registry.get(op).reference(x, **attrs))
        if not blocking and np.may_share_memory(result, x):  # a world of one's identity:
            result = result.copy()  # x's buffer may be reused before the wait reads it
        return Pending(None, result=result)
    issue = _ISSUE.get(op)
    if issue is None:
        raise CollectiveArgumentError("%s is not a collective kiln can run" % op)
    data = np.require(x, requirements="C")  # (ascontiguousarray makes 0-d arrays 1-d)
    if data is x and (op in _IN_PLACE or not blocking):
        data = x.copy()
    return issue(pg, data, attrs)


def run(op: str, x: np.ndarray, attrs: dict) -> np.ndarray:
    """Run collective `op` on `x` (never written) and wait for its result."""
    return start(op, x, attrs, blocking=True).wait()


def run_step(op: str, operands: Sequence, attrs: dict) -> list:
    """The runtime's hook: a whole collective, a `<op>_start` (returns a Pending) or a
    `collective_wait` (waits on the Pending it is given)."""
    if op == "collective_wait":
        (pending,) = operands
        if not isinstance(pending, Pending):
            raise CollectiveArgumentError(
                "collective_wait: its operand was not made by a <op>_start node (got %s)"
                % type(pending).__name__)
        return [pending.wait()]
    (x,) = operands
    if op.endswith("_start"):
        return [start(op[:-len("_start")], x, attrs)]
    return [run(op, x, attrs)]


# -- one issuer per op: lay the operand out as the ProcessGroup call wants it ------------
def _slots(x: np.ndarray, axis: int, n: int) -> np.ndarray:
    """x cut into n equal chunks along axis, stacked: shape (n, *chunk), contiguous."""
    if axis == 0:
        return x.reshape((n, x.shape[0] // n) + x.shape[1:])
    return np.ascontiguousarray(np.stack(np.split(x, n, axis=axis)))


def _join(slots: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of `_slots`: (n, *chunk) concatenated along axis."""
    if axis == 0:
        return slots.reshape((-1,) + slots.shape[2:])
    return np.concatenate(list(slots), axis=axis)


def _all_reduce(pg: ProcessGroup, x: np.ndarray, attrs: dict) -> Pending:
    return Pending(pg.all_reduce(x, op=attrs["reduce_op"]), lambda: x)


def _broadcast(pg: ProcessGroup, x: np.ndarray, attrs: dict) -> Pending:
    return Pending(pg.broadcast(x, src=attrs["src"]), lambda: x)


def _all_gather(pg: ProcessGroup, x: np.ndarray, attrs: dict) -> Pending:
    axis = attrs["axis"] % x.ndim
    out = np.empty((pg.world_size,) + x.shape, x.dtype)
    return Pending(pg.all_gather(out, x), lambda: _join(out, axis))


def _reduce_scatter(pg: ProcessGroup, x: np.ndarray, attrs: dict) -> Pending:
    axis = attrs["axis"] % x.ndim
    slots = _slots(x, axis, pg.world_size)
    out = np.empty(slots.shape[1:], x.dtype)
    return Pending(pg.reduce_scatter(out, slots, op=attrs["reduce_op"]), lambda: out)


def _all_to_all(pg: ProcessGroup, x: np.ndarray, attrs: dict) -> Pending:
    split, concat = attrs["split_axis"] % x.ndim, attrs["concat_axis"] % x.ndim
    slots = _slots(x, split, pg.world_size)
    out = np.empty_like(slots)
    return Pending(pg.all_to_all(out, slots), lambda: _join(out, concat))


_IN_PLACE = frozenset({"all_reduce", "broadcast"})
_ISSUE = {"all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather": _all_gather,
          "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all}
