"""all_reduce bus bandwidth and latency: kiln's backends vs torch.distributed (Gloo).

    python benchmarks/bench_allreduce.py                       # 2 and 4 ranks, 1 KB .. 256 MB
    python benchmarks/bench_allreduce.py --ranks 2 --max-mb 16 --out /tmp/r.md
    python benchmarks/bench_allreduce.py --rounds 3      # alternate kiln/Gloo 3 times
    python benchmarks/bench_allreduce.py --backend tcp mpi     # kiln tcp, kiln mpi and Gloo

`--backend mpi` runs kiln's mpi backend under `mpirun --with-ft ulfm` (the kiln[mpi]
extra); each round runs every backend, then Gloo, one after the other.

busbw = size * 2 * (n - 1) / n / time (NCCL-tests' definition); time is the median over
iterations of one synchronized all_reduce of float32 (sum) on loopback. Gloo runs in
the same invocation when torch is importable (it is never a kiln dependency). Results
go to benchmarks/results/distributed.md as markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20,
         64 << 20, 256 << 20]


def iterations(nbytes: int) -> int:
    if nbytes <= 256 << 10:
        return 200
    if nbytes <= 4 << 20:
        return 30
    return 8 if nbytes <= 64 << 20 else 4


def free_port() -> int:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


# -- one rank ------------------------------------------------------------------------------
def run_rank(impl: str, rank: int, world: int, address: str, sizes: list[int]) -> None:
    import numpy as np

    if impl in ("kiln", "mpi"):
        import kiln.distributed as dist

        if impl == "mpi":  # rank and world size from mpirun
            pg = dist.init_process_group("mpi", store=address, token=os.environ["KILN_TOKEN"],
                                         timeout=300.0, host_store=False)
            rank = pg.rank
        else:
            pg = dist.init_process_group(rank=rank, world_size=world, store=address,
                                         token=os.environ["KILN_TOKEN"], timeout=300.0,
                                         host_store=False)

        def make(n):
            return np.zeros(n // 4, np.float32)

        def allreduce(buf):
            pg.all_reduce(buf).wait()

        def barrier():
            pg.barrier().wait()
    else:
        import torch
        import torch.distributed as tdist

        tdist.init_process_group("gloo", init_method="tcp://" + address, rank=rank,
                                 world_size=world)

        def make(n):
            return torch.zeros(n // 4, dtype=torch.float32)

        def allreduce(buf):
            tdist.all_reduce(buf)

        def barrier():
            tdist.barrier()

    results = {}
    for nbytes in sizes:
        buf = make(nbytes)
        for _ in range(3 if nbytes <= 64 << 20 else 1):  # warm up sockets and allocations
            allreduce(buf)
        times = []
        for _ in range(iterations(nbytes)):
            barrier()
            start = time.perf_counter()
            allreduce(buf)
            times.append(time.perf_counter() - start)
        results[nbytes] = statistics.median(times)
        del buf
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    barrier()
    if impl == "gloo":
        tdist.destroy_process_group()


def run_job(impl: str, world: int, sizes: list[int]) -> dict[int, float]:
    env = dict(os.environ, KILN_TOKEN=secrets.token_hex(16))
    server = None
    if impl in ("kiln", "mpi"):
        from kiln.distributed.store import StoreServer

        server = StoreServer("127.0.0.1", 0, env["KILN_TOKEN"])
        address = server.address
    else:
        address = "127.0.0.1:%d" % free_port()
    if impl == "mpi":  # one mpirun starts every rank (in its own session: killed at the end)
        from kiln.distributed.mpi_launch import mpirun_command, stop_group

        cmd = mpirun_command(world, [sys.executable, __file__, "--worker", impl, "0",
                                     str(world), address, json.dumps(sizes)],
                             forward=("KILN_TOKEN",))
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)]
    else:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", impl, str(r),
                                   str(world), address, json.dumps(sizes)], env=env,
                                  stdout=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if impl == "mpi":
                stop_group(p)
            elif p.poll() is None:
                p.kill()
        if server is not None:
            server.close()
    lines = [l for l in outs[0].splitlines() if l.startswith("RESULT ")]
    if not lines:
        raise SystemExit("%s with %d ranks failed: %s"
                         % (impl, world, [p.returncode for p in procs]))
    line = lines[0]
    return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}


# -- report --------------------------------------------------------------------------------
def human(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return "%d %s" % (nbytes // scale, unit)
    return "%d B" % nbytes


def busbw(nbytes: int, world: int, seconds: float) -> float:
    return nbytes * 2 * (world - 1) / world / seconds / 1e9


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "%d cores, %s, Linux %s, Python %s" % (os.cpu_count() or 0, model, platform.release(),
                                                  platform.python_version())


def table(world: int, sizes: list[int], kiln: dict, gloo: dict | None,
          mpi: dict | None = None) -> list[str]:
    """One row per size: time and busbw of each implementation run, then speed ratios
    (how many times faster than Gloo; mpi's also against tcp)."""
    cols = [(name, res) for name, res in (("kiln tcp" if mpi else "kiln", kiln),
                                          ("kiln mpi", mpi), ("Gloo", gloo)) if res]
    head = "| size |" + "".join(" %s time | %s busbw |" % (c, c) for c, _ in cols)
    ratios = [(a, b) for a, b in (("kiln tcp" if mpi else "kiln", "Gloo"), ("kiln mpi", "Gloo"),
                                  ("kiln mpi", "kiln tcp")) if a in dict(cols) and b in dict(cols)]
    head += "".join(" %s / %s |" % (a, b) for a, b in ratios)
    rule = "|---:|" + "---:|---:|" * len(cols) + "---:|" * len(ratios)
    lines = ["### %d ranks" % world, "", head, rule]
    res = dict(cols)
    for n in sizes:
        row = "| %s |" % human(n)
        row += "".join(" %.3f ms | %.3f GB/s |" % (r[n] * 1e3, busbw(n, world, r[n]))
                       for _, r in cols)
        row += "".join(" %.2fx |" % (res[b][n] / res[a][n]) for a, b in ratios)
        lines.append(row)
    return lines + [""]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        impl, rank, world, address, sizes = sys.argv[2:7]
        run_rank(impl, int(rank), int(world), address, json.loads(sizes))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=float, default=256)
    parser.add_argument("--no-gloo", action="store_true", help="skip torch.distributed")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate kiln and Gloo this many times (median of rounds)")
    parser.add_argument("--backend", nargs="+", choices=("tcp", "mpi"), default=["tcp"],
                        help="kiln backends to run (mpi: under mpirun, needs kiln[mpi])")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/"
                        "distributed.md (distributed_mpi.md with --backend mpi)")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(HERE / "results" / ("distributed_mpi.md" if "mpi" in args.backend
                                           else "distributed.md"))
    sizes = [s for s in SIZES if s <= args.max_mb * (1 << 20)]
    try:
        if args.no_gloo:
            raise ImportError
        import torch.distributed  # noqa: F401
        have_gloo = True
    except ImportError:
        have_gloo = False
    lines = ["# all_reduce on loopback: kiln %s vs torch.distributed Gloo"
             % " and ".join(args.backend), "",
             "- command: `python benchmarks/bench_allreduce.py %s`" % " ".join(sys.argv[1:]),
             "- machine: %s" % machine(),
             "- date: %s" % datetime.date.today().isoformat(),
             "- load average at start: %.2f (other jobs on the box skew small-core "
             "timings)" % os.getloadavg()[0],
             "- float32 sum, median of 4-200 synchronized iterations per size, median of "
             "%d alternating kiln/Gloo rounds; busbw = size * 2(n-1)/n / time" % args.rounds,
             ""]
    for world in args.ranks:
        # kiln and Gloo alternate, round by round, so a load change on a shared box hits
        # both alike; each size reports the median over rounds of the per-round medians
        impls = [{"tcp": "kiln", "mpi": "mpi"}[b] for b in args.backend] + \
            (["gloo"] if have_gloo else [])
        runs = {impl: [] for impl in impls}
        for _ in range(args.rounds):
            for impl in impls:
                runs[impl].append(run_job(impl, world, sizes))
        med = {impl: {n: statistics.median(r[n] for r in runs[impl]) for n in sizes}
               for impl in impls}
        rows = table(world, sizes, med.get("kiln"), med.get("gloo"), med.get("mpi"))
        lines += rows
        print("\n".join(rows), flush=True)
    lines.insert(5, "- load average at end: %.2f" % os.getloadavg()[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
