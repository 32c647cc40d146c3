"""`kiln launch`: start N workers per node, host the store, watch them.

    kiln launch --nproc 4 train.py --lr 0.1
    kiln launch --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29500 --nproc 8 train.py   # on each node

Each worker gets KILN_RANK, KILN_WORLD_SIZE, KILN_LOCAL_RANK, KILN_LOCAL_WORLD_SIZE,
KILN_NODE_RANK, KILN_STORE and KILN_TOKEN (generated with `secrets` when absent; with
several nodes every node must be given the same KILN_TOKEN). SIGINT and SIGTERM are
forwarded to the workers. When a worker fails, the launcher says which one and how
(exit code or signal) and terminates the others.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from kiln.distributed.errors import DistributedError, LaunchError
from kiln.distributed.protocol import parse_address
from kiln.distributed.store import Store, StoreServer


@dataclass
class LaunchConfig:
    """What to run and where; see `kiln launch --help`."""

    script: str
    script_args: list[str] = field(default_factory=list)
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv: str | None = None
    fr_dir: str | None = None
    grace: float = 5.0
    rdzv_timeout: float = 60.0


@dataclass
class Failure:
    rank: int
    local_rank: int
    pid: int
    returncode: int

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                how = "killed by signal %s" % signal.Signals(-self.returncode).name
            except ValueError:
                how = "killed by signal %d" % -self.returncode
        else:
            how = "exit code %d" % self.returncode
        return "worker rank %d (local rank %d, pid %d) failed: %s" % (
            self.rank, self.local_rank, self.pid, how)

    @property
    def exit_code(self) -> int:
        return self.returncode if self.returncode > 0 else 128 - self.returncode


def _log(message: str) -> None:
    print("kiln launch: " + message, file=sys.stderr, flush=True)


def launch(cfg: LaunchConfig) -> int:
    """Run the job on this node; the exit code (0, or the first failure's).

        >>> launch(LaunchConfig("train.py", nproc=2))
        0
    """
    if cfg.nproc < 1 or cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        raise LaunchError("need --nproc >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes "
                          "(got %d, %d, %d)" % (cfg.nproc, cfg.nnodes, cfg.node_rank))
    if cfg.nnodes > 1 and not cfg.rdzv:
        raise LaunchError("--nnodes %d needs --rdzv HOST:PORT (node 0 hosts the store there)"
                          % cfg.nnodes)
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
        return _run(cfg, address, token, server)
    finally:
        if server is not None:
            server.close()


def _run(cfg: LaunchConfig, address: str, token: str, server: StoreServer | None) -> int:
    store = Store(address, token, timeout=cfg.rdzv_timeout) if cfg.nnodes > 1 else None
    world = cfg.nproc * cfg.nnodes
    procs: list[tuple[int, subprocess.Popen]] = []
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local in range(cfg.nproc):
            rank = cfg.node_rank * cfg.nproc + local
            env = dict(os.environ, KILN_RANK=str(rank), KILN_WORLD_SIZE=str(world),
                       KILN_LOCAL_RANK=str(local), KILN_LOCAL_WORLD_SIZE=str(cfg.nproc),
                       KILN_NODE_RANK=str(cfg.node_rank), KILN_STORE=address, KILN_TOKEN=token,
                       KILN_STORE_HOSTED="1")
            if cfg.fr_dir:
                env["KILN_FR_DIR"] = cfg.fr_dir
            # own session: a terminal's Ctrl-C reaches the launcher, which forwards it once
            procs.append((rank, subprocess.Popen([sys.executable, cfg.script] + cfg.script_args,
                                                 env=env, start_new_session=True)))
        failure = _watch(procs, received)
        if failure is not None:
            _log(failure.describe())
            _terminate(procs, cfg.grace)
            _log("terminated the other workers")
            return failure.exit_code
        if received:
            _terminate(procs, cfg.grace)
            _log("stopped by %s" % signal.Signals(received[0]).name)
            return 128 + received[0]
        if store is not None:
            _finish_nodes(store, cfg)
        return 0
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


def _watch(procs: list[tuple[int, subprocess.Popen]], received: list[int]) -> Failure | None:
    """Poll until all exit (None) or one fails (that failure)."""
    while True:
        running = 0
        for local, (rank, proc) in enumerate(procs):
            code = proc.poll()
            if code is None:
                running += 1
            elif code != 0 and not received:
                return Failure(rank, local, proc.pid, code)
        if running == 0 or (received and running == 0):
            return None
        if received and all(p.poll() is not None for _, p in procs):
            return None
        time.sleep(0.05)


def _terminate(procs: list[tuple[int, subprocess.Popen]], grace: float) -> None:
    for _, proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for _, proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _finish_nodes(store: Store, cfg: LaunchConfig) -> None:
    """Node 0 keeps the store up until every node's workers are done."""
    try:
        store.set("launch/done/%d" % cfg.node_rank, b"1")
        if cfg.node_rank == 0:
            store.wait(["launch/done/%d" % n for n in range(cfg.nnodes)], timeout=cfg.rdzv_timeout)
    except DistributedError as err:
        _log("could not coordinate the end with the other nodes: %s" % err)
