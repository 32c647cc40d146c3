"""Where the cold first call of the small-GPT training step waits on one core: the time
from the call to the first LLVM build thread, LLVM's wall clock on its threads, and the
rest after it (issue 22: cold <= 1 s; the single-threaded Python before LLVM runs while
the other core is idle, so it is what overlapping shortens).

Two kiln trees (snapshots: `git archive REV | tar -x -C DIR`), fresh processes with empty
caches, alternating (ABAB, then BABA), each with its tree's root on sys.path; bytecode
compiled first (`compileall`, as an installed kiln has). Per tree, medians (and minimums)
of: first call (wall), main-thread CPU, process CPU, `to LLVM` (call -> first build
thread starts; the split glue's thread, `kiln-glue`, is not one), `LLVM` (first build
thread starts -> last one ends; work a caller left
pending runs in it, build_overlap.py), `after` (last thread ends -> call returns), and
each module's thread CPU (how balanced the build threads were), and `2-core model`: what
the call would take on an idle two-core machine from the CPU it used (the main thread's
CPU before the first build thread + half of all threads' CPU while build threads run +
the main thread's CPU after them; work on other threads before the build, such as the
native glue, is taken to run on the idle core), a guide where other work loads the machine.

    .venv/bin/python benchmarks/bench_cold_overlap.py --before /tmp/base --after /tmp/new --pairs 10
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

WORKER = r"""
import json, os, sys, time
root = sys.argv[1]
sys.path.insert(0, root); sys.path.insert(0, os.path.join(root, "benchmarks"))
import kiln as kn
from kiln.codegen.cpu import jit
import bench_train as bt
import threading
R = {"starts": [], "ends": [], "cpu": [], "main": [], "proc": []}
main_clock = time.pthread_getcpuclockid(threading.main_thread().ident)
real = jit._compile_alone
def alone(*a):
    if threading.current_thread().name == "kiln-glue":  # the split glue, built beside the passes
        return real(*a)
    R["main"].append(time.clock_gettime(main_clock)); R["proc"].append(time.process_time())
    R["starts"].append(time.perf_counter()); c = time.thread_time()
    try:
        return real(*a)
    finally:
        R["ends"].append(time.perf_counter()); R["cpu"].append(time.thread_time() - c)
        R["main"].append(time.clock_gettime(main_clock)); R["proc"].append(time.process_time())
jit._compile_alone = alone
step, params, state, x, y, key = bt.kiln_gpt_step(compiled=False)
c = kn.compile(step)
t0, m0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
c(params, state, x, y, key)
t1, m1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
first_build = min(R["starts"]) if R["starts"] else t1
last_build = max(R["ends"]) if R["ends"] else t1
# the idle two-core model: the main thread's CPU before the first build thread, half of all
# threads' CPU while build threads run (two cores shared), the main thread's CPU after them
serial = min(R["main"]) - m0 if R["main"] else m1 - m0
shared = max(R["proc"]) - min(R["proc"]) if R["proc"] else 0.0
tail = m1 - max(R["main"]) if R["main"] else 0.0
print(json.dumps({"first": t1 - t0, "main CPU": m1 - m0, "CPU": p1 - p0, "to LLVM": first_build - t0,
                  "LLVM": last_build - first_build, "after": t1 - last_build,
                  "2-core model": serial + shared / 2 + tail, "modules": R["cpu"]}))
"""

COLUMNS = ("first", "main CPU", "CPU", "to LLVM", "LLVM", "after", "2-core model")


def run(root: str) -> dict:
    env = dict(os.environ, KILN_CACHE_DIR=tempfile.mkdtemp(prefix="kiln-overlap-"), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", WORKER, root], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="a kiln snapshot (folder holding kiln/)")
    parser.add_argument("--after", required=True, help="another kiln snapshot")
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    for root in trees.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(root, "kiln"),
                        os.path.join(root, "benchmarks")], check=True, stdout=subprocess.DEVNULL)
    load0 = os.getloadavg()[0]
    rows: dict[str, list] = {name: [] for name in trees}
    for i in range(args.pairs):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            rows[name].append(run(trees[name]))
    print(f"- command: `{' '.join([os.path.relpath(sys.executable)] + sys.argv)}`")
    print(f"- load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {args.pairs} pairs")
    print()
    print("| tree | " + " | ".join(COLUMNS) + " | module thread CPU (first 3 runs) |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for name, runs in rows.items():
        cells = [f"{statistics.median(r[c] for r in runs):.3f} ({min(r[c] for r in runs):.3f})" for c in COLUMNS]
        modules = "; ".join("/".join(f"{m:.2f}" for m in r["modules"]) for r in runs[:3])
        print(f"| {name} | " + " | ".join(cells) + f" | {modules} |")


if __name__ == "__main__":
    main()
