"""LLVM build time against run time: two kiln trees side by side (issue 22, cold compile).

Compares the kiln of this checkout with another kiln tree (`--baseline DIR`, e.g. an older
commit unpacked with `git archive REV kiln | tar -x -C DIR`), in the same run:

- **cold compile** of the small GPT training step (bench_train.py's GPT row): a fresh
  process with an empty KILN_CACHE_DIR per run, the trees alternating run by run; wall
  clock of the first call, of LLVM (pass pipeline + code generation) inside it, and the
  process's CPU seconds during the first call;
- **run time** of the compiled GPT step and of every bench_cpu.py workload: one worker
  process per tree compiles them all, then the parent asks the workers in turn
  (round-robin, the first tree alternating) for a batch of timed calls of one workload,
  so the machine's load falls on both trees alike; medians and minimums per call.

    .venv/bin/python benchmarks/bench_llvm_build.py --baseline /tmp/kiln-base [--tree DIR]
        [--rounds 5] [--reps 5] [--quick] [--out benchmarks/results/cpu.md]

With `--out`, the tables replace the section between `<!-- llvm_build: begin -->` and
`<!-- llvm_build: end -->` of that file (report.write_section).
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# both scripts start alike: this kiln first on sys.path (`python -c` puts the working
# directory there), then the GPT training step of bench_train.py, compiled, and its inputs
PROLOGUE = r"""
import functools, json, sys, time
sys.path[:0] = [{tree!r}, {here!r}]
import kiln as kn
assert kn.__file__.startswith({tree!r}), kn.__file__
import bench_train as bt
from kiln.codegen.cpu import jit
step, params, state, x, y, key = bt.kiln_gpt_step()
"""

COLD = PROLOGUE + r"""
T = {{"llvm": 0.0}}
def timed(name):
    fn = getattr(jit, name)
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T["llvm"] += time.perf_counter() - t
    setattr(jit, name, wrapper)
for name in ("object_codes", "optimize", "object_code"):
    timed(name)
t0, c0 = time.perf_counter(), time.process_time()
step(params, state, x, y, key)
T.update(first=time.perf_counter() - t0, cpu=time.process_time() - c0)
print(json.dumps(T))
"""

WORKER = PROLOGUE + r"""
import bench_cpu
calls = {{}}
calls["gpt step"] = lambda: step(params, state, x, y, key)
for item in bench_cpu.workloads(quick={quick!r}):
    name, fn, args = item[0], item[2], item[4]
    name = name if name not in calls else name + " 4096"
    compiled = kn.compile(fn)
    calls[name] = (lambda c, a: lambda: c(*a))(compiled, args)
# kiln's micro-kernel GEMMs (cost model's choice for small float32 products), a block of
# 20 calls per sample: bench_call.py --gemm-rows' shapes, an NT product, a bias epilogue
import numpy as np
rng = np.random.default_rng(0)
def gemm_row(label, fn, *shapes):
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    compiled = kn.compile(fn)
    calls[label] = lambda: [compiled(*arrays) for _ in range(20)]
for b, m, n, k in [(64, 32, 32, 16), (16, 32, 64, 256), (1, 64, 64, 64), (1, 128, 128, 128), (1, 512, 192, 64)]:
    gemm_row(f"micro {{b}}x{{m}}x{{n}}x{{k}} x20", lambda x, w: x @ w, (b, m, k), (b, k, n))
gemm_row("micro NT 64x32x32x16 x20", lambda q, k: q @ k.transpose(1, 2), (64, 32, 16), (64, 32, 16))
gemm_row("micro 512x192x64 +bias relu x20", lambda x, w, c: kn.relu(x @ w + c), (512, 64), (64, 192), (192,))
for call in calls.values():
    call(); call()
print(json.dumps(list(calls)), flush=True)
for line in sys.stdin:
    index, reps = map(int, line.split())
    call = list(calls.values())[index]
    out = []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        call()
        out.append((time.perf_counter() - t, time.process_time() - c))
    print(json.dumps(out), flush=True)
