"""Issue 22 item 1 under load: the small GPT's training step and the batched attention
GEMM measured idle and beside a competing busy process (a `stress`-like loop pinned to
one core), kiln against torch under the same load.

    .venv/bin/python benchmarks/bench_stress.py [--quick] [--out benchmarks/results/cpu.md]

The issue's rule: a step's time may degrade in proportion to the cores lost, never by
10x. On a 2-CPU machine a busy core is half the machine, so a workload that used both
cores may take up to ~2x; one that ran on one core should barely move.

kiln and torch at one thread share one process and run round-robin (every repetition
runs each once, back to back), so the machine's other load falls on both alike; torch
at its default threads and np.matmul (OpenBLAS's threads) get processes of their own
(their threads spin after their work and would slow the others down). In every process
idle and busy blocks alternate (`--rounds` of each). The busy process is a pure-Python loop pinned to the last CPU and bounded by a
deadline; it is killed when the block ends. Rows:

- GPT: benchmarks/bench_train.py's step of examples/nanogpt (2 layers, 64 wide, batch
  16 x 32 tokens, forward + backward + AdamW): kiln compiled, torch eager at its default
  threads and at one thread.
- batched GEMM (16,32,256) x (16,256,64) (attention-sized): kiln compiled, np.matmul at
  OpenBLAS's default threads, torch.bmm at its default threads and at one thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, write_section  # noqa: E402

SPIN = ("import os, time\n"
        "try:\n    os.sched_setaffinity(0, {{{cpu}}})\nexcept (AttributeError, OSError):\n    pass\n"
        "end = time.monotonic() + {seconds}\n"
        "while time.monotonic() < end:\n    pass\n")
SPIN_LIMIT_S = 300  # a spinner outlives no run: it ends by itself after this


class Spinner:
    """A busy process on one core (the last CPU) while the block runs."""

    def __enter__(self):
        cpu = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        self.proc = subprocess.Popen([sys.executable, "-c", SPIN.format(cpu=cpu, seconds=SPIN_LIMIT_S)])
        time.sleep(0.2)  # let it reach its loop
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait(timeout=30)
        return False


def _times(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _setup(impl: str):
    """name -> step function, for one implementation (`kiln`, `torch`, `torch1`, `numpy`)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 32, 256), dtype=np.float32)
    b = rng.standard_normal((16, 256, 64), dtype=np.float32)
    import bench_train as bt

    if impl == "numpy":
        return {"batched GEMM": lambda: np.matmul(a, b)}
    if impl == "kiln":
        import kiln as kn

        gemm = kn.compile(lambda a, b: a @ b)
        step, params, state, x, y, key = bt.kiln_gpt_step()
        carry = [params, state]

        def gpt():
            carry[0], carry[1], _ = step(carry[0], carry[1], x, y, key)

        return {"GPT step": gpt, "batched GEMM": lambda: gemm(a, b)}
    import torch

    torch.set_num_threads(1 if impl == "torch1" else (os.cpu_count() or 1))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return {"GPT step": bt.torch_gpt_step(), "batched GEMM": lambda: torch.bmm(ta, tb)}


REPEAT = {"GPT step": 20, "batched GEMM": 200}


