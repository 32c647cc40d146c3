"""Horizontal fusion: a graph of 16 small independent pointwise ops, compiled with the
earlier fusion rule (loops merge only when they read a common buffer) and with
horizontal fusion (independent loops over one iteration space share a kernel): kernel
count and per-call time, medians from one run.

    .venv/bin/python benchmarks/bench_horizontal.py [--out benchmarks/results/cpu.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys

import numpy as np

import kiln as kn
import kiln.passes.fusion as fusion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import median_s, write_section  # noqa: E402


def sixteen(*xs):
    return tuple(kn.exp(x) * (i + 1) for i, x in enumerate(xs))


def measure(size: int, merge: bool, repeat: int) -> tuple[int, float]:
    fusion.MERGE_INDEPENDENT = merge
    try:
        xs = [np.full(size, i / 16, np.float32) for i in range(16)]
        f = kn.compile(sixteen)
        f(*xs)
        kernels = len(f.compiled_graphs()[0].program.kernels)
        return kernels, median_s(lambda: f(*xs), repeat)
    finally:
        fusion.MERGE_INDEPENDENT = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--repeat", type=int, default=201)
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    lines = ["## Horizontal fusion: 16 small independent ops (issue 21)", "",
             f"`.venv/bin/python benchmarks/bench_horizontal.py` on {model}, "
             f"{datetime.date.today()}, load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} CPUs; per-call medians of {args.repeat} calls, both rules in "
             "the same run.", "",
             "| elements per op | kernels before | kernels after | per call before (us) | "
             "per call after (us) | before / after |", "|---|---|---|---|---|---|"]
    for size in (32, 1024, 16384):
        k0, t0 = measure(size, False, args.repeat)
        k1, t1 = measure(size, True, args.repeat)
        lines.append(f"| {size} | {k0} | {k1} | {t0 * 1e6:.1f} | {t1 * 1e6:.1f} | {t0 / t1:.2f}x |")
        print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_section(args.out, "bench_horizontal", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
