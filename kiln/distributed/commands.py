"""The distributed subcommands of `kiln`: `launch`, `store` and `fr`.

`kiln.cli` calls `register(subparsers)`; each handler takes the parsed args and
returns the exit code. Also runnable alone: `python -m kiln.distributed fr DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from kiln.distributed.errors import DistributedError


def _launch(args: argparse.Namespace) -> int:
    from kiln.distributed.launcher import LaunchConfig, launch

    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.engine == "mpi":  # mpirun starts the ranks (kiln.distributed.mpi_launch)
        from kiln.distributed.mpi_launch import launch_mpi
        try:
            return launch_mpi(args, script_args)
        except DistributedError as err:
            print("kiln launch: %s" % err, file=sys.stderr)
            return 2
    cfg = LaunchConfig(script=args.script, script_args=script_args, nproc=args.nproc,
                       nnodes=args.nnodes, node_rank=args.node_rank, rdzv=args.rdzv,
                       fr_dir=args.fr_dir, grace=args.grace, rdzv_timeout=args.rdzv_timeout,
                       on_failure=args.on_failure, max_restarts=args.max_restarts,
                       min_size=args.min_size, inject=list(args.inject),
                       events_json=args.events_json, prefix=args.prefix,
                       log_dir=args.log_dir)
    try:
        return launch(cfg)
    except DistributedError as err:
        print("kiln launch: %s" % err, file=sys.stderr)
        return 2


def _store(args: argparse.Namespace) -> int:
    from kiln.distributed.store import StoreServer

    token = os.environ.get("KILN_TOKEN")
    if not token:
        print("kiln store: set KILN_TOKEN to the job's secret (the same on every client)",
              file=sys.stderr)
        return 2
    try:
        server = StoreServer(args.host, args.port, token)
    except OSError as err:
        print("kiln store: cannot listen on %s:%d: %s" % (args.host, args.port, err),
              file=sys.stderr)
        return 2
    print("kiln store: serving on %s" % server.address, flush=True)
    stop = lambda signum, frame: server.close()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.close()
    return 0


def _fr(args: argparse.Namespace) -> int:
    from kiln.distributed.fr_analysis import analyze, format_report, has_problems, load_dumps

    try:
        report = analyze(load_dumps(args.dir))
    except DistributedError as err:
        print("kiln fr: %s" % err, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 1 if has_problems(report) else 0


def register(subparsers) -> None:
    """Add `launch`, `store` and `fr` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "launch", help="run a distributed job: N worker processes per node",
        description="Start --nproc workers of SCRIPT on this node, host the job's store "
        "(node 0), give each worker KILN_RANK, KILN_WORLD_SIZE, KILN_LOCAL_RANK, KILN_STORE "
        "and KILN_TOKEN (so kiln.distributed.init_process_group() needs no arguments), "
        "forward SIGINT/SIGTERM, and watch the workers. A worker that exits 0 is done; one "
        "that exits non-zero or is killed has died, and --on-failure decides: abort (stop "
        "the others, exit with its code), shrink (the others go on; the process group "
        "shrinks in place) or replace (start a new worker in its slot with KILN_JOIN=1, "
        "KILN_REPLACES=<rank>, KILN_RESTART_COUNT=<n>; it joins at the next epoch). Events "
        "go to the store under launcher/event/<n> and into a summary on stderr. --inject "
        "injects faults for tests; workers report their step with "
        "kiln.distributed.elastic.report_step(step). Workers' output passes through the "
        "launcher line by line (--prefix, --log-dir); workers die with the launcher. See "
        "docs/fault-tolerance.md and docs/distributed.md.",
        epilog="examples:\n  kiln launch --nproc 4 train.py --lr 0.1\n"
        "  KILN_TOKEN=s3cret kiln launch --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29500 "
        "--nproc 8 train.py\n"
        "  kiln launch --nproc 4 --on-failure replace --max-restarts 3 "
        "--inject kill:rank=2,step=50 train.py\n"
        "  kiln launch --nproc 4 --on-failure shrink --min-size 3 "
        "--inject stop:rank=1,after=3s,for=2s --events-json events.json train.py\n\n"
        "--inject SPEC forms (repeatable; each fires once, rank = launch rank):\n"
        "  kill:rank=R,step=S         SIGKILL rank R when it reports step S\n"
        "  kill:rank=R,after=2.5s     SIGKILL rank R 2.5 s after the start\n"
        "  stop:rank=R,after=3s[,for=2s]  SIGSTOP (a hung peer), SIGCONT after 'for'\n"
        "  drop-conn:rank=R,after=1s  the worker closes its store connections (they reopen)\n"
        "  every kind takes step=S or after=T (units: s, ms)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", "--nproc-per-node", type=int, default=1, dest="nproc",
                   help="worker processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--rdzv", metavar="HOST:PORT",
                   help="store address; node 0 listens there (needed with --nnodes > 1)")
    p.add_argument("--fr-dir", metavar="DIR",
                   help="Flight Recorder dump directory for the workers (sets KILN_FR_DIR)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers")
    p.add_argument("--rdzv-timeout", type=float, default=60.0,
                   help="seconds to reach the store and for all nodes to finish")
    p.add_argument("--on-failure", choices=("abort", "shrink", "replace"), default="abort",
                   help="when a worker dies: abort the job (default), shrink (the others go "
                   "on) or replace it with a new process that joins the group")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="replacements allowed over the job's life with --on-failure replace "
                   "(default 3); one more death fails the job")
    p.add_argument("--min-size", type=int, default=1, metavar="M",
                   help="the job fails when fewer than M workers are live (default 1)")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="inject a fault for testing (repeatable); forms below")
    p.add_argument("--events-json", metavar="PATH",
                   help="write the job's events (deaths, replacements, injected faults) as JSON")
    p.add_argument("--engine", choices=("kiln", "mpi"), default="kiln",
                   help="kiln (default): start and watch the workers here; mpi: run them with "
                   "`mpirun --with-ft ulfm` for init_process_group('mpi') (docs/clusters.md)")
    p.add_argument("--hostfile", metavar="PATH",
                   help="with --engine mpi: the hosts to place the ranks on (mpirun's)")
    p.add_argument("--prefix", action="store_true",
                   help="start every line a worker prints with [rank N] (lines are always "
                   "passed on whole, never mixed between ranks)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="also append rank N's stdout and stderr to DIR/rankN.log")
    p.add_argument("script", help="the Python script each worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(handler=_launch)

    p = subparsers.add_parser(
        "store", help="run a standalone kiln store (rendezvous key-value server)",
        description="Serve a kiln store until SIGINT/SIGTERM. Clients authenticate with "
        "the job token from KILN_TOKEN; point workers at it with KILN_STORE=HOST:PORT.")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: pick a free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.set_defaults(handler=_store)

    p = subparsers.add_parser(
        "fr", help="analyze Flight Recorder dumps of a distributed job",
        description="Read every rank's kiln_fr_rank<R>.json in DIR and report missing dumps, "
        "group membership disagreements, collectives whose op, sizes or dtypes differ across "
        "ranks, and ranks that never joined a collective (the usual cause of a hang), with "
        "the call sites. Exit code: 0 nothing found, 1 problems reported, 2 no readable dumps.")
    p.add_argument("dir", help="the dump directory (the job's KILN_FR_DIR)")
    p.add_argument("--json", action="store_true", help="print the report as JSON, for tools")
    p.set_defaults(handler=_fr)


def main(argv: list[str] | None = None) -> int:
    """`python -m kiln.distributed COMMAND ...` (the same as `kiln COMMAND ...`)."""
    parser = argparse.ArgumentParser(prog="python -m kiln.distributed")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register(sub)
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)
