"""Host symmetric-memory all_reduce vs kiln's TCP backend (its /dev/shm lane) and Gloo.

    python benchmarks/bench_symmetric.py                    # 2 and 4 ranks, 1 KB .. 256 MB
    python benchmarks/bench_symmetric.py --ranks 2 --max-mb 16 --out /tmp/r.md

One job per world size runs all three implementations in the same processes, one
after the other for each size: `sym` is `SymmetricMemory.all_reduce` on a buffer that
lives in the symmetric segment (how it is meant to be used), `tcp` is
`pg.all_reduce` (same-host pairs go through the shm lane), `gloo` is
torch.distributed's Gloo when torch is importable (never a kiln dependency). Time is
the median over iterations of one barrier-synchronised float32 sum; busbw = size * 2 *
(n - 1) / n / time. Results: benchmarks/results/distributed.md, section `symmetric`.
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
SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def iterations(nbytes: int) -> int:
    if nbytes <= 256 << 10:
        return 100
    return 20 if nbytes <= 4 << 20 else (6 if nbytes <= 64 << 20 else 3)


def worker(rank: int, world: int, address: str, gloo: str, sizes: list[int]) -> None:
    import numpy as np

    import kiln.distributed as dist

    pg = dist.init_process_group(rank=rank, world_size=world, store=address,
                                 token=os.environ["KILN_TOKEN"], timeout=600.0,
                                 host_store=False)
    impls = {}
    try:
        import torch
        import torch.distributed as tdist

        tdist.init_process_group("gloo", init_method="tcp://" + gloo, rank=rank,
                                 world_size=world)
        impls["gloo"] = (lambda n: torch.ones(n, dtype=torch.float32),
                         lambda b: tdist.all_reduce(b), None)
    except ImportError:
        pass
    impls["tcp"] = (lambda n: np.ones(n, np.float32), lambda b: pg.all_reduce(b).wait(), None)
    impls["sym"] = (lambda n: dist.symmetric_memory(n, "float32", pg, timeout=600.0),
                    lambda s: s.all_reduce("sum"), lambda s: s.close())
    results: dict = {}
    for nbytes in sizes:
        for name, (make, run, free) in impls.items():
            buf = make(nbytes // 4)
            run(buf)
            times = []
            for _ in range(iterations(nbytes)):
                pg.barrier().wait()
                start = time.perf_counter()
                run(buf)
                times.append(time.perf_counter() - start)
            results.setdefault(name, {})[nbytes] = statistics.median(times)
            if free:
                free(buf)
            del buf
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    pg.barrier().wait()
    if "gloo" in impls:
        tdist.destroy_process_group()


def free_port() -> int:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


def run_job(world: int, sizes: list[int]) -> dict:
    from kiln.distributed.store import StoreServer

    env = dict(os.environ, KILN_TOKEN=secrets.token_hex(16))
    server = StoreServer("127.0.0.1", 0, env["KILN_TOKEN"])
    gloo = "127.0.0.1:%d" % free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world),
                               server.address, gloo, json.dumps(sizes)], env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=3000)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            return {k: {int(s): t for s, t in v.items()} for k, v in
                    json.loads(line[7:]).items()}
    raise RuntimeError("no result from rank 0:\n" + outs[0][-2000:])


def fmt_size(n: int) -> str:
    return "%d MB" % (n >> 20) if n >= 1 << 20 else "%d KB" % (n >> 10)


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        rank, world, address, gloo, sizes = sys.argv[2:7]
        worker(int(rank), int(world), address, gloo, json.loads(sizes))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-mb", type=int, default=256)
    ap.add_argument("--out", default=str(HERE / "results" / "distributed.md"))
    args = ap.parse_args()
    sizes = [s for s in SIZES if s <= args.max_mb << 20]
    lines = ["## Host symmetric memory all_reduce vs the TCP backend (shm lane) and Gloo", "",
             "`%s` — %s, %d cores, %s UTC. float32 sum, median time per call (us) and "
             "sym's speedup over each (same run, same processes)." % (
                 "python " + " ".join(["benchmarks/bench_symmetric.py"] + sys.argv[1:]),
                 cpu_model(), os.cpu_count(),
                 datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")), ""]
    for world in args.ranks:
        res = run_job(world, sizes)
        names = [n for n in ("sym", "tcp", "gloo") if n in res]
        lines += ["### %d ranks" % world, "",
                  "| size | " + " | ".join("%s us" % n for n in names) +
                  " | sym busbw GB/s | " + " | ".join("sym vs %s" % n for n in names[1:]) + " |",
                  "|---" * (2 * len(names) + 1) + "|"]
        for s in sizes:
            t = {n: res[n][s] for n in names}
            bus = s * 2 * (world - 1) / world / t["sym"] / 1e9
            lines.append("| %s | " % fmt_size(s) + " | ".join("%.0f" % (t[n] * 1e6) for n in names)
                         + " | %.2f | " % bus + " | ".join("%.2fx" % (t[n] / t["sym"])
                                                          for n in names[1:]) + " |")
        lines.append("")
        print("\n".join(lines[-len(sizes) - 4:]), flush=True)
    sys.path.insert(0, str(HERE))
    from report import write_section

    write_section(args.out, "symmetric", "\n".join(lines), title="# Distributed benchmark results")


if __name__ == "__main__":
    main()
