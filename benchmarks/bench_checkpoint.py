"""Distributed checkpoint throughput against the disk's own, and async save's stall.

    python benchmarks/bench_checkpoint.py                 # 1, 2, 4 ranks, 256 MB state
    python benchmarks/bench_checkpoint.py --mb 64 --ranks 1 4 --repeat 3 --out /tmp/r.md

For each world size, every rank holds its Shard(0) blocks of a float32 state of `--mb`
MB (8 tensors). Each of `--repeat` rounds times, in this order: `dd if=/dev/zero of=F
bs=8M conv=fsync` of the same number of bytes into the same folder, run by rank 0 while
the others wait (the disk's own sequential write bandwidth, measured next to the save it
is compared with: the disk is shared and its speed drifts); `checkpoint.save` (wall time
from a barrier to the last rank's return: every shard fsynced and the manifest
committed); `load` into the same placements; and `async_save`'s call (what the training
loop waits for: by default the copy-on-write holds of the blocks, no copy) and
`async_save(copy=True)`'s call (the old default: the snapshot copy into the staging
buffer; the first round's call also allocates that buffer). Ratios are taken per round, then the median. Loads read files
just written, so they come from the page cache. Results:
benchmarks/results/distributed.md, section "checkpoint".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def worker(rank: int, world: int, address: str, args: dict) -> None:
    import numpy as np

    import kiln.distributed as dist
    from kiln.distributed import DeviceMesh, Shard, distribute_tensor

    pg = dist.init_process_group(rank=rank, world_size=world, store=address,
                                 token=os.environ["KILN_TOKEN"], timeout=120.0,
                                 host_store=False)
    mesh = DeviceMesh((world,), ("x",))
    n = args["mb"] * (1 << 20) // 4 // 8
    rows = 1024
    state = {"t%d" % i: distribute_tensor(np.full((rows, n // rows), i, np.float32), mesh,
                                          [Shard(0)], src_data_rank=None) for i in range(8)}
    times = {"dd": [], "save": [], "load": [], "async_call": [], "async_total": [],
             "memcpy": [], "async_copy": [], "step_held": [], "step": []}
    nbytes = args["mb"] * (1 << 20)
    local = [v.local_array().reshape(-1) for v in state.values()]
    warm = np.ones(sum(a.size for a in local), np.float32)  # the floor of the async stall
    for r in range(args["repeat"]):
        path = os.path.join(args["dir"], "ckpt")
        pg.barrier().wait()
        if rank == 0:
            times["dd"].append(nbytes / dd_bandwidth(args["dir"], args["mb"]))
        pg.barrier().wait()
        t0 = time.perf_counter()
        dist.checkpoint.save(state, path)
        pg.barrier().wait()
        times["save"].append(time.perf_counter() - t0)
        target = {k: distribute_tensor(np.zeros(v.shape, np.float32), mesh, [Shard(0)],
                                       src_data_rank=None) for k, v in state.items()}
        pg.barrier().wait()
        t0 = time.perf_counter()
        dist.checkpoint.load(target, path)
        pg.barrier().wait()
        times["load"].append(time.perf_counter() - t0)
        assert np.all(target["t3"].local_array() == 3)
        pg.barrier().wait()
        t0 = time.perf_counter()
        fut = dist.checkpoint.async_save(state, path)
        times["async_call"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # a step reading every tensor while the save holds them
        [v + 1.0 for v in state.values()]
        times["step_held"].append(time.perf_counter() - t0)
        fut.result(timeout=600)
        t0 = time.perf_counter()  # the same step, nothing held
        [v + 1.0 for v in state.values()]
        times["step"].append(time.perf_counter() - t0)
        pg.barrier().wait()
        times["async_total"].append(time.perf_counter() - t0)
        pg.barrier().wait()
        t0 = time.perf_counter()
        np.concatenate(local, out=warm)  # this rank's blocks into a warm buffer, 1 thread
        times["memcpy"].append(time.perf_counter() - t0)
        pg.barrier().wait()
        t0 = time.perf_counter()
        fut = dist.checkpoint.async_save(state, path, copy=True)  # the staging copy
        times["async_copy"].append(time.perf_counter() - t0)
        fut.result(timeout=600)
    if rank == 0:
        print("RESULT " + json.dumps(times), flush=True)
    dist.destroy_process_group()


def run_ranks(script: str, world: int, arg: str, extra_env: dict | None = None) -> dict:
    """Start `world` ranks of `script --worker RANK WORLD STORE ARG` around a store
    hosted here (killed at the end); rank 0's `RESULT {json}` line, parsed."""
    from kiln.distributed.store import StoreServer

    env = dict(os.environ, KILN_TOKEN=secrets.token_hex(16), **(extra_env or {}))
    server = StoreServer("127.0.0.1", 0, env["KILN_TOKEN"])
    procs = [subprocess.Popen([sys.executable, script, "--worker", str(r), str(world),
                               server.address, arg], env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    lines = [line for line in outs[0].splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit("%s with %d ranks failed: %s"
                         % (os.path.basename(script), world, [p.returncode for p in procs]))
    return json.loads(lines[0][len("RESULT "):])


def dd_bandwidth(folder: str, mb: int) -> float:
    """Bytes per second of `dd ... conv=fsync` writing `mb` MB into `folder`."""
    target = os.path.join(folder, "dd.bin")
    count = max(1, mb // 8)
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", "of=" + target, "bs=8M", "count=%d" % count,
                    "conv=fsync"], check=True, capture_output=True, timeout=600)
    seconds = time.perf_counter() - t0
    os.unlink(target)
    return count * 8 * (1 << 20) / seconds


def main() -> None:
    from benchmarks.report import write_section
    from benchmarks.bench_allreduce import machine

    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "distributed.md"))
    opts = parser.parse_args()
    rows = []
    total = opts.mb * (1 << 20)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KILN_BENCH_DIR")) as folder:
        for world in opts.ranks:
            t = run_ranks(__file__, world, json.dumps({"mb": opts.mb, "repeat": opts.repeat,
                                                       "dir": folder}),
                          {"KILN_LOCAL_WORLD_SIZE": str(world)})  # as kiln launch sets it
            med = {k: statistics.median(v) for k, v in t.items()}
            ratio = statistics.median(d / s for d, s in zip(t["dd"], t["save"]))
            stall = statistics.median(c / s for c, s in zip(t["async_call"], t["save"]))
            # the first copy allocates the staging buffer: the steady state is the rest
            copies = t["async_copy"][1:] or t["async_copy"]
            copied = statistics.median(c / s for c, s in zip(copies, t["save"][1:] or t["save"]))
            rows.append("| %d | %.0f | %.0f | %.0f%% | %.0f | %.2f ms | %.2f%% | %.0f ms | "
                        "%.1f ms (%.1f ms) | %.1f%% | %.1f ms | %.1f ms, %.1f ms |" % (
                            world, total / med["dd"] / 1e6, total / med["save"] / 1e6,
                            100 * ratio, total / med["load"] / 1e6,
                            1e3 * med["async_call"], 100 * stall, 1e3 * med["save"],
                            1e3 * statistics.median(copies), 1e3 * t["async_copy"][0],
                            100 * copied, 1e3 * med["memcpy"],
                            1e3 * med["step_held"], 1e3 * med["step"]))
            print(rows[-1], flush=True)
    cmd = "python benchmarks/bench_checkpoint.py " + " ".join(sys.argv[1:])
    section = "\n".join([
        "## Distributed checkpoint: save/load throughput vs dd, async stall",
        "",
        "- command: `%s`" % cmd.strip(),
        "- machine: %s; %s UTC; load average %.1f at the end (other jobs share the "
        "cores)" % (machine(), datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"),
                    os.getloadavg()[0]),
        "- state: %d MB of float32 in 8 tensors, Shard(0) over the ranks; %d rounds, each "
        "`dd bs=8M conv=fsync` of the same size into the same folder (rank 0, the others "
        "waiting), then save, load, async save; medians; save / dd and stall / save are the "
        "medians of the per-round ratios" % (opts.mb, opts.repeat),
        "- save = barrier to barrier around `checkpoint.save` (shards fsynced, manifest "
        "committed); load reads files just written (page cache); async stall = the time "
        "the default `async_save` blocks the caller (its blocks held copy-on-write, no "
        "copy: the snapshot bookkeeping and the save id); copy=True stall = the same with "
        "`copy=True`, the old default: the copy into the reused staging buffer (rounds 2 on; "
        "in brackets round 1, which also allocates it); memcpy = one thread copying this "
        "rank's blocks into a warm buffer, same round (that copy's floor); step = `v + 1.0` "
        "for every tensor right after the default call, while the save holds the blocks, "
        "then after it ended (ops read a held block in place; with 2-4 ranks on these 2 cores "
        "the held step also competes with the save's background write and checksum "
        "threads). "
        "The disk and the cores are shared with other jobs on this machine",
        "",
        "| ranks | dd MB/s | save MB/s | save / dd | load MB/s | async stall | "
        "stall / save | sync save | copy=True stall (first) | copy=True / save | memcpy | "
        "step held, free |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    write_section(opts.out, "checkpoint", section)
    print(section)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
    else:
        main()
