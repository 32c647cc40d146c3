"""`kiln launch`: start N workers per node, host the store, watch them, apply a policy.

    kiln launch --nproc 4 train.py --lr 0.1
    kiln launch --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29500 --nproc 8 train.py   # on each node
    kiln launch --nproc 4 --on-failure replace --inject kill:rank=2,step=50 train.py

Each worker gets KILN_RANK, KILN_WORLD_SIZE, KILN_LOCAL_RANK, KILN_LOCAL_WORLD_SIZE,
KILN_NODE_RANK, KILN_STORE, KILN_TOKEN (generated with `secrets` when absent; with
several nodes every node must be given the same KILN_TOKEN), KILN_STORE_HOSTED=1,
KILN_LAUNCHER=1, KILN_RESTART_COUNT=0 and KILN_MIN_SIZE (--min-size: the smallest group a
fault-tolerant process group may shrink to). SIGINT and SIGTERM are forwarded to the
workers (SIGKILL after --grace seconds). Workers die with the launcher, even a SIGKILLed
one (PR_SET_PDEATHSIG). Their output passes through it line by line (`launch_output`).

A worker that exits 0 is done. A worker that exits non-zero or is killed by a signal
has *died*; the launcher records it and applies `--on-failure`:

- `abort` (default): report which worker failed and how, stop the others (SIGTERM,
  then SIGKILL after --grace), exit with the worker's code (128 + signal if killed).
- `shrink`: leave the others running; the process group's own fault tolerance makes
  the survivors agree on a smaller membership at the next epoch.
- `replace`: start a new process in the dead worker's slot: the same command and
  environment (KILN_RANK is the slot's launch rank, KILN_WORLD_SIZE the launch size)
  plus KILN_JOIN=1, KILN_REPLACES=<the dead launch rank> and KILN_RESTART_COUNT=<n>,
  the job-wide number of replacements so far, this one included. The new process must
  not run the initial rendezvous: it joins the running group at its next epoch and
  takes its rank from that epoch's membership. At most --max-restarts replacements
  over the job's life. A worker that died before the group's first rendezvous (no
  `ft/view/0` in the store yet) is replaced without KILN_JOIN: nobody could admit a
  joiner, so the new process takes the dead one's rank in that first rendezvous.

A running worker that the fault-tolerant group removed (stopped or hung from outside,
so its peers took it for dead), or that stays stopped once all others are done, is
killed and counted as a death (`launch_lifetimes`): the launcher never waits for it.

With `shrink` and `replace` the job fails when fewer than --min-size workers are live
(not dead: running or finished). The job succeeds (exit 0) when every live worker has
exited 0; otherwise the launcher exits non-zero with the death that ended it. A
replacement still waiting to be admitted (its `ft/join/<uid>` request in the store)
when every other worker has finished is stopped and *released*, not counted as dead:
no epoch will admit it any more.

Every membership change is posted to the store as JSON under `launcher/event/<n>`
(n = 1, 2, ...; `launcher/event_count` holds the count; `elastic.read_events` reads
them): {"kind": "died"|"replaced"|"exited"|"injected"|"reconnected"|"released", "rank":
launch rank, "pid", "time" (Unix), "since_start" (s), ...}. At the end the launcher prints a
summary of the events to stderr, and writes it as JSON with --events-json PATH.

`--inject SPEC` (repeatable) injects faults for tests; see `elastic.parse_fault` and
docs/fault-tolerance.md. Workers publish their step with `elastic.report_step`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from kiln.distributed import elastic
from kiln.distributed.launch_lifetimes import GroupWatch, die_with_parent, process_state
from kiln.distributed.launch_output import Output, log_line, unbuffered_on_terminal
from kiln.distributed.launch_report import Failure, report, signal_name
from kiln.distributed.elastic import Fault
from kiln.distributed.errors import DistributedError, LaunchError
from kiln.distributed.protocol import parse_address
from kiln.distributed.store import Store, StoreServer

POLICIES = ("abort", "shrink", "replace")
_TICK = 0.05          # how often the launcher polls its workers and the store
_STORE_TIMEOUT = 5.0  # the deadline of the launcher's own store operations
_REAP_TIMEOUT = 5.0   # after SIGKILL: how long to wait for the kernel to reap a worker
_DRAIN_TIMEOUT = 5.0  # at the end: how long to wait for the last bytes of the workers' output


@dataclass
class LaunchConfig:
    """What to run and where, and what to do when a worker dies; see `kiln launch --help`."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv: str | None = None
    fr_dir: str | None = None
    grace: float = 5.0
    rdzv_timeout: float = 60.0
    on_failure: str = "abort"
    max_restarts: int = 3
    min_size: int = 1
    inject: list[str] = field(default_factory=list)
    events_json: str | None = None
    prefix: bool = False          # "[rank N] " before every line of a worker's output
    log_dir: str | None = None    # also append rank N's output to <log_dir>/rank<N>.log