def run_worker(group: str, rounds: int, quick: bool) -> dict:
    """{"impl|workload": {"idle": [s...], "busy": [s...]}} for the implementations of
    `group` ("kiln+torch1": both in this process, round-robin: every repetition runs each
    once, back to back, so they share the machine's load), idle and busy blocks
    alternating."""
    impls = group.split("+")
    steps = {impl: _setup(impl) for impl in impls}
    names = list(dict.fromkeys(name for impl in impls for name in steps[impl]))
    result = {f"{impl}|{name}": {"idle": [], "busy": []} for impl in impls for name in steps[impl]}
    for impl in impls:  # compile and warm up
        for fn in steps[impl].values():
            for _ in range(3):
                fn()

    def block(state):
        for name in names:
            for _ in range(REPEAT[name] // (4 if quick else 1)):
                for impl in impls:
                    fn = steps[impl].get(name)
                    if fn is not None:
                        result[f"{impl}|{name}"][state] += _times(fn, 1)

    for _ in range(rounds):
        block("idle")
        with Spinner():
            block("busy")
    return result


LABELS = {"kiln": "kiln compiled", "torch": "torch eager ({n} threads)", "torch1": "torch eager, 1 thread",
          "numpy": "np.matmul, OpenBLAS default threads"}


def render(rows: dict, args, load: tuple) -> str:
    lines = ["## Under a competing busy process (bench_stress.py, issue 22 item 1)", "",
             f"- command: `.venv/bin/python benchmarks/bench_stress.py"
             f"{' --quick' if args.quick else ''}{f' --rounds {args.rounds}' if args.rounds != 3 else ''}`",
             f"- machine: {os.cpu_count()} CPUs, {cpu_model()}; date {datetime.date.today().isoformat()}",
             f"- load average {load[0]:.1f} at the start, {load[1]:.1f} at the end; the machine is "
             "shared with other agents, so compare within a row (same process, idle and busy "
             f"blocks alternating, {args.rounds} of each) and between rows of one run",
             "- busy: a Python loop pinned to the last CPU (`os.sched_setaffinity`), i.e. one of "
             f"{os.cpu_count()} cores lost; the rule: busy / idle at most in proportion to the "
             "cores lost, never 10x",
             "", "Milliseconds, median (minimum).", "",
             "| workload | implementation | idle | busy | busy / idle, medians (minimums) "
             "| torch 1 thread / kiln, idle; busy (same process, round-robin) |",
             "|---|---|---|---|---|---|"]

    def stats(r):
        idle, busy = np.array(r["idle"]) * 1e3, np.array(r["busy"]) * 1e3
        return np.median(idle), idle.min(), np.median(busy), busy.min()

    for (name, impl), r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {LABELS[impl].format(n=os.cpu_count())} | {r['error']} | | | |")
            continue
        mi, li, mb, lb = stats(r)
        digits = 2 if mi >= 1 else 3
        versus = ""
        other = rows.get((name, "torch1"))
        if impl == "kiln" and other is not None and "error" not in other:
            ti, tli, tb, tlb = stats(other)
            versus = f"{ti / mi:.2f}x ({tli / li:.2f}x); {tb / mb:.2f}x ({tlb / lb:.2f}x)"
        lines.append(f"| {name} | {LABELS[impl].format(n=os.cpu_count())} "
                     f"| {mi:.{digits}f} ({li:.{digits}f}) | {mb:.{digits}f} ({lb:.{digits}f}) "
                     f"| {mb / mi:.2f}x ({lb / li:.2f}x) | {versus} |")
    return "\n".join(lines) + "\n"


def measure(impl: str, rounds: int, quick: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--rounds", str(rounds)]
    done = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": last[:80]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the repeats")
    parser.add_argument("--rounds", type=int, default=3, help="idle and busy blocks, alternating")
    parser.add_argument("--out", help="replace or append this benchmark's section in this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.rounds, args.quick)))
        return 0
    groups = ["kiln", "numpy"]
    try:
        import torch  # noqa: F401

        # torch at one thread shares kiln's process (it starts no spinning pool), round-robin
        # with kiln; torch at its default threads and OpenBLAS's threads get their own
        groups = ["kiln+torch1", "numpy", "torch"]
    except ImportError:
        pass
    order = ["kiln", "torch1", "torch", "numpy"]
    start = os.getloadavg()[0]
    rows: dict = {}
    for group in groups:
        result = measure(group, args.rounds, args.quick)
        if "error" in result:
            for impl in group.split("+"):
                rows[("GPT step" if impl != "numpy" else "batched GEMM", impl)] = result
            continue
        for key, r in result.items():
            impl, name = key.split("|")
            rows[(name, impl)] = r
    keys = sorted(rows, key=lambda k: (k[0] != "GPT step", order.index(k[1])))
    section = render({k: rows[k] for k in keys}, args, (start, os.getloadavg()[0]))
    print(section)
    if args.out:
        write_section(args.out, "bench_stress", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
