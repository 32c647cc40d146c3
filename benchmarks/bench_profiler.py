"""What kn.profile costs: per-call time of small compiled functions outside any profile
(the executor reads one global per run) and inside a profile (timed steps), and the cost
of that one read.

    .venv/bin/python benchmarks/bench_profiler.py      # prints a markdown table

Medians of 15 rounds of 2,000 calls each, all in one process: compare within a run.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time

import numpy as np

import kiln as kn


def _per_call_us(fn, args, calls=2000, rounds=15) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    cases = {
        "x + 1 (1 kernel, 16 floats)": (kn.compile(lambda x: x + 1.0), (np.ones(16, np.float32),)),
        "softmax(x @ w) (2 kernels, 64x64)": (
            kn.compile(lambda x, w: kn.softmax(x @ w, -1)),
            (np.ones((64, 64), np.float32), np.ones((64, 64), np.float32))),
    }
    rows = []
    for name, (fn, args) in cases.items():
        fn(*args)
        outside = _per_call_us(fn, args)
        with kn.profile():
            inside = _per_call_us(fn, args, rounds=5)
        rows.append((name, outside, inside))
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"],
                         capture_output=True, text=True).stdout.strip() or platform.processor()
    print(f"machine: {cpu}; python {platform.python_version()}; {time.strftime('%Y-%m-%d')}")
    print("| function | outside a profile (us/call) | inside kn.profile (us/call) | ratio |")
    print("|---|---|---|---|")
    for name, outside, inside in rows:
        print(f"| {name} | {outside:.2f} | {inside:.2f} | {inside / outside:.2f}x |")
    import timeit

    check = timeit.timeit("p.ACTIVE is None", setup="from kiln.runtime import profiler as p",
                          number=1_000_000) * 1e3
    print(f"\nthe per-run check alone (`profiler.ACTIVE is None`): {check:.0f} ns")


if __name__ == "__main__":
    main()
