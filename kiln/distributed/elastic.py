"""The worker side of an elastic `kiln launch`, and the `--inject` fault specs.

A worker calls `report_step(step)` once per training step. Under `kiln launch` this
publishes the step (the launcher fires `--inject ...,step=S` faults from it) and serves
the launcher's fault-injection requests; anywhere else it does nothing, so a script
runs unchanged without the launcher.

    from kiln.distributed.elastic import launch_info, report_step
    info = launch_info()           # rank slot, join flag, restart count (None without kiln launch)
    for step in range(start, steps):
        train_step()
        report_step(step)

Store keys written by the launcher (all under `launcher/`, read them with
`read_events`) and by this helper (`progress/<rank>`, `launcher/drop_conn_ack/<rank>`)
are listed in docs/fault-tolerance.md; the constants below are the source of truth.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable

from kiln.distributed.errors import FaultInjectionError, StoreTimeout

# keys of the launcher <-> worker protocol; `%d` is the launch rank (KILN_RANK at start)
EVENT_KEY = "launcher/event/%d"          # the n-th membership event (n = 1, 2, ...), JSON
EVENT_COUNT_KEY = "launcher/event_count"  # how many events were posted (an `add` counter)
PROGRESS_KEY = "progress/%d"              # the last step the worker in that slot reported
DROP_CONN_KEY = "launcher/drop_conn/%d"   # n: the launcher's n-th drop-conn request
DROP_ACK_KEY = "launcher/drop_conn_ack/%d"  # n: the worker dropped and reopened for request n
FIRED_KEY = "launcher/fired/%d/%d"        # (rank, step): the step-triggered fault was delivered
RESTARTS_KEY = "launcher/restarts"        # replacements started so far (job-wide counter)
ALIVE_KEY = "launcher/alive/%d"           # live workers of node n (several nodes only)

# environment the launcher sets for the helper (not part of the user-facing contract)
ENV_PAUSE_STEPS = "KILN_INJECT_STEPS"     # steps at which a fault is due for this process
ENV_POLL_DROP = "KILN_INJECT_DROP_CONN"   # "1": poll for drop-conn requests every step

# how long a worker waits, at a step that has a fault due, for the launcher to deliver
# it; past this it goes on (a launcher that lost track of it must not hang the worker)
PAUSE_TIMEOUT = 10.0
_STORE_TIMEOUT = 10.0

KINDS = ("kill", "stop", "drop-conn")
_NUMBER = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s)$")


@dataclass(frozen=True)
class Fault:
    """One `--inject` spec: what to do to which rank, and when (after a step or a delay)."""

    kind: str              # "kill" (SIGKILL), "stop" (SIGSTOP), "drop-conn"
    rank: int              # the launch rank (slot) the fault targets
    spec: str              # the text as given, for messages and the event log
    step: int | None = None    # fire when the worker reports this step ...
    after: float | None = None  # ... or this many seconds after the job started
    duration: float | None = None  # stop only: SIGCONT this many seconds after the SIGSTOP


def parse_fault(spec: str) -> Fault:
    """Parse `KIND:rank=R,(step=S|after=T)[,for=D]`; FaultInjectionError names the rule.

        >>> parse_fault("kill:rank=2,step=50")
        Fault(kind='kill', rank=2, spec='kill:rank=2,step=50', step=50, after=None, duration=None)
        >>> parse_fault("stop:rank=1,after=3s,for=500ms").duration
        0.5
    """
    def bad(rule: str) -> FaultInjectionError:
        return FaultInjectionError(
            "bad --inject spec %r: %s" % (spec, rule),
            hint="the forms are kill:rank=R,step=S  kill:rank=R,after=2.5s  "
            "stop:rank=R,after=3s[,for=2s]  drop-conn:rank=R,after=1s")

    kind, sep, rest = spec.partition(":")
    if not sep or kind not in KINDS:
        raise bad("the kind before ':' must be one of %s" % ", ".join(KINDS))
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise bad("%r is not key=value" % item)
        if key in fields:
            raise bad("%s= is given twice" % key)
        fields[key] = value
    allowed = {"rank", "step", "after"} | ({"for"} if kind == "stop" else set())
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise bad("%s does not take %s= (it takes %s)"
                  % (kind, unknown[0], ", ".join(k + "=" for k in sorted(allowed))))
    if "rank" not in fields:
        raise bad("rank=R is required")
    if ("step" in fields) == ("after" in fields):
        raise bad("give exactly one trigger, step=S or after=T")

    def integer(key: str) -> int:
        if not fields[key].isdigit():
            raise bad("%s= must be a non-negative integer, not %r" % (key, fields[key]))
        return int(fields[key])

    def seconds(key: str) -> float:
        match = _NUMBER.match(fields[key])
        if not match:
            raise bad("%s= must be a duration with a unit, like 2.5s or 500ms, not %r"
                      % (key, fields[key]))
        value = float(match.group(1))
        return value / 1000.0 if match.group(2) == "ms" else value

    duration = seconds("for") if "for" in fields else None
    if duration is not None and duration <= 0:
        raise bad("for= must be longer than 0 s")
    return Fault(kind=kind, rank=integer("rank"), spec=spec,
                 step=integer("step") if "step" in fields else None,
                 after=seconds("after") if "after" in fields else None, duration=duration)


def check_faults(faults: list[Fault], world_size: int) -> None:
    """Every fault targets a rank of the job."""
    for fault in faults:
        if fault.rank >= world_size:
            raise FaultInjectionError(
                "bad --inject spec %r: rank %d is not in the job (ranks 0..%d)"
                % (fault.spec, fault.rank, world_size - 1),
                hint="rank= is the launch rank, KILN_RANK of the worker to hit")


@dataclass(frozen=True)
class LaunchInfo:
    """What `kiln launch` told this process (see docs/fault-tolerance.md)."""

    rank: int            # the launch rank: the slot this process runs in
    world_size: int      # the job's size at launch (not the current membership)
    join: bool           # True for a replacement: join the running group at the next epoch
    replaces: int | None  # the launch rank of the dead worker this one replaces
    restart_count: int   # replacements started in the job so far, this one included


def launch_info() -> LaunchInfo | None:
    """This process's launch facts, or None when it was not started by `kiln launch`."""
    if os.environ.get("KILN_LAUNCHER") != "1":
        return None
    replaces = os.environ.get("KILN_REPLACES")
    return LaunchInfo(rank=int(os.environ["KILN_RANK"]),
                      world_size=int(os.environ["KILN_WORLD_SIZE"]),
                      join=os.environ.get("KILN_JOIN") == "1",
                      replaces=int(replaces) if replaces else None,
                      restart_count=int(os.environ.get("KILN_RESTART_COUNT", "0")))