"""


def tree_env(tree: str, cache: str) -> dict:
    """The environment of a process running the kiln under `tree` with cache `cache`."""
    return dict(os.environ, KILN_CACHE_DIR=cache, PYTHONPATH=tree)


def cold(tree: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-llvm-build-") as cache:
        done = subprocess.run([sys.executable, "-c", COLD.format(here=HERE, tree=tree)], env=tree_env(tree, cache),
                              capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip()[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


class Worker:
    """One tree's worker process: compiled workloads, timed on request (bounded waits)."""

    def __init__(self, tree: str, quick: bool, cache: str):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER.format(here=HERE, quick=quick, tree=tree)],
                                     env=tree_env(tree, cache), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.names = json.loads(self._line())

    def _line(self) -> str:
        line = self.proc.stdout.readline()  # the worker answers every request or exits
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait(timeout=60)}")
        return line

    def run(self, name: str, reps: int) -> list[float]:
        self.proc.stdin.write(f"{self.names.index(name)} {reps}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=60)


def measure(trees: dict, rounds: int, quick: bool, reps: int, only=(), cold_runs: int = 1
            ) -> tuple[dict, dict]:
    """(cold runs per tree, {tree: {workload: [(wall s, CPU s) per call]}}); `only`: the
    workloads to time (all when empty)."""
    names = list(trees)
    colds = {n: [] for n in names}
    for r in range(cold_runs):
        for n in (names if r % 2 == 0 else names[::-1]):
            res = cold(trees[n])
            colds[n].append(res)
            print("cold", n, {k: round(v, 3) for k, v in res.items()}, file=sys.stderr)
    times: dict = {n: {} for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-llvm-build-") as cache:
        workers = {}
        try:
            for n in names:  # each tree its own cache dir: nothing shared between trees
                os.makedirs(os.path.join(cache, n))
                workers[n] = Worker(trees[n], quick, os.path.join(cache, n))
            for r in range(rounds):
                for w in [w for w in workers[names[0]].names if not only or w in only]:
                    for n in (names if r % 2 == 0 else names[::-1]):
                        times[n].setdefault(w, []).extend(workers[n].run(w, reps))
                print("round", r + 1, "of", rounds, file=sys.stderr)
        finally:
            for w in workers.values():
                w.close()
    return colds, times


def render(trees: dict, colds: dict, times: dict, rounds: int, reps: int, quick: bool,
           load: tuple) -> str:
    from report import cpu_model

    cpu = cpu_model()
    a, b = list(trees)
    cmd = " ".join(["benchmarks/bench_llvm_build.py"] + sys.argv[1:])
    lines = [f"- command: `.venv/bin/python {cmd}`",
             f"- machine: {os.cpu_count()} CPUs, {cpu} (`lscpu` model name); load average "
             f"{load[0]:.1f} at the start, {load[1]:.1f} at the end",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; trees: "
             f"`{a}` = {trees[a]}, `{b}` = {trees[b]}; {rounds} rounds, "
             f"{'quick' if quick else 'full'} bench_cpu sizes, {reps} calls per turn", ""]
    if all(colds.values()):
        lines += ["Cold compile of the GPT training step (fresh process, empty cache), seconds, "
                  f"median (min) of {len(colds[a])} runs per tree:", "",
                  "| | first call | LLVM (wall) | CPU s of the first call |", "|---|---|---|---|"]
        for n in trees:
            cells = [f"{statistics.median(r[k] for r in colds[n]):.3f} ({min(r[k] for r in colds[n]):.3f})"
                     for k in ("first", "llvm", "cpu")]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", f"Run time per call, ms, median (min) over the same rounds; ratio = `{a}` / `{b}` "
                  "(above 1: the second tree is faster); CPU = the process's CPU time per call "
                  "(all threads), which a descheduled thread does not accumulate:", "",
              f"| workload | {a} | {b} | ratio of medians | ratio of minimums | {a} CPU | {b} CPU | "
              "ratio of CPU medians |", "|---|---|---|---|---|---|---|---|"]
    for w in times[a]:
        ta, tb = [x[0] for x in times[a][w]], [x[0] for x in times[b][w]]
        ca, cb = [x[1] for x in times[a][w]], [x[1] for x in times[b][w]]
        ma, mb = statistics.median(ta), statistics.median(tb)
        cma, cmb = statistics.median(ca), statistics.median(cb)
        lines.append(f"| {w} | {ma * 1e3:.3f} ({min(ta) * 1e3:.3f}) | {mb * 1e3:.3f} ({min(tb) * 1e3:.3f}) | "
                     f"{ma / mb:.3f} | {min(ta) / min(tb):.3f} | {cma * 1e3:.3f} | {cmb * 1e3:.3f} | "
                     f"{cma / max(cmb, 1e-9):.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="root of the other kiln tree (holds kiln/)")
    ap.add_argument("--tree", default=ROOT, help="root of the kiln tree to compare (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per workload per turn")
    ap.add_argument("--quick", action="store_true", help="bench_cpu.py's quick sizes")
    ap.add_argument("--only", default="", help="comma-separated workloads to time (default: all)")
    ap.add_argument("--cold", type=int, default=None, help="cold-compile runs per tree (default: --rounds)")
    ap.add_argument("--out", help="write the section into this markdown file")
    args = ap.parse_args()
    trees = {"baseline": os.path.abspath(args.baseline),
             "this tree" if args.tree == ROOT else "tree": os.path.abspath(args.tree)}
    load0 = os.getloadavg()[0]
    only = tuple(w.strip() for w in args.only.split(",") if w.strip())
    colds, times = measure(trees, args.rounds, args.quick, args.reps, only,
                           args.rounds if args.cold is None else args.cold)
    text = render(trees, colds, times, args.rounds, args.reps, args.quick, (load0, os.getloadavg()[0]))
    print(text)
    if args.out:
        from report import write_section

        write_section(args.out, "llvm_build", text)


if __name__ == "__main__":
    main()