def _log(message: str) -> None:
    log_line("kiln launch: " + message)


def launch(cfg: LaunchConfig) -> int:
    """Run the job on this node; the exit code (0, or that of the failure that ended it).

        >>> launch(LaunchConfig("train.py", nproc=2, on_failure="shrink"))
        0
    """
    if cfg.nproc < 1 or cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        raise LaunchError("need --nproc >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes "
                          "(got %d, %d, %d)" % (cfg.nproc, cfg.nnodes, cfg.node_rank))
    if cfg.nnodes > 1 and not cfg.rdzv:
        raise LaunchError("--nnodes %d needs --rdzv HOST:PORT (node 0 hosts the store there)"
                          % cfg.nnodes)
    world = cfg.nproc * cfg.nnodes
    if cfg.on_failure not in POLICIES:
        raise LaunchError("--on-failure must be one of %s, not %r"
                          % (", ".join(POLICIES), cfg.on_failure))
    if cfg.max_restarts < 0:
        raise LaunchError("--max-restarts must be >= 0 (got %d)" % cfg.max_restarts)
    if not 1 <= cfg.min_size <= world:
        raise LaunchError("--min-size must be between 1 and the job's %d workers (got %d)"
                          % (world, cfg.min_size))
    faults = [elastic.parse_fault(spec) for spec in cfg.inject]
    elastic.check_faults(faults, world)
    if cfg.log_dir is not None:
        try:
            os.makedirs(cfg.log_dir, exist_ok=True)
            probe = os.path.join(cfg.log_dir, ".kiln-launch-write-test")
            open(probe, "wb").close()
            os.unlink(probe)
        except OSError as err:
            raise LaunchError("cannot write the workers' logs into --log-dir %s: %s"
                              % (cfg.log_dir, err.strerror or err)) from None
    token = os.environ.get("KILN_TOKEN")
    if not token:
        if cfg.nnodes > 1:
            raise LaunchError("several nodes need one shared secret: set KILN_TOKEN to the same "
                              "value on every node (e.g. python -c 'import secrets; "
                              "print(secrets.token_hex(32))')")
        token = secrets.token_hex(32)
    server = None
    if cfg.node_rank == 0:
        host, port = parse_address(cfg.rdzv) if cfg.rdzv else ("127.0.0.1", 0)
        try:
            server = StoreServer(host, port, token)
        except OSError as err:
            raise LaunchError("cannot host the store at %s:%d: %s" % (host, port, err)) from None
    address = cfg.rdzv if cfg.rdzv and cfg.node_rank else server.address
    try:
        timeout = cfg.rdzv_timeout if cfg.nnodes > 1 else _STORE_TIMEOUT
        store = Store(address, token, timeout=timeout)
        store.timeout = _STORE_TIMEOUT
        job = _Job(cfg, address, token, store, faults)
        try:
            return job.run()
        finally:
            store.close()
    finally:
        if server is not None:
            server.close()


@dataclass
class _Slot:
    """One worker position: its launch rank and the process that runs in it now."""

    rank: int
    local: int
    proc: subprocess.Popen
    env: dict
    state: str = "running"            # running | exited (0) | dead | released
    resume_at: float | None = None    # a `stop ...,for=D` fault: when to SIGCONT
    stopped: bool = False             # SIGSTOPped by a fault and not resumed
    uid: int | None = None            # its uid in the fault-tolerant group, once known
    stopped_since: float | None = None  # first seen stopped from outside, all others done