class _Reporter:
    """The per-process state of `report_step`: a store connection and the fault requests."""

    def __init__(self) -> None:
        from kiln.distributed.store import Store

        self.rank = int(os.environ["KILN_RANK"])
        self.store = Store(os.environ["KILN_STORE"], os.environ["KILN_TOKEN"],
                           timeout=_STORE_TIMEOUT)
        self.pause_steps = {int(s) for s in os.environ.get(ENV_PAUSE_STEPS, "").split(",") if s}
        self.poll_drop = os.environ.get(ENV_POLL_DROP) == "1"
        self.drops = 0  # drop-conn requests handled

    def report(self, step: int) -> None:
        self.store.set(PROGRESS_KEY % self.rank, str(step))
        if step in self.pause_steps:
            # stand still until the launcher has delivered the fault (a kill never returns
            # here), so a step-triggered fault lands exactly between step and step + 1
            try:
                self.store.wait([FIRED_KEY % (self.rank, step)], timeout=PAUSE_TIMEOUT)
            except StoreTimeout:
                pass
        if self.poll_drop and self.store.check([DROP_CONN_KEY % self.rank]):
            wanted = int(self.store.get(DROP_CONN_KEY % self.rank))
            if wanted > self.drops:
                self.drops = wanted
                _drop_connections(self.store)
                # written on the reopened connection: the ack itself proves the reconnect
                self.store.set(DROP_ACK_KEY % self.rank, str(wanted))


_REPORTER: _Reporter | None = None
_DROP_HOOKS: list[Callable[[], None]] = []


def report_step(step: int) -> None:
    """Tell the launcher this worker reached `step`; serve injected faults. No-op outside
    `kiln launch`.

    At a step where an `--inject ...,step=S` fault is due for this worker, this returns
    only after the launcher delivered it (at most PAUSE_TIMEOUT s). A pending `drop-conn`
    request closes the worker's store connections here; they reopen on their next use.
    """
    global _REPORTER
    if _REPORTER is None:
        if launch_info() is None:
            return
        _REPORTER = _Reporter()
    _REPORTER.report(int(step))


def drop_count() -> int:
    """How many `drop-conn` requests this process has served (0 outside `kiln launch`)."""
    return _REPORTER.drops if _REPORTER is not None else 0


def on_drop_conn(hook: Callable[[], None]) -> None:
    """Call `hook()` when a `drop-conn` fault arrives, to drop a connection of your own."""
    _DROP_HOOKS.append(hook)


def _drop_connections(own_store) -> None:
    """Close this process's store connections as a network blip would.

    `Store` reconnects (and re-authenticates) lazily on its next operation, so this is
    the moment after a reset: the connection is gone, the server and the keys are not.
    """
    own_store.close()
    from kiln.distributed import rendezvous

    if rendezvous.is_initialized():
        world = rendezvous.get_world()
        if getattr(world, "store", None) is not None:
            world.store.close()
        if getattr(world, "_ft", None) is not None:  # membership's own connection too
            world._ft.membership.drop_connection()
    for hook in _DROP_HOOKS:
        hook()


def read_events(store) -> list[dict]:
    """The launcher's membership events posted so far, oldest first (see EVENT_KEY)."""
    if not store.check([EVENT_COUNT_KEY]):
        return []
    count = int(store.get(EVENT_COUNT_KEY))
    keys = [EVENT_KEY % n for n in range(1, count + 1)]
    # the counter is bumped before the event is written: skip one still in flight
    return [json.loads(store.get(k)) for k in keys if store.check([k])]
