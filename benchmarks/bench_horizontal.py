"""Horizontal fusion and batching: a graph of 16 small independent pointwise ops,
compiled with the earlier fusion rule (loops merge only when they read a common buffer)
and with horizontal fusion (independent loops over one iteration space share a kernel);
and 16 small independent ops of DIFFERENT shapes (pointwise and row reductions), which
horizontal fusion cannot merge, without and with the batching pass (kiln/passes/
batching.py: one launch of a batched kernel). Launch count and per-call time, medians
from one run, both variants alternated in the same run.

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
import kiln.passes.batching as batching
import kiln.passes.fusion as fusion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import median_s, write_section  # noqa: E402


def sixteen(*xs):
    return tuple(kn.exp(x) * (i + 1) for i, x in enumerate(xs))


def measure(size: int, merge: bool, repeat: int) -> tuple[int, float]:
    """The earlier rule (merge=False) is measured without batching too, which would
    otherwise put its 16 one-shape kernels in one launch."""
    fusion.MERGE_INDEPENDENT = merge
    batching.ENABLED = merge
    try:
        xs = [np.full(size, i / 16, np.float32) for i in range(16)]
        f = kn.compile(sixteen)
        f(*xs)
        kernels = len(f.compiled_graphs()[0].program.kernels)
        return kernels, median_s(lambda: f(*xs), repeat)
    finally:
        fusion.MERGE_INDEPENDENT = True
        batching.ENABLED = True


def shapes_of(scale: int) -> list[tuple[int, int]]:
    """16 different 2-d shapes of about `scale` elements each."""
    return [(4 + i, max(1, scale // (4 + i))) for i in range(16)]


def mixed(*xs):
    """Even positions: a pointwise chain; odd ones: a row sum (a reduction kernel)."""
    return tuple(kn.tanh(x) * (i + 1) if i % 2 == 0 else (x * x).sum(dim=1)
                 for i, x in enumerate(xs))


def measure_batching(scale: int, repeat: int) -> tuple[int, int, float, float]:
    """(launches unbatched, launches batched, median s unbatched, median s batched)."""
    xs = [np.linspace(-1, 1, a * b).astype(np.float32).reshape(a, b) for a, b in shapes_of(scale)]
    fs, counts = [], []
    for enabled in (False, True):
        batching.ENABLED = enabled
        try:
            f = kn.compile(mixed)
            f(*xs)
        finally:
            batching.ENABLED = True
        program = f.compiled_graphs()[0].program
        counts.append(sum(type(s).__name__ == "Launch" for s in program.steps))
        fs.append(f)
    for a, b in zip(fs[0](*xs), fs[1](*xs)):  # same answers before timing them
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    times: list[list[float]] = [[], []]
    for _ in range(5):  # alternate, so load drifts hit both alike
        for k, f in enumerate(fs):
            times[k].append(median_s(lambda: f(*xs), max(1, repeat // 5)))
    return counts[0], counts[1], float(np.median(times[0])), float(np.median(times[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--repeat", type=int, default=201)
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    lines = ["## Horizontal fusion and batching: 16 small independent ops (issue 21)", "",
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
    lines += ["", "16 small independent ops of different shapes (8 pointwise, 8 row sums; "
              "`tanh(x) * k` or `(x * x).sum(dim=1)` over x of shape (4 + i, scale // (4 + i))), "
              "without and with the batching pass:", "",
              "| elements per op | launches before | launches after | per call before (us) | "
              "per call after (us) | before / after |", "|---|---|---|---|---|---|"]
    for scale in (64, 1024, 4096):
        k0, k1, t0, t1 = measure_batching(scale, args.repeat)
        lines.append(f"| ~{scale} | {k0} | {k1} | {t0 * 1e6:.1f} | {t1 * 1e6:.1f} | {t0 / t1:.2f}x |")
        print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_section(args.out, "bench_horizontal", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