class _Job:
    """The supervision loop of one node: start, watch, inject, apply the policy, report."""

    def __init__(self, cfg: LaunchConfig, address: str, token: str, store: Store,
                 faults: list[Fault]):
        self.cfg, self.address, self.token, self.store = cfg, address, token, store
        self.world = cfg.nproc * cfg.nnodes
        first = cfg.node_rank * cfg.nproc
        # only this node's ranks are hit here; every node is given the same --inject list
        self.faults = [f for f in faults if first <= f.rank < first + cfg.nproc]
        self.drop_requests: dict[int, int] = {}   # rank -> drop-conn requests sent
        self.drop_acked: dict[int, int] = {}
        self.slots: list[_Slot] = []
        self.events: list[dict] = []
        self.restarts = 0
        self.start_wall = time.time()
        self.start = time.monotonic()
        self.received: list[int] = []
        self.store_failed = False
        self.group = GroupWatch(store, lambda fn, default: self._store_call(fn, default),
                                _STORE_TIMEOUT)
        self.die_with_me = die_with_parent()
        self.output = Output(prefix=cfg.prefix, log_dir=cfg.log_dir)

    # -- events ---------------------------------------------------------------------

    def _event(self, kind: str, slot: _Slot, at: float | None = None, **fields) -> dict:
        """Post an event; `at` (a monotonic time) when it happened, if not now."""
        now = time.monotonic() if at is None else at
        event = {"kind": kind, "rank": slot.rank, "node": self.cfg.node_rank,
                 "pid": slot.proc.pid, "time": round(self.start_wall + now - self.start, 6),
                 "since_start": round(now - self.start, 6), **fields}
        self.events.append(event)
        self._store_call(lambda: self.store.set(
            elastic.EVENT_KEY % self.store.add(elastic.EVENT_COUNT_KEY), json.dumps(event)))
        return event

    def _store_call(self, fn, default=None):
        """Run a store operation; the job goes on if the store is unreachable (said once)."""
        try:
            return fn()
        except DistributedError as err:
            if not self.store_failed:
                _log("cannot reach the store to post events or read progress: %s" % err)
                self.store_failed = True
            return default

    # -- workers --------------------------------------------------------------------

    def _env(self, rank: int, local: int) -> dict:
        env = dict(os.environ, KILN_RANK=str(rank), KILN_WORLD_SIZE=str(self.world),
                   KILN_LOCAL_RANK=str(local), KILN_LOCAL_WORLD_SIZE=str(self.cfg.nproc),
                   KILN_NODE_RANK=str(self.cfg.node_rank), KILN_STORE=self.address,
                   KILN_TOKEN=self.token, KILN_STORE_HOSTED="1", KILN_LAUNCHER="1",
                   KILN_RESTART_COUNT="0", KILN_MIN_SIZE=str(self.cfg.min_size))
        for key in ("KILN_JOIN", "KILN_REPLACES", elastic.ENV_PAUSE_STEPS, elastic.ENV_POLL_DROP):
            env.pop(key, None)
        if self.cfg.fr_dir:
            env["KILN_FR_DIR"] = self.cfg.fr_dir
        return unbuffered_on_terminal(env)

    def _spawn(self, rank: int, local: int, env: dict) -> subprocess.Popen:
        # the helper in the worker must know which faults are still due for its slot
        mine = [f for f in self.faults if f.rank == rank]
        steps = sorted({f.step for f in mine if f.step is not None})
        env = dict(env)
        if steps:
            env[elastic.ENV_PAUSE_STEPS] = ",".join(map(str, steps))
        if any(f.kind == "drop-conn" for f in mine):
            env[elastic.ENV_POLL_DROP] = "1"
        # own session: a terminal's Ctrl-C reaches the launcher, which forwards it once,
        # and a fault can signal the worker's process group; die_with_me: the kernel kills
        # it with the launcher; stdout/stderr: pipes read line by line (launch_output)
        proc = subprocess.Popen([sys.executable, self.cfg.script] + self.cfg.script_args,
                                env=env, start_new_session=True, preexec_fn=self.die_with_me,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.output.attach(rank, proc)
        return proc

    def _signal(self, slot: _Slot, signum: int) -> None:
        # not reaped yet (poll() is None), so the pid, which is also the group id, is ours
        if slot.proc.poll() is None:
            try:
                os.killpg(slot.proc.pid, signum)
            except ProcessLookupError:
                pass

    def _kill(self, slot: _Slot) -> int:
        """SIGKILL the worker's process group and reap it (bounded); its return code
        (-SIGKILL if the kernel has not let it go after _REAP_TIMEOUT s)."""
        self._signal(slot, signal.SIGKILL)
        try:
            return slot.proc.wait(timeout=_REAP_TIMEOUT)
        except subprocess.TimeoutExpired:
            _log("worker rank %d (pid %d) survived SIGKILL for %.0f s; counting it as dead"
                 % (slot.rank, slot.proc.pid, _REAP_TIMEOUT))
            return -signal.SIGKILL

    def _running(self) -> list[_Slot]:
        return [s for s in self.slots if s.state == "running"]

    # -- the loop -------------------------------------------------------------------

    def run(self) -> int:
        old = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for local in range(self.cfg.nproc):
                rank = self.cfg.node_rank * self.cfg.nproc + local
                env = self._env(rank, local)
                self.slots.append(_Slot(rank, local, self._spawn(rank, local, env), env,
                                        uid=rank))
            self._publish_alive()
            code, reason = self._watch()
        finally:
            for signum, handler in old.items():
                signal.signal(signum, handler)
            still = self.output.close(_DRAIN_TIMEOUT)  # every worker's last lines first
            if still:
                _log("the output of rank(s) %s is still open %.0f s after they ended (a "
                     "process they started holds it); not waiting for it"
                     % (", ".join(map(str, still)), _DRAIN_TIMEOUT))
        if code == 0 and self.cfg.nnodes > 1:
            self._finish_nodes()
        report(self, code, reason, _log)  # the summary and --events-json
        return code

    def _forward(self, signum, frame) -> None:
        self.received.append(signum)
        for slot in self._running():
            self._signal_one(slot, signum)

    def _signal_one(self, slot: _Slot, signum: int) -> None:
        """Send `signum` to the worker itself (it may handle it), waking it if stopped."""
        if slot.proc.poll() is None:
            slot.proc.send_signal(signum)
            if slot.stopped:
                self._signal(slot, signal.SIGCONT)

    def _watch(self) -> tuple[int, str]:
        """Poll until the job ends; (exit code, one-line outcome)."""
        stop_deadline = None
        while True:
            if self.received:
                # a forwarded SIGINT/SIGTERM: the workers get --grace seconds to exit
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + self.cfg.grace
                for slot in self._running():
                    if slot.proc.poll() is not None:
                        slot.state = "exited" if slot.proc.returncode == 0 else "dead"
                if not self._running() or time.monotonic() >= stop_deadline:
                    self._terminate()
                    name = signal_name(self.received[0])
                    _log("stopped by %s" % name)
                    return 128 + self.received[0], "stopped by %s" % name
                time.sleep(_TICK)
                continue
            self._inject()
            for slot in self._running():
                code = slot.proc.poll()
                if code is None:
                    continue
                if code == 0:
                    slot.state = "exited"
                    self._event("exited", slot, exit_code=0)
                    continue
                outcome = self._died(slot, code)
                if outcome is not None:
                    return outcome
            outcome = self._reap_removed()
            if outcome is not None:
                return outcome
            running = self._running()
            if running and all(self._stopped_for_good(s) for s in running):
                # only workers stopped for good are left: they are hung, nobody will wake
                # them, and their peers are done, so they count as dead
                for slot in running:
                    _log("rank %d is still stopped %s while every other worker is done; "
                         "killing it" % (slot.rank, "by --inject" if slot.stopped else
                                         "from outside (SIGSTOP) for %.1f s" % self.cfg.grace))
                    outcome = self._died(slot, self._kill(slot))
                    if outcome is not None:
                        return outcome
                running = self._running()
            if running and any(s.state == "exited" for s in self.slots) and \
                    self._only_waiting_joiners(running):
                # the job finished while replacements still waited to join it: nobody
                # will admit them any more, so they are stopped, not counted as dead
                for slot in running:
                    _log("rank %d (pid %d) was still waiting to join when the job finished; "
                         "stopping it" % (slot.rank, slot.proc.pid))
                    self._kill(slot)
                    slot.state = "released"
                    self._event("released", slot)
                running = self._running()
            if not running:
                dead = sum(s.state == "dead" for s in self.slots)
                return 0, ("all %d workers finished" % len(self.slots) if not dead else
                           "%d of %d workers finished, %d died (--on-failure %s)"
                           % (len(self.slots) - dead, len(self.slots), dead, self.cfg.on_failure))
            time.sleep(_TICK)

    def _stopped_for_good(self, slot: _Slot) -> bool:
        """Stopped, and nobody will wake it: by an --inject stop without for=, or from
        outside (SIGSTOP, Ctrl-Z: state T, not a debugger's t) for --grace seconds while
        no other worker runs."""
        if slot.stopped:
            return slot.resume_at is None
        if process_state(slot.proc.pid) != "T":
            slot.stopped_since = None
            return False
        now = time.monotonic()
        if slot.stopped_since is None:
            slot.stopped_since = now
        return now - slot.stopped_since >= self.cfg.grace

    def _only_waiting_joiners(self, running: list[_Slot]) -> bool:
        """Whether every running worker is a replacement still waiting to be admitted
        by the fault-tolerant group (its `ft/join/<uid>` request names its pid)."""
        if not all(s.env.get("KILN_JOIN") == "1" for s in running):
            return False
        try:
            pids = set()
            for key in self.store.list_keys("ft/join/"):
                pids.add(json.loads(self.store.get(key, timeout=_STORE_TIMEOUT)).get("pid"))
        except (DistributedError, ValueError):
            return False
        return all(s.proc.pid in pids for s in running)

    def _reap_removed(self) -> tuple[int, str] | None:
        """Kill the running workers that the fault-tolerant group shrank away (stopped or
        hung from outside: SIGSTOP, a debugger) and count them as dead; (code, outcome)
        when the policy ends the job. Without this the launcher would wait forever for
        a process that no epoch will ever take back."""
        if any(s.uid is None for s in self._running()):  # a replacement: learn its uid
            by_pid = self.group.joiners()
            for slot in self._running():
                if slot.uid is None:
                    slot.uid = by_pid.get(slot.proc.pid)
        removed = self.group.update()
        for slot in self._running():
            if slot.uid is None or slot.uid not in removed or slot.proc.poll() is not None:
                continue  # (one that exited meanwhile is handled at the next look)
            epoch = removed[slot.uid]
            _log("rank %d (pid %d) was removed from the group at epoch %d (its peers took it "
                 "for dead: stopped or hung) and is still running; killing it"
                 % (slot.rank, slot.proc.pid, epoch))
            outcome = self._died(slot, self._kill(slot), removed_at_epoch=epoch)
            if outcome is not None:
                return outcome
        return None

    def _died(self, slot: _Slot, returncode: int, **fields) -> tuple[int, str] | None:
        """Record a death and apply the policy; (code, outcome) when the job must end."""
        slot.state, slot.stopped, slot.resume_at = "dead", False, None
        failure = Failure(slot.rank, slot.local, slot.proc.pid, returncode)
        self._event("died", slot, returncode=returncode,
                    exit_code=returncode if returncode > 0 else None,
                    signal=signal_name(-returncode) if returncode < 0 else None, **fields)
        # a later step-triggered fault for this slot must not fire on the old progress
        self._store_call(lambda: self.store.delete(elastic.PROGRESS_KEY % slot.rank))
        _log(failure.describe())
        policy = self.cfg.on_failure
        if policy == "abort":
            return self._fail(failure, "rank %d died (--on-failure abort)" % slot.rank)
        if policy == "replace":
            return self._replace(slot, failure)
        live = self._live_total()
        if live < self.cfg.min_size:
            return self._fail(failure, "only %d of %d workers are live, fewer than --min-size %d"
                              % (live, self.world, self.cfg.min_size))
        _log("%d of %d workers go on (--on-failure shrink)" % (live, self.world))
        self._publish_alive()
        return None

    def _replace(self, slot: _Slot, failure: Failure) -> tuple[int, str] | None:
        count = self._store_call(lambda: self.store.add(elastic.RESTARTS_KEY),
                                 default=self.restarts + 1)
        self.restarts += 1
        if count > self.cfg.max_restarts:
            return self._fail(failure, "rank %d died and the --max-restarts %d replacements "
                              "are used up" % (slot.rank, self.cfg.max_restarts))
        env = dict(slot.env, KILN_REPLACES=str(slot.rank), KILN_RESTART_COUNT=str(count))
        # before the group's first rendezvous there is no running group to join: the
        # replacement takes the dead worker's place in that rendezvous (the others are
        # still waiting for its rank there) instead of waiting to be admitted
        joins = self.group.formed()
        if joins:
            env["KILN_JOIN"] = "1"
        else:
            env.pop("KILN_JOIN", None)
        old_pid = slot.proc.pid
        slot.proc, slot.env, slot.state = self._spawn(slot.rank, slot.local, env), env, "running"
        slot.uid = None if joins else slot.rank  # a joiner's uid comes with its join request
        self._event("replaced", slot, replaces_pid=old_pid, restart_count=count,
                    joins=joins)
        _log("started a replacement for rank %d (pid %d, restart %d of %d)%s"
             % (slot.rank, slot.proc.pid, count, self.cfg.max_restarts,
                "" if joins else ": the group had not formed yet, so it takes rank %d's place "
                "in the first rendezvous" % slot.rank))
        return None

    def _fail(self, failure: Failure, why: str) -> tuple[int, str]:
        self._terminate()
        _log("terminated the other workers")
        _log("job failed: %s" % why)
        return failure.exit_code, "failed: " + why

    def _terminate(self) -> None:
        """SIGTERM every running worker (and SIGCONT the stopped), SIGKILL after --grace."""
        running = [s for s in self.slots if s.proc.poll() is None]
        for slot in running:
            self._signal_one(slot, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.grace
        for slot in running:
            try:
                slot.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                self._kill(slot)
        for slot in running:
            if slot.state == "running":
                slot.state = "dead"

    # -- membership across nodes ----------------------------------------------------

    def _publish_alive(self) -> None:
        if self.cfg.nnodes > 1:
            live = sum(s.state != "dead" for s in self.slots)
            self._store_call(lambda: self.store.set(elastic.ALIVE_KEY % self.cfg.node_rank,
                                                    str(live)))

    def _live_total(self) -> int:
        """Live workers in the job (not dead), over every node."""
        live = sum(s.state != "dead" for s in self.slots)
        if self.cfg.nnodes == 1:
            return live

        def others() -> int:
            total = 0
            for node in range(self.cfg.nnodes):
                key = elastic.ALIVE_KEY % node
                if node != self.cfg.node_rank:
                    total += (int(self.store.get(key)) if self.store.check([key])
                              else self.cfg.nproc)
            return total

        return live + self._store_call(others, default=(self.cfg.nnodes - 1) * self.cfg.nproc)

    def _finish_nodes(self) -> None:
        """Node 0 keeps the store up until every node's workers are done."""
        try:
            self.store.set("launch/done/%d" % self.cfg.node_rank, b"1")
            if self.cfg.node_rank == 0:
                self.store.wait(["launch/done/%d" % n for n in range(self.cfg.nnodes)],
                                timeout=self.cfg.rdzv_timeout)
        except DistributedError as err:
            _log("could not coordinate the end with the other nodes: %s" % err)

    # -- fault injection ------------------------------------------------------------

    def _inject(self) -> None:
        now = time.monotonic() - self.start
        for slot in self.slots:
            if slot.resume_at is not None and now >= slot.resume_at and slot.state == "running":
                self._signal(slot, signal.SIGCONT)
                slot.resume_at, slot.stopped = None, False
                self._event("injected", slot, fault="cont")
            want = self.drop_requests.get(slot.rank, 0)
            if want > self.drop_acked.get(slot.rank, 0):
                key = elastic.DROP_ACK_KEY % slot.rank
                acked = self._store_call(
                    lambda: int(self.store.get(key)) if self.store.check([key]) else 0, default=0)
                if acked >= want:
                    self.drop_acked[slot.rank] = acked
                    self._event("reconnected", slot, request=acked)
        due = []
        for fault in self.faults:
            slot = self.slots[fault.rank - self.cfg.node_rank * self.cfg.nproc]
            if slot.state != "running":
                continue  # a fault waits for its slot to be occupied (by a replacement)
            if fault.after is not None:
                if now >= fault.after:
                    due.append((fault, slot, None))
                continue
            key = elastic.PROGRESS_KEY % fault.rank
            step = self._store_call(
                lambda: int(self.store.get(key)) if self.store.check([key]) else None)
            if step is not None and step >= fault.step:
                due.append((fault, slot, step))
        for fault, slot, step in due:
            self.faults.remove(fault)
            self._fire(fault, slot, step)

    def _fire(self, fault: Fault, slot: _Slot, step: int | None) -> None:
        fields = {"fault": fault.kind, "spec": fault.spec}
        if step is not None:
            fields["step"] = step
        sent = time.monotonic()  # the event's time: a signal acts before kill() returns
        if fault.kind == "kill":
            self._signal(slot, signal.SIGKILL)
        elif fault.kind == "stop":
            self._signal(slot, signal.SIGSTOP)
            slot.stopped = True
            if fault.duration is not None:
                slot.resume_at = time.monotonic() - self.start + fault.duration
                fields["for"] = fault.duration
        else:
            n = self.drop_requests.get(slot.rank, 0) + 1
            self.drop_requests[slot.rank] = n
            self._store_call(lambda: self.store.set(elastic.DROP_CONN_KEY % slot.rank, str(n)))
            fields["request"] = n
        self._event("injected", slot, at=sent, **fields)
        if fault.step is not None:
            # release the worker waiting in report_step (unless it is gone or stopped)
            self._store_call(lambda: self.store.set(elastic.FIRED_KEY % (slot.rank, fault.step),
                                                    b"1"))

